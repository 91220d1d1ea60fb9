"""Resource names that pods request, Kubernetes quantities, and a pod's GPU request as one typed value."""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from gpupart.core.catalogue import parse_profile_name
from gpupart.core.errors import InvalidInput

GPU = "nvidia.com/gpu"
GPU_SHARED = "nvidia.com/gpu.shared"
MIG_PREFIX = "nvidia.com/mig-"
GPU_MEMORY = "gpupart.io/gpu-memory"
"""Extender-managed: MiB of GPU memory a shared-GPU pod may use (MPS enforces it)."""
GPU_COMPUTE = "gpupart.io/gpu-compute"
"""Extender-managed: percent of the GPU's SMs a shared-GPU pod may use."""

# A GPU memory figure above this many MiB (16 TiB) is a unit slip such as "10Gi".
_MAX_SANE_MIB = 1 << 24

_SUFFIXED = re.compile(r"^(.*?gb)\.(me(?:\.all)?|gfx)$")
_QUANTITY = re.compile(
    r"^([+-]?(?:\d+\.?\d*|\.\d+))(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E|[eE][+-]?\d+)?$"
)
_SUFFIX = {
    "": Fraction(1),
    "n": Fraction(1, 10**9),
    "u": Fraction(1, 10**6),
    "m": Fraction(1, 1000),
    "k": Fraction(10**3),
    "M": Fraction(10**6),
    "G": Fraction(10**9),
    "T": Fraction(10**12),
    "P": Fraction(10**15),
    "E": Fraction(10**18),
    "Ki": Fraction(2**10),
    "Mi": Fraction(2**20),
    "Gi": Fraction(2**30),
    "Ti": Fraction(2**40),
    "Pi": Fraction(2**50),
    "Ei": Fraction(2**60),
}


def mig_resource_name(profile: str) -> str:
    """``nvidia.com/mig-<profile>``, with ``+`` spelled ``.`` as NVIDIA's device plugin does.

    Extended-resource names allow no ``+``, so ``1g.10gb+me`` is advertised as
    ``nvidia.com/mig-1g.10gb.me``.
    """
    return f"{MIG_PREFIX}{profile.replace('+', '.')}"


def find_mig_profile(resource: str) -> str | None:
    """The profile of a ``nvidia.com/mig-<profile>`` resource name, None for other names."""
    if not resource.startswith(MIG_PREFIX):
        return None
    name = resource.removeprefix(MIG_PREFIX)
    match = _SUFFIXED.match(name)
    return f"{match.group(1)}+{match.group(2)}" if match else name


def parse_quantity(text: object, *, where: str) -> Fraction:
    """A Kubernetes quantity ("1", "500m", "10Gi", "1e3") as an exact number."""
    if isinstance(text, int) and not isinstance(text, bool):
        return Fraction(text)
    if not isinstance(text, str):
        raise InvalidInput(where, f"must be a quantity such as 1 or 10Gi, got {text!r}")
    value = _quantity(text)
    if value is None:
        raise InvalidInput(where, f"{text!r} is not a Kubernetes quantity (e.g. 1, 500m, 10Gi)")
    return value


@functools.lru_cache(maxsize=4096)
def _quantity(text: str) -> Fraction | None:
    """Cached: a cluster's pods repeat a few quantities, and exact parsing is the slow part of
    reading a pod (the extender reads one per watch event)."""
    match = _QUANTITY.match(text.strip())
    if match is None:
        return None
    number, suffix = match.group(1), match.group(2) or ""
    if suffix[:1] in ("e", "E"):
        return Fraction(number) * Fraction(10) ** int(suffix[1:])
    return Fraction(number) * _SUFFIX[suffix]


def parse_memory_mib(text: object, *, where: str) -> int:
    """A memory quantity ("10Gi", "512Mi") as whole MiB, rounded up."""
    value = parse_quantity(text, where=where)
    if value <= 0:
        raise InvalidInput(where, f"must be more than 0, got {text!r}")
    return math.ceil(value / 2**20)


def _whole(value: Fraction, where: str, text: object) -> int:
    if value.denominator != 1 or value < 0:
        raise InvalidInput(where, f"must be a whole number ≥ 0, got {text!r}")
    return int(value)


@dataclass(frozen=True, slots=True)
class GpuRequest:
    """What one pod asks of GPUs, summed over its containers as the kube-scheduler does."""

    whole_gpus: int = 0
    mig: tuple[tuple[str, int], ...] = ()
    """(profile, count) pairs, sorted by profile."""
    shared: int = 0
    """Client slots on a shared (MPS or time-sliced) GPU."""
    memory_mib: int = 0
    compute_percent: int = 0

    @property
    def empty(self) -> bool:
        return not (self.whole_gpus or self.mig or self.shared)


def parse_pod_request(pod: Mapping[str, Any], *, where: str = "pod") -> GpuRequest:
    """One typed request from a pod object (or its spec); malformed quantities raise InvalidInput.

    Effective amount per resource = max(sum over containers, largest init container), the
    kube-scheduler's rule. Extended resources use limits, falling back to requests.
    """
    spec = pod.get("spec", pod)
    if not isinstance(spec, Mapping):
        raise InvalidInput(f"{where}.spec", "must be a mapping")
    totals = _sum_containers(spec.get("containers") or [], f"{where}.spec.containers")
    for name, amount in _sum_each(spec.get("initContainers") or [], f"{where}.spec.initContainers"):
        totals[name] = max(totals.get(name, (Fraction(0), ""))[0], amount[0]), amount[1]
    return _request_from_totals(totals, where)


def _sum_containers(containers: object, where: str) -> dict[str, tuple[Fraction, str]]:
    totals: dict[str, tuple[Fraction, str]] = {}
    for name, (amount, place) in _sum_each(containers, where):
        before = totals.get(name, (Fraction(0), place))[0]
        totals[name] = before + amount, place
    return totals


def _sum_each(containers: object, where: str) -> Iterable[tuple[str, tuple[Fraction, str]]]:
    if not isinstance(containers, list):
        raise InvalidInput(where, "must be a list")
    for position, container in enumerate(containers):
        place = f"{where}[{position}].resources"
        resources = (container.get("resources") or {}) if isinstance(container, Mapping) else None
        if not isinstance(resources, Mapping):
            raise InvalidInput(place, "must be a mapping")
        limits = resources.get("limits") or {}
        requests = resources.get("requests") or {}
        for name in sorted({*limits, *requests}):
            if not _is_gpu_resource(name):
                continue
            limit, request = limits.get(name), requests.get(name)
            if (
                limit is not None
                and request is not None
                and parse_quantity(limit, where=f"{place}.limits.{name}")
                != parse_quantity(request, where=f"{place}.requests.{name}")
            ):
                raise InvalidInput(
                    place, f"{name}: requests ({request}) and limits ({limit}) differ"
                )
            text = limit if limit is not None else request
            part = "limits" if limit is not None else "requests"
            yield (
                name,
                (parse_quantity(text, where=f"{place}.{part}.{name}"), f"{place}.{part}.{name}"),
            )


def _is_gpu_resource(name: str) -> bool:
    return name in (GPU, GPU_SHARED, GPU_MEMORY, GPU_COMPUTE) or name.startswith(MIG_PREFIX)


def _request_from_totals(totals: Mapping[str, tuple[Fraction, str]], where: str) -> GpuRequest:
    counts = {name: _whole(amount, place, amount) for name, (amount, place) in totals.items()}
    mig = []
    for name, count in sorted(counts.items()):
        profile = find_mig_profile(name)
        if profile is not None and count:
            parse_profile_name(profile, where=totals[name][1])
            mig.append((profile, count))
    request = GpuRequest(
        whole_gpus=counts.get(GPU, 0),
        mig=tuple(mig),
        shared=counts.get(GPU_SHARED, 0),
        memory_mib=counts.get(GPU_MEMORY, 0),
        compute_percent=counts.get(GPU_COMPUTE, 0),
    )
    kinds = [
        k
        for k, n in (
            ("nvidia.com/gpu", request.whole_gpus),
            ("MIG", len(mig)),
            (GPU_SHARED, request.shared),
        )
        if n
    ]
    if len(kinds) > 1:
        raise InvalidInput(
            where, f"asks for {' and '.join(kinds)} at once; a pod takes one kind of GPU"
        )
    if (request.memory_mib or request.compute_percent) and not request.shared:
        raise InvalidInput(where, f"{GPU_MEMORY} and {GPU_COMPUTE} need {GPU_SHARED}")
    if request.memory_mib > _MAX_SANE_MIB:
        raise InvalidInput(
            totals[GPU_MEMORY][1],
            f"{GPU_MEMORY} is in MiB; {request.memory_mib} MiB is more than any GPU has "
            "(write 10240 for 10 GiB, not 10Gi)",
        )
    if request.compute_percent > 100:
        raise InvalidInput(totals[GPU_COMPUTE][1], f"{GPU_COMPUTE} is a percentage, at most 100")
    return request
