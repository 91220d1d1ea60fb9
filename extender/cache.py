"""The one writer of the extender's picture of the cluster: watch events in, immutable snapshots out.

Fed by events (`apply`) and relists (`replace`) from the watch threads in `kube.py` (or tests),
and by the service's reservations (`assume`, `forget`, `propose`, `expire`); no I/O here. After
every change the nodes it touched are rebuilt at once, on the writer's thread: the node view,
its version, its state id and the GPU shapes of its pods. Then a new `Snapshot` is published
by swapping one reference: requests read `snapshot` without any lock, so a burst of watch
events never makes a filter request wait (the writer lock is taken by writers only, and by
bind, which must evaluate and reserve as one step).

The state id interns `scheduling.anonymous(view)`: nodes with equal inventory, allocatable CPU
and usage (GPU and CPU, up to pod names) share an id, so the service evaluates each distinct
state once per pod shape. Ids are never reused: when the intern table outgrows `max_states`
it starts afresh with new ids, and an answer kept for an old id simply never matches again.

An object that cannot be read is never fatal: a Pod is skipped, a Node kept with the problem as
its reason, and both are listed in the snapshot's `unreadable` (logged once per object and
resourceVersion) for the metrics and `diagnose`; the watch goes on with the other objects.

Preemption (docs/adr-005-preemption.md): PodDisruptionBudgets are kept for the preempt verb's
violation count, and a pending pod nominated to a node (`status.nominatedNodeName`, set by
kube-scheduler after it evicted victims for it) holds its demand there, on the GPU the preempt
verb chose, until it binds or the nomination is cleared: a pod arriving in between cannot take
the room its victims free. The nominated pod itself is evaluated without its own reservation.

Slice reservations (docs/adr-013-dynamic-mig-plans.md): each Node's MIG plan names the pods its
planned MIG instances are held for. A node's view carries the live ones: not past `expires` by
this cache's own clock (`wall`), and whose pod is neither bound nor assumed anywhere (then the
instance is simply in use). Views are snapshots, so the writer rebuilds a node when its earliest
reservation expires: at the next publish or `expire_slices` call after that time, whichever
comes first (requests call `expire_slices` before they read the snapshot).

Namespaces are kept as name -> labels, for the namespaceSelectors of pending pods' anti-affinity
terms (`parse_demand`'s `namespace_labels`, read from the snapshot): a Namespace whose labels
cannot be read is listed in `unreadable` and selected by no selector's labels. A relabel
publishes a new mapping (nothing about nodes changes: the memo keys answers on the demand, whose
resolved terms hold the namespaces they select).

Every bound, live pod is kept for its CPU request (the node's free CPU feeds the policy's
stranded-share term); pods that hold GPUs are kept with their GPU request and assignment too.

Assignments (docs/extender.md, "What the watch cache trusts"): a pod's `gpupart.io/assignment`
counts only when it verifies with the shared key for that pod's UID and node, and on the GPU
its UUID names in the node's inventory; otherwise the pod counts on its node on no GPU in
particular (logged once, with the reason). A verified assignment a tenant later edits stays
counted as it was. Assignments that could not be checked for want of a readable key are
checked again once one can be read (`recheck_assignments`).

Over 400 lines for a reason: every write path (events, relists, reservations, publishing) is
here so that one lock and one publish cover them all; reading objects lives in `objects.py`.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from gpupart import logs
from gpupart.core.scheduling.preemption import Budget, parse_budget
from gpupart.core.scheduling.shares import Shape, demand_shape
from gpupart.core.scheduling.views import NodeView, anonymous

from .objects import (
    NAMESPACE,
    NODE,
    PDB,
    POD,
    KeySource,
    NodeEntry,
    PodEntry,
    Unreadable,
    UnreadablePod,
    key_of,
    meta_of,
    problem_of,
    read_namespace_labels,
    read_node,
    read_nomination,
    read_pod,
    uid_of,
    verified_entry,
)
from .reservations import Proposal, Reservations
from .snapshot import NodeState, Snapshot, assemble_view

__all__ = ["NAMESPACE", "NODE", "PDB", "POD", "WATCH_FAILING_AFTER", "ClusterCache"]
"""The kinds are re-exported: they name what `apply` and `replace` are fed."""

log = logging.getLogger(__name__)

WATCH_FAILING_AFTER = 3
"""Consecutive failures of one kind's list or watch after which the extender is not ready."""
_LOG_SIZE = 100_000
"""Node changes remembered for `changed_since` (a few MB of name references at most)."""
_DONE_PHASES = ("Succeeded", "Failed")


class ClusterCache:
    """Nodes, pods, budgets, namespaces and reservations, changed under one writer lock, read as
    `snapshot`."""

    def __init__(
        self,
        *,
        keys: KeySource | None = None,
        max_states: int = 200_000,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._lock = threading.RLock()
        self.keys = keys
        """The shared assignment keys pods' assignments are verified with (None: none is)."""
        self.wall = wall
        """Unix seconds, the clock slice reservations expire by (tests pass their own)."""
        self._changed = threading.Condition(self._lock)
        """Notified after every change, for binds that wait for a node's admission to finish."""
        self.reservations = Reservations()
        self._nodes: dict[str, NodeEntry] = {}
        self._pods: dict[str, PodEntry] = {}
        self._by_node: dict[str, dict[str, PodEntry]] = {}
        self._nominated: dict[str, tuple[PodEntry, Mapping[str, Any]]] = {}
        """Pending pods nominated to a node: their reservation, and the object it was read from."""
        self._nominated_on: dict[str, dict[str, PodEntry]] = {}
        self._budgets: dict[str, Budget] = {}
        self._namespaces: dict[str, Mapping[str, str]] = {}
        """Namespace name -> its labels (each mapping new per read, never changed after)."""
        self._versions: dict[str, int] = {}
        self._clock = 0
        self._log: list[str] = []
        self._log_start = 0
        self._dirty: set[str] = set()
        """Nodes changed since the last publish."""
        self._stale: set[str] = set()
        """What else changed since the last publish: "nominations", "budgets", "namespaces",
        "unreadable", "proposals", "counts" (the rest of the snapshot is reused)."""
        self._states: dict[NodeView, int] = {}
        self._next_state = 0
        self._max_states = max_states
        self._node_states: dict[str, NodeState] = {}
        self._sigs: dict[str, tuple[int, int]] = {}
        self._shapes: dict[str, tuple[Shape, ...]] = {}
        self._mix: Counter[Shape] = Counter()
        self._unreadable: dict[tuple[str, str], Unreadable] = {}
        self._reserving: dict[str, set[str]] = {}
        """Pod key -> the nodes whose MIG plan reserves a slice for it (live or not)."""
        self._placed_keys: Counter[str] = Counter()
        """Keys of the pods bound or assumed: their reservations no longer count."""
        self._expiry: dict[str, float] = {}
        """Per node with live reservations: when the first of them expires."""
        self._next_expiry = math.inf
        self._unchecked: set[str] = set()
        """Uids of pods whose assignment awaits a readable key (`recheck_assignments`)."""
        self._told: dict[str, str] = {}
        """Per pod uid, the last reason logged for not counting its assignment (logged once)."""
        self.synced: dict[str, bool] = {NODE: False, POD: False, NAMESPACE: False}
        self._health = threading.Lock()
        self._failures: dict[str, tuple[int, str]] = {}
        """Per kind: consecutive failed lists or watches, and the last error."""
        self.snapshot = Snapshot.empty()
        """The current picture: replaced, never changed."""

    # -- feeding --

    def apply(self, kind: str, event: str, obj: Mapping[str, Any]) -> None:
        """One watch event: ADDED, MODIFIED, DELETED (BOOKMARK and others change nothing)."""
        with self._lock:
            self._apply(kind, event, obj)
            self._publish()

    def _apply(self, kind: str, event: str, obj: Mapping[str, Any]) -> None:
        if event not in ("ADDED", "MODIFIED", "DELETED"):
            return
        if kind == NODE:
            name = str(meta_of(obj).get("name") or "")
            if not name:
                return
            old = self._nodes.get(name)
            if event == "DELETED":
                self._nodes.pop(name, None)
                self._readable(NODE, name)
                self._index_plan(name, old, None)
            else:
                node_entry = self._read_node(name, obj)
                if old == node_entry:
                    return  # status heartbeats change nothing the extender reads
                self._nodes[name] = node_entry
                self._index_plan(name, old, node_entry)
            self._touch(name)
        elif kind == POD:
            uid = uid_of(obj)
            status = obj.get("status")
            if event == "DELETED" or (
                isinstance(status, Mapping) and status.get("phase") in _DONE_PHASES
            ):
                self._drop_assumed(uid)  # it holds nothing any more
            if event == "DELETED":
                self._readable(POD, uid)
                self._set_pod(uid, None)
                self._set_nominated(uid, None)
            else:
                self._set_pod(uid, self._read_pod(uid, obj))
                self._set_nominated(uid, obj)
        elif kind == PDB:
            self._apply_budget(event, obj)
        elif kind == NAMESPACE:
            self._apply_namespace(event, obj)

    def _apply_namespace(self, event: str, obj: Mapping[str, Any]) -> None:
        name = str(meta_of(obj).get("name") or "")
        if not name:
            return
        old = self._namespaces.get(name)
        labels = None
        if event != "DELETED":
            try:
                labels = read_namespace_labels(obj)
                self._readable(NAMESPACE, name)
            except Exception as error:  # noqa: BLE001 - one namespace's problem: not selected
                self._unreadable_seen(NAMESPACE, name, name, obj, problem_of(error))
        else:
            self._readable(NAMESPACE, name)
        if labels is None:
            self._namespaces.pop(name, None)
        elif labels != old:
            self._namespaces[name] = labels
        if labels != old:
            self._stale.add("namespaces")

    def _apply_budget(self, event: str, obj: Mapping[str, Any]) -> None:
        key = key_of(obj)
        self._stale.add("budgets")
        if event == "DELETED":
            self._budgets.pop(key, None)
            self._readable(PDB, key)
            return
        try:
            self._budgets[key] = parse_budget(obj)
            self._readable(PDB, key)
        except Exception as error:  # noqa: BLE001 - one budget's problem; it is not counted
            self._budgets.pop(key, None)
            self._unreadable_seen(PDB, key, key, obj, problem_of(error))

    def _read_node(self, name: str, obj: Mapping[str, Any]) -> NodeEntry:
        entry = read_node(obj, self._nodes.get(name))
        if entry.unreadable or entry.plan_problem:
            problem = entry.problem if entry.unreadable else entry.plan_problem
            self._unreadable_seen(NODE, name, name, obj, problem)
        else:
            self._readable(NODE, name)
        return entry

    def _index_plan(self, name: str, old: NodeEntry | None, new: NodeEntry | None) -> None:
        """Keep `_reserving` in step with the node's MIG plan."""
        for r in old.reservations if old is not None else ():
            nodes = self._reserving.get(r.pod)
            if nodes is not None:
                nodes.discard(name)
                if not nodes:
                    del self._reserving[r.pod]
        for r in new.reservations if new is not None else ():
            self._reserving.setdefault(r.pod, set()).add(name)

    def _count_placed(self, key: str, delta: int) -> None:
        """A pod bound or assumed (+1), or no longer (-1): the nodes holding a reservation for
        it are rebuilt when that changes whether it is placed."""
        before = self._placed_keys[key]
        after = before + delta
        if after > 0:
            self._placed_keys[key] = after
        else:
            self._placed_keys.pop(key, None)
        if (before > 0) != (after > 0):
            for node in self._reserving.get(key, ()):
                self._touch(node)

    def _read_pod(self, uid: str, obj: Mapping[str, Any]) -> PodEntry | None:
        old = self._pods.get(uid)
        try:
            entry = read_pod(obj, self.keys, kept=None if old is None else old.placed.assignment)
        except UnreadablePod as error:
            self._unreadable_seen(POD, uid, key_of(obj), obj, str(error))
            return None
        self._readable(POD, uid)
        if entry is not None:
            self._tell(entry, entry.distrusted)
        return entry

    def _tell(self, entry: PodEntry, reason: str, *, lost: bool = False) -> None:
        """Log, once per pod and reason, that its assignment is not counted as it says."""
        if not reason:
            self._told.pop(entry.uid, None)
            return
        if self._told.get(entry.uid) == reason:
            return
        self._told[entry.uid] = reason
        kept = None if lost else entry.placed.assignment
        log.warning(
            "Ignored a pod's GPU assignment",
            extra=logs.kv(
                pod=entry.key,
                node=entry.node,
                reason=reason,
                counted="on no GPU in particular" if kept is None else f"on GPU {kept.gpu_uuid}",
            ),
        )

    def recheck_assignments(self, *, wait: bool = True) -> int:
        """Count the assignments that could not be checked for want of a readable key, now
        that one may be readable; returns how many were checked. A check of one set when
        there are none (requests call it); `wait=False`: nothing while a writer holds the lock."""
        if not self._unchecked or self.keys is None or not self._lock.acquire(blocking=wait):
            return 0
        try:
            checked = 0
            for uid in list(self._unchecked):
                entry = self._pods.get(uid)
                fresh = None if entry is None else verified_entry(entry, self.keys)
                if entry is None or fresh is not None:
                    self._unchecked.discard(uid)
                if fresh is not None:
                    checked += 1
                    self._set_pod(uid, fresh)
                    self._tell(fresh, fresh.distrusted)
            if checked:
                self._publish()
            return checked
        finally:
            self._lock.release()

    def _unreadable_seen(
        self, kind: str, key: str, name: str, obj: Mapping[str, Any], problem: str
    ) -> None:
        """Remember an unreadable object; logged once per object and resourceVersion."""
        version = str(meta_of(obj).get("resourceVersion") or "")
        found = Unreadable(kind, name, version, problem)
        if self._unreadable.get((kind, key)) != found:
            log.warning(
                "Skipped unreadable object",
                extra=logs.kv(kind=kind, name=name, rv=version, err=problem),
            )
            self._unreadable[kind, key] = found
            self._stale.add("unreadable")

    def _readable(self, kind: str, key: str) -> None:
        if self._unreadable.pop((kind, key), None) is not None:
            self._stale.add("unreadable")

    def replace(self, kind: str, objects: Iterable[Mapping[str, Any]]) -> None:
        """A full list (start, or relist after 410 Gone): what is absent is gone."""
        with self._lock:
            listed = [o for o in objects if isinstance(o, Mapping)]
            if kind == NODE:
                fresh = {
                    name: self._read_node(name, o)
                    for o in listed
                    if (name := str(meta_of(o).get("name") or ""))
                }
                for name in set(self._nodes) | set(fresh):
                    if self._nodes.get(name) != fresh.get(name):
                        self._index_plan(name, self._nodes.get(name), fresh.get(name))
                        self._touch(name)
                self._nodes = fresh
                keys: set[str] = set(fresh)
            elif kind == POD:
                seen: dict[str, PodEntry | None] = {}
                listed_by_uid: dict[str, Mapping[str, Any]] = {}
                for o in listed:
                    uid = uid_of(o)
                    seen[uid] = self._read_pod(uid, o)
                    listed_by_uid[uid] = o
                for uid in set(self._pods) - set(seen):
                    self._set_pod(uid, None)
                for uid in set(self._nominated) - set(seen):
                    self._set_nominated(uid, None)
                for uid, entry in seen.items():
                    self._set_pod(uid, entry)
                    self._set_nominated(uid, listed_by_uid[uid])
                keys = set(seen)
            elif kind == NAMESPACE:
                keys = set()
                for o in listed:
                    self._apply_namespace("ADDED", o)
                    keys.add(str(meta_of(o).get("name") or ""))
                for name in set(self._namespaces) - keys:
                    del self._namespaces[name]
                    self._stale.add("namespaces")
            else:
                self._budgets = {}
                keys = set()
                for o in listed:
                    self._apply_budget("ADDED", o)
                    keys.add(key_of(o))
            for gone in [k for k in self._unreadable if k[0] == kind and k[1] not in keys]:
                del self._unreadable[gone]
            self.synced[kind] = True
            self._stale.add("unreadable")
            self._publish()

    def _set_pod(self, uid: str, entry: PodEntry | None) -> None:
        old = self._pods.get(uid)
        if entry is not None:
            # The watch now shows the pod bound: the reservation has served its purpose.
            self._drop_assumed(uid)
        if entry is not None and entry.unchecked is not None:
            self._unchecked.add(uid)
        else:
            self._unchecked.discard(uid)
        if entry is None:
            self._told.pop(uid, None)
        if old == entry:
            return
        self._stale.add("counts")
        if old is not None:
            self._pods.pop(uid, None)
            self._by_node.get(old.node, {}).pop(uid, None)
            self._touch(old.node)
            self._count_placed(old.key, -1)
        if entry is not None:
            self._pods[uid] = entry
            self._by_node.setdefault(entry.node, {})[uid] = entry
            self._touch(entry.node)
            self._count_placed(entry.key, +1)

    def _set_nominated(self, uid: str, obj: Mapping[str, Any] | None) -> None:
        """Keep, move or drop the reservation of a pending pod nominated to a node."""
        old = self._nominated.get(uid)
        entry = None
        if obj is not None and not self.reservations.is_assumed(uid) and uid not in self._pods:
            entry = read_nomination(obj)
            if entry is not None:
                entry = read_nomination(obj, self._proposed_gpu(uid, entry.node))
        if old is not None and old[0] == entry:
            return
        self._stale.add("nominations")
        if old is not None:
            del self._nominated[uid]
            on_node = self._nominated_on[old[0].node]
            del on_node[uid]
            if not on_node:
                del self._nominated_on[old[0].node]
            self._touch(old[0].node)
        if entry is not None and obj is not None:
            self._nominated[uid] = (entry, obj)
            self._nominated_on.setdefault(entry.node, {})[uid] = entry
            self._touch(entry.node)

    def _proposed_gpu(self, uid: str, node: str) -> tuple[int, str] | None:
        proposal = self.reservations.proposal(uid, node)
        inventory = (self._nodes.get(node) or NodeEntry(None, "")).inventory
        if proposal is None or inventory is None:
            return None
        return next(((g.index, g.uuid) for g in inventory if g.index == proposal.gpu), None)

    def _touch(self, node: str) -> None:
        self._clock += 1
        self._versions[node] = self._clock
        self._dirty.add(node)
        self._log.append(node)
        if len(self._log) > _LOG_SIZE:
            # A new list: published snapshots keep reading the old one, which no longer grows.
            # Callers further behind than this start over (changed_since answers None).
            drop = len(self._log) // 2
            self._log = self._log[drop:]
            self._log_start += drop

    # -- publishing --

    def _publish(self) -> None:
        """Rebuild every node changed since the last publish, then swap in a new snapshot."""
        now = self.wall()
        if now >= self._next_expiry:
            for name in [n for n, t in self._expiry.items() if t <= now]:
                self._touch(name)  # a change like any other: new version, in the change log
        if not self._dirty and not self._stale:
            return
        if len(self._states) > self._max_states:
            # A fresh intern table; new ids follow the old ones, so no kept answer can match.
            self._states = {}
            self._dirty.update(self._nodes)
        dirty, self._dirty = self._dirty, set()
        for name in dirty:
            self._rebuild(name, now)
        if dirty:
            self._mix = +self._mix  # drop shapes counted down to zero
            self._next_expiry = min(self._expiry.values(), default=math.inf)
        old, stale = self.snapshot, self._stale
        self.snapshot = Snapshot(
            nodes=dict(self._node_states) if dirty else old.nodes,
            signatures=dict(self._sigs) if dirty else old.signatures,
            nominations=(
                {uid: held[0] for uid, held in self._nominated.items()}
                if "nominations" in stale
                else old.nominations
            ),
            proposals=self.reservations.proposals() if "proposals" in stale else old.proposals,
            budgets=(
                tuple(self._budgets[k] for k in sorted(self._budgets))
                if "budgets" in stale
                else old.budgets
            ),
            namespaces=dict(self._namespaces) if "namespaces" in stale else old.namespaces,
            mix=Counter(self._mix) if dirty else old.mix,
            clock=self._clock,
            log=self._log,
            log_start=self._log_start,
            unreadable=(
                tuple(sorted(self._unreadable.values(), key=lambda u: (u.kind, u.name)))
                if "unreadable" in stale
                else old.unreadable
            ),
            pods=len(self._pods),
            assumed=self.reservations.assumed_count(),
            reserved=self._reserved_pods() if dirty else old.reserved,
        )
        self._stale = set()
        self._changed.notify_all()

    def _reserved_pods(self) -> dict[str, tuple[str, ...]]:
        """Pod key -> the nodes whose view holds a reservation for it (for the snapshot)."""
        found: dict[str, list[str]] = {}
        for name in sorted(self._expiry):
            for pod in sorted({r.pod for r in self._node_states[name].view.reserved}):
                found.setdefault(pod, []).append(name)
        return {pod: tuple(nodes) for pod, nodes in found.items()}

    def _rebuild(self, name: str, now: float) -> None:
        old = self._shapes.pop(name, ())
        if old:
            self._mix.subtract(old)
        entry = self._nodes.get(name)
        self._expiry.pop(name, None)
        if entry is None:
            self._node_states.pop(name, None)
            self._sigs.pop(name, None)
            return
        counted = (
            *self._by_node.get(name, {}).values(),
            *self.reservations.assumed_on(name),
        )
        nominated = tuple(self._nominated_on.get(name, {}).values())
        live = [r for r in entry.reservations if r.expires > now and r.pod not in self._placed_keys]
        if live:
            self._expiry[name] = min(r.expires for r in live)
        lost: list[tuple[PodEntry, str]] = []
        view = assemble_view(
            name, entry, (*counted, *nominated), self._versions.get(name, 0), live, lost=lost
        )
        for pod, reason in lost:
            self._tell(pod, reason, lost=True)
        key = anonymous(view)
        state = self._states.get(key)
        if state is None:
            state = self._states[key] = self._next_state
            self._next_state += 1
        sig = self._sigs[name] = (view.version, state)
        awaiting = tuple(sorted(e.key for e in counted if e.awaiting))
        self._node_states[name] = NodeState(entry, view, sig, counted, nominated, awaiting)
        shapes = _pod_shapes(self._by_node.get(name, {}).values(), view)
        if shapes:
            self._shapes[name] = shapes
            self._mix.update(shapes)

    # -- reservations that change node views (bind, preempt) --

    def assume(self, entry: PodEntry, *, expires: float) -> None:
        """Count a pod we bound on its node until the watch shows it (or `expires` passes)."""
        with self._lock:
            old = self.reservations.assume(entry, expires)
            if old is not None:
                self._touch(old.node)
                self._count_placed(old.key, -1)
            self._count_placed(entry.key, +1)
            self._set_nominated(entry.uid, None)  # bound now: the reservation has served
            self._touch(entry.node)
            self._stale.add("counts")
            self._publish()

    def forget(self, uid: str) -> None:
        """Drop an assumed pod (its bind failed)."""
        with self._lock:
            if self._drop_assumed(uid):
                self._publish()

    def _drop_assumed(self, uid: str) -> bool:
        entry = self.reservations.release_assumed(uid)
        if entry is None:
            return False
        self._touch(entry.node)
        self._count_placed(entry.key, -1)
        self._stale.add("counts")
        return True

    def expire(self, now: float, *, wait: bool = True) -> int:
        """Drop every reservation whose time has passed (holds, assumed pods, proposals), in
        one sweep; returns how many assumed pods went. `wait=False`: do nothing (0) when a
        writer holds the lock now, for callers on the event loop (the next call sweeps)."""
        if not self._lock.acquire(blocking=wait):
            return 0
        try:
            expired = self.reservations.expire(now)
            for entry in expired.assumed:
                self._touch(entry.node)
                self._count_placed(entry.key, -1)
            if expired.proposals:
                self._stale.add("proposals")
            self._publish()
            return len(expired.assumed)
        finally:
            self._lock.release()

    def expire_slices(self, *, wait: bool) -> None:
        """Rebuild the nodes whose slice reservations have expired by now and publish; a
        check of one number when none has (requests call it before reading `snapshot`).
        `wait=False`: skipped while a writer holds the lock (its publish expires them)."""
        if self.wall() < self._next_expiry or not self._lock.acquire(blocking=wait):
            return
        try:
            self._publish()
        finally:
            self._lock.release()

    def propose(
        self, uid: str, node: str, gpu: int, victims: Iterable[str], *, expires: float
    ) -> None:
        """The preempt verb freed GPU `gpu` of `node` for pod `uid` by evicting `victims`: if
        kube-scheduler nominates the pod there, its reservation goes on that GPU."""
        with self._lock:
            self.reservations.propose(uid, node, Proposal(gpu, tuple(victims), expires))
            self._stale.add("proposals")
            held = self._nominated.get(uid)
            if held is not None and held[0].node == node:
                obj = held[1]
                self._set_nominated(uid, None)
                self._set_nominated(uid, obj)
            self._publish()

    # -- bind: evaluate and reserve as one step --

    @contextmanager
    def lock(self) -> Iterator[None]:
        """The writer lock: no change is published while it is held (bind only: a request on
        the event loop reads `snapshot` instead)."""
        with self._lock:
            yield

    def wait_for_change(self, timeout: float) -> None:
        """Block until the next publish or `timeout` seconds; call under `lock()`."""
        self._changed.wait(timeout)

    # -- watch health --

    @property
    def ready(self) -> bool:
        return all(self.synced.values()) and not self.failing()

    def watch_failed(self, kind: str, error: str) -> None:
        """The list or watch of `kind` failed (the watcher retries it)."""
        with self._health:
            count = self._failures.get(kind, (0, ""))[0] + 1
            self._failures[kind] = (count, error[:500])

    def watch_ok(self, kind: str) -> None:
        """The watch of `kind` has been working (events applied, or a full watch period)."""
        with self._health:
            self._failures.pop(kind, None)

    def failing(self) -> dict[str, tuple[int, str]]:
        """Kinds whose watch failed `WATCH_FAILING_AFTER` times or more in a row, with the last
        error: the cache may be stale, so the extender is not ready."""
        with self._health:
            return {k: f for k, f in self._failures.items() if f[0] >= WATCH_FAILING_AFTER}


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
