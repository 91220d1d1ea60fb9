"""One GPU's DRA devices (ResourceSlice `devices[]` entries, as JSON) and its counter set, by partition mode.

Built from what the node agent already holds: the `OfferedGpu` view it advertises today, the
`GpuModel` of the catalogue (or NVML's answers), and per-GPU facts it read (bus id, driver
version). An attribute that is not known is omitted, never guessed.

- Whole GPU (mode None): one device, `type: gpu`.
- MIG, static layout: each existing instance one device, no counters.
- MIG, dynamic: every legal placement of every allowed profile, each consuming its GPU's
  counter set; placements that overlap an instance someone else created (`foreign`) are left
  out and the counters lowered by what it takes. No whole-GPU device: a GPU in MIG mode cannot
  give one without leaving MIG mode (docs/adr-030-whole-gpu-of-a-mig-gpu.md).
- MPS and time-slicing: one device per GPU with `allowMultipleAllocations` and consumable
  `memory` (MiB) and `compute` (percent).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from fractions import Fraction
from typing import Any

from gpupart.core.api.spec import Mode
from gpupart.core.dra import names
from gpupart.core.dra.order import Rank, placement_ranks
from gpupart.core.dynamic.model import Mix
from gpupart.core.errors import InvalidInput
from gpupart.core.mig.catalogue import GpuModel, MediaEngines, MigProfile
from gpupart.core.mig.layout import MigInstance, Placement
from gpupart.core.node.devices import OfferedGpu

Device = dict[str, Any]
"""One `devices[]` entry of a ResourceSlice, as the API's JSON."""
CounterSet = dict[str, Any]
"""One `sharedCounters[]` entry of a ResourceSlice, as the API's JSON."""

# (architecture, CUDA compute capability) by catalogue product: NVIDIA's published figures.
_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "A30-24GB": ("Ampere", "8.0"),
    "A100-SXM4-40GB": ("Ampere", "8.0"),
    "A100-PCIE-40GB": ("Ampere", "8.0"),
    "A100-SXM4-80GB": ("Ampere", "8.0"),
    "A100-PCIE-80GB": ("Ampere", "8.0"),
    "PG506-232": ("Ampere", "8.0"),
    "H100-SXM5-80GB": ("Hopper", "9.0"),
    "H100-PCIE-80GB": ("Hopper", "9.0"),
    "H100-NVL-94GB": ("Hopper", "9.0"),
    "H100-96GB": ("Hopper", "9.0"),
    "H20-96GB": ("Hopper", "9.0"),
    "H200-141GB": ("Hopper", "9.0"),
    "GH200-144GB": ("Hopper", "9.0"),
    "B200-180GB": ("Blackwell", "10.0"),
    "GB200-186GB": ("Blackwell", "10.0"),
    "B300-269GB": ("Blackwell", "10.3"),
    "GB300-278GB": ("Blackwell", "10.3"),
    "RTX-PRO-6000-96GB": ("Blackwell", "12.0"),
}

MIN_SHARED_MEMORY_MIB = 1
"""The smallest memory share a claim is given (its request is rounded up to whole MiB)."""


class Order(StrEnum):
    """How MIG placements are ordered in their profile's slice (the scheduler takes the first fit)."""

    GPUPART = "gpupart"
    """Least stranded future demand first, across the node's GPUs (docs/adr-032-dra-slices-by-profile.md)."""
    NVIDIA = "nvidia"
    """Lexicographic by device name, as NVIDIA's driver publishes."""


@dataclass(frozen=True, slots=True)
class GpuFacts:
    """What the node agent read about one GPU beyond its `OfferedGpu` view; empty: unknown."""

    pci_bus_id: str = ""
    driver_version: str = ""
    cuda_compute_capability: str = ""
    """NVML's ``major.minor``; else the table's for a catalogued product."""
    architecture: str = ""


@dataclass(frozen=True, slots=True)
class DraGpu:
    """One GPU as DRA publishes it: the view, its MIG model, and how its MIG devices are offered."""

    gpu: OfferedGpu
    model: GpuModel | None = None
    """Required for MIG; for a whole or shared GPU it names the architecture when catalogued."""
    dynamic: bool = False
    """`spec.mig.dynamic`: publish every placement, instances are made when a claim is prepared."""
    profiles: tuple[str, ...] | None = None
    """The profiles a dynamic GPU may offer (`spec.mig.dynamic.profiles`); None: all."""
    in_use: tuple[MigInstance, ...] = ()
    """Dynamic: placements our claims hold now (they order the rest; they stay published)."""
    foreign: tuple[MigInstance, ...] = ()
    """Dynamic: instances on the GPU that no claim of ours holds (made by someone else)."""
    facts: GpuFacts = GpuFacts()


@dataclass(frozen=True, slots=True)
class GpuDevices:
    """One GPU's devices and the counter set they consume (dynamic MIG), with each device's
    rank in its slice across the node's GPUs (`pool_slices` merges the GPUs by it)."""

    index: int
    devices: tuple[Device, ...]
    counters: CounterSet | None = None
    ranks: tuple[Rank, ...] = ()
    """One per device, lower first; empty: by name (NVIDIA's order)."""


def gpu_devices(gpu: DraGpu, *, mix: Mix | None = None, order: Order = Order.GPUPART) -> GpuDevices:
    """The devices of one GPU for its mode; a MIG GPU without a model raises InvalidInput."""
    view = gpu.gpu
    where = f"gpu {view.index}"
    mix = mix or Mix()
    if view.mode is Mode.MIG:
        model = gpu.model
        if model is None:
            raise InvalidInput(f"{where}.model", "a MIG GPU needs its MIG model to be published")
        if gpu.dynamic:
            return _dynamic(gpu, model, mix, order)
        return _static(gpu, model, order)
    device = _shared(gpu) if view.mode.is_shared else _whole(gpu)
    found = GpuDevices(view.index, (device,), ranks=((view.index,),))
    _check(found, where)
    return found


def _common(gpu: DraGpu) -> dict[str, dict[str, Any]]:
    """Attributes every device of the GPU carries: product, architecture, CUDA, driver, bus."""
    facts = gpu.facts
    known = _ARCHITECTURES.get(gpu.model.product) if gpu.model is not None else None
    attributes: dict[str, dict[str, Any]] = {
        names.PRODUCT_NAME: {"string": gpu.gpu.product[: names.MAX_STRING_ATTRIBUTE]}
    }
    architecture = facts.architecture or (known[0] if known else "")
    if architecture:
        attributes[names.ARCHITECTURE] = {"string": architecture[: names.MAX_STRING_ATTRIBUTE]}
    capability = names.version_text(facts.cuda_compute_capability or (known[1] if known else ""))
    if capability:
        attributes[names.CUDA_COMPUTE_CAPABILITY] = {"version": capability}
    driver = names.version_text(facts.driver_version)
    if driver:
        attributes[names.DRIVER_VERSION] = {"version": driver}
    if facts.pci_bus_id:
        attributes[names.PCI_BUS_ID] = {"string": facts.pci_bus_id[: names.MAX_STRING_ATTRIBUTE]}
    return attributes


def _whole(gpu: DraGpu) -> Device:
    view = gpu.gpu
    return {
        "name": names.gpu_device_name(view.index),
        "attributes": {
            names.TYPE: {"string": names.TYPE_GPU},
            names.UUID: {"string": view.uuid},
            names.INDEX: {"int": view.index},
            **_common(gpu),
        },
        "capacity": {names.MEMORY: {"value": names.mib(view.memory_mib)}},
    }


def _shared(gpu: DraGpu) -> Device:
    """One device many claims share; on MPS no claim may ask more than the daemon lets one
    client hold (ADR 033), so the scheduler never allocates what prepare would refuse."""
    view = gpu.gpu
    replicas = max(1, view.replicas)
    memory = view.memory_mib
    most_memory, most_compute = memory, 100
    if view.mode is Mode.MPS and view.mps_memory_mib > 0:
        most_memory = min(memory, view.mps_memory_mib)
        most_compute = min(100, max(1, view.mps_compute_percent))
    default_memory = min(most_memory, max(MIN_SHARED_MEMORY_MIB, memory // replicas))
    default_compute = min(most_compute, max(1, 100 // replicas))
    return {
        "name": names.shared_device_name(view.index),
        "allowMultipleAllocations": True,
        "attributes": {
            names.TYPE: {"string": names.TYPE_SHARED},
            names.UUID: {"string": view.uuid},
            names.INDEX: {"int": view.index},
            names.SHARING: {"string": str(view.mode)},
            names.REPLICAS: {"int": view.replicas},
            **_common(gpu),
        },
        "capacity": {
            names.MEMORY: {
                "value": names.mib(memory),
                "requestPolicy": {
                    "default": names.mib(default_memory),
                    "validRange": {
                        "min": names.mib(MIN_SHARED_MEMORY_MIB),
                        "max": names.mib(most_memory),
                        "step": names.mib(1),
                    },
                },
            },
            names.COMPUTE: {
                "value": "100",
                "requestPolicy": {
                    "default": str(default_compute),
                    "validRange": {"min": "1", "max": str(most_compute), "step": "1"},
                },
            },
        },
    }


def _mig_device(
    gpu: DraGpu,
    profile: MigProfile,
    instance: MigInstance,
    *,
    uuid: str = "",
    counters: Mapping[str, str] | None = None,
) -> Device:
    view = gpu.gpu
    attributes: dict[str, dict[str, Any]] = {
        names.TYPE: {"string": names.TYPE_MIG},
        names.PROFILE: {"string": profile.name},
        names.PARENT_UUID: {"string": view.uuid},
        names.PARENT_INDEX: {"int": view.index},
        names.PLACEMENT_START: {"int": instance.placement.start},
        names.PLACEMENT_SIZE: {"int": instance.placement.size},
        names.COMPUTE_SLICES: {"int": profile.compute_slices},
        **_common(gpu),
    }
    if uuid:
        attributes[names.UUID] = {"string": uuid}
    device: Device = {
        "name": names.mig_device_name(view.index, profile.name, instance.placement.start),
        "attributes": attributes,
        "capacity": {names.MEMORY: {"value": names.mib(profile.memory_mib)}},
    }
    if counters is not None:
        device["consumesCounters"] = [
            {"counterSet": names.counter_set_name(view.index), "counters": _values(counters)}
        ]
    return device


def _static(gpu: DraGpu, model: GpuModel, order: Order) -> GpuDevices:
    view = gpu.gpu
    instances = sorted(
        view.mig, key=lambda m: (m.instance.placement.size, m.instance.placement.start)
    )
    devices = []
    for mig in instances:
        profile = model.require_profile(mig.instance.profile)
        devices.append(_mig_device(gpu, profile, mig.instance, uuid=mig.uuid))
    # an instance that exists is used before any GPU's placement to be made, smaller first
    ranks = tuple(
        (-1, float(m.instance.placement.size), 0, 0, m.instance.placement.start, view.index)
        for m in instances
    )
    found = GpuDevices(view.index, tuple(devices), ranks=ranks if order is Order.GPUPART else ())
    _check(found, f"gpu {view.index}")
    return found


def counter_capacity(model: GpuModel) -> dict[str, str]:
    """A GPU's counters: one per memory slice, compute slices, the media engines and the
    instance limits that the others do not already imply (so that the counters allow a set of
    placements exactly when `check_layout` accepts it). Nothing implied is published: the
    scheduler converts every counter of a node's devices again in each of its Filter calls
    (docs/adr-032-dra-slices-by-profile.md), so no MiB counter (the memory slices imply it)
    and no engine counter that every profile takes in proportion to its compute slices."""
    counters = {names.memory_slice_counter(s): "1" for s in range(model.memory_slices)}
    counters[names.COUNTER_COMPUTE_SLICES] = str(model.compute_slices)
    implied = _implied_engines(model)
    counters.update(
        {k: str(v) for k, v in _engine_counters(model.engines).items() if v and k not in implied}
    )
    if _needs_instance_counter(model):
        counters[names.COUNTER_INSTANCES] = str(model.max_instances)
    for profile in model.profiles:
        if _needs_profile_counter(profile):
            counters[names.profile_counter(profile.name)] = str(profile.max_count)
    return counters


def placement_consumption(model: GpuModel, profile: MigProfile, start: int) -> dict[str, str]:
    """What one instance of `profile` at `start` takes from its GPU's counters."""
    capacity = counter_capacity(model)
    taken = {
        names.memory_slice_counter(s): "1" for s in range(start, start + profile.memory_slices)
    }
    taken[names.COUNTER_COMPUTE_SLICES] = str(profile.compute_slices)
    taken.update(
        {k: str(v) for k, v in _engine_counters(profile.engines).items() if v and k in capacity}
    )
    if names.COUNTER_INSTANCES in capacity:
        taken[names.COUNTER_INSTANCES] = "1"
    counter = names.profile_counter(profile.name)
    if counter in capacity:
        taken[counter] = "1"
    return taken


def _dynamic(gpu: DraGpu, model: GpuModel, mix: Mix, order: Order) -> GpuDevices:
    view = gpu.gpu
    where = f"gpu {view.index}"
    allowed = [p for p in model.profiles if gpu.profiles is None or p.name in gpu.profiles]
    foreign = tuple(sorted(gpu.foreign))
    for instance in foreign:
        model.require_profile(instance.profile)
    capacity = _less(model, counter_capacity(model), foreign)
    placements = [
        MigInstance(Placement(start, p.memory_slices), p.name)
        for p in allowed
        for start in p.starts
        if not any(f.placement.overlaps(Placement(start, p.memory_slices)) for f in foreign)
    ]
    ranks = placement_ranks(model, view.index, placements, (*gpu.in_use, *foreign), mix)
    ordered = sorted(placements, key=lambda i: ranks[i])
    devices = [
        _mig_device(
            gpu,
            model.require_profile(i.profile),
            i,
            counters=placement_consumption(
                model, model.require_profile(i.profile), i.placement.start
            ),
        )
        for i in ordered
    ]
    counter_set: CounterSet = {
        "name": names.counter_set_name(view.index),
        "counters": _values(capacity),
    }
    found = GpuDevices(
        view.index,
        tuple(devices),
        counter_set,
        tuple(ranks[i] for i in ordered) if order is Order.GPUPART else (),
    )
    _check(found, where)
    return found


def _less(
    model: GpuModel, capacity: dict[str, str], foreign: Iterable[MigInstance]
) -> dict[str, str]:
    """The counters left once the instances someone else made take theirs (at least 0 each)."""
    left = {name: int(value) for name, value in capacity.items()}
    for instance in foreign:
        profile = model.require_profile(instance.profile)
        taken = placement_consumption(model, profile, instance.placement.start)
        for name, value in taken.items():
            left[name] = max(0, left[name] - int(value))
    return {name: str(value) for name, value in left.items()}


def _engine_counters(engines: MediaEngines) -> dict[str, int]:
    return {
        names.COUNTER_DECODERS: engines.decoders,
        names.COUNTER_ENCODERS: engines.encoders,
        names.COUNTER_JPEG: engines.jpeg,
        names.COUNTER_OFA: engines.ofa,
    }


def _implied_engines(model: GpuModel) -> frozenset[str]:
    """The engine counters whose limit another counter already is: each profile takes of it
    in the same proportion to the GPU's total as of compute slices, or of an engine counter
    kept before it (so `Σ taken ≤ total` of the one holds exactly when it holds of the other)."""

    def shares(taken: Callable[[MigProfile], int], total: int) -> tuple[Fraction, ...]:
        return tuple(Fraction(taken(p), total) for p in model.profiles)

    kept = [shares(lambda p: p.compute_slices, model.compute_slices)]
    implied = set()
    totals = _engine_counters(model.engines)
    for name, total in totals.items():
        if not total:
            continue
        these = shares(lambda p, n=name: _engine_counters(p.engines)[n], total)  # type: ignore[misc]
        if these in kept:
            implied.add(name)
        else:
            kept.append(these)
    return frozenset(implied)


def _needs_instance_counter(model: GpuModel) -> bool:
    """Whether the compute slices alone would allow more instances than `max_instances`."""
    smallest = min((p.compute_slices for p in model.profiles), default=1)
    return model.compute_slices // max(1, smallest) > model.max_instances


def _needs_profile_counter(profile: MigProfile) -> bool:
    """Whether more instances of `profile` fit side by side than its `max_count`."""
    end = -1
    disjoint = 0
    for start in sorted(profile.starts):
        if start > end:
            disjoint += 1
            end = start + profile.memory_slices - 1
    return profile.max_count < disjoint


def _values(counters: Mapping[str, str]) -> dict[str, dict[str, str]]:
    return {name: {"value": value} for name, value in counters.items()}


def _check(found: GpuDevices, where: str) -> None:
    """The API's per-device and per-counter-set limits, as a clear error before any write."""
    seen: set[str] = set()
    for device in found.devices:
        name = names.check_dns_label(str(device["name"]), f"{where}.devices.name")
        if name in seen:
            raise InvalidInput(f"{where}.devices.{name}", "two devices have this name")
        seen.add(name)
        fields = len(device.get("attributes", {})) + len(device.get("capacity", {}))
        if fields > names.MAX_ATTRIBUTES_AND_CAPACITIES:
            raise InvalidInput(
                f"{where}.devices.{name}",
                f"{fields} attributes and capacities, the API allows "
                f"{names.MAX_ATTRIBUTES_AND_CAPACITIES}",
            )
        consumes = device.get("consumesCounters", [])
        if len(consumes) > names.MAX_CONSUMES_PER_DEVICE:
            raise InvalidInput(f"{where}.devices.{name}", "consumes more than 2 counter sets")
        for entry in consumes:
            if len(entry["counters"]) > names.MAX_COUNTERS_PER_CONSUMPTION:
                raise InvalidInput(
                    f"{where}.devices.{name}.consumesCounters",
                    f"{len(entry['counters'])} counters, the API allows "
                    f"{names.MAX_COUNTERS_PER_CONSUMPTION}",
                )
    if found.counters is not None:
        count = len(found.counters["counters"])
        if count > names.MAX_COUNTERS_PER_SET:
            raise InvalidInput(
                f"{where}.sharedCounters",
                f"{count} counters, the API allows {names.MAX_COUNTERS_PER_SET} per set",
            )
