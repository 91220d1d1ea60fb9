"""Operator logic, pure: which partition gets which GPUs of which node, and each partition's status.

`resolve` takes every GpuPartition and every Node as they are now and returns the desired
annotation per node and the status per partition. It is level-triggered: the operator calls it
after any change and writes only what differs, so a resync with nothing new writes nothing.

Conflicts: when two partitions select the same GPU, the higher `priority` wins, ties go to the
older object (then the smaller name); the loser keeps the GPUs nobody else claims and reports
`Conflict=True` naming the winner. A node serves all its GPUs through one interface
(`spec.interface`, ADR 023): the first partition in that order to hold GPUs there sets it, and
a partition asking the other interface gets none of that node's GPUs (`Conflict=True` naming
both).

A node's GPUs are the ones its node agent lists in `gpupart.io/inventory` (what NVML shows;
only that agent may write it); without an inventory, 0..n-1 from GFD's `nvidia.com/gpu.count`.

Deletion: a partition with `restoreOnDelete` keeps the nodes it held until their GPUs are whole
again (ADR 018); `Resolution.releases` says what each deleting partition still waits for.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from gpupart.core.api.spec import Interface, Mode, PartitionSpec, plan_gpu
from gpupart.core.api.wire import DesiredGroup, GpuReport, GpuState, NodeReport
from gpupart.core.errors import GpupartError
from gpupart.core.mig.catalogue import find_gpu_model

PRODUCT_LABEL = "nvidia.com/gpu.product"
"""GPU Feature Discovery's label naming the node's GPU product."""
COUNT_LABEL = "nvidia.com/gpu.count"
"""GPU Feature Discovery's label with the node's GPU count; the node agent's inventory wins."""


@dataclass(frozen=True, slots=True)
class Partition:
    spec: PartitionSpec
    created: str
    """metadata.creationTimestamp (RFC 3339, so string order is time order)."""
    deleting: bool = False


@dataclass(frozen=True, slots=True)
class LabeledNode:
    """A node as partition resolution sees it: its labels (selection, product) and its report."""

    name: str
    labels: Mapping[str, str] = field(default_factory=dict)
    report: NodeReport | None = None
    """The node agent's gpupart.io/state, if it wrote one."""
    inventory_gpus: tuple[int, ...] | None = None
    """GPU indices in the node agent's gpupart.io/inventory; None when it wrote none (or it
    cannot be read)."""
    interfaces: tuple[tuple[int, Interface | None], ...] = ()
    """(GPU index, the interface that serves it now) from the same inventory; None: moving
    between the two. Empty without an inventory."""

    @property
    def gpu_count(self) -> int | None:
        """The `nvidia.com/gpu.count` label, when it is a number."""
        text = self.labels.get(COUNT_LABEL, "")
        # ASCII digits only (str.isdigit also takes other scripts' digits), and few of them.
        return int(text) if text.isascii() and text.isdigit() and len(text) <= 18 else None

    @property
    def gpu_indices(self) -> tuple[int, ...] | None:
        """The node's GPUs: the agent's inventory (what the node has; tenants cannot write it)
        wins over the label (which GFD or anyone with Node write access sets); None: neither."""
        if self.inventory_gpus is not None:
            return tuple(sorted(set(self.inventory_gpus)))
        count = self.gpu_count
        return None if count is None else tuple(range(count))

    @property
    def count_disagreement(self) -> str:
        """Why the count label is not what the inventory lists, or '' when they agree."""
        count = self.gpu_count
        if count is None or self.inventory_gpus is None or count == len(self.gpu_indices or ()):
            return ""
        return (
            f"label {COUNT_LABEL}={count}, but the node agent's inventory lists "
            f"{len(self.gpu_indices or ())} GPU(s); the inventory is used"
        )


@dataclass(frozen=True, slots=True)
class NodeStatus:
    state: GpuState
    message: str = ""
    gpus: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True)
class Condition:
    type: str
    status: str
    reason: str
    message: str = ""


@dataclass(frozen=True, slots=True)
class ServedGpus:
    """How the GPUs a partition holds are served now, by the node agents' inventories."""

    wanted: Interface = Interface.DEVICE_PLUGIN
    """The partition's `spec.interface`."""
    dra: int = 0
    device_plugin: int = 0
    moving: int = 0
    """Between the two interfaces: neither offers them (their pods or claims drain)."""
    unreported: int = 0
    """Held on a node whose agent's inventory does not list them (none written yet)."""

    @property
    def held(self) -> int:
        return self.dra + self.device_plugin + self.moving + self.unreported

    @property
    def served(self) -> int:
        """GPUs served through the interface the partition asks for."""
        return self.dra if self.wanted is Interface.DRA else self.device_plugin


@dataclass(frozen=True, slots=True)
class PartitionStatus:
    observed_generation: int
    nodes: tuple[tuple[str, NodeStatus], ...]
    conditions: tuple[Condition, ...]
    served: ServedGpus = ServedGpus()


@dataclass(frozen=True, slots=True)
class Release:
    """What a deleting partition's finalizer still waits for (nodes the agent must answer)."""

    unanswered: tuple[str, ...] = ()
    """Nodes whose agent still reports applying the partition: it has not acted on the deletion
    yet (an agent that never answers holds it only up to the operator's release timeout)."""
    restoring: tuple[str, ...] = ()
    """restoreOnDelete: nodes whose agent answered but whose GPUs are not whole yet (in use,
    waiting for a reset, failed); the partition's status says why. No timeout: pods decide."""


@dataclass(frozen=True, slots=True)
class Resolution:
    desired: Mapping[str, tuple[DesiredGroup, ...]]
    """Per node name; nodes absent here get no desired annotation (the agent changes nothing
    there). An empty tuple is a desired annotation without groups: every GPU a whole GPU."""
    statuses: Mapping[str, PartitionStatus]
    """Live partitions, and deleting ones that restore their GPUs (their progress)."""
    releases: Mapping[str, Release] = field(default_factory=dict)
    """Per deleting partition."""


def winner_order(partitions: Sequence[Partition]) -> list[Partition]:
    return sorted(partitions, key=lambda p: (-p.spec.priority, p.created, p.spec.name))


def resolve(partitions: Sequence[Partition], nodes: Sequence[LabeledNode]) -> Resolution:
    ordered = winner_order(partitions)
    live = [p for p in ordered if not p.deleting]
    restoring = [p for p in ordered if p.deleting and p.spec.restore_on_delete]
    desired: dict[str, list[DesiredGroup]] = {}
    per_partition: dict[str, list[tuple[str, NodeStatus]]] = {p.spec.name: [] for p in ordered}
    conflicts: dict[str, list[str]] = {p.spec.name: [] for p in live}
    unknown: dict[str, list[str]] = {p.spec.name: [] for p in live}
    not_whole: dict[str, list[str]] = {p.spec.name: [] for p in restoring}
    served: dict[str, list[ServedGpus]] = {p.spec.name: [] for p in live}
    for node in sorted(nodes, key=lambda n: n.name):
        claimed: dict[int | None, str] = {}  # GPU index (None: every GPU) -> winning partition
        interface: tuple[Interface, str] | None = None  # the node's, and who set it
        for partition in live:
            spec = partition.spec
            if not spec.node_selector.matches(node.labels):
                continue
            problem = _problem_on(spec, node)
            if problem:
                per_partition[spec.name].append((node.name, NodeStatus(GpuState.FAILED, problem)))
                continue
            if interface is not None and interface[0] is not spec.config.interface:
                conflicts[spec.name].append(_other_interface(node.name, spec, *interface))
                continue
            granted, lost_to = _grant(spec, node, claimed)
            if lost_to:
                conflicts[spec.name].append(
                    f"{node.name} GPU {_indices_text(lost_to)} taken by "
                    f"{', '.join(sorted(set(lost_to.values())))}"
                )
            if granted == ():
                continue
            every: tuple[int | None, ...] = node.gpu_indices or (None,)
            for index in granted if granted is not None else every:
                claimed[index] = spec.name
            interface = interface or (spec.config.interface, spec.name)
            served[spec.name].append(_served(node, granted))
            group = DesiredGroup(spec.name, spec.generation, granted, spec.config)
            desired.setdefault(node.name, []).append(group)
            status = _node_status(group, node.report)
            if spec.config.dynamic and granted is None and node.gpu_indices is None:
                # Dynamic MIG plans per GPU index: with no index known it plans for none.
                unknown[spec.name].append(node.name)
                status = NodeStatus(GpuState.PENDING, _unknown_gpus(node.name), None)
            per_partition[spec.name].append((node.name, status))
        for partition in restoring:
            spec = partition.spec
            if not spec.node_selector.matches(node.labels) or _problem_on(spec, node):
                continue  # it never held GPUs here
            granted, _ = _grant(spec, node, claimed)
            if granted == () or node.report is None:
                continue  # every GPU went to a live partition, or no agent ever applied it here
            # Kept with no group of its own: the agent returns every GPU no group names to a
            # whole GPU; removing the annotation would leave them as they are.
            desired.setdefault(node.name, [])
            status, answered = _restore_status(spec.name, granted, node.report)
            per_partition[spec.name].append((node.name, status))
            if answered and status.state is not GpuState.APPLIED:
                not_whole[spec.name].append(node.name)
    statuses = {
        p.spec.name: replace(
            _status(
                p.spec, per_partition[p.spec.name], conflicts[p.spec.name], unknown[p.spec.name]
            ),
            served=_sum_served(p.spec.config.interface, served[p.spec.name]),
        )
        for p in live
    }
    statuses.update(
        (p.spec.name, _restore_conditions(p.spec, per_partition[p.spec.name])) for p in restoring
    )
    releases = {
        p.spec.name: Release(
            tuple(released(p.spec.name, nodes)), tuple(not_whole.get(p.spec.name, ()))
        )
        for p in ordered
        if p.deleting
    }
    return Resolution(
        {
            name: tuple(sorted(groups, key=lambda g: g.partition))
            for name, groups in desired.items()
        },
        statuses,
        releases,
    )


def released(partition_name: str, nodes: Sequence[LabeledNode]) -> list[str]:
    """Nodes whose agent still reports applying `partition_name`: deletion waits for them."""
    return sorted(
        node.name
        for node in nodes
        if node.report is not None and any(p == partition_name for p, _ in node.report.observed)
    )


def _unknown_gpus(node: str) -> str:
    return (
        f"{node}: GPUs unknown: no gpupart.io/inventory from gpupart's node agent and no "
        f"{COUNT_LABEL} label, so dynamic MIG makes no MIG device there; run the node agent there "
        f"(the chart's DaemonSet selects node.nodeSelector, nvidia.com/gpu.present=true), or "
        f"label the node {COUNT_LABEL}=<GPUs>"
    )


def _other_interface(node: str, spec: PartitionSpec, interface: Interface, owner: str) -> str:
    return (
        f"{node} serves its GPUs through {interface} for partition {owner}, and partition "
        f"{spec.name} asks {spec.config.interface}: a node serves all its GPUs through one "
        f"interface"
    )


def _served(node: LabeledNode, granted: tuple[int, ...] | None) -> ServedGpus:
    """How the GPUs granted on `node` are served now, by its agent's inventory."""
    now = dict(node.interfaces)
    counts = {Interface.DRA: 0, Interface.DEVICE_PLUGIN: 0, None: 0}
    unreported = 0
    for index in granted if granted is not None else node.gpu_indices or ():
        if index in now:
            counts[now[index]] += 1
        else:
            unreported += 1
    return ServedGpus(
        dra=counts[Interface.DRA],
        device_plugin=counts[Interface.DEVICE_PLUGIN],
        moving=counts[None],
        unreported=unreported,
    )


def _sum_served(wanted: Interface, parts: Sequence[ServedGpus]) -> ServedGpus:
    return ServedGpus(
        wanted,
        sum(p.dra for p in parts),
        sum(p.device_plugin for p in parts),
        sum(p.moving for p in parts),
        sum(p.unreported for p in parts),
    )


def _problem_on(spec: PartitionSpec, node: LabeledNode) -> str:
    """Why `spec` cannot apply to this node's GPUs, or ''."""
    indices = node.gpu_indices
    if indices == ():
        source = (
            "the node agent's gpupart.io/inventory lists none"
            if node.inventory_gpus is not None
            else f"{COUNT_LABEL} is 0"
        )
        return f"{node.name} has no GPU ({source}); leave it out of spec.nodeSelector"
    if spec.gpus is not None and indices is not None and any(i not in indices for i in spec.gpus):
        have = f"{len(indices)} GPU{'' if len(indices) == 1 else 's'}"
        return (
            f"{node.name} has {have} ({_indices_text(indices)}); spec.gpus asks "
            f"for {_indices_text(spec.gpus)}"
        )
    if spec.config.mode not in (Mode.MIG, Mode.MPS):
        return ""
    product = node.labels.get(PRODUCT_LABEL)
    if product is None:
        return (
            f"{node.name}: no {PRODUCT_LABEL} label, so its GPU's MIG and memory tables are unknown"
        )
    model = find_gpu_model(product)
    if model is None:
        return f"{node.name}: GPU product {product!r} is not in gpupart's catalogue"
    try:
        plan_gpu(spec, model)
    except GpupartError as error:
        return f"{node.name}: {error}"
    return ""


def _grant(
    spec: PartitionSpec, node: LabeledNode, claimed: Mapping[int | None, str]
) -> tuple[tuple[int, ...] | None, dict[int | None, str]]:
    """GPUs of this node that `spec` gets after the winners before it (None: all), and those lost.

    Key None in `claimed` means a winner took every GPU of a node whose GPUs are unknown.
    """
    indices = node.gpu_indices
    if spec.gpus is None and indices is None:
        if not claimed:
            return None, {}
        return (), {None: ", ".join(sorted(set(claimed.values())))}
    wanted = spec.gpus if spec.gpus is not None else indices or ()
    lost: dict[int | None, str] = {}
    for index in wanted:
        winner = claimed.get(index) or claimed.get(None)
        if winner is not None:
            lost[index] = winner
    kept = tuple(i for i in wanted if i not in lost)
    return (None if spec.gpus is None and not lost else kept), lost


def _node_status(group: DesiredGroup, report: NodeReport | None) -> NodeStatus:
    if report is None:
        return NodeStatus(GpuState.PENDING, "waiting for the node agent to report", group.gpus)
    if (group.partition, group.generation) not in report.observed:
        return NodeStatus(
            GpuState.PENDING,
            f"node agent has not applied generation {group.generation} yet",
            group.gpus,
        )
    gpus = [g for g in report.gpus if group.gpus is None or g.index in group.gpus]
    worst = _worst(gpus)
    if worst is not None:
        return NodeStatus(*worst, group.gpus)
    return NodeStatus(GpuState.APPLIED, "", group.gpus)


def _worst(gpus: Sequence[GpuReport]) -> tuple[GpuState, str] | None:
    """The worst state among these GPUs' reports and why, or None when all are Applied."""
    for state in (GpuState.FAILED, GpuState.BLOCKED, GpuState.PENDING):
        hit = [g for g in gpus if g.state is state]
        if hit:
            pods = sorted({p for g in hit for p in g.blocking_pods})
            by_message: dict[str, list[int]] = {}
            for g in hit:  # GPUs with one reason are named together, the reason once
                by_message.setdefault(g.message, []).append(g.index)
            message = "; ".join(
                f"GPU {', '.join(map(str, indices))}: {text}"
                for text, indices in by_message.items()
            )
            if pods:
                message += f" (in use by {', '.join(pods)})"
            return state, message
    return None


def _restore_status(
    name: str, granted: tuple[int, ...] | None, report: NodeReport
) -> tuple[NodeStatus, bool]:
    """How far a deleting partition's GPUs on one node are from whole GPUs (Applied: there),
    and whether the node agent has acted on the deletion at all."""
    if any(p == name for p, _ in report.observed):
        message = "the node agent has not acted on the deletion yet"
        return NodeStatus(GpuState.PENDING, message, granted), False
    gpus = [g for g in report.gpus if granted is None or g.index in granted]
    worst = _worst(gpus)
    if worst is not None:
        return NodeStatus(*worst, granted), True
    # Applied in another mode: the report is older than the pass that makes them whole.
    modes = [g for g in gpus if g.mode is not Mode.NONE]
    if modes:
        still = "; ".join(f"GPU {g.index}: still {g.mode}" for g in modes)
        return NodeStatus(GpuState.PENDING, still, granted), True
    return NodeStatus(GpuState.APPLIED, "whole GPUs again", granted), True


def _restore_conditions(
    spec: PartitionSpec, nodes: list[tuple[str, NodeStatus]]
) -> PartitionStatus:
    """A deleting partition with restoreOnDelete: how many nodes are whole again, and why not."""
    done = sum(1 for _, s in nodes if s.state is GpuState.APPLIED)
    waiting = [f"{name}: {s.message}" for name, s in nodes if s.state is not GpuState.APPLIED]
    if waiting:
        message = (
            f"returning GPUs to whole GPUs before deletion: {done} of {len(nodes)} node(s) "
            f"done; {'; '.join(waiting)}"
        )
    else:
        message = f"whole GPUs again on {len(nodes)} node(s); deleting"
    blocked = [s for _, s in nodes if s.state in (GpuState.BLOCKED, GpuState.FAILED)]
    worst = "Blocked" if any(s.state is GpuState.BLOCKED for s in blocked) else "Failed"
    return PartitionStatus(
        spec.generation,
        tuple(nodes),
        (
            Condition("Ready", "False", "Restoring", message[:1000]),
            Condition(
                "Progressing",
                "True" if waiting else "False",
                "Restoring" if waiting else "Settled",
                message[:1000] if waiting else "",
            ),
            Condition(
                "Degraded",
                "True" if blocked else "False",
                worst if blocked else "Healthy",
                "; ".join(f"{n}: {s.message}" for n, s in nodes if s in blocked)[:1000],
            ),
            Condition("Conflict", "False", "NoConflict", ""),
        ),
    )


def _status(
    spec: PartitionSpec,
    nodes: list[tuple[str, NodeStatus]],
    conflicts: list[str],
    unknown: list[str],
) -> PartitionStatus:
    states = [status.state for _, status in nodes]
    count = {state: states.count(state) for state in GpuState}

    def worst(state: GpuState) -> str:
        return "; ".join(f"{s.message}" for _, s in nodes if s.state is state)[:1000]

    if not nodes and conflicts:
        ready = Condition(
            "Ready",
            "False",
            "Conflict",
            f"every GPU it selects is claimed by another partition: {'; '.join(conflicts)}"[:1000],
        )
    elif not nodes:
        ready = Condition("Ready", "False", "NoMatchingNodes", "the nodeSelector matches no node")
    elif count[GpuState.APPLIED] == len(nodes):
        ready = Condition("Ready", "True", "Applied", f"applied on {len(nodes)} node(s)")
    elif count[GpuState.FAILED]:
        ready = Condition("Ready", "False", "InvalidForNode", worst(GpuState.FAILED))
    elif unknown:
        ready = Condition(
            "Ready",
            "False",
            "GpusUnknown",
            "; ".join(s.message for n, s in nodes if n in unknown)[:1000],
        )
    else:
        ready = Condition(
            "Ready",
            "False",
            "NotApplied",
            f"{count[GpuState.APPLIED]} of {len(nodes)} node(s) applied",
        )
    progressing = Condition(
        "Progressing",
        "True" if count[GpuState.PENDING] else "False",
        "Applying" if count[GpuState.PENDING] else "Settled",
        worst(GpuState.PENDING),
    )
    trouble = count[GpuState.FAILED] + count[GpuState.BLOCKED]
    degraded = Condition(
        "Degraded",
        "True" if trouble else "False",
        ("Blocked" if count[GpuState.BLOCKED] else "Failed") if trouble else "Healthy",
        "; ".join(m for m in (worst(GpuState.BLOCKED), worst(GpuState.FAILED)) if m),
    )
    conflict = Condition(
        "Conflict",
        "True" if conflicts else "False",
        "GpusClaimedElsewhere" if conflicts else "NoConflict",
        "; ".join(conflicts)[:1000],
    )
    return PartitionStatus(spec.generation, tuple(nodes), (ready, progressing, degraded, conflict))


def merge_conditions(
    old: Sequence[Mapping[str, str]], new: Sequence[Condition], *, now: str
) -> list[dict[str, str]]:
    """metav1.Condition dicts: `lastTransitionTime` moves only when a condition's status flips."""
    before = {c.get("type"): c for c in old}
    merged = []
    for condition in new:
        previous = before.get(condition.type)
        changed = previous is None or previous.get("status") != condition.status
        merged.append(
            {
                "type": condition.type,
                "status": condition.status,
                "reason": condition.reason,
                "message": condition.message,
                "lastTransitionTime": now
                if changed or previous is None
                else previous["lastTransitionTime"],
            }
        )
    return merged


def _indices_text(indices: Mapping[int | None, str] | Sequence[int]) -> str:
    values = [i for i in indices if i is not None]
    return ", ".join(map(str, values)) if values else "all"
