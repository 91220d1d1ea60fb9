"""Device ids the node agent advertises, and the pure choices behind Allocate, preferred allocation and health.

Device ids: a MIG device is its MIG UUID, a whole GPU its GPU UUID, a shared client slot
``<GPU UUID>::<n>`` (NVIDIA's annotated-id form). No I/O here: the gRPC servicer and the health
loop call these functions with what they read. Which pod a shared slot is for: `admission.py`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from gpupart.core.api.resources import (
    GPU,
    GPU_COMPUTE,
    GPU_MEMORY,
    GPU_SHARED,
    MIG_PREFIX,
    mig_resource_name,
)
from gpupart.core.api.spec import Interface, Mode
from gpupart.core.errors import InvalidInput
from gpupart.core.mig.layout import MigInstance

SLOT_SEPARATOR = "::"
HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
DEFAULT_IGNORED_XIDS = frozenset({13, 31, 43, 45, 68, 109})
"""Xids caused by applications, not the GPU (NVIDIA's device plugin ignores the same)."""


@dataclass(frozen=True, slots=True)
class OfferedMigDevice:
    """A MIG device (GPU instance with its full compute instance) as read from the GPU."""

    uuid: str
    instance: MigInstance
    gpu_instance_id: int
    compute_instance_id: int
    cap_minors: tuple[int, ...] = ()
    """Minors of ``/dev/nvidia-caps/nvidia-cap<M>`` for GI and CI access (from mig-minors)."""


@dataclass(frozen=True, slots=True)
class OfferedGpu:
    """One GPU as the device plugin offers it after a reconcile pass."""

    index: int
    uuid: str
    product: str
    memory_mib: int
    minor: int
    numa_node: int | None
    mode: Mode
    mig: tuple[OfferedMigDevice, ...] = ()
    replicas: int = 0
    """Client slots when shared (MPS clients or time-slicing replicas); 0 unless shared."""
    mps_pipe_directory: str = ""
    """Host path of the GPU's MPS pipe directory when the mode is MPS."""
    mps_memory_mib: int = 0
    mps_compute_percent: int = 0
    interface: Interface | None = Interface.DEVICE_PLUGIN
    """The one kubelet interface that offers this GPU now; None while it moves from one to the
    other and neither may (a GPU is never offered through both at once)."""
    pci_bus_id: str = ""
    """NVML's PCI bus id (`0000:3b:00.0`), lower case; empty when not read."""
    dynamic: bool = False
    """MIG mode, dynamic (`spec.mig.dynamic`): instances are made on demand, so DRA offers
    every placement of `dynamic_profiles` (None: all of the model's)."""
    dynamic_profiles: tuple[str, ...] | None = None


@dataclass(frozen=True, slots=True)
class Device:
    """One device id under one resource name, with the GPU it lives on."""

    id: str
    resource: str
    gpu: OfferedGpu
    mig: OfferedMigDevice | None = None


def slot_id(gpu_uuid: str, n: int) -> str:
    return f"{gpu_uuid}{SLOT_SEPARATOR}{n}"


def node_devices(gpus: Iterable[OfferedGpu]) -> dict[str, tuple[Device, ...]]:
    """Every resource this node's device plugin offers and its devices.

    A GPU in MIG mode with no instance offers nothing, and neither does a GPU that is not the
    device plugin's (served through DRA, or moving between the two).
    """
    found: dict[str, list[Device]] = {}
    for gpu in sorted(gpus, key=lambda g: g.index):
        if gpu.interface is not Interface.DEVICE_PLUGIN:
            continue
        if gpu.mode is Mode.MIG:
            for mig in sorted(gpu.mig, key=lambda m: m.instance):
                resource = mig_resource_name(mig.instance.profile)
                found.setdefault(resource, []).append(Device(mig.uuid, resource, gpu, mig))
        elif gpu.mode.is_shared:
            found.setdefault(GPU_SHARED, []).extend(
                Device(slot_id(gpu.uuid, n), GPU_SHARED, gpu) for n in range(gpu.replicas)
            )
        else:
            found.setdefault(GPU, []).append(Device(gpu.uuid, GPU, gpu))
    return {resource: tuple(devices) for resource, devices in sorted(found.items())}


def managed_capacity(gpus: Iterable[OfferedGpu]) -> dict[str, int]:
    """What the node offers of the extender-managed resources: MiB and percent on shared GPUs.

    kube-scheduler counts these per node against the Node's allocatable (its filter, its
    preemption's dry run, its requeueing of a pending pod after a Node change): without them
    there, a pod asking for `gpupart.io/gpu-memory` fits no node. The extender still decides
    per GPU.
    """
    shared = [g for g in gpus if g.mode.is_shared and g.interface is Interface.DEVICE_PLUGIN]
    return {
        GPU_MEMORY: sum(g.memory_mib for g in shared),
        GPU_COMPUTE: 100 * len(shared),
    }


@dataclass(frozen=True, slots=True)
class Listing:
    """One resource as its device plugin's ListAndWatch sends it: every device id, the healthy ones."""

    ids: frozenset[str] = frozenset()
    healthy: frozenset[str] = frozenset()

    @property
    def capacity(self) -> int:
        """What the kubelet writes in the Node's capacity: every device, healthy or not."""
        return len(self.ids)

    @property
    def allocatable(self) -> int:
        """What the kubelet writes in the Node's allocatable: the healthy devices."""
        return len(self.healthy)


@dataclass(frozen=True, slots=True)
class StatusChange:
    """New MIG counts for the Node's status, once the kubelet holds every id in `awaited`."""

    resource: str
    capacity: int
    allocatable: int
    awaited: frozenset[str] = frozenset()
    """Healthy device ids new in this pass; empty for a decrease (written at once)."""


def status_changes(
    before: Mapping[str, Listing], after: Mapping[str, Listing]
) -> tuple[tuple[StatusChange, ...], tuple[str, ...]]:
    """The MIG resources whose counts a pass changed: (changes to write, resources left to the kubelet).

    The kubelet writes these counts itself at its next node-status sync; writing them sooner is
    only safe for what it already holds. A decrease never names a device it lacks, so it is
    written at once; an increase waits for the kubelet to list the new healthy ids. A new
    device that is unhealthy cannot be confirmed (the kubelet lists only healthy devices as
    allocatable): that resource is left to the kubelet's own sync. Same counts: nothing.
    """
    changes: list[StatusChange] = []
    left: list[str] = []
    for resource in sorted({*before, *after}):
        if not resource.startswith(MIG_PREFIX):
            continue
        old, new = before.get(resource, Listing()), after.get(resource, Listing())
        if (new.capacity, new.allocatable) == (old.capacity, old.allocatable):
            continue
        if new.capacity <= old.capacity and new.allocatable <= old.allocatable:
            changes.append(StatusChange(resource, new.capacity, new.allocatable))
        elif (new.ids - old.ids) - new.healthy:
            left.append(resource)
        else:
            awaited = frozenset(new.healthy - old.healthy)
            changes.append(StatusChange(resource, new.capacity, new.allocatable, awaited))
    return tuple(changes), tuple(left)


def resolve_devices(ids: Sequence[str], devices: Mapping[str, Device]) -> tuple[Device, ...]:
    """The devices the kubelet asks for; an unknown or repeated id raises (never a wrong device)."""
    if not ids:
        raise InvalidInput("devices_ids", "the kubelet asked for no device")
    if len(set(ids)) != len(ids):
        raise InvalidInput("devices_ids", f"a device is asked for twice: {sorted(ids)}")
    unknown = [i for i in ids if i not in devices]
    if unknown:
        raise InvalidInput(
            "devices_ids",
            f"{', '.join(unknown)} not offered by this node now (repartitioned or withdrawn)",
        )
    return tuple(devices[i] for i in ids)


def preferred_allocation(
    available: Sequence[str],
    must_include: Sequence[str],
    size: int,
    devices: Mapping[str, Device],
    *,
    prefer_gpu: str | None = None,
) -> tuple[str, ...]:
    """`size` ids from `available` that keep a container on as few GPUs and NUMA nodes as possible.

    GPUs already holding a must-include device come first, then `prefer_gpu` (the GPU the
    extender assigned), then GPUs on a NUMA node already used; among the rest, the smallest GPU
    that holds all remaining devices (keeps larger free groups whole), else the largest first.
    """
    chosen = [i for i in must_include if i in available]
    wanted = max(0, size - len(chosen))
    by_gpu: dict[str, list[str]] = {}
    for device_id in available:
        if device_id not in chosen and device_id in devices:
            by_gpu.setdefault(devices[device_id].gpu.uuid, []).append(device_id)
    used_gpus = {devices[i].gpu.uuid for i in chosen if i in devices}
    used_numa = {devices[i].gpu.numa_node for i in chosen if i in devices}

    def rank(uuid: str) -> tuple[int, int, int, int, int]:
        gpu = devices[by_gpu[uuid][0]].gpu
        count = len(by_gpu[uuid])
        fits = count >= wanted
        return (
            uuid not in used_gpus,
            uuid != prefer_gpu,
            bool(used_numa) and gpu.numa_node not in used_numa,
            not fits,
            count if fits else -count,
        )

    for uuid in sorted(by_gpu, key=lambda u: (rank(u), devices[by_gpu[u][0]].gpu.index)):
        if wanted <= 0:
            break
        take = by_gpu[uuid][:wanted]
        chosen.extend(take)
        wanted -= len(take)
        used_numa.add(devices[take[0]].gpu.numa_node)
    return tuple(chosen[:size] if size else chosen)


@dataclass(frozen=True, slots=True)
class XidEvent:
    """An NVML critical-error event; instance ids are None when the event names the whole GPU."""

    gpu_uuid: str
    xid: int
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None


def affected_devices(
    event: XidEvent, devices: Iterable[Device], *, ignored: frozenset[int] = DEFAULT_IGNORED_XIDS
) -> frozenset[str]:
    """The device ids an Xid makes unhealthy: only that GPU's, only that MIG instance's when named."""
    if event.xid in ignored:
        return frozenset()
    hit = set()
    for device in devices:
        if device.gpu.uuid != event.gpu_uuid:
            continue
        mig = device.mig
        if mig is not None and event.gpu_instance_id is not None:
            if mig.gpu_instance_id != event.gpu_instance_id:
                continue
            if (
                event.compute_instance_id is not None
                and mig.compute_instance_id != event.compute_instance_id
            ):
                continue
        hit.add(device.id)
    return frozenset(hit)


@dataclass(frozen=True, slots=True)
class HealthBook:
    """Which devices are unhealthy and since when (seconds on the caller's clock)."""

    sick: Mapping[str, float] = field(default_factory=dict)
    """Device id -> time of the latest critical event on it."""
    gpus: Mapping[str, str] = field(default_factory=dict)
    """Device id -> GPU UUID, for the recovery probe."""

    @property
    def unhealthy(self) -> frozenset[str]:
        return frozenset(self.sick)

    def record(self, ids: Iterable[Device], now: float) -> HealthBook:
        devices = tuple(ids)
        if not devices:
            return self
        return replace(
            self,
            sick={**self.sick, **{d.id: now for d in devices}},
            gpus={**self.gpus, **{d.id: d.gpu.uuid for d in devices}},
        )

    def sick_gpus(self) -> frozenset[str]:
        return frozenset(self.gpus[i] for i in self.sick)

    def recover(self, healthy_gpus: Iterable[str], now: float, *, quiet_s: float) -> HealthBook:
        """Devices back to Healthy: their GPU answers again and no critical event for `quiet_s`."""
        ok = frozenset(healthy_gpus)
        return self._keeping(
            {
                i: since
                for i, since in self.sick.items()
                if self.gpus[i] not in ok or now - since < quiet_s
            }
        )

    def forget_missing(self, present: Iterable[str]) -> HealthBook:
        """Drop devices that no longer exist (a repartition gave the GPU new MIG devices)."""
        ids = frozenset(present)
        return self._keeping({i: t for i, t in self.sick.items() if i in ids})

    def _keeping(self, keep: dict[str, float]) -> HealthBook:
        """The book with only the sick devices in `keep` (a subset of `sick`); self if all."""
        if len(keep) == len(self.sick):
            return self
        return HealthBook(keep, {i: self.gpus[i] for i in keep})
