"""Annotation keys and their versioned JSON formats: the contracts between operator, node agent and extender.

Every payload carries ``"version"``; a reader refuses versions it does not know rather than guess.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, TypeVar

from gpupart.core.api.jsontext import loads
from gpupart.core.api.records import Record
from gpupart.core.api.resources import check_profile_name
from gpupart.core.api.spec import (
    MAX_MIG_PROFILES,
    Disruption,
    GpuConfig,
    Interface,
    Mode,
    MpsSettings,
)
from gpupart.core.errors import InvalidInput, WireFormatError
from gpupart.core.mig.layout import Layout, MigInstance, Placement

DESIRED_ANNOTATION = "gpupart.io/desired"
"""On a Node, written by the operator: the configuration each partition wants there."""
STATE_ANNOTATION = "gpupart.io/state"
"""On a Node, written by the node agent: what it applied, per GPU, and why not when it could not."""
INVENTORY_ANNOTATION = "gpupart.io/inventory"
"""On a Node, written by the node agent: GPUs and MIG devices as the extender needs them."""
ASSIGNMENT_ANNOTATION = "gpupart.io/assignment"
"""On a Pod, written by the extender before binding: which GPU a shared-GPU pod gets."""
ALLOCATION_CONDITION = "gpupart.io/SharedGpuAllocated"
"""On a Pod, the type of the status condition the node agent writes in Allocate (as its node,
through pods/status, which no tenant may write): its message records what each of the pod's
shared-GPU containers got (docs/adr-034-node-agent-writes-as-its-node.md)."""
MIG_PLAN_ANNOTATION = "gpupart.io/mig-plan"
"""On a Node, written by the operator: the exact MIG layouts its dynamic GPUs go to, with the pod
each planned instance is reserved for (docs/adr-013-dynamic-mig-plans.md)."""
WIRE_VERSION = "v1"


class GpuState(StrEnum):
    APPLIED = "Applied"
    PENDING = "Pending"
    BLOCKED = "Blocked"
    FAILED = "Failed"


@dataclass(frozen=True, slots=True)
class DesiredGroup:
    """One partition's wish for some GPUs of a node (all of them when `gpus` is None)."""

    partition: str
    generation: int
    gpus: tuple[int, ...] | None
    config: GpuConfig


@dataclass(frozen=True, slots=True)
class GpuReport:
    index: int
    state: GpuState
    mode: Mode
    layout: Layout = ()
    message: str = ""
    blocking_pods: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class PlanReport:
    """The node agent's answer to one MIG plan: Applied, or why not (Failed, Blocked, Pending)."""

    id: str
    state: GpuState
    message: str = ""


@dataclass(frozen=True, slots=True)
class NodeReport:
    """The node agent's answer to the desired annotation, with the generations it acted on."""

    observed: tuple[tuple[str, int], ...]
    gpus: tuple[GpuReport, ...]
    plan: PlanReport | None = None
    """The answer to the MIG plan on the node, when there is one."""


@dataclass(frozen=True, slots=True)
class MigDevice:
    uuid: str
    instance: MigInstance
    used: bool = False
    """A pod (PodResources) or a process (NVML) held it at the node agent's last pass."""


@dataclass(frozen=True, slots=True)
class PlannedGpu:
    """One dynamic GPU of a MIG plan: the whole layout it goes to, every kept instance included."""

    index: int
    layout: Layout


@dataclass(frozen=True, slots=True)
class MigReservation:
    """An instance of a plan (created by it, or idle and reused) held for one pending pod."""

    pod: str
    """namespace/name"""
    uid: str
    gpu: int
    instance: MigInstance
    expires: float
    """Unix seconds; after that, or once the pod is gone, the instance is free for any pod."""


@dataclass(frozen=True, slots=True)
class MigPlan:
    """The operator's MIG plan for one node (`gpupart.io/mig-plan`); `id` names it in reports."""

    id: str
    gpus: tuple[PlannedGpu, ...] = ()
    reservations: tuple[MigReservation, ...] = ()


@dataclass(frozen=True, slots=True)
class InventoryGpu:
    index: int
    uuid: str
    product: str
    memory_mib: int
    mode: Mode
    mig_devices: tuple[MigDevice, ...] = ()
    replicas: int = 0
    """Client slots when the GPU is shared (MPS or time-slicing), else 0."""
    client_memory_mib: int = 0
    """MPS only: the most memory one client may pin on this GPU (its control daemon's default
    limit, which a client can lower but never raise); 0: no per-client limit."""
    client_compute_percent: int = 0
    """MPS only: the most of the GPU's SMs one client may use (the daemon's default active
    thread percentage, likewise a ceiling); 0: no per-client limit."""
    interface: Interface | None = Interface.DEVICE_PLUGIN
    """The interface that serves the GPU now (`OfferedGpu.interface`); None while it moves
    between the two and neither offers it. Only a device-plugin GPU is the extender's."""


@dataclass(frozen=True, slots=True)
class Inventory:
    """What the node agent tells the extender about its node."""

    gpus: tuple[InventoryGpu, ...]
    serial_admission: bool = False
    """The node's device plugin pairs shared Allocates with the one pod awaiting them and
    records each in the pod's `ALLOCATION_CONDITION`: the extender binds one such pod at a time
    there."""


@dataclass(frozen=True, slots=True)
class GivenContainer:
    """What the device plugin gave one container of a shared-GPU pod in Allocate."""

    name: str
    devices: tuple[str, ...]
    """The slot ids the kubelet allocated, sorted."""
    gpu_uuid: str
    memory_mib: int = 0
    """The MPS pinned-memory limit (0 on time-slicing)."""
    compute_percent: int = 0


@dataclass(frozen=True, slots=True)
class PodAssignment:
    """The extender's choice for one shared-GPU pod: its node and GPU, and the pod's totals.

    `pod_uid` and `signature` bind it to the pod it was made for
    (`gpupart.core.api.provenance`): the node agent serves only assignments that verify.
    """

    node: str
    gpu: int
    gpu_uuid: str
    memory_mib: int = 0
    compute_percent: int = 0
    pod_uid: str = ""
    signature: str = ""


T = TypeVar("T")


def _encode(payload: dict[str, Any]) -> str:
    return json.dumps({"version": WIRE_VERSION, **payload}, sort_keys=True, separators=(",", ":"))


def _decode(text: str, annotation: str, read: Callable[[Record], T]) -> T:
    try:
        raw = loads(text, annotation)
    except InvalidInput as error:
        raise WireFormatError(str(error)) from None
    if not isinstance(raw, Mapping):
        raise WireFormatError(f"{annotation}: expected a JSON object")
    version = raw.get("version")
    if version != WIRE_VERSION:
        raise WireFormatError(
            f"{annotation}: unknown format version {version!r} (this build reads {WIRE_VERSION!r})"
        )
    record = Record(raw, annotation)
    record.string("version")
    try:
        value = read(record)
        record.done()
    except InvalidInput as error:
        raise WireFormatError(str(error)) from None
    return value


def _enum(record: Record, key: str, kind: type[StrEnum]) -> Any:
    text = record.string(key)
    try:
        return kind(text)
    except ValueError:
        raise InvalidInput(record.path(key), f"{text!r} is not one of {', '.join(kind)}") from None


def _layout_json(layout: Layout) -> list[dict[str, Any]]:
    return [
        {"profile": i.profile, "start": i.placement.start, "size": i.placement.size} for i in layout
    ]


def _read_instance(record: Record) -> MigInstance:
    return MigInstance(
        Placement(record.integer("start", minimum=0), record.integer("size", minimum=1)),
        record.string("profile"),
    )


def _read_layout(record: Record, key: str) -> Layout:
    return tuple(sorted(record.each(key, _read_instance)))


def _counts(record: Record, key: str) -> tuple[tuple[str, int], ...]:
    counts = record.optional_record(key)
    if counts is None:
        return ()
    pairs = tuple((name, counts.integer(name, minimum=0)) for name in sorted(counts.raw))
    counts.done()
    return pairs


def _config_json(config: GpuConfig) -> dict[str, Any]:
    """A GPU's configuration as the desired annotation writes it (inside its group's object)."""
    mps = None
    if config.mode is Mode.MPS and config.mps is not None:
        mps = {"maxClients": config.replicas}
        if config.mps.default_memory_mib is not None:
            mps["defaultMemoryMiB"] = config.mps.default_memory_mib
        if config.mps.default_compute_percent is not None:
            mps["defaultComputePercent"] = config.mps.default_compute_percent
    return {
        "mode": config.mode.value,
        "mig": dict(config.mig),
        "mps": mps,
        "replicas": (config.replicas or None) if config.mode is Mode.TIME_SLICING else None,
        "disruption": config.disruption.value,
        # Only when set, so a static partition's annotation keeps its bytes.
        **({"dynamic": True} if config.dynamic else {}),
        **(
            {"profiles": list(config.dynamic_profiles)}
            if config.dynamic and config.dynamic_profiles is not None
            else {}
        ),
        # Only when not the default, likewise; an agent that predates DRA refuses the key
        # (an unknown field) rather than serve a DRA GPU through its device plugin.
        **(
            {"interface": config.interface.value}
            if config.interface is not Interface.DEVICE_PLUGIN
            else {}
        ),
    }


def _read_config(record: Record) -> GpuConfig:
    """`_config_json`'s inverse; the settings of modes other than the record's are read and dropped."""
    mode = _enum(record, "mode", Mode)
    mig = _counts(record, "mig")
    mps, replicas = None, 0
    block = record.optional_record("mps")
    if block is not None:
        clients = block.integer("maxClients", minimum=1)
        settings = MpsSettings(
            block.optional_integer("defaultMemoryMiB", minimum=1),
            block.optional_integer("defaultComputePercent", minimum=1),
        )
        block.done()
        if mode is Mode.MPS:
            mps, replicas = settings, clients
    sliced = record.integer("replicas", 0)
    if mode is Mode.TIME_SLICING:
        replicas = max(1, sliced)  # a time-sliced GPU offers at least one slot
    dynamic = record.boolean("dynamic", False) and mode is Mode.MIG
    profiles = _profiles(record) if dynamic and record.has("profiles") else None
    interface = (
        _enum(record, "interface", Interface)
        if record.has("interface")
        else Interface.DEVICE_PLUGIN
    )
    return GpuConfig(
        mode,
        mig,
        mps,
        replicas,
        _enum(record, "disruption", Disruption),
        dynamic=dynamic,
        interface=interface,
        dynamic_profiles=profiles,
    )


def _profiles(record: Record) -> tuple[str, ...]:
    """A dynamic GPU's allowed MIG profiles, as `spec.mig.dynamic.profiles` allows them."""
    items = record.items("profiles")
    where = record.path("profiles")
    if not items or len(items) > MAX_MIG_PROFILES:
        raise InvalidInput(where, f"lists {len(items)} profiles; 1 to {MAX_MIG_PROFILES}")
    for position, name in enumerate(items):
        if not isinstance(name, str):
            raise InvalidInput(f"{where}[{position}]", f"must be a profile name, got {name!r:.40}")
        check_profile_name(name, where=f"{where}[{position}]")
    return tuple(sorted(set(items)))


def encode_desired(groups: tuple[DesiredGroup, ...]) -> str:
    def group(g: DesiredGroup) -> dict[str, Any]:
        return {
            "partition": g.partition,
            "generation": g.generation,
            "gpus": None if g.gpus is None else list(g.gpus),
            **_config_json(g.config),
        }

    return _encode({"groups": [group(g) for g in groups]})


def decode_desired(text: str) -> tuple[DesiredGroup, ...]:
    def group(g: Record) -> DesiredGroup:
        gpus = g.items("gpus")
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in gpus):
            raise InvalidInput(g.path("gpus"), f"must list GPU indices, got {gpus!r}")
        return DesiredGroup(
            partition=g.string("partition"),
            generation=g.integer("generation", minimum=0),
            gpus=tuple(gpus) if g.has("gpus") else None,
            config=_read_config(g),
        )

    def read(record: Record) -> tuple[DesiredGroup, ...]:
        return tuple(record.each("groups", group, required=True))

    return _decode(text, DESIRED_ANNOTATION, read)


def encode_report(report: NodeReport) -> str:
    return _encode(
        {
            "observed": [{"partition": p, "generation": g} for p, g in report.observed],
            "gpus": [
                {
                    "index": gpu.index,
                    "state": gpu.state.value,
                    "mode": gpu.mode.value,
                    "layout": _layout_json(gpu.layout),
                    "message": gpu.message,
                    "blockingPods": list(gpu.blocking_pods),
                }
                for gpu in report.gpus
            ],
            **(
                {}
                if report.plan is None
                else {
                    "plan": {
                        "id": report.plan.id,
                        "state": report.plan.state.value,
                        "message": report.plan.message,
                    }
                }
            ),
        }
    )


def decode_report(text: str) -> NodeReport:
    def observed(o: Record) -> tuple[str, int]:
        return o.string("partition"), o.integer("generation", minimum=0)

    def gpu(g: Record) -> GpuReport:
        return GpuReport(
            index=g.integer("index", minimum=0),
            state=_enum(g, "state", GpuState),
            mode=_enum(g, "mode", Mode),
            layout=_read_layout(g, "layout"),
            message=g.string("message", ""),
            blocking_pods=tuple(str(p) for p in g.items("blockingPods")),
        )

    def read(record: Record) -> NodeReport:
        plan = None
        block = record.optional_record("plan")
        if block is not None:
            plan = PlanReport(
                block.string("id"), _enum(block, "state", GpuState), block.string("message", "")
            )
            block.done()
        return NodeReport(
            tuple(record.each("observed", observed)), tuple(record.each("gpus", gpu)), plan
        )

    return _decode(text, STATE_ANNOTATION, read)


def _served_by(g: Record) -> Interface | None:
    """An inventory GPU's `interface`: absent is the device plugin, null is neither (moving)."""
    text = g.string("interface", "")
    if not text:
        return None if "interface" in g.raw else Interface.DEVICE_PLUGIN
    try:
        return Interface(text)
    except ValueError:
        raise InvalidInput(
            g.path("interface"), f"{text!r} is not one of {', '.join(Interface)}"
        ) from None


def encode_inventory(inventory: Inventory) -> str:
    gpus = inventory.gpus
    return _encode(
        {
            "serialAdmission": inventory.serial_admission,
            "gpus": [
                {
                    "index": gpu.index,
                    "uuid": gpu.uuid,
                    "product": gpu.product,
                    "memoryMiB": gpu.memory_mib,
                    "mode": gpu.mode.value,
                    "migDevices": [
                        {"uuid": d.uuid, **_layout_json((d.instance,))[0], "used": d.used}
                        for d in gpu.mig_devices
                    ],
                    "maxClients": gpu.replicas,
                    **(
                        {"mpsClientMemoryMiB": gpu.client_memory_mib}
                        if gpu.client_memory_mib
                        else {}
                    ),
                    **(
                        {"mpsClientComputePercent": gpu.client_compute_percent}
                        if gpu.client_compute_percent
                        else {}
                    ),
                    **(
                        {"interface": gpu.interface.value if gpu.interface else None}
                        if gpu.interface is not Interface.DEVICE_PLUGIN
                        else {}
                    ),
                }
                for gpu in gpus
            ],
        }
    )


def decode_inventory(text: str) -> Inventory:
    def device(d: Record) -> MigDevice:
        return MigDevice(d.string("uuid"), _read_instance(d), d.boolean("used", False))

    def gpu(g: Record) -> InventoryGpu:
        devices = tuple(g.each("migDevices", device))  # read first: its errors come first
        return InventoryGpu(
            index=g.integer("index", minimum=0),
            uuid=g.string("uuid"),
            product=g.string("product"),
            memory_mib=g.integer("memoryMiB", minimum=0),
            mode=_enum(g, "mode", Mode),
            mig_devices=devices,
            replicas=g.integer("maxClients", 0, minimum=0),
            client_memory_mib=g.integer("mpsClientMemoryMiB", 0, minimum=0),
            client_compute_percent=g.integer("mpsClientComputePercent", 0, minimum=0, maximum=100),
            interface=_served_by(g),
        )

    def read(record: Record) -> Inventory:
        serial = record.boolean("serialAdmission", False)
        return Inventory(tuple(record.each("gpus", gpu)), serial)

    return _decode(text, INVENTORY_ANNOTATION, read)


def encode_assignment(assignment: PodAssignment) -> str:
    return _encode(
        {
            "node": assignment.node,
            "gpu": assignment.gpu,
            "gpuUUID": assignment.gpu_uuid,
            "memoryMiB": assignment.memory_mib,
            "computePercent": assignment.compute_percent,
            "podUID": assignment.pod_uid,
            "signature": assignment.signature,
        }
    )


def decode_assignment(text: str) -> PodAssignment:
    def read(record: Record) -> PodAssignment:
        return PodAssignment(
            node=record.string("node"),
            gpu=record.integer("gpu", minimum=0),
            gpu_uuid=record.string("gpuUUID"),
            memory_mib=record.integer("memoryMiB", 0, minimum=0),
            compute_percent=record.integer("computePercent", 0, minimum=0),
            pod_uid=record.string("podUID", ""),
            signature=record.string("signature", ""),
        )

    return _decode(text, ASSIGNMENT_ANNOTATION, read)


def given_fields(given: GivenContainer) -> dict[str, Any]:
    """One served container as JSON fields: the allocation annotation's and the node agent's
    checkpoint's one shape."""
    return {
        "name": given.name,
        "devices": list(given.devices),
        "gpuUUID": given.gpu_uuid,
        "memoryMiB": given.memory_mib,
        "computePercent": given.compute_percent,
    }


def read_given(c: Record) -> GivenContainer:
    """`given_fields` read back, strictly."""
    devices = c.items("devices", required=True)
    if not devices or not all(isinstance(d, str) for d in devices):
        raise InvalidInput(c.path("devices"), "must be a list of device ids")
    return GivenContainer(
        name=c.string("name"),
        devices=tuple(sorted(devices)),
        gpu_uuid=c.string("gpuUUID"),
        memory_mib=c.integer("memoryMiB", 0, minimum=0),
        compute_percent=c.integer("computePercent", 0, minimum=0),
    )


def encode_allocation(given: tuple[GivenContainer, ...]) -> str:
    return _encode({"containers": [given_fields(g) for g in given]})


def decode_allocation(text: str) -> tuple[GivenContainer, ...]:
    def read(record: Record) -> tuple[GivenContainer, ...]:
        return tuple(record.each("containers", read_given, required=True))

    return _decode(text, ALLOCATION_CONDITION, read)


def allocation_condition(given: tuple[GivenContainer, ...], now: str) -> dict[str, str]:
    """The pod status condition that records what a shared-GPU pod's containers got (`now`:
    its lastTransitionTime, RFC 3339)."""
    return {
        "type": ALLOCATION_CONDITION,
        "status": "True",
        "reason": "Allocated",
        "message": encode_allocation(given),
        "lastTransitionTime": now,
    }


def allocation_record(pod: Mapping[str, Any]) -> object:
    """The message of the pod's `ALLOCATION_CONDITION` (the API's plain dict form): a text to
    `decode_allocation`, None when there is no such condition, anything else when the condition
    is not a readable record (a client that reads it treats that as served, ADR 001)."""
    status = pod.get("status")
    conditions = status.get("conditions") if isinstance(status, Mapping) else None
    if not isinstance(conditions, list):
        return None
    for condition in conditions:
        if isinstance(condition, Mapping) and condition.get("type") == ALLOCATION_CONDITION:
            message = condition.get("message")
            return "" if message is None else message  # a condition of no record: unreadable
    return None


MAX_PLAN_RESERVATIONS = 512
"""More instances than any node's GPUs hold (64 GPUs x 7): a longer list is not ours."""


def encode_mig_plan(plan: MigPlan) -> str:
    return _encode(
        {
            "id": plan.id,
            "gpus": [{"index": g.index, "layout": _layout_json(g.layout)} for g in plan.gpus],
            "reservations": [
                {
                    "pod": r.pod,
                    "uid": r.uid,
                    "gpu": r.gpu,
                    **_layout_json((r.instance,))[0],
                    "expires": round(r.expires, 3),
                }
                for r in plan.reservations
            ],
        }
    )


def decode_mig_plan(text: str) -> MigPlan:
    def planned(g: Record) -> PlannedGpu:
        # Required, even when empty: a GPU planned to hold nothing is said, never implied.
        if "layout" not in g.raw:
            raise InvalidInput(g.path("layout"), "is required (an empty list empties the GPU)")
        return PlannedGpu(g.integer("index", minimum=0), _read_layout(g, "layout"))

    def reservation(r: Record) -> MigReservation:
        return MigReservation(
            pod=r.string("pod"),
            uid=r.string("uid", ""),
            gpu=r.integer("gpu", minimum=0),
            instance=_read_instance(r),
            expires=r.number("expires", minimum=0),
        )

    def read(record: Record) -> MigPlan:
        gpus = tuple(record.each("gpus", planned))
        indices = [g.index for g in gpus]
        if len(set(indices)) != len(indices):
            raise InvalidInput(record.path("gpus"), f"names a GPU twice: {indices[:64]}")
        reservations = tuple(record.each("reservations", reservation))
        if len(reservations) > MAX_PLAN_RESERVATIONS:
            raise InvalidInput(
                record.path("reservations"),
                f"lists {len(reservations)} reservations; at most {MAX_PLAN_RESERVATIONS}",
            )
        return MigPlan(record.string("id"), gpus, reservations)

    return _decode(text, MIG_PLAN_ANNOTATION, read)
