"""Dynamic MIG rounds: list pods, nodes and partitions, plan with the core, write plans, Events and status.

`DemandPlanner.run_round` is level-triggered like the partition pass (ADR 007): every round
lists what is there now, `gpupart.core.dynamic.live.plan_round` decides, and only nodes whose
plan changes are written, in parallel. What it keeps in memory (when an idle instance was first
seen idle, the Events already posted, the last plan's operations per node) only refines
messages and the hysteresis; a restarted operator converges from the annotations alone.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from gpupart import logs
from gpupart.core.api.events import object_event
from gpupart.core.api.pods import node_constraint, parse_pod_request, pod_key
from gpupart.core.api.selectors import NodeConstraint
from gpupart.core.api.spec import PartitionSpec
from gpupart.core.api.wire import (
    INVENTORY_ANNOTATION,
    MIG_PLAN_ANNOTATION,
    GpuState,
    MigPlan,
    decode_inventory,
    decode_mig_plan,
    encode_mig_plan,
)
from gpupart.core.cluster.partitioning import PRODUCT_LABEL, resolve
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
from gpupart_operator.metrics import Metrics
from gpupart_operator.model import (
    GROUP,
    PLURAL,
    VERSION,
    InventoryCache,
    merge_patch,
    read_node,
    read_partition,
)
from gpupart_operator.reconciler import MERGE_PATCH, Reconciler, drain
from gpupart_operator.settings import OperatorSettings

log = logging.getLogger("gpupart.operator")
T = TypeVar("T")

MIG_RESOURCE_PREFIX = "nvidia.com/mig-"
EVENT_REPEAT_S = 60.0
"""A pod hears the same kind of news (e.g. MigSliceUnavailable) at most this often."""
MAX_WAITING_SHOWN = 20
"""Pods a partition's status lists as waiting (it counts the rest)."""
_FINISHED = ("Succeeded", "Failed")


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
                if isinstance(block, Mapping) and any(
                    str(k).startswith(MIG_RESOURCE_PREFIX) for k in block
                ):
                    return True
    return False


def _unix(timestamp: object) -> float | None:
    if not isinstance(timestamp, str):
        return None
    try:
        return dt.datetime.fromisoformat(timestamp).timestamp()
    except ValueError:
        return None


def _pod_scheduled(status: Mapping[str, Any]) -> Mapping[str, Any]:
    """The pod's PodScheduled condition ({} when it has none yet)."""
    for condition in status.get("conditions") or []:
        if isinstance(condition, Mapping) and condition.get("type") == "PodScheduled":
            return condition
    return {}


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


def read_pods(items: list[Mapping[str, Any]]) -> PodFacts:
    """The round's view of the listed pods; a pod whose request does not parse is skipped (the
    extender and kube-scheduler tell its owner why), and never stops the others."""
    pending: list[PendingPod] = []
    unbound: dict[str, str] = {}
    holders: dict[str, Counter[str]] = {}
    holder_pods: dict[str, dict[str, list[str]]] = {}
    bound: dict[str, tuple[str, float, float | None]] = {}
    namespaces: dict[str, tuple[str, str]] = {}
    constraints: dict[str, NodeConstraint] = {}
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
            created = _unix(meta.get("creationTimestamp")) or 0.0
            node = spec.get("nodeName")
            if node:
                held = holders.setdefault(str(node), Counter())
                held.update(profiles)
                for profile in set(profiles):
                    holder_pods.setdefault(str(node), {}).setdefault(profile, []).append(key)
                bound[uid] = (key, created, _unix(_pod_scheduled(status).get("lastTransitionTime")))
                continue
            unbound[key] = uid
            scheduled = _pod_scheduled(status)
            if (scheduled.get("status"), scheduled.get("reason")) == ("False", "Unschedulable"):
                priority = spec.get("priority") or 0
                priority = priority if isinstance(priority, int) else 0
                constraints[key] = node_constraint(pod)
                pending.append(PendingPod(key, uid, profiles, priority, created))
        except Exception as error:  # noqa: BLE001 - one unreadable pod never stops the others
            log.debug("Skipped pod", extra=logs.kv(pod=_safe_key(pod), err=error))
    named = {
        node: {profile: tuple(sorted(pods)) for profile, pods in by_profile.items()}
        for node, by_profile in holder_pods.items()
    }
    return PodFacts(tuple(pending), unbound, holders, named, bound, namespaces, constraints)


def _safe_key(pod: object) -> str:
    try:
        return pod_key(pod)  # type: ignore[arg-type]
    except Exception:  # noqa: BLE001 - only for a log line
        return "?"


def unknown_gpus(partitions: list[Any], nodes: list[Any]) -> str:
    """Why some nodes of live dynamic MIG partitions get no slice (GPUs unknown), or ''."""
    resolution = resolve(
        [p.partition for p in partitions if p.partition is not None], [n.view for n in nodes]
    )
    return "; ".join(
        c.message
        for status in resolution.statuses.values()
        for c in status.conditions
        if c.type == "Ready" and c.reason == "GpusUnknown"
    )


def dynamic_gpus(partitions: list[Any], nodes: list[Any]) -> dict[str, tuple[DynamicGpu, ...]]:
    """Per node, the GPUs a partition with `spec.mig.dynamic` wins there (partition resolution)."""
    specs: dict[str, PartitionSpec] = {
        p.partition.spec.name: p.partition.spec for p in partitions if p.partition is not None
    }
    resolution = resolve(
        [p.partition for p in partitions if p.partition is not None], [n.view for n in nodes]
    )
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
            # Every GPU: the agent's inventory lists them (else the count label); with neither,
            # none, and the partition's status says so (GpusUnknown).
            indices = group.gpus if group.gpus is not None else node.view.gpu_indices or ()
            gpus.extend(DynamicGpu(i, model, spec.dynamic, group.partition) for i in indices)
        if gpus:
            found[node.name] = tuple(gpus)
    return found


class DemandPlanner:
    """Runs dynamic MIG rounds against the API server; one round at a time."""

    def __init__(
        self,
        reconciler: Reconciler,
        settings: OperatorSettings,
        metrics: Metrics,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.reconciler = reconciler
        self.core = reconciler.core
        self.custom = reconciler.custom
        self.settings = settings
        self.metrics = metrics
        self.clock = clock
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(settings.write_workers, thread_name_prefix="gpupart-plan")
        self._inventories = InventoryCache()
        self._idle_since: dict[tuple[str, int, MigInstance], float] = {}
        self._failed_at: dict[str, tuple[str, float]] = {}
        """node -> (id of its last failed plan, when that failure was first seen): the node is
        not planned again until `plan_retry_seconds` after, whatever plan it holds meanwhile
        (the back-off's own plan, which only ends reservations, is Applied at once)."""
        self._said: dict[str, tuple[str, str, float]] = {}
        """pod uid -> (reason, message, when) of the last Event posted about it."""
        self._reserved_for: set[str] = set()
        """uids of pods a plan reserved a slice for: their binding time is measured once."""
        self._answered: set[tuple[str, str]] = set()
        self._last: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {}
        """node -> (created, destroyed) of the last plan written there, for the status."""

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def run_round(self) -> Round | None:
        with self._lock:
            started = time.monotonic()
            try:
                return self._round()
            finally:
                self.metrics.demand_duration.observe(time.monotonic() - started)

    def _round(self) -> Round | None:
        now = self.clock()
        partitions = [read_partition(raw) for raw in self.reconciler.list_partitions()]
        raw_nodes = self.reconciler.list_all(self.core.list_node)
        nodes = [read_node(raw, self._inventories) for raw in raw_nodes]
        self._inventories.keep({n.name for n in nodes})
        by_name = {n.name: raw for n, raw in zip(nodes, raw_nodes, strict=True)}
        dynamic = dynamic_gpus(partitions, nodes)
        stale = [
            n.name
            for n in nodes
            if n.name not in dynamic
            and _annotation(by_name[n.name], MIG_PLAN_ANNOTATION) is not None
        ]
        for name in stale:  # a node no dynamic partition holds any more keeps no plan
            self._write_plan(name, None)
        live_dynamic = [
            p
            for p in partitions
            if p.partition is not None and not p.deleting and p.partition.spec.dynamic is not None
        ]
        if not live_dynamic:
            return None
        # A dynamic partition whose nodes' GPUs are unknown has nothing to plan on: its pending
        # pods still hear why, and what to do.
        unknown = unknown_gpus(partitions, nodes)
        pods = read_pods(self.reconciler.list_all(self.core.list_pod_for_all_namespaces))
        facts = [
            self._facts(node, by_name[node.name], gpus, pods, now)
            for node in nodes
            if (gpus := dynamic.get(node.name))
        ]
        self._forget(facts)
        labels = {n.name: n.view.labels for n in nodes if n.name in dynamic}
        result = plan_round(
            facts,
            pods.placed(labels),
            now=now,
            ttl_s=self.settings.reservation_ttl_seconds,
            unbound=pods.unbound,
            idle_since=self._idle_since,
        )
        written = {
            name
            for name, ok in zip(
                result.changes,
                self._pool.map(
                    lambda item: self._write_plan(item[0], item[1].plan), result.changes.items()
                ),
                strict=True,
            )
            if ok
        }
        for name in written:
            change = result.changes[name]
            self.metrics.plans.labels(result="written").inc()
            self.metrics.operations.labels(op="create").inc(len(change.created))
            self.metrics.operations.labels(op="destroy").inc(len(change.destroyed))
            if change.created or change.destroyed:  # not a plan that only ends reservations
                self._last[name] = (
                    tuple(f"{i} on GPU {g}" for g, i in change.created),
                    tuple(f"{i} on GPU {g}" for g, i in change.destroyed),
                )
            self._count_disruptions(name, change.plan, facts)
            log.info(
                "Wrote MIG plan",
                extra=logs.kv(
                    node=name,
                    plan=change.plan.id,
                    creates=len(change.created),
                    destroys=len(change.destroyed),
                    reservations=len(change.plan.reservations),
                ),
            )
        self.metrics.reservations_expired.inc(len(result.expired))
        if unknown:
            result = replace(
                result, unserved=tuple((pod, f"{why}; {unknown}") for pod, why in result.unserved)
            )
        self._events(result, written, pods)
        self._measure_bound(pods)
        self._write_statuses(partitions, facts, result, dynamic)
        return result

    # -- reading --

    def _facts(
        self,
        node: Any,
        raw: Mapping[str, Any],
        gpus: tuple[DynamicGpu, ...],
        pods: PodFacts,
        now: float,
    ) -> NodeFacts:
        inventory = _read(raw, INVENTORY_ANNOTATION, decode_inventory, node.name)
        # A plan that is not ours (edited by hand, another version) is replaced by the next one.
        plan = _read(raw, MIG_PLAN_ANNOTATION, decode_mig_plan, node.name)
        report = node.view.report.plan if node.view.report is not None else None
        if plan is not None and report is not None and report.id == plan.id:
            key = (node.name, plan.id)
            if key not in self._answered:
                self._answered.add(key)
                ok = report.state is GpuState.APPLIED
                self.metrics.plans.labels(result="applied" if ok else "failed").inc()
            failed = self._failed_at.get(node.name)
            if report.state is not GpuState.APPLIED and (failed is None or failed[0] != plan.id):
                self._failed_at[node.name] = (plan.id, now)
        failed = self._failed_at.get(node.name)
        hold = failed is not None and now - failed[1] < self.settings.plan_retry_seconds
        if inventory is not None:
            for gpu in inventory.gpus:
                for device in gpu.mig_devices:
                    spot = (node.name, gpu.index, device.instance)
                    if device.used:
                        self._idle_since.pop(spot, None)
                    else:
                        self._idle_since.setdefault(spot, now)
        return NodeFacts(
            node.name,
            gpus,
            inventory,
            plan,
            report,
            dict(pods.holders.get(node.name, Counter())),
            holder_pods=pods.holder_pods.get(node.name, {}),
            hold=hold,
        )

    def _forget(self, facts: list[NodeFacts]) -> None:
        """Drop what is kept about instances and plans that are no longer there."""
        devices = {
            (f.name, g.index, d.instance)
            for f in facts
            if f.inventory is not None
            for g in f.inventory.gpus
            for d in g.mig_devices
        }
        self._idle_since = {k: v for k, v in self._idle_since.items() if k in devices}
        plans = {(f.name, f.plan.id) for f in facts if f.plan is not None}
        self._answered &= plans
        names = {f.name for f in facts}
        self._failed_at = {k: v for k, v in self._failed_at.items() if k in names}

    # -- writing --

    def _write_plan(self, node: str, plan: MigPlan | None) -> bool:
        text = None if plan is None else encode_mig_plan(plan)
        patch = {"metadata": {"annotations": {MIG_PLAN_ANNOTATION: text}}}
        try:
            return bool(
                self.reconciler.contained(
                    "write MIG plan", node, self.reconciler.patch_node, node, patch
                )
            )
        except Exception as error:  # noqa: BLE001 - the API failing: this node waits a round
            log.warning("Failed to write MIG plan", extra=logs.kv(node=node, err=error))
            return False

    def _count_disruptions(self, node: str, plan: MigPlan, facts: list[NodeFacts]) -> None:
        """Instances used by a pod that the written plan's layout leaves out (must stay 0)."""
        seen = next((f for f in facts if f.name == node), None)
        if seen is None or seen.inventory is None:
            return
        for planned in plan.gpus:
            gpu = next((g for g in seen.inventory.gpus if g.index == planned.index), None)
            if gpu is None:
                continue
            lost = [d for d in gpu.mig_devices if d.used and d.instance not in planned.layout]
            if lost:
                self.metrics.disruptions.inc(len(lost))
                log.error(
                    "Planned to destroy a used instance",
                    extra=logs.kv(node=node, gpu=planned.index, count=len(lost)),
                )

    def _events(self, result: Round, written: set[str], pods: PodFacts) -> None:
        for planned in result.planned:
            if planned.node not in written:
                continue
            r = planned.reservation
            verb = "creating" if planned.created else "reserved the idle"
            self._pod_event(
                pods,
                r.pod,
                "Normal",
                "MigSlicePlanned",
                f"{verb} {r.instance.profile} on {planned.node} GPU {r.gpu} "
                f"(slot {r.instance.placement.start}) for this pod",
            )
            self._reserved_for.add(r.uid)
        for pod, why in result.unserved:
            self._pod_event(pods, pod, "Warning", "MigSliceUnavailable", why)
        for node, r, why in result.failed:
            self._pod_event(
                pods,
                r.pod,
                "Warning",
                "MigPlanFailed",
                f"{node} could not create {r.instance.profile} on GPU {r.gpu}: {why}",
            )
        for r in result.expired:
            self._pod_event(
                pods,
                r.pod,
                "Warning",
                "MigReservationExpired",
                f"the {r.instance.profile} reserved on GPU {r.gpu} waited "
                f"{self.settings.reservation_ttl_seconds:g} s for this pod to be bound; "
                "it is free again",
            )

    def _pod_event(self, pods: PodFacts, pod: str, kind: str, reason: str, message: str) -> None:
        namespace, uid = pods.namespaces.get(pod, ("", ""))
        if not namespace:
            return
        said = self._said.get(uid)
        # The same reason again only when its words changed and not more than every
        # EVENT_REPEAT_S (a planner's reason names how long instances have been idle).
        if (
            said is not None
            and said[0] == reason
            and (said[1] == message or self.clock() - said[2] < EVENT_REPEAT_S)
        ):
            return
        self._said[uid] = (reason, message, self.clock())
        involved = {
            "apiVersion": "v1",
            "kind": "Pod",
            "name": pod.split("/", 1)[1],
            "namespace": namespace,
            "uid": uid,
        }
        body = object_event(
            involved,
            reason=reason,
            message=message,
            kind=kind,
            namespace=namespace,
            now=self.reconciler.clock(),
            component="operator",
            instance=self.settings.instance,
        )
        self.reconciler.post_event(body)

    def _measure_bound(self, pods: PodFacts) -> None:
        for uid, (_, created, scheduled) in pods.bound.items():
            if uid in self._reserved_for and scheduled is not None:
                self._reserved_for.discard(uid)
                self.metrics.pending_to_bound.observe(max(0.0, scheduled - created))
        live = set(pods.bound) | set(pods.unbound.values())
        self._said = {uid: said for uid, said in self._said.items() if uid in live}
        self._reserved_for &= live

    def _write_statuses(
        self,
        partitions: list[Any],
        facts: list[NodeFacts],
        result: Round,
        dynamic: Mapping[str, tuple[DynamicGpu, ...]],
    ) -> None:
        """status.dynamicMig of each dynamic partition: per node its plan and what waits."""
        waiting = [{"pod": pod, "reason": why[:512]} for pod, why in result.unserved]
        for partition in partitions:
            if partition.partition is None or partition.partition.spec.dynamic is None:
                continue
            name = partition.name
            nodes: dict[str, Any] = {}
            for node in facts:
                if not any(g.partition == name for g in dynamic.get(node.name, ())):
                    continue
                change = result.changes.get(node.name)
                plan = change.plan if change is not None else node.plan
                created, destroyed = self._last.get(node.name, ((), ()))
                entry: dict[str, Any] = {
                    "plan": plan.id if plan is not None else "",
                    "state": (
                        "InFlight"
                        if change is not None or node.in_flight
                        else (node.report.state.value if node.report is not None else "")
                    ),
                    "message": (node.report.message[:512] if node.report is not None else ""),
                    "created": list(created)[:32],
                    "destroyed": list(destroyed)[:32],
                    "reserved": [
                        f"{r.pod}: {r.instance.profile} on GPU {r.gpu}"
                        for r in (plan.reservations if plan is not None else ())
                    ][:32],
                }
                nodes[node.name] = entry
            document = {
                "nodes": nodes,
                "waiting": waiting[:MAX_WAITING_SHOWN],
                "waitingCount": len(waiting),
            }
            old = partition.status.get("dynamicMig")
            old = old if isinstance(old, Mapping) else {}
            if old == document:
                continue
            self.reconciler.contained(
                "write dynamic MIG status", name, self._patch_status, name, old, document
            )

    def _patch_status(self, name: str, old: Mapping[str, Any], document: Mapping[str, Any]) -> int:
        # A merge patch from the old document: nodes that left are set to null, lists replaced.
        patch = {"status": {"dynamicMig": merge_patch(old, document)}}
        drain(
            self.custom.patch_cluster_custom_object_status(
                GROUP,
                VERSION,
                PLURAL,
                name,
                patch,
                _content_type=MERGE_PATCH,
                _preload_content=False,
            )
        )
        self.metrics.writes.labels(kind="status").inc()
        return 1


def _read(raw: Mapping[str, Any], key: str, decode: Callable[[str], T], node: str) -> T | None:
    """The annotation `key` decoded; None when absent or unreadable (logged: the node only)."""
    text = _annotation(raw, key)
    if text is None:
        return None
    try:
        return decode(text)
    except GpupartError as error:
        log.warning("Ignored annotation", extra=logs.kv(node=node, annotation=key, err=error))
        return None


def _annotation(raw: Mapping[str, Any], key: str) -> str | None:
    annotations = (raw.get("metadata") or {}).get("annotations") or {}
    value = annotations.get(key)
    return None if value is None else str(value)
