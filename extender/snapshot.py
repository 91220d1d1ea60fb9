"""One immutable picture of the cluster as requests read it: node views, signatures, pods per node, reservations.

The cluster state (`cache.ClusterCache`, fed by the watch threads) is the only writer: after
every change it builds (`cache.publish`) a new `Snapshot` and publishes it by swapping one reference. A request
reads `cache.snapshot` once and answers from it alone, without a lock: nothing in a snapshot
changes after it is published (the mappings are the writer's copies, never written again).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from gpupart.core.api.wire import MigReservation
from gpupart.core.dra.read import ClaimView, SliceView
from gpupart.core.dra.requests import ClaimSpec, ClassView
from gpupart.core.scheduling.preemption import Budget
from gpupart.core.scheduling.shares import Shape
from gpupart.core.scheduling.views import NodeView, assemble_node

from .objects import (
    DRA_KINDS,
    NAMESPACE,
    NODE,
    PDB,
    POD,
    NodeEntry,
    PodEntry,
    Unreadable,
    placed_by_uuid,
    problem_of,
)
from .reservations import Proposal

Signature = tuple[int, int]
"""A node's (version, state id). Nodes with equal inventory, allocatable CPU and usage (up to
pod names) share the state id, and ids are never reused, so verdicts can be kept per state id.
A new tuple object is made whenever the node changes: callers may compare it by identity."""


@dataclass(frozen=True, slots=True)
class NodeSnapshot:
    """One node as the snapshot holds it."""

    entry: NodeEntry
    view: NodeView
    sig: Signature
    counted: tuple[PodEntry, ...]
    """The pods bound (or assumed) on the node."""
    nominated: tuple[PodEntry, ...]
    """Pending pods nominated to the node: their reservations count in `view` too."""
    awaiting: tuple[str, ...]
    """Keys of the counted shared-GPU pods its device plugin has not fully served yet, sorted."""


def assemble_view(
    name: str,
    entry: NodeEntry,
    entries: Iterable[PodEntry],
    version: int,
    reservations: Iterable[MigReservation] = (),
    *,
    lost: list[tuple[PodEntry, str]] | None = None,
) -> NodeView:
    """The node's view with the pods `entries` on it (each on the GPU its assignment's UUID
    names: `objects.placed_by_uuid`) and the live MIG `reservations`; a node that cannot be
    evaluated gets the reason as its problem (alone: the others are not affected). `lost`
    collects the pods whose GPU the inventory does not have, with the reason."""
    try:
        placed, missing = placed_by_uuid(entry.inventory, entries)
        if lost is not None:
            lost.extend(missing)
        return assemble_node(
            name,
            entry.inventory,
            placed,
            cpu_milli=entry.cpu_milli,
            problem=entry.problem,
            version=version,
            reservations=reservations,
            plan_problem=entry.plan_problem,
        )
    except Exception as error:  # noqa: BLE001 - this node fails with the reason, alone
        problem = f"cannot be evaluated: {problem_of(error)}"
        return assemble_node(name, None, (), problem=problem, version=version)


@dataclass(frozen=True, slots=True)
class DraPicture:
    """The DRA objects the extender watched, as the reasons read them (`cache.dra`): taken
    when a DRA pod is explained (`ClusterCache.dra`), not on every publish, since only those
    words read it."""

    slices: Mapping[str, tuple[SliceView, ...]]
    """Node name -> our slices whose `nodeName` it is, by name."""
    claims_on: Mapping[str, tuple[ClaimView, ...]]
    """Pool name -> the claims allocated from it."""
    allocated: Mapping[str, ClaimView]
    """`namespace/name` -> the claim's allocation from our driver."""
    specs: Mapping[str, ClaimSpec]
    """`namespace/name` -> every readable claim's requests."""
    classes: Mapping[str, ClassView]


@dataclass(frozen=True, slots=True, eq=False)
class Snapshot:
    nodes: Mapping[str, NodeSnapshot]
    signatures: Mapping[str, Signature]
    """Node name -> signature, for every known node (the memo's hot path reads this in C)."""
    nominations: Mapping[str, PodEntry]
    """Pod uid -> the reservation it holds as a nominated pod."""
    proposals: Mapping[str, Mapping[str, Proposal]]
    """Pod uid -> node -> what the preempt verb freed for it there."""
    budgets: tuple[Budget, ...]
    namespaces: Mapping[str, Mapping[str, str]]
    """Namespace name -> its labels, every readable Namespace (for `parse_demand`)."""
    mix: Mapping[Shape, int]
    """How many bound GPU pods have each (GPU count, milli per GPU, CPU): the policy's mix."""
    clock: int
    """Node changes so far (see `changed_since`)."""
    log: Sequence[str]
    """`log[i]` is the node of change number `log_start + i + 1`; the writer only appends past
    `clock`, and starts a new list when it trims."""
    log_start: int
    unreadable: tuple[Unreadable, ...]
    """Objects skipped (Pods) or kept with their problem (Nodes, budgets), by kind and name."""
    pods: int
    """Bound pods counted (assumed ones not included)."""
    assumed: int
    reserved: Mapping[str, tuple[str, ...]]
    """Pod `namespace/name` -> the nodes whose view holds a live MIG reservation for it."""

    @classmethod
    def empty(cls) -> Snapshot:
        return cls({}, {}, {}, {}, (), {}, {}, 0, (), 0, (), 0, 0, {})

    def reserved_for(self, pod: str) -> tuple[str, ...]:
        """The nodes where a live MIG reservation names `pod` (namespace/name)."""
        return self.reserved.get(pod, ())

    def view(self, name: str) -> NodeView | None:
        """The node's current view, None for a node not seen."""
        state = self.nodes.get(name)
        return None if state is None else state.view

    def node_names(self) -> list[str]:
        return sorted(self.nodes)

    def pods_on(self, node: str) -> tuple[PodEntry, ...]:
        """The pods bound (or assumed) on `node`."""
        state = self.nodes.get(node)
        return () if state is None else state.counted

    def nominated_on(self, node: str) -> tuple[PodEntry, ...]:
        state = self.nodes.get(node)
        return () if state is None else state.nominated

    def nomination(self, uid: str) -> PodEntry | None:
        """The reservation pod `uid` holds as a nominated pod, if any."""
        return self.nominations.get(uid)

    def evicted_for(self, uid: str, node: str) -> tuple[str, ...]:
        """The victims the preempt verb chose for pod `uid` on `node` (kube-scheduler evicts
        them once it nominates the pod there); the pod's own evaluation counts them gone even
        before the watch shows them deleted."""
        proposal = self.proposals.get(uid, {}).get(node)
        return () if proposal is None else proposal.victims

    def awaiting(self, node: str) -> tuple[str, ...]:
        """Pods on `node` (bound or assumed) that its device plugin has not fully served yet."""
        state = self.nodes.get(node)
        return () if state is None else state.awaiting

    def serial_admission(self, node: str) -> bool:
        state = self.nodes.get(node)
        return state is not None and state.entry.serial_admission

    def view_excluding(self, name: str, uids: Iterable[str]) -> NodeView | None:
        """The node's view without the pods `uids` (bound, assumed or nominated): what it would
        be with them gone. Not kept; None for a node not seen."""
        state = self.nodes.get(name)
        if state is None:
            return None
        skip = set(uids)
        entries = (*state.counted, *state.nominated)
        if not any(e.uid in skip for e in entries):
            return state.view  # none of them here: the kept view (a bind, mostly)
        kept = [e for e in entries if e.uid not in skip]
        return assemble_view(name, state.entry, kept, state.view.version, state.view.reserved)

    def changed_since(self, clock: int) -> set[str] | None:
        """Nodes whose signature may differ from what it was at `clock`; None when the record
        no longer reaches back that far (everything may have changed)."""
        if clock < self.log_start:
            return None
        return set(self.log[clock - self.log_start : self.clock - self.log_start])

    def counts(self) -> dict[str, int]:
        return {
            "nodes": len(self.nodes),
            "pods": self.pods,
            "assumed": self.assumed,
            "nominated": len(self.nominations),
            "budgets": len(self.budgets),
            "namespaces": len(self.namespaces),
        }

    def mig_reservations(self, now: float) -> int:
        """MIG reservations honoured (in some node's view) and not expired by `now` (the
        cache's clock, Unix seconds), for the metrics: read-only, whenever scraped."""
        nodes = {n for held in self.reserved.values() for n in held}
        return sum(1 for n in nodes for r in self.nodes[n].view.reserved if r.expires > now)

    def unreadable_counts(self) -> dict[str, int]:
        found = {NODE: 0, POD: 0, PDB: 0, NAMESPACE: 0, **dict.fromkeys(DRA_KINDS, 0)}
        for u in self.unreadable:
            found[u.kind] = found.get(u.kind, 0) + 1
        return found
