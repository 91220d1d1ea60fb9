"""Operator logic, pure: which partition gets which GPUs of which node, and each partition's status.

`resolve` takes every GpuPartition and every Node as they are now and returns the desired
annotation per node and the status per partition. It is level-triggered: the operator calls it
after any change and writes only what differs, so a resync with nothing new writes nothing.

Conflicts: when two partitions select the same GPU, the higher `priority` wins, ties go to the
older object (then the smaller name); the loser keeps the GPUs nobody else claims and reports
`Conflict=True` naming the winner.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from gpupart.core.api.spec import Mode, PartitionSpec, plan_gpu
from gpupart.core.api.wire import DesiredGroup, GpuState, NodeReport
from gpupart.core.errors import GpupartError
from gpupart.core.mig.catalogue import find_gpu_model

PRODUCT_LABEL = "nvidia.com/gpu.product"
"""GPU Feature Discovery's label naming the node's GPU product."""
COUNT_LABEL = "nvidia.com/gpu.count"


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

    @property
    def gpu_count(self) -> int | None:
        text = self.labels.get(COUNT_LABEL, "")
        # ASCII digits only (str.isdigit also takes other scripts' digits), and few of them.
        return int(text) if text.isascii() and text.isdigit() and len(text) <= 18 else None


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
class PartitionStatus:
    observed_generation: int
    nodes: tuple[tuple[str, NodeStatus], ...]
    conditions: tuple[Condition, ...]


@dataclass(frozen=True, slots=True)
class Resolution:
    desired: Mapping[str, tuple[DesiredGroup, ...]]
    """Per node name; nodes absent here get no desired annotation (partition-free default)."""
    statuses: Mapping[str, PartitionStatus]


def winner_order(partitions: Sequence[Partition]) -> list[Partition]:
    return sorted(partitions, key=lambda p: (-p.spec.priority, p.created, p.spec.name))


def resolve(partitions: Sequence[Partition], nodes: Sequence[LabeledNode]) -> Resolution:
    live = [p for p in winner_order(partitions) if not p.deleting]
    desired: dict[str, list[DesiredGroup]] = {}
    per_partition: dict[str, list[tuple[str, NodeStatus]]] = {p.spec.name: [] for p in live}
    conflicts: dict[str, list[str]] = {p.spec.name: [] for p in live}
    for node in sorted(nodes, key=lambda n: n.name):
        claimed: dict[int | None, str] = {}  # GPU index (None: every GPU) -> winning partition
        for partition in live:
            spec = partition.spec
            if not spec.node_selector.matches(node.labels):
                continue
            problem = _problem_on(spec, node)
            if problem:
                per_partition[spec.name].append((node.name, NodeStatus(GpuState.FAILED, problem)))
                continue
            granted, lost_to = _grant(spec, node, claimed)
            if lost_to:
                conflicts[spec.name].append(
                    f"{node.name} GPU {_indices_text(lost_to)} taken by "
                    f"{', '.join(sorted(set(lost_to.values())))}"
                )
            if granted == ():
                continue
            every: tuple[int | None, ...] = (None,)
            if node.gpu_count is not None:
                every = tuple(range(node.gpu_count))
            for index in granted if granted is not None else every:
                claimed[index] = spec.name
            group = DesiredGroup(spec.name, spec.generation, granted, spec.config)
            desired.setdefault(node.name, []).append(group)
            per_partition[spec.name].append((node.name, _node_status(group, node.report)))
    statuses = {
        p.spec.name: _status(p.spec, per_partition[p.spec.name], conflicts[p.spec.name])
        for p in live
    }
    return Resolution(
        {
            name: tuple(sorted(groups, key=lambda g: g.partition))
            for name, groups in desired.items()
        },
        statuses,
    )


def released(partition_name: str, nodes: Sequence[LabeledNode]) -> list[str]:
    """Nodes whose agent still reports applying `partition_name`: deletion waits for them."""
    return [
        node.name
        for node in nodes
        if node.report is not None and any(p == partition_name for p, _ in node.report.observed)
    ]


def _problem_on(spec: PartitionSpec, node: LabeledNode) -> str:
    """Why `spec` cannot apply to this node's GPUs, or ''."""
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
    count = node.gpu_count
    if spec.gpus is not None and count is not None and any(i >= count for i in spec.gpus):
        return f"{node.name} has {count} GPUs; spec.gpus asks for {_indices_text(spec.gpus)}"
    try:
        plan_gpu(spec, model)
    except GpupartError as error:
        return f"{node.name}: {error}"
    return ""


def _grant(
    spec: PartitionSpec, node: LabeledNode, claimed: Mapping[int | None, str]
) -> tuple[tuple[int, ...] | None, dict[int | None, str]]:
    """GPUs of this node that `spec` gets after the winners before it (None: all), and those lost.

    Key None in `claimed` means a winner took every GPU of a node whose GPU count is unknown.
    """
    count = node.gpu_count
    if spec.gpus is None and count is None:
        if not claimed:
            return None, {}
        return (), {None: ", ".join(sorted(set(claimed.values())))}
    wanted = spec.gpus if spec.gpus is not None else tuple(range(count or 0))
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
            return NodeStatus(state, message, group.gpus)
    return NodeStatus(GpuState.APPLIED, "", group.gpus)


def _status(
    spec: PartitionSpec, nodes: list[tuple[str, NodeStatus]], conflicts: list[str]
) -> PartitionStatus:
    states = [status.state for _, status in nodes]
    count = {state: states.count(state) for state in GpuState}

    def worst(state: GpuState) -> str:
        return "; ".join(f"{s.message}" for _, s in nodes if s.state is state)[:1000]

    if not nodes:
        ready = Condition(
            "Ready", "False", "NoMatchingNodes", "the nodeSelector matches no node with free GPUs"
        )
    elif count[GpuState.APPLIED] == len(nodes):
        ready = Condition("Ready", "True", "Applied", f"applied on {len(nodes)} node(s)")
    elif count[GpuState.FAILED]:
        ready = Condition("Ready", "False", "InvalidForNode", worst(GpuState.FAILED))
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
