"""The extender's words for what went wrong: core errors in `Error` fields, and nodes it does not know.

The one place an error becomes text for kube-scheduler (and from there the pod's events).
"""

from __future__ import annotations

from gpupart.core.errors import GpupartError, InvalidInput


def explain(error: BaseException) -> str:
    """The one place an error becomes the text of an `Error` field."""
    if isinstance(error, InvalidInput):
        return f"invalid pod: {error}"
    if isinstance(error, GpupartError):
        return str(error)
    return f"internal error: {type(error).__name__}: {error}"


NOT_SELECTED = "node(s) didn't match Pod's node affinity/selector"
"""kube-scheduler's own reason (its NodeAffinity plugin, v1.36) for the nodes a pod's node
selector and required node affinity rule out: a pending pod's words count them so."""

UNKNOWN_SUMMARY = "node(s) not yet known to the gpupart extender"
"""A node the cluster state has not seen, as one counted reason (see `answers.DETAILED_NODES`)."""


def unknown_reason(name: str) -> str:
    return f"{name}: not known to the gpupart extender (no such Node watched yet)"
