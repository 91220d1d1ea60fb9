"""core/v1 Events as plain documents: the one shape every gpupart component reports in."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

MAX_MESSAGE = 1024
"""The API server refuses longer Event messages."""


def object_event(
    involved: Mapping[str, str],
    *,
    reason: str,
    message: str,
    kind: str,
    namespace: str,
    now: str,
    component: str,
    instance: str,
) -> dict[str, Any]:
    """A core/v1 Event of `kind` (Normal or Warning) about the object `involved` names.

    `component` is the gpupart component reporting (operator, node), `instance` which one of
    them (the operator's peer id, the node agent's node).
    """
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{involved['name'][:200]}.", "namespace": namespace},
        "involvedObject": dict(involved),
        "reason": reason,
        "message": message[:MAX_MESSAGE],
        "type": kind,
        "source": {"component": f"gpupart-{component}"},
        "reportingComponent": f"gpupart.io/{component}",
        "reportingInstance": instance,
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }
