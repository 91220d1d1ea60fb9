"""The extender's picture of the cluster: Nodes (GPU inventory) and Pods (GPU requests, assignments).

Fed by events (`apply`) and relists (`replace`), from the watch loop in `kube.py` or from tests;
no I/O here. Pods the extender has bound but the watch has not yet shown ("assumed") count
against capacity until the watch confirms them or their TTL lapses.

An object the cache cannot read is never fatal: a Pod is skipped, a Node kept with the problem as
its reason, and both are listed in `unreadable()` (logged once per object and resourceVersion) for
the metrics and `diagnose`; the watch goes on with the other objects.

Preemption (docs/adr-005-preemption.md): PodDisruptionBudgets are kept for the preempt verb's
violation count, and a pending pod nominated to a node (`status.nominatedNodeName`, set by
kube-scheduler after it evicted victims for it) holds its demand there, on the GPU the preempt
verb chose, until it binds or the nomination is cleared: a pod arriving in between cannot take
the room its victims free. The nominated pod itself is evaluated without its own reservation.

Every bound, live pod is kept for its CPU request (the node's free CPU feeds the policy's
stranded-share term); pods that hold GPUs are kept with their GPU request and assignment too.

After every change the nodes it touched are rebuilt at once (on the watch thread, not in a
request): the node view, its version, its *state id* and the GPU shapes of its pods. The state
id interns `scheduling.anonymous(view)`: nodes with equal inventory, allocatable CPU and usage
(GPU and CPU, up to pod names) share an id, so the service evaluates each distinct state once per pod shape. A request
then maps names to `(version, state id)` with one dict lookup per node (`signatures()`).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from gpupart.core.api.resources import parse_pod_request
from gpupart.core.api.wire import (
    ALLOCATION_ANNOTATION,
    ASSIGNMENT_ANNOTATION,
    INVENTORY_ANNOTATION,
    InventoryGpu,
    PodAssignment,
    decode_allocation,
    decode_assignment,
    decode_inventory,
)
from gpupart.core.errors import GpupartError
from gpupart.core.node.admission import admission_complete, shared_containers
from gpupart.core.scheduling.pods import node_cpu_milli, pod_cpu_milli, tenant_of
from gpupart.core.scheduling.preemption import Budget, parse_budget
from gpupart.core.scheduling.shares import Shape, demand_shape
from gpupart.core.scheduling.views import NodeView, PlacedPod, anonymous, assemble_node

log = logging.getLogger(__name__)

NODE = "Node"
POD = "Pod"
PDB = "PodDisruptionBudget"
WATCH_FAILING_AFTER = 3
"""Consecutive failures of one kind's list or watch after which the extender is not ready."""
_LOG_SIZE = 100_000
"""Node changes remembered for `changed_since` (a few MB of name references at most)."""
_DONE_PHASES = ("Succeeded", "Failed")


@dataclass(frozen=True, slots=True)
class NodeEntry:
    inventory: tuple[InventoryGpu, ...] | None
    problem: str
    cpu_milli: int | None = None
    """Allocatable CPU (millicores); None when the Node does not say."""
    source: tuple[object, object] = field(default=(None, None), compare=False)
    """The annotation text and allocatable CPU value it was read from."""
    serial_admission: bool = False
    """The node's device plugin serves one shared-GPU pod at a time (`Inventory`)."""
    unreadable: bool = False
    """The Node or its inventory could not be read (`problem` says why)."""


@dataclass(frozen=True, slots=True)
class PodEntry:
    uid: str
    key: str
    node: str
    placed: PlacedPod
    awaiting: bool = False
    """A live shared-GPU pod with an assignment whose containers the device plugin has not all
    served yet (no complete `gpupart.io/allocation` record)."""


@dataclass(frozen=True, slots=True)
class Unreadable:
    """An object the cache could not read, at the resourceVersion it was seen."""

    kind: str
    name: str
    version: str
    problem: str


class UnreadablePod(Exception):
    """A bound pod whose GPU request, CPU request or assignment cannot be read."""


@dataclass(frozen=True, slots=True)
class Assumed:
    entry: PodEntry
    expires: float


def read_node(node: Mapping[str, Any], previous: NodeEntry | None = None) -> NodeEntry:
    """Inventory from a Node object's annotation (or the problem that keeps it from being read),
    and its allocatable CPU; `previous` itself when both texts are the ones it was read from.
    Never raises: a node that cannot be read is kept with the reason (`unreadable`)."""
    try:
        return _read_node(node, previous)
    except Exception as error:  # noqa: BLE001 - the node keeps its name and says why
        return NodeEntry(None, f"Node unreadable: {_problem(error)}", unreadable=True)


def _read_node(node: Mapping[str, Any], previous: NodeEntry | None) -> NodeEntry:
    annotations = _meta(node).get("annotations") or {}
    text = annotations.get(INVENTORY_ANNOTATION)
    status = node.get("status")
    allocatable = status.get("allocatable") if isinstance(status, Mapping) else None
    source = (text, allocatable.get("cpu") if isinstance(allocatable, Mapping) else None)
    if previous is not None and previous.source == source:
        # A status heartbeat (every node, every few seconds): decoding the inventory again
        # cost ~0.1 ms a node, a steady load on large clusters for nothing.
        return previous
    cpu = node_cpu_milli(node)
    if text is None:
        return NodeEntry(
            None,
            f"no GPU inventory (annotation {INVENTORY_ANNOTATION} not written by the node agent)",
            cpu,
            source,
        )
    try:
        inventory = decode_inventory(text)
        return NodeEntry(inventory.gpus, "", cpu, source, inventory.serial_admission)
    except Exception as error:  # noqa: BLE001 - the node keeps its name and says why
        problem = f"GPU inventory unreadable: {_problem(error)}"
        return NodeEntry(None, problem, cpu, source, unreadable=True)


def _problem(error: BaseException) -> str:
    """Why an object could not be read, in one bounded line (a bug names its exception)."""
    text = str(error) if isinstance(error, GpupartError) else f"{type(error).__name__}: {error}"
    return text[:500]


def _meta(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    meta = obj.get("metadata")
    return meta if isinstance(meta, Mapping) else {}


def read_pod(pod: Mapping[str, Any]) -> PodEntry | None:
    """The GPU capacity and CPU a bound, live pod holds; None for pods that hold neither.

    Raises UnreadablePod when what it holds cannot be read: the cache skips it and says so,
    rather than count it as holding nothing (or fail the watch).
    """
    try:
        return _read_pod(pod)
    except Exception as error:  # noqa: BLE001 - whatever breaks, it is this pod's problem
        raise UnreadablePod(_problem(error)) from None


def _read_pod(pod: Mapping[str, Any]) -> PodEntry | None:
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    status = pod.get("status") or {}
    node = spec.get("nodeName")
    if not node or status.get("phase") in _DONE_PHASES:
        return None
    annotations = meta.get("annotations") or {}
    request = parse_pod_request(pod)
    cpu = pod_cpu_milli(pod)
    if request.empty and cpu == 0:
        return None
    assignment = None
    text = annotations.get(ASSIGNMENT_ANNOTATION)
    if text is not None:
        try:
            assignment = decode_assignment(text)
        except GpupartError:
            assignment = None  # unplaced: it still counts against the node, on no GPU in particular
    awaiting = (
        bool(request.shared)
        and assignment is not None
        and meta.get("deletionTimestamp") is None
        and not _served(pod, annotations.get(ALLOCATION_ANNOTATION))
    )
    # A CPU-only pod is no GPU tenant of the view; its labels and priority are kept for the
    # preempt verb (kube-scheduler may name it as a victim, and PDBs may cover it).
    tenant = tenant_of(pod, request)
    return PodEntry(
        str(meta.get("uid") or tenant.pod),
        tenant.pod,
        str(node),
        PlacedPod(tenant, request, assignment, cpu),
        awaiting,
    )


def read_nomination(pod: Mapping[str, Any], gpu: tuple[int, str] | None = None) -> PodEntry | None:
    """The reservation of a pending pod nominated to a node (`status.nominatedNodeName`), on
    `gpu` (index, UUID: the GPU the preempt verb chose there) or on no GPU in particular; None
    for pods that are bound, finished, deleting, not nominated or ask for no GPU. Never raises:
    a pod whose request cannot be read reserves nothing (filter refuses it anyway)."""
    try:
        meta = pod.get("metadata") or {}
        spec = pod.get("spec") or {}
        status = pod.get("status") or {}
        node = status.get("nominatedNodeName")
        if (
            not node
            or spec.get("nodeName")
            or status.get("phase") in _DONE_PHASES
            or meta.get("deletionTimestamp") is not None
        ):
            return None
        request = parse_pod_request(pod)
        if request.empty:
            return None
        assignment = None
        if gpu is not None and request.shared:
            index, uuid = gpu
            assignment = PodAssignment(
                str(node), index, uuid, request.memory_mib, request.compute_percent
            )
        tenant = tenant_of(pod, request)
        uid = str(meta.get("uid") or tenant.pod)
        return PodEntry(
            uid, tenant.pod, str(node), PlacedPod(tenant, request, assignment, pod_cpu_milli(pod))
        )
    except Exception:  # noqa: BLE001 - one pod's problem; it reserves nothing
        return None


def _served(pod: Mapping[str, Any], record: object) -> bool:
    """Whether the device plugin has served every container of the pod that asks for slots.

    The same rule as the plugin's (`AssignedPod.complete`): a record it cannot read counts as
    served, and so does a pod whose containers it cannot read (the plugin never serves those,
    so waiting for them would hold the node for nothing).
    """
    if record is None:
        return False
    if not isinstance(record, str):
        return True
    try:
        return admission_complete(shared_containers(pod), decode_allocation(record))
    except GpupartError:
        return True


class ClusterCache:
    """Thread-safe store of nodes, pods and assumed pods; `lock()` holds it across many reads."""

    def __init__(self, *, max_states: int = 200_000) -> None:
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        """Notified after every change, for binds that wait for a node's admission to finish."""
        self._nodes: dict[str, NodeEntry] = {}
        self._pods: dict[str, PodEntry] = {}
        self._by_node: dict[str, dict[str, PodEntry]] = {}
        self._assumed: dict[str, Assumed] = {}
        self._assumed_on: dict[str, dict[str, Assumed]] = {}
        """The same assumed pods by node: a view reads its node's only."""
        self._nominated: dict[str, tuple[PodEntry, Mapping[str, Any]]] = {}
        """Pending pods nominated to a node: their reservation, and the object it was read from."""
        self._nominated_on: dict[str, dict[str, PodEntry]] = {}
        self._proposals: dict[str, dict[str, tuple[int, float, tuple[str, ...]]]] = {}
        """Per pod uid, per node: the GPU the preempt verb freed for it there, until when."""
        self._budgets: dict[str, Budget] = {}
        self._views: dict[str, NodeView] = {}
        self._versions: dict[str, int] = {}
        self._clock = 0
        self._log: list[str] = []
        self._log_start = 0
        """`_log[i]` is the node of touch number `_log_start + i + 1` (`_clock` counts touches)."""
        self._dirty: set[str] = set()
        self._sigs: dict[str, tuple[int, int]] = {}
        self._states: dict[NodeView, int] = {}
        self._max_states = max_states
        self._shapes: dict[str, tuple[Shape, ...]] = {}
        self._mix: Counter[Shape] = Counter()
        self.generation = 0
        """Bumped when state ids are renumbered (the intern table outgrew `max_states`)."""
        self.synced: dict[str, bool] = {NODE: False, POD: False}
        self._unreadable: dict[tuple[str, str], Unreadable] = {}
        self._failures: dict[str, tuple[int, str]] = {}
        """Per kind: consecutive failed lists or watches, and the last error."""

    # -- feeding --

    def apply(self, kind: str, event: str, obj: Mapping[str, Any]) -> None:
        """One watch event: ADDED, MODIFIED, DELETED (BOOKMARK and others change nothing)."""
        with self._lock:
            self._apply(kind, event, obj)
            self._refresh()
            self._changed.notify_all()

    def _apply(self, kind: str, event: str, obj: Mapping[str, Any]) -> None:
        if event not in ("ADDED", "MODIFIED", "DELETED"):
            return
        meta = _meta(obj)
        if kind == NODE:
            name = str(meta.get("name") or "")
            if not name:
                return
            if event == "DELETED":
                self._nodes.pop(name, None)
                self._readable(NODE, name)
            else:
                node_entry = self._read_node(name, obj)
                if self._nodes.get(name) == node_entry:
                    return  # heartbeats and label changes touch neither GPUs nor allocatable
                self._nodes[name] = node_entry
            self._touch(name)
        elif kind == POD:
            uid = str(meta.get("uid") or "") or _key(obj)
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

    def _apply_budget(self, event: str, obj: Mapping[str, Any]) -> None:
        key = _key(obj)
        if event == "DELETED":
            self._budgets.pop(key, None)
            self._readable(PDB, key)
            return
        try:
            self._budgets[key] = parse_budget(obj)
            self._readable(PDB, key)
        except Exception as error:  # noqa: BLE001 - one budget's problem; it is not counted
            self._budgets.pop(key, None)
            self._unreadable_seen(PDB, key, key, obj, _problem(error))

    def _read_node(self, name: str, obj: Mapping[str, Any]) -> NodeEntry:
        entry = read_node(obj, self._nodes.get(name))
        if entry.unreadable:
            self._unreadable_seen(NODE, name, name, obj, entry.problem)
        else:
            self._readable(NODE, name)
        return entry

    def _read_pod(self, uid: str, obj: Mapping[str, Any]) -> PodEntry | None:
        try:
            entry = read_pod(obj)
        except UnreadablePod as error:
            self._unreadable_seen(POD, uid, _key(obj), obj, str(error))
            return None
        self._readable(POD, uid)
        return entry

    def _unreadable_seen(
        self, kind: str, key: str, name: str, obj: Mapping[str, Any], problem: str
    ) -> None:
        """Remember an unreadable object; logged once per object and resourceVersion."""
        version = str(_meta(obj).get("resourceVersion") or "")
        found = Unreadable(kind, name, version, problem)
        if self._unreadable.get((kind, key)) != found:
            log.warning(
                "Skipped unreadable object",
                extra={"kv": {"kind": kind, "name": name, "rv": version, "err": problem}},
            )
        self._unreadable[kind, key] = found

    def _readable(self, kind: str, key: str) -> None:
        self._unreadable.pop((kind, key), None)

    def replace(self, kind: str, objects: Iterable[Mapping[str, Any]]) -> None:
        """A full list (start, or relist after 410 Gone): what is absent is gone."""
        with self._lock:
            listed = [o for o in objects if isinstance(o, Mapping)]
            if kind == NODE:
                fresh = {
                    name: self._read_node(name, o)
                    for o in listed
                    if (name := str(_meta(o).get("name") or ""))
                }
                for name in set(self._nodes) | set(fresh):
                    if self._nodes.get(name) != fresh.get(name):
                        self._touch(name)
                self._nodes = fresh
                keys: set[str] = set(fresh)
            elif kind == POD:
                seen: dict[str, PodEntry | None] = {}
                listed_by_uid: dict[str, Mapping[str, Any]] = {}
                for o in listed:
                    uid = str(_meta(o).get("uid") or "") or _key(o)
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
            else:
                self._budgets = {}
                keys = set()
                for o in listed:
                    self._apply_budget("ADDED", o)
                    keys.add(_key(o))
            for gone in [k for k in self._unreadable if k[0] == kind and k[1] not in keys]:
                del self._unreadable[gone]
            self.synced[kind] = True
            self._refresh()
            self._changed.notify_all()

    def _set_pod(self, uid: str, entry: PodEntry | None) -> None:
        old = self._pods.get(uid)
        assumed = self._assumed.get(uid)
        if entry is not None and assumed is not None:
            # The watch now shows the pod bound: the reservation has served its purpose.
            self._drop_assumed(uid)
        if old == entry:
            return
        if old is not None:
            self._pods.pop(uid, None)
            self._by_node.get(old.node, {}).pop(uid, None)
            self._touch(old.node)
        if entry is not None:
            self._pods[uid] = entry
            self._by_node.setdefault(entry.node, {})[uid] = entry
            self._touch(entry.node)

    def _set_nominated(self, uid: str, obj: Mapping[str, Any] | None) -> None:
        """Keep, move or drop the reservation of a pending pod nominated to a node."""
        old = self._nominated.get(uid)
        entry = None
        if obj is not None and uid not in self._assumed and uid not in self._pods:
            entry = read_nomination(obj)
            if entry is not None:
                entry = read_nomination(obj, self._proposed_gpu(uid, entry.node))
        if old is not None and old[0] == entry:
            return
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
        proposal = self._proposals.get(uid, {}).get(node)
        inventory = (self._nodes.get(node) or NodeEntry(None, "")).inventory
        if proposal is None or inventory is None:
            return None
        return next(((g.index, g.uuid) for g in inventory if g.index == proposal[0]), None)

    def _touch(self, node: str) -> None:
        self._clock += 1
        self._versions[node] = self._clock
        self._views.pop(node, None)
        self._dirty.add(node)
        self._log.append(node)
        if len(self._log) > _LOG_SIZE:
            # Callers further behind than this start over (changed_since answers None).
            drop = len(self._log) // 2
            del self._log[:drop]
            self._log_start += drop

    def _refresh(self) -> None:
        """Rebuild view, state id and pod shapes of every node changed since the last refresh."""
        if not self._dirty:
            return
        if len(self._states) > self._max_states:
            # Renumber: states no node is in any more are dropped with the old ids.
            self._states = {}
            self._sigs = {}
            self.generation += 1
            self._dirty.update(self._nodes)
        dirty, self._dirty = self._dirty, set()
        for name in dirty:
            old = self._shapes.pop(name, ())
            if old:
                self._mix.subtract(old)
            view = self.view(name)
            if view is None:
                self._sigs.pop(name, None)
                continue
            key = anonymous(view)
            state = self._states.get(key)
            if state is None:
                state = len(self._states)
                self._states[key] = state
            self._sigs[name] = (view.version, state)
            shapes = self._pod_shapes(name, view)
            if shapes:
                self._shapes[name] = shapes
                self._mix.update(shapes)
        self._mix = +self._mix  # drop shapes counted down to zero

    def _pod_shapes(self, name: str, view: NodeView) -> tuple[Shape, ...]:
        gpus = {g.index: g for g in view.gpus}
        shapes = []
        for entry in self._by_node.get(name, {}).values():
            placed = entry.placed
            a = placed.assignment
            shape = demand_shape(placed.request, gpus.get(a.gpu) if a else None, placed.cpu_milli)
            if shape is not None:
                shapes.append(shape)
        return tuple(shapes)

    # -- assumed pods (bound by us, not yet seen bound) --

    def assume(self, entry: PodEntry, *, expires: float) -> None:
        with self._lock:
            self._drop_assumed(entry.uid)
            self._set_nominated(entry.uid, None)  # bound now: the reservation has served
            assumed = self._assumed[entry.uid] = Assumed(entry, expires)
            self._assumed_on.setdefault(entry.node, {})[entry.uid] = assumed
            self._touch(entry.node)
            self._refresh()

    def forget(self, uid: str) -> None:
        with self._lock:
            if self._drop_assumed(uid):
                self._refresh()
                self._changed.notify_all()

    def _drop_assumed(self, uid: str) -> bool:
        assumed = self._assumed.pop(uid, None)
        if assumed is None:
            return False
        on_node = self._assumed_on[assumed.entry.node]
        del on_node[uid]
        if not on_node:
            del self._assumed_on[assumed.entry.node]
        self._touch(assumed.entry.node)
        return True

    def expire(self, now: float) -> int:
        """Drop assumed pods and preemption proposals whose TTL has passed; returns how many
        assumed pods went."""
        with self._lock:
            for uid, proposals in list(self._proposals.items()):
                for node in [n for n, (_, until, _v) in proposals.items() if until <= now]:
                    del proposals[node]
                if not proposals:
                    del self._proposals[uid]
            gone = [uid for uid, a in self._assumed.items() if a.expires <= now]
            for uid in gone:
                self.forget(uid)
            return len(gone)

    # -- preemption --

    def propose(
        self, uid: str, node: str, gpu: int, victims: Iterable[str], *, expires: float
    ) -> None:
        """The preempt verb freed GPU `gpu` of `node` for pod `uid` by evicting `victims`: if
        kube-scheduler nominates the pod there, its reservation goes on that GPU."""
        with self._lock:
            self._proposals.setdefault(uid, {})[node] = (gpu, expires, tuple(victims))
            held = self._nominated.get(uid)
            if held is not None and held[0].node == node:
                obj = held[1]
                self._set_nominated(uid, None)
                self._set_nominated(uid, obj)
                self._refresh()
                self._changed.notify_all()

    def evicted_for(self, uid: str, node: str) -> tuple[str, ...]:
        """The victims the preempt verb chose for pod `uid` on `node` (kube-scheduler evicts
        them once it nominates the pod there); the pod's own evaluation counts them gone even
        before the watch shows them deleted."""
        with self._lock:
            proposal = self._proposals.get(uid, {}).get(node)
            return proposal[2] if proposal is not None else ()

    def nomination(self, uid: str) -> PodEntry | None:
        """The reservation pod `uid` holds as a nominated pod, if any."""
        with self._lock:
            held = self._nominated.get(uid)
            return held[0] if held is not None else None

    def nominated_on(self, node: str) -> list[PodEntry]:
        with self._lock:
            return list(self._nominated_on.get(node, {}).values())

    def pods_on(self, node: str) -> list[PodEntry]:
        """The pods bound (or assumed) on `node` that the cache counts."""
        with self._lock:
            return self._bound(node)

    def budgets(self) -> list[Budget]:
        with self._lock:
            return [self._budgets[k] for k in sorted(self._budgets)]

    def view_excluding(self, name: str, uids: Iterable[str]) -> NodeView | None:
        """The node's view without the pods `uids` (bound, assumed or nominated): what it would
        be with them gone. Not kept; None for a node the cache has not seen."""
        skip = set(uids)
        with self._lock:
            if name not in self._nodes:
                return None
            entries = self._entries(name)
            if not any(e.uid in skip for e in entries):
                return self.view(name)  # none of them here: the kept view (a bind, mostly)
            return self._assemble(name, [e for e in entries if e.uid not in skip])

    # -- shared-GPU admission, one pod per node at a time --

    def serial_admission(self, node: str) -> bool:
        entry = self._nodes.get(node)
        return entry is not None and entry.serial_admission

    def awaiting(self, node: str) -> list[str]:
        """Pods on `node` (bound or assumed) that its device plugin has not fully served yet."""
        with self._lock:
            found = [e.key for e in self._by_node.get(node, {}).values() if e.awaiting]
            found += [
                a.entry.key for a in self._assumed_on.get(node, {}).values() if a.entry.awaiting
            ]
            return sorted(found)

    def wait_for_change(self, timeout: float) -> None:
        """Block until the next change or `timeout` seconds; call under `lock()`."""
        self._changed.wait(timeout)

    # -- reading --

    @contextmanager
    def lock(self) -> Iterator[None]:
        with self._lock:
            yield

    def view(self, name: str) -> NodeView | None:
        """The node's current view, None for a node the cache has not seen."""
        view = self._views.get(name)
        if view is not None:
            return view
        with self._lock:
            if name not in self._nodes:
                return None
            view = self._views[name] = self._assemble(name, self._entries(name))
            return view

    def _bound(self, name: str) -> list[PodEntry]:
        found = list(self._by_node.get(name, {}).values())
        found += [a.entry for a in self._assumed_on.get(name, {}).values()]
        return found

    def _entries(self, name: str) -> list[PodEntry]:
        """Everything the node's view counts: bound, assumed and nominated pods."""
        return [*self._bound(name), *self._nominated_on.get(name, {}).values()]

    def _assemble(self, name: str, entries: Iterable[PodEntry]) -> NodeView:
        entry = self._nodes[name]
        placed = [e.placed for e in entries]
        version = self._versions.get(name, 0)
        try:
            return assemble_node(
                name,
                entry.inventory,
                placed,
                cpu_milli=entry.cpu_milli,
                problem=entry.problem,
                version=version,
            )
        except Exception as error:  # noqa: BLE001 - this node fails with the reason, alone
            problem = f"cannot be evaluated: {_problem(error)}"
            return assemble_node(name, None, (), problem=problem, version=version)

    def signatures(self) -> Mapping[str, tuple[int, int]]:
        """Node name -> (version, state id), current for every known node; read under `lock()`.

        The tuple object is replaced whenever the node changes, so callers may compare it by
        identity.
        """
        return self._sigs

    @property
    def clock(self) -> int:
        """Counts node changes; read under `lock()`, with `changed_since`."""
        return self._clock

    def changed_since(self, clock: int) -> set[str] | None:
        """Nodes whose signature may differ from what it was at `clock`; None when the record
        no longer reaches back that far (everything may have changed). Read under `lock()`."""
        if clock < self._log_start:
            return None
        return set(self._log[clock - self._log_start :])

    def has_pod(self, uid: str) -> bool:
        with self._lock:
            return uid in self._pods or uid in self._assumed

    def node_names(self) -> list[str]:
        with self._lock:
            return sorted(self._nodes)

    @property
    def ready(self) -> bool:
        return all(self.synced.values()) and not self.failing()

    def watch_failed(self, kind: str, error: str) -> None:
        """The list or watch of `kind` failed (the watcher retries it)."""
        with self._lock:
            count = self._failures.get(kind, (0, ""))[0] + 1
            self._failures[kind] = (count, error[:500])

    def watch_ok(self, kind: str) -> None:
        """The watch of `kind` has been working (events applied, or a full watch period)."""
        with self._lock:
            self._failures.pop(kind, None)

    def failing(self) -> dict[str, tuple[int, str]]:
        """Kinds whose watch failed `WATCH_FAILING_AFTER` times or more in a row, with the last
        error: the cache may be stale, so the extender is not ready."""
        with self._lock:
            return {k: f for k, f in self._failures.items() if f[0] >= WATCH_FAILING_AFTER}

    def unreadable(self) -> list[Unreadable]:
        """Objects skipped (Pods) or kept with their problem (Nodes) because they could not be
        read, by kind and name."""
        with self._lock:
            return sorted(self._unreadable.values(), key=lambda u: (u.kind, u.name))

    def counts(self) -> dict[str, int]:
        with self._lock:
            return {
                "nodes": len(self._nodes),
                "pods": len(self._pods),
                "assumed": len(self._assumed),
                "nominated": len(self._nominated),
                "budgets": len(self._budgets),
            }

    def unreadable_counts(self) -> dict[str, int]:
        with self._lock:
            found = Counter(kind for kind, _ in self._unreadable)
            return {NODE: found[NODE], POD: found[POD], PDB: found[PDB]}

    def observed_mix(self) -> Counter[Shape]:
        """How many bound GPU pods have each (GPU count, milli per GPU, CPU): the policy's mix.

        Kept up to date incrementally; this returns a copy.
        """
        with self._lock:
            return Counter(self._mix)

    def observed_shapes(self) -> list[Shape]:
        """(GPU count, milli per GPU, CPU) of every bound GPU pod, for the policy's mix."""
        return list(self.observed_mix().elements())


def _key(obj: Mapping[str, Any]) -> str:
    meta = _meta(obj)
    return f"{meta.get('namespace') or 'default'}/{meta.get('name') or ''}"
