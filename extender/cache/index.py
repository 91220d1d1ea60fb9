"""The watched objects, indexed as the node views need them: Nodes, Pods, nominations, budgets, Namespaces, DRA objects.

Written only by the cluster state's writer (`ClusterCache`, under its lock); every change
that alters a node's view touches that node in the change log (`changes.ChangeLog`) and every
other change marks the part of the snapshot it makes stale, so the next publish rebuilds no
more than that. No I/O and no lock here.

An object that cannot be read is never fatal: a Pod is skipped, a Node kept with the problem as
its reason, a budget not counted, a Namespace selected by no selector's labels; each is listed
in `problems` (`problems.Problems`: logged once per object and resourceVersion).

Assignments (docs/extender.md, "What the watch cache trusts"): a pod's `gpupart.io/assignment`
counts only when it verifies with the shared key for that pod's UID and node, and on the GPU
its UUID names in the node's inventory; otherwise the pod counts on its node on no GPU in
particular (`Problems.tell`: logged once, with the reason). A verified assignment a tenant later edits stays
counted as it was. Assignments that could not be checked for want of a readable key are
checked again once one can be read (`recheck_assignments`).

Preemption (docs/adr-005-preemption.md): a pending pod nominated to a node holds its demand
there, on the GPU the preempt verb proposed, until it binds or the nomination is cleared.

MIG reservations (docs/adr-013-dynamic-mig-plans.md): `reserving` maps each pod to the nodes
whose MIG plan reserves an instance for it, and `placed` counts the pods bound or assumed (their
reservations no longer count), so that a pod binding rebuilds exactly the nodes that held one.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

from gpupart.core.scheduling.preemption import Budget, parse_budget

from ..objects import (
    DRA_KINDS,
    NAMESPACE,
    NODE,
    PDB,
    POD,
    KeySource,
    NodeEntry,
    PodEntry,
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
from ..reservations import Reservations
from .changes import ChangeLog
from .dra import DraIndex
from .problems import Problems

_DONE_PHASES = ("Succeeded", "Failed")


class Index:
    """Every watched object the extender reads, by name or uid, with the indexes views need."""

    def __init__(
        self, changes: ChangeLog, reservations: Reservations, keys: KeySource | None
    ) -> None:
        self.changes = changes
        self.reservations = reservations
        """Assumed pods and proposals: read here, changed by the writer (one drop, theirs)."""
        self.keys = keys
        self.nodes: dict[str, NodeEntry] = {}
        self.pods: dict[str, PodEntry] = {}
        self.by_node: dict[str, dict[str, PodEntry]] = {}
        self.nominated: dict[str, tuple[PodEntry, Mapping[str, Any]]] = {}
        """Pending pods nominated to a node: their reservation, and the object it was read from."""
        self.nominated_on: dict[str, dict[str, PodEntry]] = {}
        self.budgets: dict[str, Budget] = {}
        self.namespaces: dict[str, Mapping[str, str]] = {}
        """Namespace name -> its labels (each mapping new per read, never changed after)."""
        self.problems = Problems(changes)
        """Objects that could not be read, and pods whose assignment is not counted as it says."""
        self.dra = DraIndex(changes, self.problems)
        self.reserving: dict[str, set[str]] = {}
        """Pod key -> the nodes whose MIG plan reserves an instance for it (live or not)."""
        self.placed: Counter[str] = Counter()
        """Keys of the pods bound or assumed: their MIG reservations no longer count."""
        self._unchecked: set[str] = set()
        """Uids of pods whose assignment awaits a readable key (`recheck_assignments`)."""

    # -- events --

    def apply(self, kind: str, event: str, obj: Mapping[str, Any]) -> None:
        """One watch event: ADDED, MODIFIED, DELETED (BOOKMARK and others change nothing)."""
        if event not in ("ADDED", "MODIFIED", "DELETED"):
            return
        if kind == NODE:
            name = str(meta_of(obj).get("name") or "")
            if not name:
                return
            old = self.nodes.get(name)
            if event == "DELETED":
                self.nodes.pop(name, None)
                self.problems.readable(NODE, name)
                self._index_plan(name, old, None)
            else:
                entry = self._read_node(name, obj)
                if old == entry:
                    return  # status heartbeats change nothing the extender reads
                self.nodes[name] = entry
                self._index_plan(name, old, entry)
            self.changes.touch(name)
        elif kind == POD:
            uid = uid_of(obj)
            status = obj.get("status")
            if event == "DELETED" or (
                isinstance(status, Mapping) and status.get("phase") in _DONE_PHASES
            ):
                self.drop_assumed(uid)  # it holds nothing any more
            if event == "DELETED":
                self.problems.readable(POD, uid)
                self.set_pod(uid, None)
                self.set_nominated(uid, None)
            else:
                self.set_pod(uid, self._read_pod(uid, obj))
                self.set_nominated(uid, obj)
        elif kind == PDB:
            self._apply_budget(event, obj)
        elif kind == NAMESPACE:
            self._apply_namespace(event, obj)
        elif kind in DRA_KINDS:
            self.dra.apply(kind, event, obj)

    def replace(self, kind: str, listed: list[Mapping[str, Any]]) -> None:
        """A full list (start, or relist after 410 Gone): what is absent is gone."""
        if kind == NODE:
            fresh = {
                name: self._read_node(name, o)
                for o in listed
                if (name := str(meta_of(o).get("name") or ""))
            }
            for name in set(self.nodes) | set(fresh):
                if self.nodes.get(name) != fresh.get(name):
                    self._index_plan(name, self.nodes.get(name), fresh.get(name))
                    self.changes.touch(name)
            self.nodes = fresh
            keys: set[str] = set(fresh)
        elif kind == POD:
            seen: dict[str, PodEntry | None] = {}
            listed_by_uid: dict[str, Mapping[str, Any]] = {}
            for o in listed:
                uid = uid_of(o)
                seen[uid] = self._read_pod(uid, o)
                listed_by_uid[uid] = o
            for uid in set(self.pods) - set(seen):
                self.set_pod(uid, None)
            for uid in set(self.nominated) - set(seen):
                self.set_nominated(uid, None)
            for uid, entry in seen.items():
                self.set_pod(uid, entry)
                self.set_nominated(uid, listed_by_uid[uid])
            keys = set(seen)
        elif kind in DRA_KINDS:
            keys = self.dra.replace(kind, listed)
        elif kind == NAMESPACE:
            keys = set()
            for o in listed:
                self._apply_namespace("ADDED", o)
                keys.add(str(meta_of(o).get("name") or ""))
            for name in set(self.namespaces) - keys:
                del self.namespaces[name]
                self.changes.mark("namespaces")
        else:
            self.budgets = {}
            keys = set()
            for o in listed:
                self._apply_budget("ADDED", o)
                keys.add(key_of(o))
        self.problems.listed(kind, keys)

    def _apply_namespace(self, event: str, obj: Mapping[str, Any]) -> None:
        name = str(meta_of(obj).get("name") or "")
        if not name:
            return
        old = self.namespaces.get(name)
        labels = None
        if event != "DELETED":
            try:
                labels = read_namespace_labels(obj)
                self.problems.readable(NAMESPACE, name)
            except Exception as error:  # noqa: BLE001 - one namespace's problem: not selected
                self.problems.seen(NAMESPACE, name, name, obj, problem_of(error))
        else:
            self.problems.readable(NAMESPACE, name)
        if labels is None:
            self.namespaces.pop(name, None)
        elif labels != old:
            self.namespaces[name] = labels
        if labels != old:
            self.changes.mark("namespaces")

    def _apply_budget(self, event: str, obj: Mapping[str, Any]) -> None:
        key = key_of(obj)
        self.changes.mark("budgets")
        if event == "DELETED":
            self.budgets.pop(key, None)
            self.problems.readable(PDB, key)
            return
        try:
            self.budgets[key] = parse_budget(obj)
            self.problems.readable(PDB, key)
        except Exception as error:  # noqa: BLE001 - one budget's problem; it is not counted
            self.budgets.pop(key, None)
            self.problems.seen(PDB, key, key, obj, problem_of(error))

    # -- nodes --

    def _read_node(self, name: str, obj: Mapping[str, Any]) -> NodeEntry:
        entry = read_node(obj, self.nodes.get(name))
        if entry.unreadable or entry.plan_problem:
            problem = entry.problem if entry.unreadable else entry.plan_problem
            self.problems.seen(NODE, name, name, obj, problem)
        else:
            self.problems.readable(NODE, name)
        return entry

    def _index_plan(self, name: str, old: NodeEntry | None, new: NodeEntry | None) -> None:
        """Keep `reserving` in step with the node's MIG plan."""
        for r in old.reservations if old is not None else ():
            nodes = self.reserving.get(r.pod)
            if nodes is not None:
                nodes.discard(name)
                if not nodes:
                    del self.reserving[r.pod]
        for r in new.reservations if new is not None else ():
            self.reserving.setdefault(r.pod, set()).add(name)

    # -- pods --

    def count_placed(self, key: str, delta: int) -> None:
        """A pod bound or assumed (+1), or no longer (-1): the nodes holding a MIG reservation
        for it are rebuilt when that changes whether it is placed."""
        before = self.placed[key]
        after = before + delta
        if after > 0:
            self.placed[key] = after
        else:
            self.placed.pop(key, None)
        if (before > 0) != (after > 0):
            for node in self.reserving.get(key, ()):
                self.changes.touch(node)

    def assumed(self, entry: PodEntry) -> None:
        """`entry` now counts on its node as an assumed pod (bound by us, not watched yet)."""
        self.count_placed(entry.key, +1)
        self.set_nominated(entry.uid, None)  # bound now: the nomination has served
        self.changes.touch(entry.node)
        self.changes.mark("counts")

    def unassumed(self, entry: PodEntry) -> None:
        """`entry`, an assumed pod, no longer counts (watched bound, bind failed, expired)."""
        self.changes.touch(entry.node)
        self.count_placed(entry.key, -1)
        self.changes.mark("counts")

    def drop_assumed(self, uid: str) -> bool:
        """Release pod `uid`'s assumed reservation, if it holds one."""
        entry = self.reservations.release_assumed(uid)
        if entry is None:
            return False
        self.unassumed(entry)
        return True

    def _read_pod(self, uid: str, obj: Mapping[str, Any]) -> PodEntry | None:
        old = self.pods.get(uid)
        try:
            entry = read_pod(obj, self.keys, kept=None if old is None else old.placed.assignment)
        except UnreadablePod as error:
            self.problems.seen(POD, uid, key_of(obj), obj, str(error))
            return None
        self.problems.readable(POD, uid)
        if entry is not None:
            self.problems.tell(entry, entry.distrusted)
        return entry

    def set_pod(self, uid: str, entry: PodEntry | None) -> None:
        old = self.pods.get(uid)
        if entry is not None:
            # The watch now shows the pod bound: the reservation has served its purpose.
            self.drop_assumed(uid)
        if entry is not None and entry.unchecked is not None:
            self._unchecked.add(uid)
        else:
            self._unchecked.discard(uid)
        if entry is None:
            self.problems.forget(uid)
        if old == entry:
            return
        self.changes.mark("counts")
        if old is not None:
            self.pods.pop(uid, None)
            self.by_node.get(old.node, {}).pop(uid, None)
            self.changes.touch(old.node)
            self.count_placed(old.key, -1)
        if entry is not None:
            self.pods[uid] = entry
            self.by_node.setdefault(entry.node, {})[uid] = entry
            self.changes.touch(entry.node)
            self.count_placed(entry.key, +1)

    def set_nominated(self, uid: str, obj: Mapping[str, Any] | None) -> None:
        """Keep, move or drop the reservation of a pending pod nominated to a node."""
        old = self.nominated.get(uid)
        entry = None
        if obj is not None and not self.reservations.is_assumed(uid) and uid not in self.pods:
            entry = read_nomination(obj)
            if entry is not None:
                entry = read_nomination(obj, self._proposed_gpu(uid, entry.node))
        if old is not None and old[0] == entry:
            return
        self.changes.mark("nominations")
        if old is not None:
            del self.nominated[uid]
            on_node = self.nominated_on[old[0].node]
            del on_node[uid]
            if not on_node:
                del self.nominated_on[old[0].node]
            self.changes.touch(old[0].node)
        if entry is not None and obj is not None:
            self.nominated[uid] = (entry, obj)
            self.nominated_on.setdefault(entry.node, {})[uid] = entry
            self.changes.touch(entry.node)

    def renominate(self, uid: str, node: str) -> None:
        """Read pod `uid`'s nomination to `node` again (a proposal there may move it)."""
        held = self.nominated.get(uid)
        if held is not None and held[0].node == node:
            obj = held[1]
            self.set_nominated(uid, None)
            self.set_nominated(uid, obj)

    def _proposed_gpu(self, uid: str, node: str) -> tuple[int, str] | None:
        proposal = self.reservations.proposal(uid, node)
        inventory = (self.nodes.get(node) or NodeEntry(None, "")).inventory
        if proposal is None or inventory is None:
            return None
        return next(((g.index, g.uuid) for g in inventory if g.index == proposal.gpu), None)

    # -- assignments --

    def awaits_key(self) -> bool:
        """Some pod's assignment could not be checked for want of a readable key."""
        return bool(self._unchecked) and self.keys is not None

    def recheck_assignments(self) -> int:
        """Check the assignments that awaited a readable key; returns how many were checked."""
        if self.keys is None:
            return 0
        checked = 0
        for uid in list(self._unchecked):
            entry = self.pods.get(uid)
            fresh = None if entry is None else verified_entry(entry, self.keys)
            if entry is None or fresh is not None:
                self._unchecked.discard(uid)
            if fresh is not None:
                checked += 1
                self.set_pod(uid, fresh)
                self.problems.tell(fresh, fresh.distrusted)
        return checked

    # -- what a node's view is built from --

    def counted_on(self, node: str) -> tuple[PodEntry, ...]:
        """The pods bound or assumed on `node`."""
        return (*self.by_node.get(node, {}).values(), *self.reservations.assumed_on(node))

    def nominated_to(self, node: str) -> tuple[PodEntry, ...]:
        return tuple(self.nominated_on.get(node, {}).values())

    def bound_on(self, node: str) -> Iterable[PodEntry]:
        """The pods the watch shows bound on `node` (their shapes make the policy's mix)."""
        return self.by_node.get(node, {}).values()
