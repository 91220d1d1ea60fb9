"""GpuPartition (gpupart.io/v1alpha1) as a domain value: strict parsing, node selection, per-GPU checks."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from gpupart.core.catalogue import GpuModel, parse_profile_name
from gpupart.core.errors import InvalidInput
from gpupart.core.mig import Layout, require_counts, solve_layout
from gpupart.core.records import Record
from gpupart.core.resources import parse_memory_mib

API_VERSION = "gpupart.io/v1alpha1"
KIND = "GpuPartition"
MPS_MAX_CLIENTS = 48
"""CUDA MPS's client limit per GPU on Volta and later."""


class Mode(StrEnum):
    MIG = "MIG"
    MPS = "MPS"
    TIME_SLICING = "TimeSlicing"
    NONE = "None"


class Disruption(StrEnum):
    WHEN_IDLE = "WhenIdle"
    NEVER = "Never"


_MODE_BLOCKS = {Mode.MIG: "mig", Mode.MPS: "mps", Mode.TIME_SLICING: "timeSlicing", Mode.NONE: ""}


@dataclass(frozen=True, slots=True)
class LabelRequirement:
    key: str
    operator: str
    values: tuple[str, ...]

    def matches(self, labels: Mapping[str, str]) -> bool:
        if self.operator == "In":
            return labels.get(self.key) in self.values
        if self.operator == "NotIn":
            return labels.get(self.key) not in self.values
        if self.operator == "Exists":
            return self.key in labels
        return self.key not in labels  # DoesNotExist


@dataclass(frozen=True, slots=True)
class NodeSelector:
    """A metav1.LabelSelector: all labels and all expressions must match; empty selects all."""

    match_labels: tuple[tuple[str, str], ...] = ()
    match_expressions: tuple[LabelRequirement, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        return all(labels.get(k) == v for k, v in self.match_labels) and all(
            r.matches(labels) for r in self.match_expressions
        )


@dataclass(frozen=True, slots=True)
class MpsSettings:
    max_clients: int
    default_memory_mib: int | None = None
    default_compute_percent: int | None = None


@dataclass(frozen=True, slots=True)
class PartitionSpec:
    name: str
    generation: int
    node_selector: NodeSelector
    gpus: tuple[int, ...] | None
    """GPU indices on each selected node; None means every GPU."""
    mode: Mode
    mig: tuple[tuple[str, int], ...] = ()
    mps: MpsSettings | None = None
    replicas: int | None = None
    disruption: Disruption = Disruption.WHEN_IDLE
    priority: int = 0

    @property
    def mig_counts(self) -> dict[str, int]:
        return dict(self.mig)


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
            spec.path("mode"), f"{mode_text!r} is not a mode (one of {', '.join(Mode)})"
        ) from None
    for block_mode, block in _MODE_BLOCKS.items():
        if block and spec.has(block) and block_mode != mode:
            raise InvalidInput(
                spec.path(block),
                f"is set but mode is {mode}; set only {_MODE_BLOCKS[mode] or 'no block'}",
            )
    parsed = PartitionSpec(
        name=name,
        generation=generation,
        node_selector=_parse_selector(spec.optional_record("nodeSelector")),
        gpus=_parse_gpus(spec),
        mode=mode,
        mig=_parse_mig(spec) if mode is Mode.MIG else (),
        mps=_parse_mps(spec.record("mps")) if mode is Mode.MPS else None,
        replicas=spec.record("timeSlicing").integer("replicas", minimum=1)
        if mode is Mode.TIME_SLICING
        else None,
        disruption=_parse_disruption(spec),
        priority=spec.integer("priority", 0),
    )
    spec.done()
    return parsed


def _parse_selector(record: Record | None) -> NodeSelector:
    if record is None:
        return NodeSelector()
    labels = record.optional_record("matchLabels")
    match_labels: list[tuple[str, str]] = []
    if labels is not None:
        for key in sorted(labels.raw):
            match_labels.append((key, labels.string(key)))
        labels.done()
    expressions = record.each("matchExpressions", _parse_requirement)
    record.done()
    return NodeSelector(tuple(match_labels), tuple(expressions))


def _parse_requirement(expression: Record) -> LabelRequirement:
    operator = expression.string("operator")
    if operator not in ("In", "NotIn", "Exists", "DoesNotExist"):
        raise InvalidInput(
            expression.path("operator"),
            f"{operator!r} is not In, NotIn, Exists or DoesNotExist",
        )
    values = tuple(str(v) for v in expression.items("values"))
    if operator in ("In", "NotIn") and not values:
        raise InvalidInput(expression.path("values"), f"{operator} needs at least one value")
    return LabelRequirement(expression.string("key"), operator, values)


def _parse_gpus(spec: Record) -> tuple[int, ...] | None:
    indices = spec.items("gpus")
    if not spec.has("gpus"):
        return None
    for position, index in enumerate(indices):
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise InvalidInput(
                f"{spec.path('gpus')}[{position}]", f"must be a GPU index ≥ 0, got {index!r}"
            )
    if len(set(indices)) != len(indices):
        raise InvalidInput(spec.path("gpus"), f"lists a GPU index twice: {indices}")
    return tuple(sorted(indices))


def _parse_mig(spec: Record) -> tuple[tuple[str, int], ...]:
    mig = spec.record("mig")
    devices = mig.record("devices")
    counts = []
    for profile in sorted(devices.raw):
        parse_profile_name(profile, where=devices.path(profile))
        counts.append((profile, devices.integer(profile, minimum=0)))
    devices.done()
    mig.done()
    if not any(count for _, count in counts):
        raise InvalidInput(
            devices.where, "asks for no MIG instance; use mode None for an unpartitioned GPU"
        )
    return tuple(counts)


def _parse_mps(mps: Record) -> MpsSettings:
    max_clients = mps.integer("maxClients", minimum=1)
    if max_clients > MPS_MAX_CLIENTS:
        raise InvalidInput(
            mps.path("maxClients"), f"CUDA MPS serves at most {MPS_MAX_CLIENTS} clients per GPU"
        )
    memory = None
    if mps.has("defaultMemory"):
        memory = parse_memory_mib(mps.value("defaultMemory"), where=mps.path("defaultMemory"))
    compute = None
    if mps.has("defaultComputePercent"):
        compute = mps.integer("defaultComputePercent", minimum=1)
        if compute > 100:
            raise InvalidInput(mps.path("defaultComputePercent"), "is a percentage, at most 100")
    mps.done()
    return MpsSettings(max_clients, memory, compute)


def _parse_disruption(spec: Record) -> Disruption:
    text = spec.string("disruption", Disruption.WHEN_IDLE.value)
    try:
        return Disruption(text)
    except ValueError:
        raise InvalidInput(spec.path("disruption"), f"{text!r} is not WhenIdle or Never") from None


def plan_gpu_layout(spec: PartitionSpec, model: GpuModel) -> Layout:
    """The layout each selected GPU of `model` gets; InvalidInput/InfeasibleLayout name the problem."""
    require_counts(model, spec.mig_counts, where="spec.mig.devices")
    return solve_layout(model, spec.mig_counts)


def plan_gpu(spec: PartitionSpec, model: GpuModel) -> Layout:
    """Check that `spec` fits each selected GPU of `model`: its MIG layout (empty in other modes)."""
    if spec.mode is Mode.MIG:
        return plan_gpu_layout(spec, model)
    check_mps_fits(spec, model)
    return ()


def check_mps_fits(spec: PartitionSpec, model: GpuModel) -> None:
    """MPS defaults must fit the GPU: clients × memory ≤ GPU memory."""
    if spec.mps is None or spec.mps.default_memory_mib is None:
        return
    total = spec.mps.max_clients * spec.mps.default_memory_mib
    if total > model.memory_mib:
        raise InvalidInput(
            "spec.mps",
            f"{spec.mps.max_clients} clients × {spec.mps.default_memory_mib} MiB = {total} MiB, "
            f"more than the {model.memory_mib} MiB of a {model.product}",
        )
