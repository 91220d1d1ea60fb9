"""Dynamic MIG rounds, pure: listed pods and Nodes into facts, one memory record per node, news and status as values.

Nothing here does I/O; `gpupart_operator.rounds` lists, calls these and writes what they say.
What a round remembers between rounds (`Memory`) goes in as a value and comes out as a new one:
when an idle instance was first seen idle, a node's failed plan and its back-off, the answers
already counted, the last plan's operations, the news already told each pod. It only refines
messages and the hysteresis; a restarted operator converges from the annotations alone.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from gpupart.core.api.events import object_event
from gpupart.core.api.pods import find_condition, node_constraint, parse_pod_request, pod_key
from gpupart.core.api.records import find_time
from gpupart.core.api.resources import MIG_PREFIX
from gpupart.core.api.selectors import NodeConstraint
from gpupart.core.api.spec import Interface, PartitionSpec
from gpupart.core.api.wire import (
    INVENTORY_ANNOTATION,
    MIG_PLAN_ANNOTATION,
    GpuState,
    Inventory,
    MigPlan,
    decode_inventory,
    decode_mig_plan,
)
from gpupart.core.cluster.partitioning import PRODUCT_LABEL, LabeledNode, Partition, Resolution
from gpupart.core.dynamic.live import (
    DynamicGpu,
    NodeFacts,
    PendingPod,
    Round,
    plan_round,
)
from gpupart.core.errors import GpupartError
from gpupart.core.mig.catalogue import find_gpu_model
from gpupart.core.mig.layout import MigInstance
from gpupart_operator.model import (
    Contained,
    NodeObject,
    PartitionObject,
    resolve_each,
)

T = TypeVar("T")

EVENT_REPEAT_S = 60.0
"""A pod hears the same kind of news (e.g. MigSliceUnavailable) at most this often."""
MAX_WAITING_SHOWN = 20
"""Pods a partition's status lists as waiting (it counts the rest)."""
_FINISHED = ("Succeeded", "Failed")


# -- pods --


def requests_mig(pod: object) -> bool:
    """Whether any container asks for a `nvidia.com/mig-*` resource (cheap: no full parse).

    Total: whatever the object holds, the answer is a bool (kopf calls it on every pod event).
    """
    spec = pod.get("spec") if isinstance(pod, Mapping) else None
    if not isinstance(spec, Mapping):
        return False
    for key in ("containers", "initContainers"):
        containers = spec.get(key)
        for container in containers if isinstance(containers, list) else ():
            resources = container.get("resources") if isinstance(container, Mapping) else None
            if not isinstance(resources, Mapping):
                continue
            for block in (resources.get("limits"), resources.get("requests")):
                if isinstance(block, Mapping) and any(str(k).startswith(MIG_PREFIX) for k in block):
                    return True
    return False


@dataclass(frozen=True, slots=True)
class PodFacts:
    """What a round needs of the MIG pods: demand, unbound pods, profiles held per node."""

    pending: tuple[PendingPod, ...] = ()
    unbound: Mapping[str, str] = field(default_factory=dict)
    holders: Mapping[str, Counter[str]] = field(default_factory=dict)
    holder_pods: Mapping[str, Mapping[str, tuple[str, ...]]] = field(default_factory=dict)
    """node -> profile -> the bound pods holding it (for reasons that name them)."""
    bound: Mapping[str, tuple[str, float, float | None]] = field(default_factory=dict)
    """uid -> (pod, created, scheduled) for bound pods (Unix seconds; scheduled may be None)."""
    namespaces: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    """pod key -> (namespace, uid), for Events."""
    constraints: Mapping[str, NodeConstraint] = field(default_factory=dict)
    """pending pod key -> the nodes it may run on, by their labels."""
    skipped: tuple[tuple[str, str], ...] = ()
    """(pod, why) for the MIG pods that could not be read (the caller logs them)."""

    def placed(self, labels: Mapping[str, Mapping[str, str]]) -> tuple[PendingPod, ...]:
        """The pending pods, each with the nodes among `labels` (name -> labels) it may use."""
        return tuple(
            replace(
                pod,
                nodes=frozenset(
                    name
                    for name, these in labels.items()
                    if self.constraints.get(pod.key, NodeConstraint()).allows(these, name)
                ),
            )
            for pod in self.pending
        )


def read_pods(items: Sequence[Mapping[str, Any]]) -> PodFacts:
    """The round's view of the listed pods; a pod whose request does not parse is skipped (the
    extender and kube-scheduler tell its owner why), and never stops the others."""
    pending: list[PendingPod] = []
    unbound: dict[str, str] = {}
    holders: dict[str, Counter[str]] = {}
    holder_pods: dict[str, dict[str, list[str]]] = {}
    bound: dict[str, tuple[str, float, float | None]] = {}
    namespaces: dict[str, tuple[str, str]] = {}
    constraints: dict[str, NodeConstraint] = {}
    skipped: list[tuple[str, str]] = []
    for pod in items:
        try:
            if not requests_mig(pod):
                continue
            meta = pod.get("metadata") or {}
            spec = pod.get("spec") or {}
            status = pod.get("status") or {}
            if meta.get("deletionTimestamp") or status.get("phase") in _FINISHED:
                continue
            request = parse_pod_request(pod, where="Pod")
            profiles = tuple(p for p, n in request.mig for _ in range(n))
            if not profiles:
                continue
            key, uid = pod_key(pod), str(meta.get("uid", ""))
            namespaces[key] = (str(meta.get("namespace") or "default"), uid)
            created = find_time(meta.get("creationTimestamp")) or 0.0
            node = spec.get("nodeName")
            if node:
                held = holders.setdefault(str(node), Counter())
                held.update(profiles)
                for profile in set(profiles):
                    holder_pods.setdefault(str(node), {}).setdefault(profile, []).append(key)
                transition = (find_condition(pod, "PodScheduled") or {}).get("lastTransitionTime")
                scheduled = find_time(transition)
                bound[uid] = (key, created, scheduled)
                continue
            unbound[key] = uid
            condition = find_condition(pod, "PodScheduled") or {}
            if (condition.get("status"), condition.get("reason")) == ("False", "Unschedulable"):
                priority = spec.get("priority") or 0
                priority = priority if isinstance(priority, int) else 0
                constraints[key] = node_constraint(pod)
                pending.append(PendingPod(key, uid, profiles, priority, created))
        except Exception as error:  # noqa: BLE001 - one unreadable pod never stops the others
            skipped.append((_safe_key(pod), str(error)))
    named = {
        node: {profile: tuple(sorted(pods)) for profile, pods in by_profile.items()}
        for node, by_profile in holder_pods.items()
    }
    return PodFacts(
        tuple(pending), unbound, holders, named, bound, namespaces, constraints, tuple(skipped)
    )


def _safe_key(pod: object) -> str:
    try:
        return pod_key(pod)  # type: ignore[arg-type]
    except Exception:  # noqa: BLE001 - only for a log line
        return "?"


# -- nodes and their dynamic GPUs --


def unknown_gpus(resolution: Resolution) -> str:
    """Why some nodes of live dynamic MIG partitions get no slice (GPUs unknown), or ''."""
    return "; ".join(
        c.message
        for status in resolution.statuses.values()
        for c in status.conditions
        if c.type == "Ready" and c.reason == "GpusUnknown"
    )


def dynamic_gpus(
    resolution: Resolution, partitions: Sequence[PartitionObject], nodes: Sequence[NodeObject]
) -> dict[str, tuple[DynamicGpu, ...]]:
    """Per node, the GPUs a partition with `spec.mig.dynamic` wins there (in `resolution`) and
    serves through the device plugin: a DRA partition's instances follow its claims, never a
    MIG plan (ADR 023)."""
    specs: dict[str, PartitionSpec] = {
        p.partition.spec.name: p.partition.spec for p in partitions if p.partition is not None
    }
    found: dict[str, tuple[DynamicGpu, ...]] = {}
    for node in nodes:
        model = find_gpu_model(node.view.labels.get(PRODUCT_LABEL, ""))
        if model is None:
            continue
        gpus: list[DynamicGpu] = []
        for group in resolution.desired.get(node.name, ()):
            spec = specs.get(group.partition)
            if not group.config.dynamic or spec is None or spec.dynamic is None:
                continue
            if group.config.interface is not Interface.DEVICE_PLUGIN:
                continue
            # Every GPU: the agent's inventory lists them (else the count label); with neither,
            # none, and the partition's status says so (GpusUnknown).
            indices = group.gpus if group.gpus is not None else node.view.gpu_indices or ()
            gpus.extend(DynamicGpu(i, model, spec.dynamic, group.partition) for i in indices)
        if gpus:
            found[node.name] = tuple(gpus)
    return found


def planned_by_rounds(spec: PartitionSpec | None) -> bool:
    """Whether the rounds plan this partition's MIG instances: dynamic MIG through the device
    plugin (through DRA the scheduler allocates placements and the kubelet plugin makes them)."""
    return (
        spec is not None
        and spec.dynamic is not None
        and spec.config.interface is Interface.DEVICE_PLUGIN
    )


def live_dynamic(partitions: Sequence[PartitionObject]) -> bool:
    """Whether any partition the rounds plan for is not being deleted."""
    return any(
        p.partition is not None and not p.deleting and planned_by_rounds(p.partition.spec)
        for p in partitions
    )


def stale_plans(raw_nodes: Sequence[Mapping[str, Any]], dynamic: Mapping[str, object]) -> list[str]:
    """Nodes with a MIG plan that no dynamic partition holds any more: their plan is removed."""
    return [
        name
        for raw in raw_nodes
        if (name := str((raw.get("metadata") or {}).get("name", ""))) not in dynamic
        and _annotation(raw, MIG_PLAN_ANNOTATION) is not None
    ]


@dataclass(frozen=True, slots=True)
class DynamicNode:
    """A node holding dynamic GPUs, read for a round: its inventory and plan annotations."""

    node: NodeObject
    gpus: tuple[DynamicGpu, ...]
    inventory: Inventory | None
    plan: MigPlan | None
    """None when absent or unreadable: a plan that is not ours (edited by hand, another
    version) is replaced by the next one."""
    ignored: tuple[tuple[str, str], ...] = ()
    """(annotation, why) for each annotation that could not be read (the caller logs them)."""

    @property
    def name(self) -> str:
        return self.node.name


def read_dynamic_node(
    raw: Mapping[str, Any], node: NodeObject, gpus: tuple[DynamicGpu, ...]
) -> DynamicNode:
    ignored: list[tuple[str, str]] = []
    inventory = _decoded(raw, INVENTORY_ANNOTATION, decode_inventory, ignored)
    plan = _decoded(raw, MIG_PLAN_ANNOTATION, decode_mig_plan, ignored)
    return DynamicNode(node, gpus, inventory, plan, tuple(ignored))


def _decoded(
    raw: Mapping[str, Any],
    key: str,
    decode: Callable[[str], T],
    ignored: list[tuple[str, str]],
) -> T | None:
    """The annotation `key` decoded; None when absent or unreadable (said in `ignored`)."""
    text = _annotation(raw, key)
    if text is None:
        return None
    try:
        return decode(text)
    except GpupartError as error:
        ignored.append((key, str(error)))
        return None


def _annotation(raw: Mapping[str, Any], key: str) -> str | None:
    annotations = (raw.get("metadata") or {}).get("annotations") or {}
    value = annotations.get(key)
    return None if value is None else str(value)


@dataclass(frozen=True, slots=True)
class Survey:
    """Where a round plans: the nodes holding dynamic GPUs, and the plans to remove."""

    dynamic: Mapping[str, tuple[DynamicGpu, ...]]
    """node -> the dynamic GPUs partitions win there."""
    nodes: tuple[DynamicNode, ...]
    stale: tuple[str, ...]
    """Nodes with a MIG plan that no dynamic partition holds any more."""
    unknown: str
    """Why some dynamic partitions' nodes get no slice (GPUs unknown), or ''."""
    live: bool
    """Any partition asks for dynamic MIG and is not being deleted: there is a round to plan."""


def survey(
    partitions: Sequence[PartitionObject],
    raw_nodes: Sequence[Mapping[str, Any]],
    nodes: Sequence[NodeObject],
    *,
    resolve: Callable[[Sequence[Partition], Sequence[LabeledNode]], Contained] = resolve_each,
) -> Survey:
    """The round's nodes, from one resolution with the pass's containment: a partition that
    breaks the core is set apart (the pass gives it InvalidSpec), the others still get rounds.

    `raw_nodes` and `nodes`: the listed Nodes and the same read (`model.read_node`), in order.
    """
    resolution = resolve(
        [p.partition for p in partitions if p.partition is not None], [n.view for n in nodes]
    ).resolution
    dynamic = dynamic_gpus(resolution, partitions, nodes)
    views = tuple(
        read_dynamic_node(raw, node, gpus)
        for raw, node in zip(raw_nodes, nodes, strict=True)
        if (gpus := dynamic.get(node.name))
    )
    return Survey(
        dynamic,
        views,
        tuple(stale_plans(raw_nodes, dynamic)),
        unknown_gpus(resolution),
        live_dynamic(partitions),
    )


# -- the memory: one record per node, one per pod --


@dataclass(frozen=True, slots=True)
class NodeMemory:
    """What the rounds remember of one node with dynamic GPUs."""

    idle_since: Mapping[tuple[int, MigInstance], float] = field(default_factory=dict)
    """(GPU, instance) -> when it was first seen idle (the planner's hysteresis)."""
    failed: tuple[str, float] | None = None
    """(id of the last failed plan, when that failure was first seen): the node is not planned
    again until `plan_retry_seconds` after, whatever plan it holds meanwhile (the back-off's own
    plan, which only ends reservations, is Applied at once)."""
    answered: str = ""
    """Id of the current plan once its answer was counted (each answer is counted once)."""
    created: tuple[str, ...] = ()
    destroyed: tuple[str, ...] = ()
    """What the last plan written there that changed a GPU creates and destroys (the status)."""


@dataclass(frozen=True, slots=True)
class PodMemory:
    """What the rounds remember of one pod that asks for MIG slices."""

    said: tuple[str, str, float] | None = None
    """(reason, message, when) of the last Event posted about it."""
    reserved: bool = False
    """A plan reserved a slice for it: its binding time is measured once."""


@dataclass(frozen=True, slots=True)
class Memory:
    """All the rounds remember: per node name and per pod uid. Empty after a restart."""

    nodes: Mapping[str, NodeMemory] = field(default_factory=dict)
    pods: Mapping[str, PodMemory] = field(default_factory=dict)


def observe(
    before: NodeMemory, node: DynamicNode, *, now: float, retry_s: float
) -> tuple[NodeMemory, bool, str]:
    """A node's record after seeing it now; whether it is held back; the plan answer newly seen
    ('applied', 'failed', or '')."""
    plan = node.plan
    report = node.node.view.report.plan if node.node.view.report is not None else None
    answered, failed, answer = before.answered, before.failed, ""
    if plan is not None and report is not None and report.id == plan.id:
        if answered != plan.id:
            answered = plan.id
            answer = "applied" if report.state is GpuState.APPLIED else "failed"
        if report.state is not GpuState.APPLIED and (failed is None or failed[0] != plan.id):
            failed = (plan.id, now)
    hold = failed is not None and now - failed[1] < retry_s
    idle: dict[tuple[int, MigInstance], float] = {}
    for gpu in node.inventory.gpus if node.inventory is not None else ():
        for device in gpu.mig_devices:
            if not device.used:
                spot = (gpu.index, device.instance)
                idle[spot] = before.idle_since.get(spot, now)
    after = replace(
        before,
        idle_since=idle,
        failed=failed,
        # Only the current plan's answer is kept: a plan written again is counted again.
        answered=answered if plan is not None and answered == plan.id else "",
    )
    return after, hold, answer


@dataclass(frozen=True, slots=True)
class Planned:
    """A round's decision, before its writes: the core's Round and what it was planned from."""

    round: Round
    facts: tuple[NodeFacts, ...]
    answers: tuple[str, ...]
    """Plan answers newly seen this round ('applied' or 'failed'), for the metrics."""


def plan_demand(
    memory: Memory,
    surveyed: Survey,
    pods: PodFacts,
    *,
    now: float,
    ttl_s: float,
    retry_s: float,
) -> tuple[Memory, Planned]:
    """The round's plans: each node observed (its record updated), then the core's `plan_round`.

    Every pod left waiting also hears why some dynamic nodes' GPUs are unknown. Nodes no longer
    surveyed are forgotten.
    """
    nodes, unknown = surveyed.nodes, surveyed.unknown
    records: dict[str, NodeMemory] = {}
    facts: list[NodeFacts] = []
    answers: list[str] = []
    for node in nodes:
        record, hold, answer = observe(
            memory.nodes.get(node.name, NodeMemory()), node, now=now, retry_s=retry_s
        )
        records[node.name] = record
        if answer:
            answers.append(answer)
        view = node.node.view
        facts.append(
            NodeFacts(
                node.name,
                node.gpus,
                node.inventory,
                node.plan,
                view.report.plan if view.report is not None else None,
                dict(pods.holders.get(node.name, Counter())),
                holder_pods=pods.holder_pods.get(node.name, {}),
                hold=hold,
            )
        )
    idle_since = {
        (name, gpu, instance): since
        for name, record in records.items()
        for (gpu, instance), since in record.idle_since.items()
    }
    labels = {node.name: node.node.view.labels for node in nodes}
    result = plan_round(
        facts,
        pods.placed(labels),
        now=now,
        ttl_s=ttl_s,
        unbound=pods.unbound,
        idle_since=idle_since,
    )
    if unknown:
        waiting = tuple((pod, f"{why}; {unknown}") for pod, why in result.unserved)
        result = replace(result, unserved=waiting)
    return replace(memory, nodes=records), Planned(result, tuple(facts), tuple(answers))


def disruptions(plan: MigPlan, seen: NodeFacts | None) -> list[tuple[int, int]]:
    """(GPU, count) of the instances used by a pod that the plan's layout leaves out (must be
    none: the node agent refuses to destroy them)."""
    if seen is None or seen.inventory is None:
        return []
    lost: list[tuple[int, int]] = []
    for planned in plan.gpus:
        gpu = next((g for g in seen.inventory.gpus if g.index == planned.index), None)
        if gpu is None:
            continue
        used = [d for d in gpu.mig_devices if d.used and d.instance not in planned.layout]
        if used:
            lost.append((planned.index, len(used)))
    return lost


# -- after the writes: what the pods hear, what is measured --


@dataclass(frozen=True, slots=True)
class PodNews:
    """One Event to post about a pod."""

    pod: str
    """namespace/name"""
    namespace: str
    uid: str
    kind: str
    reason: str
    message: str


@dataclass(frozen=True, slots=True)
class Settled:
    """What a round tells and measures once its plans are written."""

    news: tuple[PodNews, ...]
    bound_seconds: tuple[float, ...]
    """Creation to binding of each pod a plan reserved a slice for, bound since."""


def settle(
    memory: Memory,
    planned: Planned,
    written: set[str],
    pods: PodFacts,
    *,
    now: float,
    ttl_s: float,
) -> tuple[Memory, Settled]:
    """The records after the nodes in `written` got their plans: the news for the pods (each
    kind again only when its words changed, at most every EVENT_REPEAT_S), binding times."""
    result = planned.round
    records = dict(memory.nodes)
    for name in written:
        change = result.changes[name]
        if change.created or change.destroyed:  # not a plan that only ends reservations
            records[name] = replace(
                records.get(name, NodeMemory()),
                created=tuple(f"{i} on GPU {g}" for g, i in change.created),
                destroyed=tuple(f"{i} on GPU {g}" for g, i in change.destroyed),
            )
    told = dict(memory.pods)
    news: list[PodNews] = []

    def tell(pod: str, kind: str, reason: str, message: str) -> None:
        namespace, uid = pods.namespaces.get(pod, ("", ""))
        if not namespace:
            return
        record = told.get(uid, PodMemory())
        said = record.said
        # A planner's reason names how long instances have been idle: its words change often.
        if (
            said is not None
            and said[0] == reason
            and (said[1] == message or now - said[2] < EVENT_REPEAT_S)
        ):
            return
        told[uid] = replace(record, said=(reason, message, now))
        news.append(PodNews(pod, namespace, uid, kind, reason, message))

    for made in result.planned:
        if made.node not in written:
            continue
        r = made.reservation
        verb = "creating" if made.created else "reserved the idle"
        tell(
            r.pod,
            "Normal",
            "MigSlicePlanned",
            f"{verb} {r.instance.profile} on {made.node} GPU {r.gpu} "
            f"(slot {r.instance.placement.start}) for this pod",
        )
        told[r.uid] = replace(told.get(r.uid, PodMemory()), reserved=True)
    for pod, why in result.unserved:
        tell(pod, "Warning", "MigSliceUnavailable", why)
    for node, r, why in result.failed:
        tell(
            r.pod,
            "Warning",
            "MigPlanFailed",
            f"{node} could not create {r.instance.profile} on GPU {r.gpu}: {why}",
        )
    for r in result.expired:
        tell(
            r.pod,
            "Warning",
            "MigReservationExpired",
            f"the {r.instance.profile} reserved on GPU {r.gpu} waited "
            f"{ttl_s:g} s for this pod to be bound; it is free again",
        )
    bound_seconds: list[float] = []
    for uid, (_, created, scheduled) in pods.bound.items():
        record = told.get(uid)
        if record is not None and record.reserved and scheduled is not None:
            told[uid] = replace(record, reserved=False)
            bound_seconds.append(max(0.0, scheduled - created))
    live = set(pods.bound) | set(pods.unbound.values())
    kept = {uid: record for uid, record in told.items() if uid in live}
    memory = Memory(records, kept)
    return memory, Settled(tuple(news), tuple(bound_seconds))


def pod_event(news: PodNews, *, now: str, instance: str) -> dict[str, Any]:
    """The core/v1 Event that tells a pod `news`."""
    involved = {
        "apiVersion": "v1",
        "kind": "Pod",
        "name": news.pod.split("/", 1)[1],
        "namespace": news.namespace,
        "uid": news.uid,
    }
    return object_event(
        involved,
        reason=news.reason,
        message=news.message,
        kind=news.kind,
        namespace=news.namespace,
        now=now,
        component="operator",
        instance=instance,
    )


# -- status.dynamicMig --


def dynamic_status(name: str, planned: Planned, surveyed: Survey, memory: Memory) -> dict[str, Any]:
    """status.dynamicMig of the dynamic partition `name`: per node its plan, and what waits."""
    result = planned.round
    waiting = [{"pod": pod, "reason": why[:512]} for pod, why in result.unserved]
    nodes: dict[str, Any] = {}
    for node in planned.facts:
        if not any(g.partition == name for g in surveyed.dynamic.get(node.name, ())):
            continue
        change = result.changes.get(node.name)
        plan = change.plan if change is not None else node.plan
        record = memory.nodes.get(node.name, NodeMemory())
        nodes[node.name] = {
            "plan": plan.id if plan is not None else "",
            "state": (
                "InFlight"
                if change is not None or node.in_flight
                else (node.report.state.value if node.report is not None else "")
            ),
            "message": (node.report.message[:512] if node.report is not None else ""),
            "created": list(record.created)[:32],
            "destroyed": list(record.destroyed)[:32],
            "reserved": [
                f"{r.pod}: {r.instance.profile} on GPU {r.gpu}"
                for r in (plan.reservations if plan is not None else ())
            ][:32],
        }
    return {
        "nodes": nodes,
        "waiting": waiting[:MAX_WAITING_SHOWN],
        "waitingCount": len(waiting),
    }
