"""The extender's cluster state: one writer, the index of watched objects, the change log, the publisher.

Requests read `ClusterCache.snapshot` (`snapshot.Snapshot`, immutable); only the writer changes
anything, under one lock. The kinds are re-exported: they name what `apply` and `replace` are fed.
"""

from ..objects import NAMESPACE, NODE, PDB, POD
from .writer import ClusterCache

__all__ = ["NAMESPACE", "NODE", "PDB", "POD", "ClusterCache"]
