"""Pods that wait on DRA claims: which they are, and why each node cannot allocate them, from the DRA picture.

kube-scheduler allocates DRA claims itself (its DynamicResources plugin); the extender neither
filters nor binds them. What it adds is the words (docs/dra.md, "Reasons"): for the pending
reasons' Event (ADR 019) and for `diagnose`, each node's sentence from `gpupart.core.dra.reasons`
over the slices and claims it watched. A pod is a DRA pod when it has ResourceClaims, or when it
asks for an extended resource a DeviceClass serves and kube-scheduler's PodScheduled message says
its claims could not be allocated (KEP-5004: the device plugin serves the name where a node
advertises it, and then the pod is not DRA's).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

from gpupart.core.api.pods import find_condition, node_constraint
from gpupart.core.dra.reasons import DraAsk, NodeReason, ask_of, dra_message, node_reason
from gpupart.core.dra.requests import extended_class, pod_claims
from gpupart.core.errors import GpupartError

from .objects import key_of, problem_of
from .snapshot import DraPicture, Snapshot
from .texts import NOT_SELECTED, explain

CLAIMS_WORD = "claim"
"""In kube-scheduler's message for a pod whose claims no node could allocate (v1.36:
`cannot allocate all claims`, `cannot schedule extended resource claim`)."""


def dra_ask(pod: Mapping[str, Any], dra: DraPicture) -> DraAsk | None:
    """What the pod asks through DRA; None when it is not a DRA pod (or not one it can read:
    the device-plugin path then says why)."""
    key = key_of(pod)
    try:
        asked = pod_claims(pod)
    except Exception as error:  # noqa: BLE001 - this pod's problem, whatever its shape
        spec = pod.get("spec")
        if isinstance(spec, Mapping) and spec.get("resourceClaims"):
            return DraAsk(key, problem=f"its claims cannot be read: {problem_of(error)}")
        return None
    if not asked.claims:
        served = any(extended_class(r, dra.classes) is not None for r, _ in asked.extended)
        condition = find_condition(pod, "PodScheduled") or {}
        if not served or CLAIMS_WORD not in str(condition.get("message") or ""):
            return None
    namespace = key.split("/", 1)[0]
    return ask_of(key, asked, dra.specs, dra.allocated, dra.classes, namespace=namespace)


def node_reasons(
    pod: Mapping[str, Any], ask: DraAsk, snap: Snapshot, dra: DraPicture
) -> tuple[list[NodeReason], Counter[str]]:
    """Each node's reason for the pod (every node of the snapshot), and the nodes its node
    selector and required node affinity rule out, counted in kube-scheduler's words."""
    allowed = node_constraint(pod)
    reasons: list[NodeReason] = []
    others: Counter[str] = Counter()
    if ask.problem:
        return reasons, others
    for name in snap.node_names():
        state = snap.nodes[name]
        if not allowed.allows(dict(state.entry.labels), name):
            others[NOT_SELECTED] += 1
            continue
        reasons.append(
            node_reason(name, dra.slices.get(name, ()), dra.claims_on.get(name, ()), ask)
        )
    return reasons, others


def pending_text(pod: Mapping[str, Any], ask: DraAsk, snap: Snapshot, dra: DraPicture) -> str:
    """The Event text for a pending DRA pod."""
    try:
        reasons, others = node_reasons(pod, ask, snap, dra)
    except GpupartError as error:
        return f"gpupart cannot read this pod: {explain(error)}."
    return dra_message(ask, reasons, others=others)
