"""The operator's edge, pure: raw API objects into core values, and core results into the patches to send.

Nothing here does I/O. Given the objects as listed and the core's Resolution, these functions
say exactly which writes a pass needs; an empty answer is what makes a resync write nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpupart.core.api.events import object_event
from gpupart.core.api.spec import API_VERSION, KIND, Interface, parse_partition
from gpupart.core.api.wire import (
    DESIRED_ANNOTATION,
    INVENTORY_ANNOTATION,
    STATE_ANNOTATION,
    DesiredGroup,
    GpuState,
    NodeReport,
    decode_inventory,
    decode_report,
    encode_desired,
)
from gpupart.core.cluster.partitioning import (
    Condition,
    LabeledNode,
    Partition,
    PartitionStatus,
    Resolution,
    ServedGpus,
    merge_conditions,
    resolve,
)
from gpupart.core.errors import GpupartError

GROUP = "gpupart.io"
VERSION = "v1alpha1"
PLURAL = "gpupartitions"
FINALIZER = "gpupart.io/finalizer"
OWNED_STATUS_KEYS = (
    "observedGeneration",
    "selectedNodes",
    "readyNodes",
    "nodesReady",
    "nodes",
    "conditions",
    "interface",
)
"""Status fields the operator writes; anything else under status is not ours to compare."""

# (type, status) pairs that are bad news: their Events are Warnings.
MAX_MESSAGE = 2000
"""Characters of one refusal kept in a condition message (the CRD allows 32768)."""

_WARNING_STATES = {("Degraded", "True"), ("Conflict", "True")}
_WARNING_READY_REASONS = {
    "InvalidSpec",
    "InvalidForNode",
    "NoMatchingNodes",
    "Conflict",
    "GpusUnknown",
}
# A condition first seen in one of these states is not news; no Event for it.
_QUIET_STATES = {("Progressing", "False"), ("Degraded", "False"), ("Conflict", "False")}


@dataclass(frozen=True, slots=True)
class PartitionObject:
    """One GpuPartition as listed: the parsed partition, or why it does not parse."""

    name: str
    uid: str
    generation: int
    deleting: bool
    status: Mapping[str, Any]
    partition: Partition | None
    error: str = ""
    """The InvalidInput message when the spec does not parse; the partition then claims nothing."""


@dataclass(frozen=True, slots=True)
class NodeObject:
    """One Node as listed: the core's view of it, its current desired annotation, reachability."""

    view: LabeledNode
    desired: str | None
    reachable: bool
    report_error: str = ""
    """Why gpupart.io/state was ignored (malformed or unknown version), or ''."""
    inventory_error: str = ""
    """Why gpupart.io/inventory was ignored, or ''."""

    @property
    def name(self) -> str:
        return self.view.name


def read_partition(raw: Mapping[str, Any]) -> PartitionObject:
    """One listed GpuPartition; whatever it holds, the answer is a value (never an exception):
    a spec that does not parse, or breaks the parser, becomes `error` for InvalidSpec."""
    meta = raw.get("metadata")
    meta = meta if isinstance(meta, Mapping) else {}
    # Listed items of a custom resource carry apiVersion/kind; a watch body may not.
    document = {"apiVersion": API_VERSION, "kind": KIND, **raw}
    name = str(meta.get("name", ""))
    deleting = bool(meta.get("deletionTimestamp"))
    status = raw.get("status") or {}
    partition: Partition | None = None
    error = ""
    try:
        spec = parse_partition(document)
        partition = Partition(spec, str(meta.get("creationTimestamp", "")), deleting)
    except GpupartError as problem:
        error = str(problem)
    except Exception as problem:  # noqa: BLE001 - one unreadable partition never stops the others
        error = f"cannot be read ({type(problem).__name__}: {str(problem)[:300]})"
    generation = meta.get("generation")
    return PartitionObject(
        name=name,
        uid=str(meta.get("uid", "")),
        generation=generation if type(generation) is int and generation >= 0 else 0,
        deleting=deleting,
        status=status if isinstance(status, Mapping) else {},
        partition=partition,
        error=error[:MAX_MESSAGE],
    )


def read_node(raw: Mapping[str, Any], inventories: InventoryCache | None = None) -> NodeObject:
    """One listed Node; `inventories` spares decoding an inventory read before."""
    meta = raw.get("metadata") or {}
    labels = {str(k): str(v) for k, v in (meta.get("labels") or {}).items()}
    annotations = meta.get("annotations") or {}
    report: NodeReport | None = None
    report_error = ""
    state_text = annotations.get(STATE_ANNOTATION)
    if state_text is not None:
        try:
            report = decode_report(state_text)
        except GpupartError as error:
            report_error = str(error)
    name = str(meta.get("name", ""))
    listed, inventory_error = (
        listed_gpus(annotations) if inventories is None else inventories.listed(name, annotations)
    )
    desired = annotations.get(DESIRED_ANNOTATION)
    return NodeObject(
        view=LabeledNode(
            name,
            labels,
            report,
            None if listed is None else tuple(index for index, _ in listed),
            listed or (),
        ),
        desired=None if desired is None else str(desired),
        reachable=node_ready(raw),
        report_error=report_error,
        inventory_error=inventory_error,
    )


Listed = tuple[tuple[int, Interface | None], ...]
"""(GPU index, the interface that serves it now) for each GPU an inventory lists."""


def listed_gpus(annotations: Mapping[str, Any]) -> tuple[Listed | None, str]:
    """The GPUs the node agent's inventory lists (only that agent may write it) with the
    interface serving each, and why it cannot be read ('' when it can); None when there is none
    or it cannot be read."""
    text = annotations.get(INVENTORY_ANNOTATION)
    if text is None:
        return None, ""
    try:
        return tuple((g.index, g.interface) for g in decode_inventory(str(text)).gpus), ""
    except GpupartError as error:
        return None, str(error)


class InventoryCache:
    """`listed_gpus` per node, decoded again only when the node's inventory text changed.

    A full decode of an 8-GPU MIG inventory takes ~1.5 ms; Nodes change (heartbeats, status)
    far more often than their inventories, and every pass reads every Node. One per thread.
    """

    def __init__(self) -> None:
        self._seen: dict[str, tuple[str, Listed | None, str]] = {}

    def listed(self, node: str, annotations: Mapping[str, Any]) -> tuple[Listed | None, str]:
        text = annotations.get(INVENTORY_ANNOTATION)
        if text is None:
            self._seen.pop(node, None)
            return None, ""
        hit = self._seen.get(node)
        if hit is not None and hit[0] == text:
            return hit[1], hit[2]
        listed, error = listed_gpus(annotations)
        self._seen[node] = (str(text), listed, error)
        return listed, error

    def keep(self, nodes: set[str]) -> None:
        """Forget the nodes that are gone."""
        self._seen = {name: hit for name, hit in self._seen.items() if name in nodes}


def node_ready(raw: Mapping[str, Any]) -> bool:
    """The kubelet's Ready condition is True: the node (and its agent) can still act."""
    for condition in (raw.get("status") or {}).get("conditions") or []:
        if condition.get("type") == "Ready":
            return bool(condition.get("status") == "True")
    return False


def desired_patches(
    desired: Mapping[str, tuple[DesiredGroup, ...]], nodes: Sequence[NodeObject]
) -> dict[str, dict[str, Any]]:
    """Merge patches for the nodes whose gpupart.io/desired differs: set, change, or remove (null).

    A node in `desired` with no group gets the annotation without groups (whole GPUs)."""
    patches: dict[str, dict[str, Any]] = {}
    for node in nodes:
        groups = desired.get(node.name)
        text = None if groups is None else encode_desired(groups)
        if text != node.desired:
            patches[node.name] = {"metadata": {"annotations": {DESIRED_ANNOTATION: text}}}
    return patches


def status_document(
    status: PartitionStatus, old_conditions: Sequence[Mapping[str, str]], *, now: str
) -> dict[str, Any]:
    """The operator-owned part of .status for a resolved partition."""
    nodes: dict[str, dict[str, Any]] = {}
    for name, node in status.nodes:
        entry: dict[str, Any] = {"state": node.state.value, "message": node.message}
        if node.gpus is not None:
            entry["gpus"] = list(node.gpus)
        nodes[name] = entry
    ready = sum(1 for _, node in status.nodes if node.state is GpuState.APPLIED)
    return {
        "observedGeneration": status.observed_generation,
        "selectedNodes": len(nodes),
        "readyNodes": ready,
        "nodesReady": f"{ready}/{len(nodes)}",
        "nodes": nodes,
        "conditions": merge_conditions(old_conditions, status.conditions, now=now),
        "interface": served_document(status.served),
    }


def served_document(served: ServedGpus) -> dict[str, Any]:
    """status.interface: how the partition's GPUs are served now, and `served` for kubectl."""
    return {
        "dra": served.dra,
        "devicePlugin": served.device_plugin,
        "moving": served.moving,
        "unreported": served.unreported,
        "served": f"{served.served}/{served.held}",
    }


def invalid_status(generation: int, message: str) -> PartitionStatus:
    """Status of a partition whose spec does not parse: not ready, claiming nothing."""
    return PartitionStatus(
        generation,
        (),
        (
            Condition("Ready", "False", "InvalidSpec", message),
            Condition("Progressing", "False", "InvalidSpec", ""),
            Condition("Degraded", "True", "InvalidSpec", message),
            Condition("Conflict", "False", "NoConflict", ""),
        ),
    )


def merge_patch(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """The RFC 7386 merge patch that turns `old` into `new` (keys only in `old` become null)."""
    patch: dict[str, Any] = {}
    for key in old.keys() - new.keys():
        patch[key] = None
    for key, value in new.items():
        before = old.get(key)
        if isinstance(value, Mapping) and isinstance(before, Mapping):
            inner = merge_patch(before, value)
            if inner:
                patch[key] = inner
        elif key not in old or before != value:
            patch[key] = value
    return patch


def status_patch(old_status: Mapping[str, Any], document: Mapping[str, Any]) -> dict[str, Any]:
    """{"status": ...} merge patch for the operator-owned fields, or {} when nothing changed."""
    owned = {k: old_status[k] for k in OWNED_STATUS_KEYS if k in old_status}
    diff = merge_patch(owned, document)
    return {"status": diff} if diff else {}


def old_conditions(status: Mapping[str, Any]) -> list[Mapping[str, str]]:
    """The conditions as written before; anything that is not one of ours is left out."""
    conditions = status.get("conditions")
    if not isinstance(conditions, list):
        return []
    return [
        c
        for c in conditions
        if isinstance(c, Mapping) and isinstance(c.get("lastTransitionTime"), str) and "type" in c
    ]


def condition_events(old: Sequence[Mapping[str, str]], new: Sequence[Condition]) -> list[Condition]:
    """Conditions worth an Event: status or reason changed; a first quiet state is no news."""
    before = {c.get("type"): c for c in old}
    changed = []
    for condition in new:
        previous = before.get(condition.type)
        if previous is None:
            if (condition.type, condition.status) not in _QUIET_STATES:
                changed.append(condition)
        elif (previous.get("status"), previous.get("reason")) != (
            condition.status,
            condition.reason,
        ):
            changed.append(condition)
    return changed


def event_type(condition: Condition) -> str:
    bad = (condition.type, condition.status) in _WARNING_STATES or (
        condition.type == "Ready"
        and condition.status == "False"
        and condition.reason in _WARNING_READY_REASONS
    )
    return "Warning" if bad else "Normal"


def event_manifest(
    partition: PartitionObject, condition: Condition, *, namespace: str, now: str, instance: str
) -> dict[str, Any]:
    """A core/v1 Event about `partition` for a condition that changed."""
    message = f"{condition.type}={condition.status}"
    if condition.message:
        message += f": {condition.message}"
    return partition_event(
        partition.name,
        partition.uid,
        reason=condition.reason,
        message=message,
        kind=event_type(condition),
        namespace=namespace,
        now=now,
        instance=instance,
    )


def partition_event(
    name: str,
    uid: str,
    *,
    reason: str,
    message: str,
    kind: str,
    namespace: str,
    now: str,
    instance: str,
) -> dict[str, Any]:
    """A core/v1 Event of `kind` (Normal or Warning) about the GpuPartition `name`."""
    involved = {"apiVersion": API_VERSION, "kind": KIND, "name": name, "uid": uid}
    return object_event(
        involved, reason=reason, message=message, kind=kind, namespace=namespace, now=now,
        component="operator", instance=instance,
    )  # fmt: skip


@dataclass(frozen=True, slots=True)
class Contained:
    """A resolution with the partitions that broke the core set apart (one bug costs only its own)."""

    resolution: Resolution
    broken: Mapping[str, str] = field(default_factory=dict)
    """name -> why it cannot be evaluated, for its InvalidSpec status."""
    error: Exception | None = None
    """What resolving all together raised (for the log's traceback), or None."""


def resolve_each(partitions: Sequence[Partition], nodes: Sequence[LabeledNode]) -> Contained:
    """`resolve`, with any partition that makes it fail set apart: name -> why, for InvalidSpec.

    The core raises nothing for a parsed partition; this is the net under a bug in it, so one
    partition's bug never stops the others (each is tried alone only after a failure).
    """
    try:
        return Contained(resolve(list(partitions), list(nodes)))
    except Exception as error:  # noqa: BLE001 - find the partition that breaks it, below
        failure = error
    broken: dict[str, str] = {}
    for partition in partitions:
        try:
            resolve([partition], list(nodes))
        except Exception as error:  # noqa: BLE001 - this one is set apart
            broken[partition.spec.name] = (
                f"cannot be evaluated ({type(error).__name__}: {str(error)[:300]})"
            )
    kept = [p for p in partitions if p.spec.name not in broken]
    return Contained(resolve(kept, list(nodes)), broken, failure)


class Resolutions:
    """`resolve_each` of the last partitions and nodes, kept while they read the same.

    The partition pass and the dynamic MIG round list the same change and resolve it once: the
    second to ask gets the first's answer (the core is pure, so equal inputs give it). Safe to
    share between their worker threads.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: (
            tuple[tuple[tuple[Partition, ...], tuple[LabeledNode, ...]], Contained] | None
        ) = None

    def resolve(self, partitions: Sequence[Partition], nodes: Sequence[LabeledNode]) -> Contained:
        key = (tuple(partitions), tuple(nodes))
        with self._lock:
            last = self._last
        if last is not None and last[0] == key:
            return last[1]
        contained = resolve_each(key[0], key[1])
        with self._lock:
            self._last = (key, contained)
        return contained
