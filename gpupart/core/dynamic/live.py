"""One round of dynamic MIG in a live cluster, pure: nodes, plans, reports and pods in; new plans out.

The operator calls `plan_round` with what it listed (ADR 013). Per node:
- A plan the node agent has not answered yet is **in flight**: its GPUs are not planned again
  (one plan in flight per node, never one for the cluster) and the pods it reserves for are
  being served. Its reservations still end when their pod is bound, gone, or past the TTL.
- An answered plan: the GPUs are what the inventory says. If it failed, its reservations for
  instances that do not exist are dropped, so their pods are planned again from the inventory.
- The planner (`gpupart.core.dynamic.planner.plan`) then gets every dynamic GPU not in flight
  that the inventory shows served through the device plugin (a GPU served through DRA, or
  moving between the two, is never planned: ADR 023), each instance marked in use (the
  inventory's `used`, or conservatively every idle instance of a profile when more bound pods
  hold it than the inventory marks), reserved, or idle.
A node's plan is rewritten only when its layouts or reservations change; its id is a digest of
the content, so a round with nothing new writes nothing.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from gpupart.core.api.spec import DynamicMig, Interface, Mode
from gpupart.core.api.wire import (
    GpuState,
    Inventory,
    MigPlan,
    MigReservation,
    PlannedGpu,
    PlanReport,
    encode_mig_plan,
)
from gpupart.core.dynamic.model import (
    Gpu,
    Instance,
    MigDemand,
    Mix,
    Use,
)
from gpupart.core.dynamic.planner import PlannerAnswer, plan
from gpupart.core.mig.catalogue import GpuModel
from gpupart.core.mig.layout import MigInstance
from gpupart.core.mig.planning import CreateGpuInstance, DestroyGpuInstance

DEFAULT_RESERVATION_TTL_S = 120.0
"""How long a reservation waits for its pod to be bound before its instance is free again."""


@dataclass(frozen=True, slots=True)
class DynamicGpu:
    """A GPU that a partition with `spec.mig.dynamic` holds (from the partition resolution)."""

    index: int
    model: GpuModel
    policy: DynamicMig
    partition: str


@dataclass(frozen=True, slots=True)
class NodeFacts:
    """One node as the round sees it; `plan` and `inventory` None when absent or unreadable."""

    name: str
    gpus: tuple[DynamicGpu, ...]
    inventory: Inventory | None = None
    plan: MigPlan | None = None
    report: PlanReport | None = None
    holders: Mapping[str, int] = field(default_factory=dict)
    """Instances per profile held by the pods bound to the node (not finished)."""
    hold: bool = False
    """Not planned this round (the caller backs off after a failed plan): as if in flight."""
    holder_pods: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """Per profile, the pods (namespace/name) bound to the node that hold it: reasons name
    them (the inventory says which instance is used, not by whom)."""

    @property
    def in_flight(self) -> bool:
        return self.plan is not None and (self.report is None or self.report.id != self.plan.id)


@dataclass(frozen=True, slots=True)
class PendingPod:
    """A pod that no node can take for want of a MIG profile (PodScheduled=False, Unschedulable)."""

    key: str
    """namespace/name"""
    uid: str
    profiles: tuple[str, ...]
    priority: int = 0
    pending_since: float = 0.0
    nodes: frozenset[str] | None = None
    """The nodes it may run on (node selector, required node affinity); None: any."""


@dataclass(frozen=True, slots=True)
class Planned:
    """A reservation this round made: the pod's Event says it."""

    reservation: MigReservation
    node: str
    created: bool


@dataclass(frozen=True, slots=True)
class NodeChange:
    """What the round does to one node: the plan to write and the instance operations in it."""

    plan: MigPlan
    created: tuple[tuple[int, MigInstance], ...] = ()
    destroyed: tuple[tuple[int, MigInstance], ...] = ()


@dataclass(frozen=True, slots=True)
class Round:
    changes: Mapping[str, NodeChange]
    """Per node whose plan annotation changes."""
    planned: tuple[Planned, ...]
    unserved: tuple[tuple[str, str], ...]
    """(pod, the planner's reason) for pending pods no GPU can serve now."""
    expired: tuple[MigReservation, ...]
    """Reservations dropped because their pod was not bound within the TTL."""
    failed: tuple[tuple[str, MigReservation, str], ...]
    """(node, reservation, why) for reservations of a plan the node agent could not apply."""
    in_flight: tuple[str, ...]
    """Nodes with a plan the node agent has not answered yet."""
    planned_nodes: tuple[str, ...] = ()
    """Nodes whose GPUs the planner saw this round."""


def plan_round(
    nodes: Sequence[NodeFacts],
    pending: Sequence[PendingPod],
    *,
    now: float,
    ttl_s: float = DEFAULT_RESERVATION_TTL_S,
    unbound: Mapping[str, str] | None = None,
    idle_since: Mapping[tuple[str, int, MigInstance], float] | None = None,
) -> Round:
    """Plan for `pending` on the dynamic GPUs of `nodes`; see the module docstring.

    `unbound` maps every pod that exists and is not bound yet (namespace/name) to its uid: a
    reservation lives while its pod is there (default: the pending pods). `idle_since` says
    since when the caller has seen each idle instance (node, GPU, instance) idle; unknown ones
    count as idle since `now` (the hysteresis then keeps them longest).
    """
    waiting = {p.key: p for p in pending}
    if unbound is None:
        unbound = {p.key: p.uid for p in pending}
    idle_since = idle_since or {}
    kept: dict[str, list[MigReservation]] = {}
    expired: list[MigReservation] = []
    failed: list[tuple[str, MigReservation, str]] = []
    gpus: list[Gpu] = []
    served: set[str] = set()
    for node in nodes:
        live, gone = _live_reservations(node, unbound, now)
        expired.extend(gone)
        report = node.report
        if not node.in_flight and report is not None and report.state is not GpuState.APPLIED:
            exists = _existing(node.inventory)
            failed.extend(
                (node.name, r, report.message) for r in live if (r.gpu, r.instance) not in exists
            )
            live = [r for r in live if (r.gpu, r.instance) in exists]
        kept[node.name] = live
        served.update(r.pod for r in live)
        if not node.in_flight and not node.hold:
            gpus.extend(_planner_gpus(node, live, now, idle_since))
    demand = [
        MigDemand(p.key, p.profiles, p.priority, p.pending_since, p.nodes)
        for p in pending
        if p.key not in served and p.profiles
    ]
    mix = Mix.of(
        Counter(p for d in demand for p in d.profiles)
        + Counter({p: n for node in nodes for p, n in node.holders.items() if n > 0})
    )
    answer = plan(gpus, demand, now=now, mix=mix) if gpus else PlannerAnswer((), (), ())
    unserved = answer.unserved
    if not gpus:
        unserved = tuple(
            (d.pod, "no GPU of a dynamic MIG partition can be planned now") for d in demand
        )
    changes, planned = _changes(nodes, kept, answer, waiting, now, ttl_s)
    return Round(
        changes,
        planned,
        tuple(unserved),
        tuple(expired),
        tuple(failed),
        tuple(sorted(n.name for n in nodes if n.in_flight)),
        tuple(sorted({g.node for g in gpus})),
    )


def _live_reservations(
    node: NodeFacts, unbound: Mapping[str, str], now: float
) -> tuple[list[MigReservation], list[MigReservation]]:
    """(kept, expired): a reservation lives while its pod is unbound (same uid) and its TTL runs.

    A pod bound or gone ends it without counting as expired: bound, the instance is in use.
    """
    if node.plan is None:
        return [], []
    live, expired = [], []
    for r in node.plan.reservations:
        uid = unbound.get(r.pod)
        if uid is None or (r.uid and uid and r.uid != uid):
            continue
        if r.expires <= now:
            expired.append(r)
            continue
        live.append(r)
    return live, expired


def _existing(inventory: Inventory | None) -> set[tuple[int, MigInstance]]:
    if inventory is None:
        return set()
    return {(g.index, d.instance) for g in inventory.gpus for d in g.mig_devices}


def _planner_gpus(
    node: NodeFacts,
    reservations: Sequence[MigReservation],
    now: float,
    idle_since: Mapping[tuple[str, int, MigInstance], float],
) -> list[Gpu]:
    """The node's dynamic GPUs that the inventory shows in MIG mode, instances with their use."""
    if node.inventory is None:
        return []
    reserved = {(r.gpu, r.instance): r.pod for r in reservations}
    inventory = {g.index: g for g in node.inventory.gpus}
    # More pods hold a profile than the inventory marks used: it lags the kubelet, so which
    # idle instance they hold is unknown. Keep them all: a wrong guess only keeps one idle.
    marked: Counter[str] = Counter(
        d.instance.profile for g in node.inventory.gpus for d in g.mig_devices if d.used
    )
    unsure = {p for p, n in node.holders.items() if n > marked[p]}
    gpus = []
    for dynamic in node.gpus:
        seen = inventory.get(dynamic.index)
        if seen is None or seen.mode is not Mode.MIG:
            continue  # the node agent has not enabled MIG mode yet: nothing to plan on
        if seen.interface is not Interface.DEVICE_PLUGIN:
            continue  # served through DRA or moving: the claims decide its instances (ADR 023)
        instances = []
        for device in seen.mig_devices:
            spot = (dynamic.index, device.instance)
            if spot in reserved:
                instances.append(Instance(device.instance, Use.RESERVED, reserved[spot]))
            elif device.used or device.instance.profile in unsure:
                holder = _holder(node, device.instance.profile, device.uuid)
                instances.append(Instance(device.instance, Use.IN_USE, holder))
            else:
                since = idle_since.get((node.name, *spot), now)
                instances.append(Instance(device.instance, Use.IDLE, since=since))
        # A reservation for an instance not made yet (a plan that went Applied before the
        # inventory shows it) still holds its slots.
        shown = {d.instance for d in seen.mig_devices}
        for (gpu, instance), pod in sorted(reserved.items()):
            if gpu == dynamic.index and instance not in shown:
                instances.append(Instance(instance, Use.RESERVED, pod))
        gpus.append(
            Gpu(node.name, dynamic.index, dynamic.model, tuple(sorted(instances)), dynamic.policy)
        )
    return gpus


MAX_HOLDERS_NAMED = 3
"""Pods a reason names as the possible holders of one instance (it counts the rest)."""


def _holder(node: NodeFacts, profile: str, uuid: str) -> str:
    """Who uses an instance, for a person: its pod when only one bound pod holds the profile,
    the candidates when several do, the MIG device when no pod does (a process, a pod leaving)."""
    pods = sorted(node.holder_pods.get(profile, ()))
    if len(pods) == 1:
        return pods[0]
    if not pods:
        return f"no pod gpupart sees ({uuid}: a process, or a pod on its way out)"
    named = ", ".join(pods[:MAX_HOLDERS_NAMED])
    more = len(pods) - MAX_HOLDERS_NAMED
    return f"one of {named}" + (f" and {more} more" if more > 0 else "")


def _changes(
    nodes: Sequence[NodeFacts],
    kept: Mapping[str, list[MigReservation]],
    answer: PlannerAnswer,
    waiting: Mapping[str, PendingPod],
    now: float,
    ttl_s: float,
) -> tuple[dict[str, NodeChange], tuple[Planned, ...]]:
    """The plan to write per node whose layouts or reservations change, and the new reservations."""
    layouts: dict[str, list[PlannedGpu]] = {}
    created: dict[str, list[tuple[int, MigInstance]]] = {}
    destroyed: dict[str, list[tuple[int, MigInstance]]] = {}
    for gpu_plan in answer.gpus:
        layouts.setdefault(gpu_plan.node, []).append(PlannedGpu(gpu_plan.gpu, gpu_plan.layout))
        for step in gpu_plan.steps:
            if isinstance(step, CreateGpuInstance):
                created.setdefault(gpu_plan.node, []).append((step.gpu, step.instance))
            elif isinstance(step, DestroyGpuInstance):
                destroyed.setdefault(gpu_plan.node, []).append((step.gpu, step.instance))
    planned: list[Planned] = []
    fresh: dict[str, list[MigReservation]] = {}
    for r in answer.reservations:
        reservation = MigReservation(
            r.pod, waiting[r.pod].uid, r.gpu, r.instance, round(now + ttl_s, 3)
        )
        fresh.setdefault(r.node, []).append(reservation)
        planned.append(Planned(reservation, r.node, r.created))
    changes: dict[str, NodeChange] = {}
    for node in nodes:
        name = node.name
        reservations = tuple(sorted(kept.get(name, []) + fresh.get(name, []), key=_order))
        current = node.plan
        if current is not None and node.in_flight:
            gpus = current.gpus  # not planned again: only its reservations may end
        elif node.hold:
            gpus = ()  # a failed plan is not tried again while the caller backs off
        else:
            # Answered: GPUs it does not change again are left out, so the agent leaves them.
            gpus = tuple(sorted(layouts.get(name, []), key=lambda g: g.index))
        if current is None:
            if not gpus and not reservations:
                continue
        elif (current.gpus == gpus or not layouts.get(name)) and (
            current.reservations == reservations
        ):
            continue  # nothing new for this node
        changes[name] = NodeChange(
            _with_id(MigPlan("", gpus, reservations)),
            tuple(created.get(name, ())),
            tuple(destroyed.get(name, ())),
        )
    return changes, tuple(planned)


def _order(r: MigReservation) -> tuple[int, MigInstance, str]:
    return (r.gpu, r.instance, r.pod)


def _with_id(plan: MigPlan) -> MigPlan:
    """The plan with its id: a digest of its content, so the same plan keeps the same id."""
    digest = hashlib.sha256(encode_mig_plan(plan).encode()).hexdigest()[:16]
    return MigPlan(digest, plan.gpus, plan.reservations)
