"""Why a pending pod fits nowhere, in one message: node verdicts counted as kube-scheduler does, plus dynamic MIG.

The extender posts this text as an Event on pods kube-scheduler left Unschedulable
(docs/adr-019-pending-reasons.md): kube-scheduler asks the extender only about nodes its own
resource counts passed, so for a MIG or whole-GPU pod that fits nowhere it never sees the
extender's reasons. Pure: the extender passes the verdicts, the MIG devices being made and the
dynamic GPUs it read from the Nodes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from gpupart.core.api.events import MAX_MESSAGE
from gpupart.core.mig.catalogue import find_gpu_model
from gpupart.core.mig.layout import MigInstance
from gpupart.core.scheduling.demand import PodDemand

_NODES_IN_MESSAGE = 3
"""Nodes named in a lead sentence before "and N more"."""


@dataclass(frozen=True, slots=True, order=True)
class DesiredDynamicGpu:
    """A GPU that a GpuPartition with dynamic MIG selects (the Node's `gpupart.io/desired`)."""

    node: str
    gpu: int
    product: str
    """The product name of the node agent's inventory ("" when the inventory lacks the GPU)."""
    partition: str


@dataclass(frozen=True, slots=True, order=True)
class Making:
    """A MIG instance a node's plan reserves for the pod that its inventory does not have yet."""

    node: str
    gpu: int
    instance: MigInstance


def mig_outlook(
    demand: PodDemand,
    *,
    offered: Iterable[str],
    making: Sequence[Making],
    dynamic: Sequence[DesiredDynamicGpu],
) -> str:
    """What dynamic MIG does for a MIG pod, as a sentence ("" when the node reasons say it all).

    `offered`: every MIG profile some node's inventory has a device of; `making`: the instances
    reserved for this pod and not made yet; `dynamic`: every GPU under a dynamic-MIG partition.
    """
    parts = []
    offers = frozenset(offered)
    for profile, _ in demand.request.mig:
        mine = sorted(m for m in making if m.instance.profile == profile)
        if mine:
            parts.append(
                f"dynamic MIG is creating a {profile} slice for this pod on "
                + _listed(f"{m.node} (GPU {m.gpu}, {_slots(m.instance)})" for m in mine)
            )
            continue
        if profile in offers:
            continue
        able = sorted(g for g in dynamic if _offers(g.product, profile))
        if not able:
            parts.append(
                f"no node offers {profile} and no GpuPartition with dynamic MIG selects a node "
                "that could make one"
            )
            continue
        partitions = ", ".join(sorted({g.partition for g in able}))
        parts.append(
            f"no node offers {profile} yet; dynamic MIG (GpuPartition {partitions}) can make one "
            f"on {_listed(f'{g.node} GPU {g.gpu}' for g in able)}: the operator's "
            "MigSliceUnavailable events on this pod say what is in the way"
        )
    return "; ".join(parts)


def pending_message(
    *, lead: str, nodes: int, fits: Sequence[str], reasons: Mapping[str, int]
) -> str:
    """The Event text: `lead`, then the nodes counted as kube-scheduler counts an extender's
    reasons ("0/5 nodes can take it (gpupart): 1 n1: ..., 4 node(s) had ..."), cut to what
    the API server accepts.

    `fits`: the nodes where gpupart finds room (kube-scheduler's own filters keep the pod off
    them); `reasons`: each distinct reason text with how many nodes gave it.
    """
    counted = ", ".join(
        f"{count} {text}" for text, count in sorted(reasons.items(), key=lambda i: (-i[1], i[0]))
    )
    if fits:
        body = (
            f"gpupart finds GPU room for it on {len(fits)}/{nodes} node(s) ({_listed(fits)}): "
            "kube-scheduler keeps it off them for its own reasons (its FailedScheduling event)"
        )
        if counted:
            body += f"; the others: {counted}"
    elif nodes == 0:
        body = "gpupart knows of no node (no Node has been listed yet)"
    else:
        body = f"0/{nodes} nodes can take it (gpupart): {counted}"
    text = f"{lead}. {body}." if lead else f"{body}."
    if len(text) > MAX_MESSAGE:
        text = text[: MAX_MESSAGE - 3] + "..."
    return text


def _offers(product: str, profile: str) -> bool:
    model = find_gpu_model(product) if product else None
    return model is not None and model.find_profile(profile) is not None


def _slots(instance: MigInstance) -> str:
    p = instance.placement
    if p.size == 1:
        return f"slot {p.start}"
    return f"slots {p.start}-{p.start + p.size - 1}"


def _listed(items: Iterable[str]) -> str:
    names = list(items)
    shown = ", ".join(names[:_NODES_IN_MESSAGE])
    more = len(names) - _NODES_IN_MESSAGE
    return f"{shown}, and {more} more" if more > 0 else shown
