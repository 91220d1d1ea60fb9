"""Publishing the cluster state: node rebuilds with their state ids, MIG-reservation expiry, the `Snapshot`.

After every change the writer (`ClusterCache`) calls `Publisher.publish`: the nodes touched
since the last publish are rebuilt (view, version, state id, the GPU shapes of their pods),
then one new immutable `Snapshot` is made, reusing every part of the old one nothing changed.

The state id interns `scheduling.anonymous(view)`: nodes with equal inventory, allocatable CPU
and usage (GPU and CPU, up to pod names) share an id, so the service evaluates each distinct
state once per pod shape. Ids are never reused: when the intern table outgrows `max_states`
it starts afresh with new ids, and an answer kept for an old id simply never matches again.

MIG reservations (docs/adr-013-dynamic-mig-plans.md): a node's view carries the live ones, not
past `expires` by the cache's clock and whose pod is neither bound nor assumed. Views are
snapshots, so a node is rebuilt when its earliest live reservation expires: the publisher keeps
that time per node (`expiry_due`), and the first publish at or after it touches the node.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Set

from gpupart.core.scheduling.shares import Shape, demand_shape
from gpupart.core.scheduling.views import NodeView, anonymous

from ..objects import PodEntry
from ..reservations import Reservations
from ..snapshot import NodeSnapshot, Snapshot, assemble_view
from .changes import ChangeLog
from .index import Index


class Publisher:
    """Rebuilds touched nodes and makes each new `Snapshot` (the writer's lock held)."""

    def __init__(self, changes: ChangeLog, *, max_states: int) -> None:
        self.changes = changes
        self._states: dict[NodeView, int] = {}
        self._next_state = 0
        self._max_states = max_states
        self._nodes: dict[str, NodeSnapshot] = {}
        self._sigs: dict[str, tuple[int, int]] = {}
        self._shapes: dict[str, tuple[Shape, ...]] = {}
        self._mix: Counter[Shape] = Counter()
        self._expiry: dict[str, float] = {}
        """Per node with live MIG reservations: when the first of them expires."""
        self._next_expiry = math.inf

    def expiry_due(self, now: float) -> bool:
        """Some node's view holds a MIG reservation that has expired by `now`."""
        return now >= self._next_expiry

    def publish(
        self, old: Snapshot, index: Index, reservations: Reservations, now: float
    ) -> Snapshot | None:
        """The snapshot after every change since `old`; None when nothing changed."""
        changes = self.changes
        if self.expiry_due(now):
            for name in [n for n, t in self._expiry.items() if t <= now]:
                changes.touch(name)  # a change like any other: new version, in the change log
        if not changes.dirty and not changes.stale:
            return None
        if len(self._states) > self._max_states:
            # A fresh intern table; new ids follow the old ones, so no kept answer can match.
            self._states = {}
            changes.dirty.update(index.nodes)
        dirty, changes.dirty = changes.dirty, set()
        for name in dirty:
            self._rebuild(name, index, now)
        if dirty:
            self._mix = +self._mix  # drop shapes counted down to zero
            self._next_expiry = min(self._expiry.values(), default=math.inf)
        stale: Set[str] = changes.stale
        changes.stale = set()
        return Snapshot(
            nodes=dict(self._nodes) if dirty else old.nodes,
            signatures=dict(self._sigs) if dirty else old.signatures,
            nominations=(
                {uid: held[0] for uid, held in index.nominated.items()}
                if "nominations" in stale
                else old.nominations
            ),
            proposals=reservations.proposals() if "proposals" in stale else old.proposals,
            budgets=(
                tuple(index.budgets[k] for k in sorted(index.budgets))
                if "budgets" in stale
                else old.budgets
            ),
            namespaces=dict(index.namespaces) if "namespaces" in stale else old.namespaces,
            mix=Counter(self._mix) if dirty else old.mix,
            clock=changes.clock,
            log=changes.log,
            log_start=changes.log_start,
            unreadable=(
                tuple(sorted(index.problems.unreadable.values(), key=lambda u: (u.kind, u.name)))
                if "unreadable" in stale
                else old.unreadable
            ),
            pods=len(index.pods),
            assumed=reservations.assumed_count(),
            reserved=self._reserved_pods() if dirty else old.reserved,
        )

    def _reserved_pods(self) -> dict[str, tuple[str, ...]]:
        """Pod key -> the nodes whose view holds a MIG reservation for it (for the snapshot)."""
        found: dict[str, list[str]] = {}
        for name in sorted(self._expiry):
            for pod in sorted({r.pod for r in self._nodes[name].view.reserved}):
                found.setdefault(pod, []).append(name)
        return {pod: tuple(nodes) for pod, nodes in found.items()}

    def _rebuild(self, name: str, index: Index, now: float) -> None:
        old = self._shapes.pop(name, ())
        if old:
            self._mix.subtract(old)
        entry = index.nodes.get(name)
        self._expiry.pop(name, None)
        if entry is None:
            self._nodes.pop(name, None)
            self._sigs.pop(name, None)
            return
        counted = index.counted_on(name)
        nominated = index.nominated_to(name)
        live = [r for r in entry.reservations if r.expires > now and r.pod not in index.placed]
        if live:
            self._expiry[name] = min(r.expires for r in live)
        lost: list[tuple[PodEntry, str]] = []
        version = self.changes.versions.get(name, 0)
        view = assemble_view(name, entry, (*counted, *nominated), version, live, lost=lost)
        for pod, reason in lost:
            index.problems.tell(pod, reason, lost=True)
        key = anonymous(view)
        state = self._states.get(key)
        if state is None:
            state = self._states[key] = self._next_state
            self._next_state += 1
        sig = self._sigs[name] = (view.version, state)
        awaiting = tuple(sorted(e.key for e in counted if e.awaiting))
        self._nodes[name] = NodeSnapshot(entry, view, sig, counted, nominated, awaiting)
        shapes = _pod_shapes(index.bound_on(name), view)
        if shapes:
            self._shapes[name] = shapes
            self._mix.update(shapes)


def _pod_shapes(entries: Iterable[PodEntry], view: NodeView) -> tuple[Shape, ...]:
    """(GPU count, milli per GPU, CPU) of the node's bound GPU pods, for the policy's mix."""
    gpus = {g.uuid: g for g in view.gpus}
    shapes = []
    for entry in entries:
        placed = entry.placed
        a = placed.assignment
        shape = demand_shape(placed.request, gpus.get(a.gpu_uuid) if a else None, placed.cpu_milli)
        if shape is not None:
            shapes.append(shape)
    return tuple(shapes)
