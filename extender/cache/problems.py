"""What the cluster state could not take as given: unreadable objects, and pods whose GPU assignment is not counted.

Kept by the index (`index.Index`) and read by the publisher: each unreadable object is logged
once per object and resourceVersion and listed for the metrics and `diagnose` (the snapshot's
`unreadable`); each pod whose assignment is not counted as it says is logged once per reason.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Set
from typing import Any

from gpupart import logs

from ..objects import PodEntry, Unreadable, meta_of
from .changes import ChangeLog

log = logging.getLogger(__name__)


class Problems:
    """Unreadable objects by (kind, key), and the last reason told per pod uid."""

    def __init__(self, changes: ChangeLog) -> None:
        self.changes = changes
        self.unreadable: dict[tuple[str, str], Unreadable] = {}
        self._told: dict[str, str] = {}
        """Per pod uid, the last reason logged for not counting its assignment (logged once)."""

    def seen(self, kind: str, key: str, name: str, obj: Mapping[str, Any], problem: str) -> None:
        """Remember an unreadable object; logged once per object and resourceVersion."""
        version = str(meta_of(obj).get("resourceVersion") or "")
        found = Unreadable(kind, name, version, problem)
        if self.unreadable.get((kind, key)) != found:
            log.warning(
                "Skipped unreadable object",
                extra=logs.kv(kind=kind, name=name, rv=version, err=problem),
            )
            self.unreadable[kind, key] = found
            self.changes.mark("unreadable")

    def readable(self, kind: str, key: str) -> None:
        if self.unreadable.pop((kind, key), None) is not None:
            self.changes.mark("unreadable")

    def listed(self, kind: str, keys: Set[str]) -> None:
        """A full list of `kind` holds `keys`: the problems of objects no longer there go."""
        for gone in [k for k in self.unreadable if k[0] == kind and k[1] not in keys]:
            del self.unreadable[gone]
        self.changes.mark("unreadable")

    def forget(self, uid: str) -> None:
        """Pod `uid` is gone: a pod by that uid again is told afresh."""
        self._told.pop(uid, None)

    def tell(self, entry: PodEntry, reason: str, *, lost: bool = False) -> None:
        """Log, once per pod and reason, that its assignment is not counted as it says."""
        if not reason:
            self._told.pop(entry.uid, None)
            return
        if self._told.get(entry.uid) == reason:
            return
        self._told[entry.uid] = reason
        kept = None if lost else entry.placed.assignment
        log.warning(
            "Ignored a pod's GPU assignment",
            extra=logs.kv(
                pod=entry.key,
                node=entry.node,
                reason=reason,
                counted="on no GPU in particular" if kept is None else f"on GPU {kept.gpu_uuid}",
            ),
        )
