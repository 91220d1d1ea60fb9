"""Evaluating one node for one pod: which GPUs can take it, why not (reasons a person reads), and how good a fit is.

The scheduler extender calls `evaluate(node, demand, config=..., model=...)` once per candidate
node; the answer is a `Fit` (a 0-10 score and the GPU a shared pod gets) or a `NoFit` (a reason a
person can read, and whether preemption could help). Nothing here does I/O, reads the clock or
logs: node views (`views`) and demands (`pods`) are built from API objects by the extender and
passed in; the terms are in `terms` and `shares`.

Over 400 lines on purpose: MIG, whole-GPU and shared requests are one decision, and each reason
text sits beside the check that produces it.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

from gpupart.core.api.resources import GpuRequest
from gpupart.core.api.spec import Mode
from gpupart.core.api.wire import MIG_PLAN_ANNOTATION
from gpupart.core.scheduling.demand import (
    PodDemand,
    matches,
    node_conflict,
)
from gpupart.core.scheduling.scoring import MILLI, FragmentationModel, Request
from gpupart.core.scheduling.shares import (
    fragmentation_term,
    node_leftover,
    share_milli,
)
from gpupart.core.scheduling.terms import (
    MAX_SCORE,
    Conflict,
    ScoringConfig,
    Terms,
    Weights,
    anti_affinity_term,
    combine,
    headroom_term,
    priority_term,
    weighted_sum,
)
from gpupart.core.scheduling.views import GpuView, NodeView, Tenant

_NAMES_IN_REASON = 3
"""A reason lists at most this many pods, then "and N more"."""


class FailureKind(StrEnum):
    """Why a node was filtered out, as a closed set (the metrics label)."""

    NO_INVENTORY = "no_inventory"
    NO_SUCH_RESOURCE = "no_such_resource"
    TOO_SMALL = "too_small"
    IN_USE = "in_use"
    ANTI_AFFINITY = "anti_affinity"
    UNKNOWN_NODE = "unknown_node"
    UNREADABLE_PLAN = "unreadable_plan"


@dataclass(frozen=True, slots=True)
class Fit:
    score: int
    gpu: int | None
    """The GPU index a shared-GPU pod gets; None for MIG and whole GPUs (the device plugin picks)."""
    terms: Terms


@dataclass(frozen=True, slots=True)
class NoFit:
    reason: str
    """In full: the node, what it has, and the pods in the way ("node-7: 2 GPUs, no free ...")."""
    summary: str
    """Without the node or pod names ("node(s) had no free 3g.40gb MIG slice"): the same text for
    every node failing the same way, so kube-scheduler's "0/N nodes are available" message counts
    them under one reason instead of growing by a line per node."""
    kind: FailureKind
    unresolvable: bool
    """True when preemption cannot help (FailedAndUnresolvableNodes)."""
    shortfall: int = 0
    """How far from fitting, in thousandths of the request (the closest GPU's missing memory,
    slots or compute; the missing MIG devices or whole GPUs): the extender shows the nodes closest
    to fitting in full. 0 when only anti-affinity is in the way."""


Verdict = Fit | NoFit


def evaluate(
    node: NodeView, demand: PodDemand, *, config: ScoringConfig, model: FragmentationModel
) -> Verdict:
    """Whether `node` can take `demand`, and how well; reasons name the node and the blockers."""
    if node.problem:
        return NoFit(
            f"{node.name}: {node.problem}",
            "node(s) had no GPU inventory from the gpupart node agent",
            FailureKind.NO_INVENTORY,
            True,
        )
    request = demand.request
    if request.mig:
        return _evaluate_mig(node, demand, config)
    if request.whole_gpus:
        return _evaluate_whole(node, demand, config, model)
    if request.shared:
        return _evaluate_shared(node, demand, config, model)
    # Not a GPU pod: nothing to decide here (kube-scheduler only sends pods we manage).
    return Fit(MAX_SCORE // 2, None, Terms(0.5, 0.5, 1.0, 0.5))


def _gpus_text(node: NodeView) -> str:
    n = len(node.gpus)
    return f"{n} GPU" if n == 1 else f"{n} GPUs"


def _modes_text(node: NodeView) -> str:
    return ", ".join(sorted({str(g.mode) for g in node.gpus})) or "no GPUs"


def _pods_text(tenants: Iterable[Tenant]) -> str:
    return _names_text(t.pod for t in tenants)


def _names_text(pods: Iterable[str]) -> str:
    names = sorted(set(pods))
    if not names:
        return "no pod the extender knows of"
    shown = ", ".join(names[:_NAMES_IN_REASON])
    more = len(names) - _NAMES_IN_REASON
    return f"{shown}, and {more} more" if more > 0 else shown


PLAN_SUMMARY = f"node(s) had an unreadable MIG plan ({MIG_PLAN_ANNOTATION})"


def _evaluate_mig(node: NodeView, demand: PodDemand, config: ScoringConfig) -> Verdict:
    if node.plan_problem:
        return NoFit(
            f"{node.name}: {node.plan_problem}",
            PLAN_SUMMARY,
            FailureKind.UNREADABLE_PLAN,
            True,
        )
    offered: Counter[str] = Counter()
    for gpu in node.gpus:
        if gpu.mode is Mode.MIG:
            offered.update(gpu.mig_profiles)
    used: Counter[str] = Counter()
    for t in node.mig_tenants:
        used[t.profile] += t.count
    # A MIG device reserved for another pod is taken; the pod's own reservations are free for it.
    reserved: Counter[str] = Counter()
    reserved_for: dict[str, list[str]] = {}
    own = False
    for r in node.reserved:
        profile = r.instance.profile
        if r.pod == demand.pod:
            own = own or any(p == profile for p, _ in demand.request.mig)
        else:
            reserved[profile] += 1
            reserved_for.setdefault(profile, []).append(r.pod)
    left_after = 0
    capacity = 0
    for profile, count in demand.request.mig:
        total = offered[profile]
        if total == 0:
            here = ", ".join(f"{p}×{n}" for p, n in sorted(offered.items())) or "none"
            return NoFit(
                f"{node.name}: {_gpus_text(node)}, none with a {profile} slice "
                f"(MIG slices here: {here})",
                f"node(s) had no {profile} MIG slice",
                FailureKind.NO_SUCH_RESOURCE,
                True,
            )
        if total < count:
            return NoFit(
                f"{node.name}: {_gpus_text(node)}, needs {count} {profile} slices, "
                f"the node has {total}",
                f"node(s) had fewer than {count} {profile} MIG slices",
                FailureKind.TOO_SMALL,
                True,
            )
        free = total - used[profile] - reserved[profile]
        if free < count:
            holders = [t for t in node.mig_tenants if t.profile == profile]
            what = _mig_taken_text(
                profile, free, total, count, holders, used[profile], reserved_for.get(profile, [])
            )
            short = (
                f"no free {profile} MIG slice"
                if count == 1
                else (f"fewer than {count} free {profile} MIG slices")
            )
            return NoFit(
                f"{node.name}: {_gpus_text(node)}, {what}",
                f"node(s) had {short}",
                FailureKind.IN_USE,
                # No eviction frees a reserved MIG device: only its pod or its expiry does.
                total - reserved[profile] < count,
                _thousandths(count - max(free, 0), count),
            )
        left_after += free - count
        capacity += total
    all_devices = sum(offered.values())
    taken = sum(used.values()) + sum(reserved.values())
    contention = min(1.0, taken / all_devices) if all_devices else 0.0
    mine = node.mig_tenants
    # The device plugin picks the MIG device, so a same-group pod on the node may share our GPU.
    conflict = (
        Conflict.MAYBE_GPU
        if node_conflict(mine, demand, config.anti_affinity_label)
        else Conflict.NONE
    )
    if conflict is Conflict.NONE and node_conflict(
        (*node.whole_tenants, *_shared_tenants(node)), demand, config.anti_affinity_label
    ):
        conflict = Conflict.NODE
    terms = Terms(
        headroom=headroom_term(left_after, capacity, config.strategy),
        priority=priority_term(demand.priority, contention, config),
        anti_affinity=anti_affinity_term(conflict, config.anti_affinity_scope),
        fragmentation=0.5,  # the policy's model is about GPU shares; MIG devices are fixed
    )
    # Its MIG device is being made (or kept) here for it: this node first, so that kube-scheduler
    # binds it where the operator planned, not to another node with a free MIG device.
    score = MAX_SCORE if own else combine(terms, config.weights)
    return Fit(score, None, terms)


def _mig_taken_text(
    profile: str,
    free: int,
    total: int,
    count: int,
    holders: list[Tenant],
    used: int,
    reserved_for: list[str],
) -> str:
    """Why too few MIG devices of `profile` are free: the pods holding them, those reserved for."""
    if not reserved_for:
        # The texts from before reservations, unchanged.
        if free <= 0:
            return f"no free {profile} slice (all {total} in use by {_pods_text(holders)})"
        return (
            f"{free} free {profile} slice{'s' if free > 1 else ''} of {total}, "
            f"needs {count} (in use by {_pods_text(holders)})"
        )
    reserved = f"{len(reserved_for)} reserved for {_names_text(reserved_for)}"
    if used > 0:
        why = f"{used} in use by {_pods_text(holders)}; {reserved}"
    elif free <= 0:
        why = f"all {reserved}"
    else:
        why = reserved
    if free <= 0:
        return f"no free {profile} slice ({why})"
    return f"{free} free {profile} slice{'s' if free > 1 else ''} of {total}, needs {count} ({why})"


def _shared_tenants(node: NodeView) -> tuple[Tenant, ...]:
    return tuple(t for gpu in node.gpus for t in gpu.tenants) + node.unplaced_tenants


def _evaluate_whole(
    node: NodeView, demand: PodDemand, config: ScoringConfig, model: FragmentationModel
) -> Verdict:
    count = demand.request.whole_gpus
    total = sum(1 for gpu in node.gpus if gpu.mode is Mode.NONE)
    if total == 0:
        return NoFit(
            f"{node.name}: {_gpus_text(node)}, none offered whole (modes: {_modes_text(node)})",
            "node(s) had no GPU offered whole",
            FailureKind.NO_SUCH_RESOURCE,
            True,
        )
    if total < count:
        return NoFit(
            f"{node.name}: needs {count} whole GPUs, the node offers {total}",
            f"node(s) had fewer than {count} GPUs offered whole",
            FailureKind.TOO_SMALL,
            True,
        )
    used = sum(t.count for t in node.whole_tenants)
    free = total - used
    if free < count:
        return NoFit(
            f"{node.name}: {_gpus_text(node)}, needs {count} whole GPU{'s' if count > 1 else ''}, "
            f"{max(free, 0)} free (in use by {_pods_text(node.whole_tenants)})",
            "node(s) had no free whole GPU"
            if count == 1
            else f"node(s) had fewer than {count} whole GPUs free",
            FailureKind.IN_USE,
            False,
            _thousandths(count - max(free, 0), count),
        )
    conflict = Conflict.NONE
    if node_conflict(
        (*node.whole_tenants, *node.mig_tenants, *_shared_tenants(node)),
        demand,
        config.anti_affinity_label,
    ):
        conflict = Conflict.NODE
    state = node_leftover(node)
    gpus = tuple(i for i, share in enumerate(state.gpu_left) if share == MILLI)[:count]
    terms = Terms(
        headroom=headroom_term(free - count, total, config.strategy),
        priority=priority_term(demand.priority, used / total, config),
        anti_affinity=anti_affinity_term(conflict, config.anti_affinity_scope),
        fragmentation=fragmentation_term(
            model, state, Request(demand.cpu_milli, 0, count, MILLI), gpus
        ),
    )
    return Fit(combine(terms, config.weights), None, terms)


def _thousandths(missing: int, wanted: int) -> int:
    return min(1000, -(-1000 * max(missing, 0) // wanted)) if wanted > 0 else 0


def _gpu_shortfall(gpu: GpuView, request: GpuRequest) -> int:
    """How much of the request this shared GPU lacks, in thousandths (its scarcest dimension)."""
    lacks = [0]
    if gpu.replicas:
        lacks.append(
            _thousandths(gpu.used_replicas + request.shared - gpu.replicas, request.shared)
        )
    if request.memory_mib:
        lacks.append(_thousandths(request.memory_mib - gpu.free_memory_mib, request.memory_mib))
    if request.compute_percent:
        free = 100 - gpu.used_compute_percent
        lacks.append(_thousandths(request.compute_percent - free, request.compute_percent))
    return max(lacks)


def _gpu_blocker(
    gpu: GpuView, demand: PodDemand, anti_affinity_label: str
) -> tuple[str, bool] | None:
    """Why this shared GPU cannot take the pod (text, unresolvable), or None if it can."""
    request = demand.request
    if gpu.replicas and request.shared > gpu.replicas:
        return f"GPU {gpu.index}: {gpu.replicas} client slots, needs {request.shared}", True
    if request.memory_mib > gpu.memory_mib:
        return f"GPU {gpu.index}: {gpu.memory_mib} MiB in all", True
    if not gpu.holds_client(demand.client_memory_mib, demand.client_compute_percent):
        # MPS would cap a container at the daemon's default, whatever it asked: refuse, never shrink.
        return (
            f"GPU {gpu.index}: MPS lets one container hold at most {gpu.client_memory_mib} MiB "
            f"and {gpu.client_compute_percent}% compute (the partition's mps.defaultMemory and "
            "mps.defaultComputePercent, else an even share)",
            True,
        )
    if gpu.replicas and gpu.used_replicas + request.shared > gpu.replicas:
        return (
            f"GPU {gpu.index}: all {gpu.replicas} client slots taken "
            f"(by {_pods_text(gpu.tenants)})",
            False,
        )
    if request.memory_mib and gpu.free_memory_mib < request.memory_mib:
        return (
            f"GPU {gpu.index}: {gpu.free_memory_mib} of {gpu.memory_mib} MiB free "
            f"(used by {_pods_text(gpu.tenants)})",
            False,
        )
    if request.compute_percent and gpu.used_compute_percent + request.compute_percent > 100:
        return (
            f"GPU {gpu.index}: {100 - gpu.used_compute_percent}% compute free "
            f"(used by {_pods_text(gpu.tenants)})",
            False,
        )
    if not demand.terms:
        return None
    blockers = [
        t for t in gpu.tenants if matches(t, demand, anti_affinity_label, required_only=True)
    ]
    if blockers:
        return (
            f"GPU {gpu.index}: required podAntiAffinity with {_pods_text(blockers)}",
            False,
        )
    return None


def _evaluate_shared(
    node: NodeView, demand: PodDemand, config: ScoringConfig, model: FragmentationModel
) -> Verdict:
    request = demand.request
    shared = [gpu for gpu in node.gpus if gpu.mode.is_shared]
    if not shared:
        return NoFit(
            f"{node.name}: {_gpus_text(node)}, none shared by MPS or time-slicing "
            f"(modes: {_modes_text(node)})",
            "node(s) had no GPU shared by MPS or time-slicing",
            FailureKind.NO_SUCH_RESOURCE,
            True,
        )
    fitting: list[GpuView] = []
    blocked: list[str] = []
    all_unresolvable = True
    anti_affinity_only = True
    for gpu in shared:
        blocker = _gpu_blocker(gpu, demand, config.anti_affinity_label)
        if blocker is None:
            fitting.append(gpu)
        else:
            blocked.append(blocker[0])
            all_unresolvable = all_unresolvable and blocker[1]
            anti_affinity_only = anti_affinity_only and "podAntiAffinity" in blocker[0]
    unplaced_memory = sum(t.memory_mib for t in node.unplaced_tenants)
    # Pods whose GPU we cannot read still use memory somewhere on this node.
    room = sum(g.free_memory_mib for g in shared) - unplaced_memory
    if fitting and unplaced_memory and room < request.memory_mib:
        fitting = []
        blocked.append(
            f"{unplaced_memory} MiB used by pods without a GPU assignment "
            f"({_pods_text(node.unplaced_tenants)})"
        )
        all_unresolvable = anti_affinity_only = False
    if not fitting:
        need = _need_text(request)
        kind = (
            FailureKind.ANTI_AFFINITY
            if anti_affinity_only
            else (FailureKind.TOO_SMALL if all_unresolvable else FailureKind.IN_USE)
        )
        shortfall = min(_gpu_shortfall(gpu, request) for gpu in shared)
        if unplaced_memory and request.memory_mib:
            shortfall = max(shortfall, _thousandths(request.memory_mib - room, request.memory_mib))
        return NoFit(
            f"{node.name}: {_gpus_text(node)}, no shared GPU with {need} ({'; '.join(blocked)})",
            f"node(s) had no shared GPU with {need}{_WHY_SHARED[kind]}",
            kind,
            all_unresolvable,
            shortfall,
        )
    reserve = math.ceil(config.reserve_fraction * request.memory_mib)
    comfortable = [g for g in fitting if g.free_memory_mib - request.memory_mib >= reserve]
    eats_reserve = not comfortable
    state = node_leftover(node)
    positions = {
        gpu.index: n for n, gpu in enumerate(g for g in node.gpus if g.mode is not Mode.MIG)
    }
    # Which GPUs hold a pod the new one should avoid, computed once per GPU (not per pair).
    label = config.anti_affinity_label
    aware = bool(demand.terms) or bool(demand.group and label)
    near = {g.index for g in shared if aware and node_conflict(g.tenants, demand, label)}
    elsewhere = aware and node_conflict(
        (*node.unplaced_tenants, *node.whole_tenants, *node.mig_tenants), demand, label
    )
    seen: set[tuple[int, int, float, Conflict, int, int]] = set()
    best: Fit | None = None
    for gpu in comfortable or fitting:
        if request.memory_mib:
            left, capacity = gpu.free_memory_mib - request.memory_mib, gpu.memory_mib
        elif request.compute_percent:
            left, capacity = 100 - gpu.used_compute_percent - request.compute_percent, 100
        else:
            cap = gpu.replicas or 1
            left, capacity = cap - gpu.used_replicas - request.shared, cap
        if gpu.index in near:
            conflict = Conflict.GPU
        elif elsewhere or len(near) > 0:
            conflict = Conflict.NODE
        else:
            conflict = Conflict.NONE
        milli = share_milli(request.memory_mib, request.compute_percent, gpu, request.shared)
        position = positions[gpu.index]
        contention = gpu.contention
        # A GPU equal to an earlier one in everything the terms look at scores the same, and
        # ties go to the lower index: skip it.
        key = (left, capacity, contention, conflict, milli, state.gpu_left[position])
        if key in seen:
            continue
        seen.add(key)
        terms = Terms(
            headroom=headroom_term(left, capacity, config.strategy),
            priority=priority_term(demand.priority, contention, config),
            anti_affinity=anti_affinity_term(conflict, config.anti_affinity_scope),
            fragmentation=fragmentation_term(
                model, state, Request(demand.cpu_milli, 0, 1, milli), (position,)
            ),
            eats_reserve=eats_reserve,
        )
        fit = Fit(combine(terms, config.weights), gpu.index, terms)
        if best is None or _rank(fit, config.weights) > _rank(best, config.weights):
            best = fit
    assert best is not None  # `fitting` is not empty
    return best


def _rank(fit: Fit, weights: Weights) -> float:
    """Ties in the 0-10 score are broken by the unrounded mean (lowest GPU index wins the rest)."""
    return fit.score + 1e-3 * weighted_sum(fit.terms, weights)


_WHY_SHARED = {
    FailureKind.IN_USE: " (in use)",
    FailureKind.TOO_SMALL: " (too small)",
    FailureKind.ANTI_AFFINITY: " away from pods it must not share with (podAntiAffinity)",
}


def _need_text(request: GpuRequest) -> str:
    parts = []
    if request.memory_mib:
        parts.append(f"{request.memory_mib} MiB free")
    if request.compute_percent:
        parts.append(f"{request.compute_percent}% compute")
    parts.append(f"{request.shared} client slot{'s' if request.shared > 1 else ''}")
    return " and ".join(parts)
