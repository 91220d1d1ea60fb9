"""Shared-GPU admission: which pod and container a shared-slot Allocate is for, exactly or not at all.

The kubelet's Allocate names no pod: only device ids and their count. gpupart makes the pairing
exact by construction (docs/adr-001-shared-gpu-admission.md): the extender binds at most one
shared-GPU pod per node that the device plugin has not fully served, so at any time at most one
pod on a node awaits shared slots, and the kubelet calls Allocate once per container of that pod
in its own order (init containers, then app containers).

Nothing a tenant can write decides an answer (docs/adr-015-tenant-proof-admission.md): a pod is
paired only if its `gpupart.io/assignment` verifies as the extender's, made for that pod's UID
and the node it is bound to; what each container got comes from the agent's own records (its
checkpoint), never from the pod's allocation record (its `gpupart.io/SharedGpuAllocated`
condition), which the agent writes for the extender's gate only; the GPU is the one the
kubelet's slots belong to, and it must be the assigned one; and the GPU must have room for
the pod's verified amounts next to every pod the agent already served there. Anything else
is refused with a message naming the pods.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpupart.core.api.pods import (
    TERMINAL_PHASES,
    SharedContainer,
    mentions_shared,
    pod_annotations,
    pod_deleting,
    pod_node_name,
    pod_phase,
    pod_uid,
    shared_containers,
)
from gpupart.core.api.provenance import AssignmentKeys, forgery
from gpupart.core.api.records import Record
from gpupart.core.api.wire import (
    ASSIGNMENT_ANNOTATION,
    WIRE_VERSION,
    GivenContainer,
    PodAssignment,
    decode_assignment,
    given_fields,
    read_given,
)
from gpupart.core.errors import GpupartError, InvalidInput
from gpupart.core.node.devices import Device, OfferedGpu

MAX_RECORDS = 4096
"""Pods one checkpoint holds at most: more than any node's shared slots (64 GPUs x 48 clients)."""


class AdmissionRefused(InvalidInput):
    """A shared Allocate gpupart will not serve; `pods` (namespace/name) are the pods it concerns."""

    def __init__(self, problem: str, pods: Iterable[str] = ()) -> None:
        super().__init__("Allocate", problem)
        self.pods = tuple(pods)


@dataclass(frozen=True, slots=True)
class SharedPod:
    """A pod bound to this node that asks for shared-GPU slots, as the API server lists it.

    Only `uid`, `node` (spec.nodeName, set by the Binding) and the phase are the API server's;
    the assignment is trusted only when `problem` is empty (it verified, `read_shared_pod`).
    """

    uid: str
    namespace: str
    name: str
    node: str
    assignment: PodAssignment
    containers: tuple[SharedContainer, ...]
    """Its containers that ask for slots, in the kubelet's Allocate order."""
    phase: str = "Pending"
    deleting: bool = False
    """The pod has a deletion timestamp (the kubelet admits it no more)."""
    problem: str = ""
    """Why its assignment is not served ("" when it verified): it is never paired."""

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def live(self) -> bool:
        return self.phase not in TERMINAL_PHASES and not self.deleting


@dataclass(frozen=True, slots=True)
class AdmissionRecord:
    """What this node agent gave one pod's shared containers: its own record, kept in its checkpoint.

    The amounts are the pod's verified assignment (what the extender counted on the GPU), so
    the per-GPU room check counts exactly what the extender does.
    """

    uid: str
    pod: str
    """namespace/name, for messages."""
    gpu_uuid: str
    memory_mib: int
    compute_percent: int
    given: tuple[GivenContainer, ...] = ()


@dataclass(frozen=True, slots=True)
class SharedAdmission:
    """The answer to one shared Allocate: the container it is for, or the record to repeat."""

    pod: SharedPod
    container: SharedContainer | None
    """The next container of the one awaiting pod; None when `repeat` answers."""
    repeat: GivenContainer | None = None
    """The kubelet asks again for devices it gave a container already: the same answer."""


def admission_complete(
    containers: Iterable[SharedContainer], given: Iterable[GivenContainer]
) -> bool:
    served = {g.name for g in given}
    return all(c.name in served for c in containers)


def read_shared_pod(raw: Mapping[str, Any], keys: AssignmentKeys | str) -> SharedPod | None:
    """The pod (the API's plain dict form) as the allocator sees it; None when it asks for no slot.

    Every such pod counts, with or without an assignment: the kubelet's Allocate names no pod,
    so any pod that may be the one being admitted must be known. An assignment that is missing
    or does not parse or verify (forged, copied from another pod, edited, made for another
    node, or no key to check it with) is kept as the pod's `problem`: such a pod is never
    served, and the refusal can name it. `keys` is a text when the agent has no key: why not.
    InvalidInput when the pod itself is unreadable.
    """
    meta = raw.get("metadata")
    if not isinstance(meta, Mapping):
        raise InvalidInput("pod.metadata", "must be a mapping")
    annotations = pod_annotations(raw, where="pod")
    spec = raw.get("spec")
    if not isinstance(spec, Mapping):
        raise InvalidInput("pod.spec", "must be a mapping")
    uid, node = pod_uid(raw), pod_node_name(raw)
    assignment, problem = PodAssignment("", 0, ""), ""
    try:
        containers = shared_containers(raw)
    except InvalidInput as error:
        if not mentions_shared(spec):
            raise
        # It may be the pod the kubelet is admitting: a candidate that is never served.
        containers, problem = (SharedContainer("", 0),), f"its spec is unreadable: {error}"
    if not containers:
        return None
    if not problem:
        assignment, problem = _verified(annotations.get(ASSIGNMENT_ANNOTATION), keys, uid, node)
    return SharedPod(
        uid=uid,
        namespace=str(meta.get("namespace") or ""),
        name=str(meta.get("name") or ""),
        node=node,
        assignment=assignment,
        containers=containers,
        phase=pod_phase(raw),
        deleting=pod_deleting(raw),
        problem=problem,
    )


def _verified(
    text: object, keys: AssignmentKeys | str, uid: str, node: str
) -> tuple[PodAssignment, str]:
    """The assignment and "" when it is the extender's for this pod and node, else why not."""
    if text is None:
        return PodAssignment("", 0, ""), (
            f"it has no {ASSIGNMENT_ANNOTATION} (it was not bound by gpupart's scheduler extender)"
        )
    try:
        assignment = decode_assignment(str(text))
    except GpupartError as error:
        return PodAssignment("", 0, ""), f"its {ASSIGNMENT_ANNOTATION} is unreadable: {error}"
    if isinstance(keys, str):
        return assignment, f"the node agent cannot verify its {ASSIGNMENT_ANNOTATION}: {keys}"
    problem = forgery(assignment, keys, pod_uid=uid, node=node)
    if problem:
        return assignment, f"its {ASSIGNMENT_ANNOTATION} is not the extender's: {problem}"
    return assignment, ""


def slot_gpu(devices: Sequence[Device]) -> OfferedGpu:
    """The one shared GPU the kubelet's slots belong to; refused when they span GPUs or none is shared."""
    gpus = {d.gpu.uuid: d.gpu for d in devices}
    if len(gpus) != 1:
        raise AdmissionRefused(
            f"the kubelet allocated slots of {len(gpus)} GPUs ({', '.join(sorted(gpus))}) to one "
            "container; a container's shared slots are on one GPU"
        )
    gpu = next(iter(gpus.values()))
    if not gpu.mode.is_shared:
        raise AdmissionRefused(f"GPU {gpu.uuid} is not a shared GPU on this node now")
    return gpu


def admit_shared(
    pods: Iterable[SharedPod],
    records: Mapping[str, AdmissionRecord],
    *,
    node: str,
    ids: Sequence[str],
    gpu: OfferedGpu,
) -> SharedAdmission:
    """Which container a shared Allocate of `ids` (slots of `gpu`) is for; AdmissionRefused says why not.

    A repeat first: the devices are exactly those the agent's own record says a container of a
    live, fully served pod got (the kubelet asks again when it lost its own state), answered as before.
    Otherwise the one live pod bound to `node` that asks for slots and is not fully served,
    counting pods whose assignment did not verify (any of them may be the pod being admitted):
    it must have verified, and it gets its next container, whose slot count must be the number
    of ids, on the GPU it was assigned, with room there for the pod's amounts. No such pod, or
    more than one, is refused rather than guessed.
    """
    listed = [p for p in pods if p.node == node and p.phase not in TERMINAL_PHASES]
    here = [p for p in listed if p.live]
    wanted = frozenset(ids)
    repeats = sorted(
        (
            (pod.uid, given)
            for pod in here
            if pod.uid in records and _complete(pod, records)
            for given in records[pod.uid].given
            if frozenset(given.devices) == wanted
        ),
        key=lambda repeat: (repeat[0], repeat[1].name),
    )
    if repeats:
        answers = {(g.gpu_uuid, g.memory_mib, g.compute_percent) for _, g in repeats}
        if len(answers) > 1:
            raise AdmissionRefused(
                f"devices {sorted(wanted)} were given to several containers before"
            )
        uid, given = repeats[0]
        return SharedAdmission(next(p for p in here if p.uid == uid), None, given)
    awaiting = sorted(
        (p for p in here if not _complete(p, records)),
        key=lambda p: (bool(p.problem), p.key),
    )
    if not awaiting:
        raise AdmissionRefused(
            f"no pod bound to node {node} awaits shared GPU slots (every one was served); "
            "is the gpupart scheduler extender configured?"
        )
    if len(awaiting) > 1:
        named = "; ".join(p.key + (f" ({p.problem})" if p.problem else "") for p in awaiting[:4])
        raise AdmissionRefused(
            f"{len(awaiting)} pods on node {node} await shared GPU slots at once: {named}. "
            "The kubelet names no pod, so gpupart refuses to guess; only one shared-GPU pod per "
            "node may await admission, bound by gpupart's scheduler extender",
            (p.key for p in awaiting),
        )
    if awaiting[0].problem:
        pod = awaiting[0]
        raise AdmissionRefused(f"pod {pod.key} is not served: {pod.problem}", (pod.key,))
    pod = awaiting[0]
    record = records.get(pod.uid)
    served = {g.name for g in record.given} if record is not None else set()
    container = next(c for c in pod.containers if c.name not in served)
    if container.replicas != len(ids):
        raise AdmissionRefused(
            f"pod {pod.key} container {container.name} asks for {container.replicas} shared "
            f"slot(s), the kubelet allocated {len(ids)}",
            (pod.key,),
        )
    assigned = pod.assignment
    if gpu.uuid != assigned.gpu_uuid:
        raise AdmissionRefused(
            f"pod {pod.key} was assigned GPU {assigned.gpu_uuid}, the kubelet allocated slots "
            f"of GPU {gpu.uuid}",
            (pod.key,),
        )
    if assigned.memory_mib and container.memory_mib > assigned.memory_mib:
        raise AdmissionRefused(
            f"pod {pod.key} container {container.name} asks for {container.memory_mib} MiB, its "
            f"assignment counts {assigned.memory_mib} MiB for the whole pod",
            (pod.key,),
        )
    if record is None:
        shortfall = room_shortfall(
            gpu, assigned, [r for r in records.values() if r.uid in {p.uid for p in listed}]
        )
        if shortfall:
            raise AdmissionRefused(
                f"pod {pod.key} does not fit on GPU {gpu.uuid}: {shortfall}", (pod.key,)
            )
    return SharedAdmission(pod, container)


def room_shortfall(
    gpu: OfferedGpu, assignment: PodAssignment, served: Iterable[AdmissionRecord]
) -> str:
    """What `gpu` lacks for a pod's verified amounts next to the pods served there; "" when it fits.

    The extender's rule (`gpupart.core.scheduling.evaluate`): memory and compute percent add up
    per GPU, within the GPU's memory and 100 %.
    """
    there = [r for r in served if r.gpu_uuid == gpu.uuid]
    memory = sum(r.memory_mib for r in there)
    compute = sum(r.compute_percent for r in there)
    if memory + assignment.memory_mib > gpu.memory_mib:
        return (
            f"{gpu.memory_mib - memory} of {gpu.memory_mib} MiB free, "
            f"{assignment.memory_mib} MiB assigned"
        )
    if compute + assignment.compute_percent > 100:
        return f"{100 - compute}% compute free, {assignment.compute_percent}% assigned"
    return ""


def awaiting_pod(
    pods: Iterable[SharedPod], records: Mapping[str, AdmissionRecord], *, node: str
) -> SharedPod | None:
    """The one live pod on `node` not fully served, if it verified; None when there is none or several."""
    awaiting = [p for p in pods if p.node == node and p.live and not _complete(p, records)]
    return awaiting[0] if len(awaiting) == 1 and not awaiting[0].problem else None


def _complete(pod: SharedPod, records: Mapping[str, AdmissionRecord]) -> bool:
    record = records.get(pod.uid)
    return admission_complete(pod.containers, record.given if record is not None else ())


def encode_records(node: str, records: Iterable[AdmissionRecord]) -> str:
    """The checkpoint file's text: versioned JSON, one entry per pod, in uid order."""
    return json.dumps(
        {
            "version": WIRE_VERSION,
            "node": node,
            "pods": [
                {
                    "uid": r.uid,
                    "pod": r.pod,
                    "gpuUUID": r.gpu_uuid,
                    "memoryMiB": r.memory_mib,
                    "computePercent": r.compute_percent,
                    "containers": [given_fields(g) for g in r.given],
                }
                for r in sorted(records, key=lambda r: r.uid)
            ],
        },
        sort_keys=True,
        indent=1,
    )


def decode_records(text: str, *, node: str, where: str) -> dict[str, AdmissionRecord]:
    """The checkpoint read back; InvalidInput naming `where` and the field when it is not ours."""
    try:
        raw = json.loads(text)
    except (TypeError, ValueError, RecursionError) as error:
        raise InvalidInput(where, f"not JSON ({error})") from None
    record = Record(raw, where)
    version = record.string("version")
    if version != WIRE_VERSION:
        raise InvalidInput(record.path("version"), f"unknown format version {version!r}")
    if record.string("node") != node:
        raise InvalidInput(record.path("node"), f"is not this node ({node!r})")

    def entry(r: Record) -> AdmissionRecord:
        return AdmissionRecord(
            r.string("uid"),
            r.string("pod"),
            r.string("gpuUUID"),
            r.integer("memoryMiB", 0, minimum=0),
            r.integer("computePercent", 0, minimum=0),
            tuple(r.each("containers", read_given)),
        )

    entries = record.each("pods", entry, required=False)
    record.done()
    if len(entries) > MAX_RECORDS:
        raise InvalidInput(record.path("pods"), f"{len(entries)} pods; at most {MAX_RECORDS}")
    return {e.uid: e for e in entries}
