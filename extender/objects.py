"""Reading Nodes, Pods, Namespaces and reservations into the entries the cluster state keeps.

Pure functions over API objects (raw JSON mappings): no I/O, no state (the assignment keys
come in as a function). An object that cannot be read is never fatal: a Node is kept with the
problem as its reason (`NodeEntry.unreadable`), a Pod raises `UnreadablePod` for the caller to
skip and report.

A pod's annotations are its tenant's to write, so a `gpupart.io/assignment` counts only when
it verifies (`provenance.forgery`: signed by the extender for this pod's UID and the node it is
bound to). One that does not is ignored, never trusted for its GPU or amounts: the pod then
counts as what kube-scheduler counted it as, a shared-GPU pod on its node with the amounts of
its own spec, on no GPU in particular (`NodeView.unplaced_tenants`: its memory is taken from the
node's total room). A forged or copied assignment so neither takes room on the GPU it names nor
frees room on the one the pod was given (`read_pod`'s `kept`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from gpupart.core.api.pods import parse_pod_request, pod_cpu_milli, shared_containers
from gpupart.core.api.provenance import AssignmentKeys, Signer, forgery
from gpupart.core.api.resources import node_cpu_milli
from gpupart.core.api.selectors import check_label_key, check_label_value, string_map
from gpupart.core.api.spec import Interface
from gpupart.core.api.wire import (
    ASSIGNMENT_ANNOTATION,
    DESIRED_ANNOTATION,
    INVENTORY_ANNOTATION,
    MIG_PLAN_ANNOTATION,
    InventoryGpu,
    MigReservation,
    PodAssignment,
    allocation_record,
    decode_allocation,
    decode_assignment,
    decode_desired,
    decode_inventory,
    decode_mig_plan,
)
from gpupart.core.errors import GpupartError, InvalidInput
from gpupart.core.node.admission import admission_complete
from gpupart.core.scheduling.demand import tenant_of
from gpupart.core.scheduling.views import PlacedPod

NODE = "Node"
"""The kinds the watch feeds (names as in the API)."""
POD = "Pod"
PDB = "PodDisruptionBudget"
NAMESPACE = "Namespace"
RESOURCE_SLICE = "ResourceSlice"
RESOURCE_CLAIM = "ResourceClaim"
DEVICE_CLASS = "DeviceClass"
DRA_KINDS = (RESOURCE_SLICE, RESOURCE_CLAIM, DEVICE_CLASS)
"""`resource.k8s.io/v1`, read only: the words for pods waiting on DRA claims."""
_DONE_PHASES = ("Succeeded", "Failed")

KeySource = Callable[[], AssignmentKeys]
"""The public keys that verify assignments (`gpupart.keyfile.KeyFile.keys`, the extender's
private key file); raises InvalidInput when they cannot be read."""
SignerSource = Callable[[], Signer]
"""The extender's private key that signs assignments (the same `KeyFile.keys`)."""
NO_KEY = "no assignment key is configured (setting assignment_key_file)"


@dataclass(frozen=True, slots=True)
class NodeEntry:
    inventory: tuple[InventoryGpu, ...] | None
    problem: str
    cpu_milli: int | None = None
    """Allocatable CPU (millicores); None when the Node does not say."""
    source: tuple[object, ...] = field(default=(None, None, None, None, None), compare=False)
    """The inventory annotation's text, the allocatable CPU value, the MIG plan's text, the
    desired annotation's text and the labels it was read from."""
    serial_admission: bool = False
    """The node's device plugin serves one shared-GPU pod at a time (`Inventory`)."""
    unreadable: bool = False
    """The Node or its inventory could not be read (`problem` says why)."""
    reservations: tuple[MigReservation, ...] = ()
    """The MIG reservations of the node's MIG plan (`gpupart.io/mig-plan`), expired or not."""
    plan_problem: str = ""
    """Why the MIG plan could not be read: the node then takes no MIG pod (others it may)."""
    dynamic: tuple[tuple[int, str], ...] = ()
    """(GPU index, GpuPartition) of each GPU a partition with dynamic MIG selects, from the
    operator's `gpupart.io/desired`: only the words of a pending MIG pod's reason use it
    (docs/adr-019-pending-reasons.md); an unreadable annotation gives none."""
    labels: tuple[tuple[str, str], ...] = ()
    """The Node's labels, sorted: a pending pod's reason leaves out the nodes its node selector
    and required node affinity rule out, as kube-scheduler's NodeAffinity filter does."""


@dataclass(frozen=True, slots=True)
class PodEntry:
    uid: str
    key: str
    node: str
    placed: PlacedPod
    awaiting: bool = False
    """A live shared-GPU pod with an assignment whose containers the device plugin has not all
    served yet (no complete allocation record, `gpupart.io/SharedGpuAllocated`)."""
    distrusted: str = ""
    """Why the pod's `gpupart.io/assignment` annotation is not counted ("" when it is, or when
    there is none): forged, copied, edited, or no key to check it with."""
    unchecked: tuple[PodAssignment, bool] | None = None
    """The assignment that could not be checked for want of a readable key, and whether the
    pod would await admission with it: checked again once the key can be read."""


@dataclass(frozen=True, slots=True)
class Unreadable:
    """An object the cache could not read, at the resourceVersion it was seen."""

    kind: str
    name: str
    version: str
    problem: str


class UnreadablePod(Exception):
    """A bound pod whose GPU request, CPU request or assignment cannot be read."""


def read_node(node: Mapping[str, Any], previous: NodeEntry | None = None) -> NodeEntry:
    """Inventory from a Node object's annotation (or the problem that keeps it from being read),
    and its allocatable CPU; `previous` itself when both texts are the ones it was read from.
    Never raises: a node that cannot be read is kept with the reason (`unreadable`)."""
    try:
        return _read_node(node, previous)
    except Exception as error:  # noqa: BLE001 - the node keeps its name and says why
        return NodeEntry(None, f"Node unreadable: {problem_of(error)}", unreadable=True)


def _read_node(node: Mapping[str, Any], previous: NodeEntry | None) -> NodeEntry:
    annotations = meta_of(node).get("annotations") or {}
    text = annotations.get(INVENTORY_ANNOTATION)
    status = node.get("status")
    allocatable = status.get("allocatable") if isinstance(status, Mapping) else None
    plan = annotations.get(MIG_PLAN_ANNOTATION)
    cpu_text = allocatable.get("cpu") if isinstance(allocatable, Mapping) else None
    desired = annotations.get(DESIRED_ANNOTATION)
    raw_labels = meta_of(node).get("labels")
    source = (text, cpu_text, plan, desired, raw_labels)
    if previous is not None and previous.source == source:
        # A status heartbeat (every node, every few seconds): decoding the inventory again
        # cost ~0.1 ms a node, a steady load on large clusters for nothing.
        return previous
    labels = (
        tuple(sorted((str(k), str(v)) for k, v in raw_labels.items()))
        if isinstance(raw_labels, Mapping)
        else ()
    )
    cpu = node_cpu_milli(node)
    reservations, plan_problem = read_reservations(plan)
    if text is None:
        return NodeEntry(
            None,
            f"no GPU inventory (annotation {INVENTORY_ANNOTATION} not written by the node agent)",
            cpu,
            source,
            reservations=reservations,
            plan_problem=plan_problem,
            labels=labels,
        )
    try:
        inventory = decode_inventory(text)
        # Only the device plugin's GPUs are the extender's to filter, score, assign and preempt
        # for: a GPU served through DRA (or moving between the two) is the scheduler's own.
        gpus = tuple(g for g in inventory.gpus if g.interface is Interface.DEVICE_PLUGIN)
        return NodeEntry(
            gpus,
            "",
            cpu,
            source,
            inventory.serial_admission,
            reservations=reservations,
            plan_problem=plan_problem,
            dynamic=read_dynamic(desired, gpus),
            labels=labels,
        )
    except Exception as error:  # noqa: BLE001 - the node keeps its name and says why
        problem = f"GPU inventory unreadable: {problem_of(error)}"
        return NodeEntry(
            None, problem, cpu, source, unreadable=True, plan_problem=plan_problem, labels=labels
        )


def read_reservations(text: object) -> tuple[tuple[MigReservation, ...], str]:
    """The MIG reservations of a MIG plan annotation (none without one), or why it cannot be
    read. Never raises: a bad plan costs its node its MIG pods, and nothing else."""
    if text is None:
        return (), ""
    try:
        if not isinstance(text, str):
            raise InvalidInput(MIG_PLAN_ANNOTATION, "must be a string")
        reservations = decode_mig_plan(text).reservations
        seen: dict[tuple[int, object], str] = {}
        for n, r in enumerate(reservations):
            where = (r.gpu, r.instance)
            if where in seen:
                raise InvalidInput(
                    f"{MIG_PLAN_ANNOTATION}.reservations[{n}]",
                    f"reserves GPU {r.gpu}'s {r.instance.profile} at "
                    f"{r.instance.placement.start}+{r.instance.placement.size} for {r.pod}, "
                    f"already reserved for {seen[where]}",
                )
            seen[where] = r.pod
        return reservations, ""
    except Exception as error:  # noqa: BLE001 - this node's plan's problem only
        return (), f"MIG plan unreadable: {problem_of(error)}"


def read_dynamic(text: object, inventory: tuple[InventoryGpu, ...]) -> tuple[tuple[int, str], ...]:
    """(GPU index, GpuPartition) of the inventory's GPUs that a dynamic-MIG group of the
    desired annotation selects. Never raises: a bad annotation only costs a reason its words
    (the node agent, which acts on it, reports its problem)."""
    if not isinstance(text, str):
        return ()
    try:
        groups = decode_desired(text)
    except Exception:  # noqa: BLE001 - words only; the node agent reports the annotation
        return ()
    found: dict[int, str] = {}
    indices = [g.index for g in inventory]
    for group in groups:
        if not group.config.dynamic:
            continue
        for index in indices if group.gpus is None else group.gpus:
            if index in indices:
                found.setdefault(index, group.partition)
    return tuple(sorted(found.items()))


def read_namespace_labels(namespace: Mapping[str, Any]) -> Mapping[str, str]:
    """A Namespace's labels, for the namespaceSelectors of pods' anti-affinity terms; InvalidInput
    when they are not labels as the API server admits them (then the namespace is selected by
    no selector's labels, as if kube-scheduler's lister did not have it)."""
    labels = string_map(meta_of(namespace).get("labels"), "Namespace.metadata.labels")
    for key, value in labels.items():
        check_label_key(key, where="Namespace.metadata.labels")
        check_label_value(value, f"Namespace.metadata.labels.{key[:64]}")
    return labels


def problem_of(error: BaseException) -> str:
    """Why an object could not be read, in one bounded line (a bug names its exception)."""
    text = str(error) if isinstance(error, GpupartError) else f"{type(error).__name__}: {error}"
    return text[:500]


def meta_of(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    meta = obj.get("metadata")
    return meta if isinstance(meta, Mapping) else {}


def read_pod(
    pod: Mapping[str, Any], keys: KeySource | None = None, *, kept: PodAssignment | None = None
) -> PodEntry | None:
    """The GPU capacity and CPU a bound, live pod holds; None for pods that hold neither.

    Its assignment counts only when it verifies with `keys` (None: no key, none does). `kept`:
    the verified assignment the pod was counted with so far; an annotation that no longer
    verifies (a tenant edited or removed it) leaves it in place: the extender never rewrites
    an assignment after bind, so a change to one is never its own.

    Raises UnreadablePod when what it holds cannot be read: the cache skips it and says so,
    rather than count it as holding nothing (or fail the watch).
    """
    try:
        return _read_pod(pod, keys, kept)
    except Exception as error:  # noqa: BLE001 - whatever breaks, it is this pod's problem
        raise UnreadablePod(problem_of(error)) from None


def _read_pod(
    pod: Mapping[str, Any], keys: KeySource | None, kept: PodAssignment | None
) -> PodEntry | None:
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
    # A CPU-only pod is no GPU tenant of the view; its labels and priority are kept for the
    # preempt verb (kube-scheduler may name it as a victim, and PDBs may cover it).
    tenant = tenant_of(pod, request)
    uid = str(meta.get("uid") or tenant.pod)
    assignment = None
    distrusted = ""
    unchecked = None
    text = annotations.get(ASSIGNMENT_ANNOTATION)
    if text is not None:
        try:
            claimed = decode_assignment(text)
        except GpupartError as error:
            distrusted = f"unreadable ({problem_of(error)})"
        else:
            distrusted, retry = check_assignment(claimed, keys, pod_uid=uid, node=str(node))
            if not distrusted:
                assignment = claimed
            elif retry:
                unchecked = claimed
    if assignment is None and kept is not None and kept.node == node:
        assignment = kept
    could_await = (
        bool(request.shared)
        and meta.get("deletionTimestamp") is None
        and not _served(pod, allocation_record(pod))
    )
    return PodEntry(
        uid,
        tenant.pod,
        str(node),
        # Without a verified assignment: unplaced, it still counts against the node, on no
        # GPU in particular, with its own spec's amounts.
        PlacedPod(tenant, request, assignment, cpu),
        could_await and assignment is not None,
        distrusted,
        None if unchecked is None else (unchecked, could_await),
    )


def check_assignment(
    claimed: PodAssignment, keys: KeySource | None, *, pod_uid: str, node: str
) -> tuple[str, bool]:
    """Why `claimed` is not the extender's assignment for pod `pod_uid` on `node` ("" if it
    is), and whether that may change once a key can be read (no key, or an unreadable one)."""
    if keys is None:
        return NO_KEY, True
    try:
        found = keys()
    except InvalidInput as error:
        return str(error), True
    return forgery(claimed, found, pod_uid=pod_uid, node=node), False


def verified_entry(entry: PodEntry, keys: KeySource) -> PodEntry | None:
    """`entry` with its unchecked assignment counted, once `keys` verify it (None: still not
    checkable, or checked and not genuine: `distrusted` then says why)."""
    if entry.unchecked is None:
        return None
    claimed, could_await = entry.unchecked
    reason, retry = check_assignment(claimed, keys, pod_uid=entry.uid, node=entry.node)
    if retry:
        return None
    if reason:
        return replace(entry, distrusted=reason, unchecked=None)
    placed = replace(entry.placed, assignment=claimed)
    return replace(entry, placed=placed, awaiting=could_await, distrusted="", unchecked=None)


def placed_by_uuid(
    inventory: tuple[InventoryGpu, ...] | None, entries: Iterable[PodEntry]
) -> tuple[list[PlacedPod], list[tuple[PodEntry, str]]]:
    """The pods as the node's view counts them: each assignment on the GPU its UUID names in
    the node's inventory (the node agent serves by UUID; an index may name another GPU after a
    change of hardware), and the pods whose GPU the inventory does not have (counted on no GPU
    in particular), with the reason."""
    by_uuid = {g.uuid: g.index for g in inventory or ()}
    placed: list[PlacedPod] = []
    lost: list[tuple[PodEntry, str]] = []
    for e in entries:
        p = e.placed
        a = p.assignment
        if a is not None and inventory is not None:
            index = by_uuid.get(a.gpu_uuid)
            if index is None:
                lost.append((e, f"its assignment names GPU {a.gpu_uuid}, not in the inventory"))
                p = replace(p, assignment=None)
            elif index != a.gpu:
                p = replace(p, assignment=replace(a, gpu=index))
        placed.append(p)
    return placed, lost


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


def key_of(obj: Mapping[str, Any]) -> str:
    """`namespace/name` of an object (namespace `default` when it has none)."""
    meta = meta_of(obj)
    return f"{meta.get('namespace') or 'default'}/{meta.get('name') or ''}"


def uid_of(obj: Mapping[str, Any]) -> str:
    """The object's uid, or `namespace/name` when it has none (tests, hand-written pods)."""
    return str(meta_of(obj).get("uid") or "") or key_of(obj)
