"""GpuPartition (gpupart.io/v1alpha1) as a domain value: strict parsing, node selection, per-GPU checks."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from gpupart.core.api.records import Record
from gpupart.core.api.resources import check_profile_name, parse_memory_mib
from gpupart.core.api.selectors import (
    EVERYTHING,
    SELECTOR_OPERATORS,
    LabelSelector,
    Operator,
    Requirement,
    check_label_key,
    check_label_value,
    requirement,
    selector_of,
)
from gpupart.core.errors import InvalidInput, shown
from gpupart.core.mig.catalogue import GpuModel
from gpupart.core.mig.layout import Layout, require_counts, solve_layout

API_VERSION = "gpupart.io/v1alpha1"
KIND = "GpuPartition"
MPS_MAX_CLIENTS = 48
"""CUDA MPS's client limit per GPU on Volta and later."""
MAX_GPU_INDEX = 63
MAX_REPLICAS = 1024
MAX_MIG_COUNT = 7
"""No GPU has more than 7 compute slices, so no profile is placed more than 7 times."""
INT32 = 2**31 - 1
MAX_MIG_PROFILES = 16
MAX_SELECTOR_TERMS = 64
"""matchLabels entries, matchExpressions and values per expression: the CRD's bounds."""


class Mode(StrEnum):
    MIG = "MIG"
    MPS = "MPS"
    TIME_SLICING = "TimeSlicing"
    NONE = "None"

    @property
    def is_shared(self) -> bool:
        """Whether pods share the GPU through client slots (MPS or time-slicing)."""
        return self in (Mode.MPS, Mode.TIME_SLICING)


class Interface(StrEnum):
    """The kubelet interface a GPU is served through (`spec.interface`); never both at once."""

    DEVICE_PLUGIN = "devicePlugin"
    """Extended resources from the device plugin (`nvidia.com/gpu`, `nvidia.com/mig-<profile>`)."""
    DRA = "dra"
    """DRA devices in the node's ResourceSlices (driver `gpu.gpupart.io`, docs/dra.md)."""


class Disruption(StrEnum):
    WHEN_IDLE = "WhenIdle"
    NEVER = "Never"


_MODE_BLOCKS = {Mode.MIG: "mig", Mode.MPS: "mps", Mode.TIME_SLICING: "timeSlicing", Mode.NONE: ""}

DEFAULT_MIN_IDLE_S = 60
"""An idle instance younger than this is not merged into the warm mix (hysteresis); a pending
pod that needs its memory slices may reclaim it at once."""
MAX_MIN_IDLE_S = 86_400


@dataclass(frozen=True, slots=True)
class DynamicMig:
    """A GpuPartition's dynamic MIG policy (`spec.mig.dynamic`)."""

    profiles: tuple[str, ...] | None = None
    """Profiles the planner may create; None: all of the GPU model's."""
    warm: tuple[tuple[str, int], ...] = ()
    """Instances kept ready on GPUs that hold nothing in use or reserved."""
    min_idle_s: int = DEFAULT_MIN_IDLE_S
    """Seconds idle before an instance may be merged back to restore the warm mix (the
    hysteresis); a pending pod whose creation needs its memory slices reclaims it at any age."""
    carve_idle_gpus: bool = True
    """Whether a GPU with no instance at all may be carved."""

    def allows(self, profile: str) -> bool:
        return self.profiles is None or profile in self.profiles

    @property
    def warm_counts(self) -> dict[str, int]:
        return {name: count for name, count in self.warm if count}


DEFAULT_DYNAMIC = DynamicMig()


@dataclass(frozen=True, slots=True)
class MpsSettings:
    """The MPS daemon's per-client defaults (`spec.mps`); None leaves an even share per client."""

    default_memory_mib: int | None = None
    default_compute_percent: int | None = None


@dataclass(frozen=True, slots=True)
class GpuConfig:
    """What one GPU should be: the mode and its settings.

    One value from `spec` (where a partition asks for it) through the desired annotation (where
    the operator writes it per node) to the node agent (where it is the GPU's target).
    """

    mode: Mode
    mig: tuple[tuple[str, int], ...] = ()
    """MIG instances per profile: the static layout (`spec.mig.devices`) or dynamic MIG's warm mix."""
    mps: MpsSettings | None = None
    """Set in mode MPS."""
    replicas: int = 0
    """Client slots per shared GPU (`nvidia.com/gpu.shared` devices, NVIDIA's "replicas"):
    `spec.mps.maxClients` in mode MPS, `spec.timeSlicing.replicas` in mode TimeSlicing, else 0."""
    disruption: Disruption = Disruption.WHEN_IDLE
    dynamic: bool = False
    """MIG instances follow the operator's plans (`gpupart.io/mig-plan`), exact placements on
    demand; `mig` is then only the warm mix the plans keep on otherwise idle GPUs."""
    interface: Interface = Interface.DEVICE_PLUGIN
    """How the GPU reaches pods: the device plugin's extended resources, or DRA devices."""
    dynamic_profiles: tuple[str, ...] | None = None
    """Dynamic MIG through DRA only: the profiles whose placements it publishes
    (`spec.mig.dynamic.profiles`); None: all. Set only with `interface: dra`, so the desired
    annotation of a device-plugin partition keeps its bytes (the planner reads the profiles
    from the partition itself)."""

    @property
    def mig_counts(self) -> dict[str, int]:
        return dict(self.mig)


@dataclass(frozen=True, slots=True)
class PartitionSpec:
    name: str
    generation: int
    node_selector: LabelSelector
    gpus: tuple[int, ...] | None
    """GPU indices on each selected node; None means every GPU."""
    config: GpuConfig
    """What each selected GPU becomes."""
    dynamic: DynamicMig | None = None
    """`spec.mig.dynamic`: instances created on demand; None keeps the static layout."""
    priority: int = 0
    restore_on_delete: bool = False
    """`spec.restoreOnDelete`: deleting the partition returns its GPUs to whole GPUs (MIG
    instances destroyed once no pod uses them, MPS and time-slicing off) before the finalizer
    goes; False leaves them as they are (docs/adr-018-restore-on-delete.md)."""


def parse_partition(raw: Mapping[str, Any]) -> PartitionSpec:
    """A GpuPartition object (as from YAML or the API server) into a PartitionSpec."""
    top = Record(raw, "")
    api_version, kind = top.string("apiVersion", ""), top.string("kind", "")
    if (api_version, kind) != (API_VERSION, KIND):
        raise InvalidInput(
            "apiVersion/kind",
            f"expected {API_VERSION} {KIND}, got {api_version or '?'} {kind or '?'}",
        )
    meta = top.record("metadata")
    name = meta.string("name")
    generation = meta.integer("generation", 0)
    top.optional_record("status")
    spec = top.record("spec")
    top.done()
    mode_text = spec.string("mode")
    try:
        mode = Mode(mode_text)
    except ValueError:
        raise InvalidInput(
            spec.path("mode"), f"{shown(mode_text)} is not a mode (one of {', '.join(Mode)})"
        ) from None
    for block_mode, block in _MODE_BLOCKS.items():
        if block and spec.has(block) and block_mode != mode:
            raise InvalidInput(
                spec.path(block),
                f"is set but mode is {mode}; set only {_MODE_BLOCKS[mode] or 'no block'}",
            )
    mig, dynamic = _parse_mig(spec) if mode is Mode.MIG else ((), None)
    node_selector = _parse_selector(spec.optional_record("nodeSelector"))
    gpus = _parse_gpus(spec)
    mps, replicas = None, 0
    if mode is Mode.MPS:
        mps, replicas = _parse_mps(spec.record("mps"))
    elif mode is Mode.TIME_SLICING:
        replicas = spec.record("timeSlicing").integer("replicas", minimum=1, maximum=MAX_REPLICAS)
    interface = _parse_interface(spec)
    if interface is Interface.DRA and dynamic is not None:
        _check_dra_dynamic(spec.path("mig.dynamic"), dynamic)
    config = GpuConfig(
        mode,
        mig,
        mps,
        replicas,
        _parse_disruption(spec),
        dynamic=dynamic is not None,
        interface=interface,
        dynamic_profiles=(
            dynamic.profiles if dynamic is not None and interface is Interface.DRA else None
        ),
    )
    parsed = PartitionSpec(
        name,
        generation,
        node_selector,
        gpus,
        config,
        dynamic,
        _parse_priority(spec),
        spec.boolean("restoreOnDelete", False),
    )
    spec.done()
    return parsed


def _parse_selector(record: Record | None) -> LabelSelector:
    """`spec.nodeSelector`, a label selector; absent or `{}` selects every node (the CRD's rule)."""
    if record is None:
        return EVERYTHING
    labels = record.optional_record("matchLabels")
    found: list[Requirement] = []
    if labels is not None:
        _check_count(labels.where, len(labels.raw))
        for key in sorted(labels.raw):
            check_label_key(key, where=labels.where)
            value = check_label_value(labels.string(key), labels.path(key))
            found.append(requirement(key, Operator.IN, (value,), where=labels.path(key)))
        labels.done()
    _check_count(record.path("matchExpressions"), len(record.items("matchExpressions")))
    found += record.each("matchExpressions", _parse_requirement)
    record.done()
    return selector_of(found)


def _parse_requirement(expression: Record) -> Requirement:
    operator = expression.string("operator")
    if operator not in SELECTOR_OPERATORS:
        raise InvalidInput(
            expression.path("operator"),
            f"{shown(operator)} is not In, NotIn, Exists or DoesNotExist",
        )
    where = expression.path("values")
    raw = expression.items("values")
    _check_count(where, len(raw))
    values = []
    for position, value in enumerate(raw):
        if not isinstance(value, str):
            raise InvalidInput(f"{where}[{position}]", f"must be a label value, got {value!r:.40}")
        values.append(check_label_value(value, f"{where}[{position}]"))
    if operator in ("In", "NotIn") and not values:
        raise InvalidInput(where, f"{operator} needs at least one value")
    if operator in ("Exists", "DoesNotExist") and values:
        raise InvalidInput(where, f"{operator} takes no values")
    key = check_label_key(expression.string("key"), where=expression.path("key"))
    return requirement(key, Operator(operator), values, where=expression.where)


def _check_count(where: str, count: int) -> None:
    if count > MAX_SELECTOR_TERMS:
        raise InvalidInput(where, f"has {count} entries; at most {MAX_SELECTOR_TERMS}")


def _parse_gpus(spec: Record) -> tuple[int, ...] | None:
    indices = spec.items("gpus")
    if not spec.has("gpus"):
        return None
    if len(indices) > MAX_GPU_INDEX + 1:
        raise InvalidInput(
            spec.path("gpus"), f"lists {len(indices)} GPUs; at most {MAX_GPU_INDEX + 1}"
        )
    for position, index in enumerate(indices):
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index <= MAX_GPU_INDEX:
            raise InvalidInput(
                f"{spec.path('gpus')}[{position}]",
                f"must be a GPU index from 0 to {MAX_GPU_INDEX}, got {index!r:.40}",
            )
    if len(set(indices)) != len(indices):
        raise InvalidInput(spec.path("gpus"), f"lists a GPU index twice: {indices}")
    return tuple(sorted(indices))


def _parse_mig(spec: Record) -> tuple[tuple[tuple[str, int], ...], DynamicMig | None]:
    """The static layout, or the dynamic policy and its warm mix: exactly one of the two."""
    mig = spec.record("mig")
    if mig.has("devices") and mig.has("dynamic"):
        raise InvalidInput(
            mig.where, "set only one of devices (a static layout) and dynamic (instances on demand)"
        )
    if not mig.has("devices") and not mig.has("dynamic"):
        raise InvalidInput(
            mig.path("devices"), "is required (or spec.mig.dynamic for instances on demand)"
        )
    if mig.has("dynamic"):
        dynamic = _parse_dynamic(mig.record("dynamic"))
        mig.done()
        return dynamic.warm, dynamic
    devices = mig.record("devices")
    counts = _parse_counts(devices)
    mig.done()
    if not any(count for _, count in counts):
        raise InvalidInput(
            devices.where, "asks for no MIG instance; use mode None for an unpartitioned GPU"
        )
    return counts, None


def _parse_counts(devices: Record) -> tuple[tuple[str, int], ...]:
    counts = []
    if len(devices.raw) > MAX_MIG_PROFILES:
        raise InvalidInput(
            devices.where, f"names {len(devices.raw)} profiles; at most {MAX_MIG_PROFILES}"
        )
    for profile in sorted(devices.raw):
        check_profile_name(profile, where=devices.path(profile))
        counts.append((profile, devices.integer(profile, minimum=0, maximum=MAX_MIG_COUNT)))
    devices.done()
    return tuple(counts)


def _parse_dynamic(dynamic: Record) -> DynamicMig:
    profiles: tuple[str, ...] | None = None
    if dynamic.has("profiles"):
        raw = dynamic.items("profiles")
        where = dynamic.path("profiles")
        if not raw or len(raw) > MAX_MIG_PROFILES:
            raise InvalidInput(where, f"lists {len(raw)} profiles; 1 to {MAX_MIG_PROFILES}")
        for position, name in enumerate(raw):
            if not isinstance(name, str):
                raise InvalidInput(
                    f"{where}[{position}]", f"must be a profile name, got {name!r:.40}"
                )
            check_profile_name(name, where=f"{where}[{position}]")
        if len(set(raw)) != len(raw):
            raise InvalidInput(where, "lists a profile twice")
        profiles = tuple(sorted(raw))
    warm: tuple[tuple[str, int], ...] = ()
    warm_record = dynamic.optional_record("warm")
    if warm_record is not None:
        warm = tuple((p, n) for p, n in _parse_counts(warm_record) if n)
        outside = [p for p, _ in warm if profiles is not None and p not in profiles]
        if outside:
            raise InvalidInput(
                warm_record.path(outside[0]), "is not among spec.mig.dynamic.profiles"
            )
    parsed = DynamicMig(
        profiles=profiles,
        warm=warm,
        min_idle_s=dynamic.integer(
            "minIdleSeconds", DEFAULT_MIN_IDLE_S, minimum=0, maximum=MAX_MIN_IDLE_S
        ),
        carve_idle_gpus=dynamic.boolean("carveIdleGpus", True),
    )
    dynamic.done()
    return parsed


def _parse_mps(mps: Record) -> tuple[MpsSettings, int]:
    """The MPS defaults and the replicas (`maxClients`)."""
    replicas = mps.integer("maxClients", minimum=1)
    if replicas > MPS_MAX_CLIENTS:
        raise InvalidInput(
            mps.path("maxClients"), f"CUDA MPS serves at most {MPS_MAX_CLIENTS} clients per GPU"
        )
    memory = None
    if mps.has("defaultMemory"):
        memory = parse_memory_mib(mps.value("defaultMemory"), where=mps.path("defaultMemory"))
    compute = None
    if mps.has("defaultComputePercent"):
        compute = mps.integer("defaultComputePercent", minimum=1, maximum=100)
    mps.done()
    return MpsSettings(memory, compute), replicas


def _parse_interface(spec: Record) -> Interface:
    """`spec.interface`; absent: the device plugin, as before the field existed."""
    text = spec.string("interface", Interface.DEVICE_PLUGIN.value)
    try:
        return Interface(text)
    except ValueError:
        raise InvalidInput(
            spec.path("interface"),
            f"{shown(text)} is not an interface (one of {', '.join(Interface)})",
        ) from None


def _check_dra_dynamic(where: str, dynamic: DynamicMig) -> None:
    """What dynamic MIG through DRA cannot honour: the operator's MIG plans keep the warm mix
    and leave idle GPUs whole, and a DRA GPU gets no plan (its instances follow the claims)."""
    if dynamic.warm:
        raise InvalidInput(
            f"{where}.warm",
            "is kept by the operator's MIG plans, and a GPU served through DRA gets none (its "
            "instances follow the claims the scheduler allocates); remove warm, or use "
            "interface devicePlugin",
        )
    if not dynamic.carve_idle_gpus:
        raise InvalidInput(
            f"{where}.carveIdleGpus",
            "false is honoured by the operator's MIG plans, and a GPU served through DRA gets "
            "none (every placement is published); remove it, or use interface devicePlugin",
        )


def _parse_disruption(spec: Record) -> Disruption:
    text = spec.string("disruption", Disruption.WHEN_IDLE.value)
    try:
        return Disruption(text)
    except ValueError:
        raise InvalidInput(
            spec.path("disruption"), f"{shown(text)} is not WhenIdle or Never"
        ) from None


def _parse_priority(spec: Record) -> int:
    return spec.integer("priority", 0, minimum=-INT32 - 1, maximum=INT32)  # the CRD's int32


def plan_gpu_layout(spec: PartitionSpec, model: GpuModel) -> Layout:
    """The layout each selected GPU of `model` gets; InvalidInput/InfeasibleLayout name the problem.

    With dynamic MIG that is the warm mix (what an otherwise idle GPU is kept at).
    """
    where = "spec.mig.dynamic.warm" if spec.dynamic is not None else "spec.mig.devices"
    counts = spec.config.mig_counts
    require_counts(model, counts, where=where)
    return solve_layout(model, counts)


def plan_gpu(spec: PartitionSpec, model: GpuModel) -> Layout:
    """Check that `spec` fits each selected GPU of `model`: its MIG layout (empty in other modes)."""
    if spec.config.mode is Mode.MIG:
        return plan_gpu_layout(spec, model)
    _check_mps_fits(spec.config, model)
    return ()


def _check_mps_fits(config: GpuConfig, model: GpuModel) -> None:
    """MPS defaults must fit the GPU: clients × memory ≤ GPU memory."""
    if config.mps is None or config.mps.default_memory_mib is None:
        return
    memory = config.mps.default_memory_mib
    total = config.replicas * memory
    if total > model.memory_mib:
        raise InvalidInput(
            "spec.mps",
            f"{config.replicas} clients × {memory} MiB = {total} MiB, "
            f"more than the {model.memory_mib} MiB of a {model.product}",
        )
