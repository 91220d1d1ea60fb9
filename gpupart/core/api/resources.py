"""Resource names that pods request, Kubernetes quantities (memory, CPU), and a pod's GPU request as one typed value.

A pod's request is read from the pod in `gpupart.core.api.pods`.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from gpupart.core.api.selectors import parse_int64
from gpupart.core.errors import InvalidInput, shown
from gpupart.core.mig.catalogue import parse_profile_name

GPU = "nvidia.com/gpu"
GPU_SHARED = "nvidia.com/gpu.shared"
MIG_PREFIX = "nvidia.com/mig-"
GPU_MEMORY = "gpupart.io/gpu-memory"
"""Extender-managed: MiB of GPU memory a shared-GPU pod may use (MPS enforces it)."""
GPU_COMPUTE = "gpupart.io/gpu-compute"
"""Extender-managed: percent of the GPU's SMs a shared-GPU pod may use."""

# A GPU memory figure above this many MiB (16 TiB) is a unit slip such as "10Gi".
MAX_SANE_MIB = 1 << 24
MAX_QUANTITY_LENGTH = 64
"""The longest quantity text read: far beyond any real one, and a bound before any arithmetic."""
MAX_QUANTITY = 2**63 - 1
"""The most a Kubernetes quantity counts (int64); beyond it nothing a GPU, node or API holds."""
MAX_PROFILE_LENGTH = 32
"""The longest MIG profile name read (the longest real one, ``1c.7g.141gb+me.all``, has 18)."""

_SUFFIXED = re.compile(r"(.*?gb)\.(me(?:\.all)?|gfx)")
_DIGITS = frozenset("0123456789")
_SUFFIX_LETTERS = frozenset("eEinumkKMGTP")
_DECIMAL_SUFFIX = {
    "n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18,
}  # fmt: skip
_BINARY_SUFFIX = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}
_NANO = 10**9
_MAX_DIGITS = len(str(MAX_QUANTITY))
MAX_EXPONENT = 999_999_999
"""The largest decimal exponent read (`1e999999999`): Kubernetes keeps only an exponent's low
32 bits (it reads `1e4294967297` as 10) and computes 10^|e| for a small value, so a larger one
is refused rather than read as something else."""


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
    match = _SUFFIXED.fullmatch(name)
    return f"{match.group(1)}+{match.group(2)}" if match else name


def parse_quantity(text: object, *, where: str) -> Fraction:
    """A Kubernetes quantity ("1", "500m", "10Gi", "1e3", "1E") as an exact number.

    Read as `resource.ParseQuantity` reads it, character for character (nothing is stripped:
    a space, newline or other character Kubernetes refuses is refused), and valued as it
    values it: rounded up (away from zero) to a whole nano, a binary SI value capped at
    2^63-1. Refused where Kubernetes would accept, so that nothing is misread: text longer
    than `MAX_QUANTITY_LENGTH`, a spelling with no digit (`+`, `.`, `Ki`, which Kubernetes
    reads as 0), a decimal value beyond ±`MAX_QUANTITY`, an exponent beyond ±`MAX_EXPONENT`;
    each bound is checked before any arithmetic.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        if abs(text) > MAX_QUANTITY:
            # Never str() it: Python refuses to write an int of more than 4,300 digits.
            raise InvalidInput(
                where, f"an integer of {text.bit_length()} bits is more than a quantity can hold"
            )
        return Fraction(text)
    if not isinstance(text, str):
        raise InvalidInput(where, f"must be a quantity such as 1 or 10Gi, got {shown(repr(text))}")
    if len(text) > MAX_QUANTITY_LENGTH:
        raise InvalidInput(
            where,
            f"{shown(text)} is {len(text)} characters long; a quantity has at most "
            f"{MAX_QUANTITY_LENGTH}",
        )
    value = _quantity(text)
    if isinstance(value, str):
        raise InvalidInput(where, value)
    return value


def _scan(text: str) -> tuple[bool, str, str, str, str] | None:
    """(positive, mantissa, numerator, denominator, suffix) as resource.Quantity's scanner
    (`parseQuantityString`) splits `text`; None where it refuses the text."""
    positive, pos, end = True, 0, len(text)
    if text[:1] in ("-", "+"):
        positive, pos = text[0] != "-", 1
    while pos < end and text[pos] == "0":  # leading zeros
        pos += 1
    if pos == end:
        return positive, text[:pos], "0", "", ""
    start = pos
    while pos < end and text[pos] in _DIGITS:
        pos += 1
    numerator = text[start:pos] or "0"
    denominator = ""
    if pos < end and text[pos] == ".":
        pos += 1
        start = pos
        while pos < end and text[pos] in _DIGITS:
            pos += 1
        denominator = text[start:pos]
    mantissa, suffix_start = text[:pos], pos
    while pos < end and text[pos] in _SUFFIX_LETTERS:
        pos += 1
    if pos < end and text[pos] in ("-", "+"):
        pos += 1
    while pos < end and text[pos] in _DIGITS:
        pos += 1
    if pos < end:
        return None
    return positive, mantissa, numerator, denominator, text[suffix_start:]


@functools.lru_cache(maxsize=4096)
def _quantity(text: str) -> Fraction | str:
    """The value of a quantity of at most `MAX_QUANTITY_LENGTH` characters, or the problem.

    Cached: a cluster's pods repeat a few quantities, and exact parsing is the slow part of
    reading a pod (the extender reads one per watch event).
    """
    refused = f"{shown(text)} is not a Kubernetes quantity (e.g. 1, 500m, 10Gi, 1e3)"
    scanned = _scan(text) if text else None
    if scanned is None:
        return refused
    positive, mantissa, numerator, denominator, suffix = scanned
    binary = _BINARY_SUFFIX.get(suffix)
    scale = _DECIMAL_SUFFIX.get(suffix)
    if binary is None and scale is None:
        exponent = parse_int64(suffix[1:]) if suffix[:1] in ("e", "E") and suffix[1:] else None
        if exponent is None:
            return refused
        if abs(exponent) > MAX_EXPONENT:
            return f"{shown(text)} is not a Kubernetes quantity: its exponent is beyond ±{MAX_EXPONENT}"
        scale = exponent
    if not _DIGITS.intersection(mantissa):
        return f"{shown(text)} is not a Kubernetes quantity: it has no digits"
    digits = (numerator + denominator).lstrip("0")
    if not digits:
        return Fraction(0)
    if binary is not None:
        value = Fraction(int(digits) << binary, 10 ** len(denominator))
        return _signed(min(_nano_up(value), Fraction(MAX_QUANTITY)), not positive)
    assert scale is not None
    scale -= len(denominator)
    # `digits` × 10^scale has len(digits) + scale digits before the point: bound it first.
    if len(digits) + scale > _MAX_DIGITS:
        return f"{shown(text)} is more than a quantity can hold ({MAX_QUANTITY})"
    if len(digits) + scale < -9:
        return _signed(Fraction(1, _NANO), not positive)  # below a nano: rounds up to 1n
    value = _nano_up(int(digits) * Fraction(10) ** scale)
    if value > MAX_QUANTITY:
        return f"{shown(text)} is more than a quantity can hold ({MAX_QUANTITY})"
    return _signed(value, not positive)


def _nano_up(value: Fraction) -> Fraction:
    """A value ≥ 0 rounded up to a whole nano, as resource.Quantity keeps it."""
    return Fraction(math.ceil(value * _NANO), _NANO)


def _signed(value: Fraction, negative: bool) -> Fraction:
    return -value if negative else value


def parse_memory_mib(text: object, *, where: str) -> int:
    """A memory quantity ("10Gi", "512Mi") as whole MiB, rounded up; 1 MiB to `MAX_SANE_MIB`.

    Less than 1 MiB ("100m" is a tenth of a byte, "1.5" bytes) is a unit slip, never 1 MiB.
    """
    value = parse_quantity(text, where=where)
    if value < 2**20:
        raise InvalidInput(
            where,
            f"must be at least 1Mi (1 MiB), got {shown(str(text))}; write e.g. 4096Mi or 10Gi",
        )
    mib = math.ceil(value / 2**20)
    if mib > MAX_SANE_MIB:
        raise InvalidInput(where, f"{shown(str(text))} is more memory than any GPU has")
    return mib


def check_profile_name(name: str, *, where: str) -> tuple[int, int, int, str]:
    """`parse_profile_name` on a name of bounded length (a longer one is refused unread)."""
    if isinstance(name, str) and len(name) > MAX_PROFILE_LENGTH:
        raise InvalidInput(
            where,
            f"{shown(name)} is not a MIG profile name (at most {MAX_PROFILE_LENGTH} characters, "
            "e.g. 1g.10gb, 3g.40gb, 1g.10gb+me)",
        )
    return parse_profile_name(name, where=where)


def whole(value: Fraction, where: str, text: object) -> int:
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


MAX_CPU_CORES = 1_000_000
"""More CPU than any node has: a larger figure is refused, never counted."""


def parse_cpu_quantity(text: object, where: str) -> Fraction:
    """A CPU quantity in cores, 0 to `MAX_CPU_CORES`; InvalidInput names `where` otherwise."""
    value = parse_quantity(text, where=where)
    if value < 0:
        raise InvalidInput(where, f"must not be negative, got {str(text)[:40]!r}")
    if value > MAX_CPU_CORES:
        raise InvalidInput(where, f"{str(text)[:40]!r} is more CPU than any node has")
    return value


def node_cpu_milli(node: Mapping[str, Any]) -> int | None:
    """A Node's allocatable CPU in millicores (rounded down); None when absent or unreadable."""
    status = node.get("status")
    allocatable = status.get("allocatable") if isinstance(status, Mapping) else None
    if not isinstance(allocatable, Mapping) or allocatable.get("cpu") is None:
        return None
    try:
        return math.floor(
            parse_cpu_quantity(allocatable["cpu"], "Node.status.allocatable.cpu") * 1000
        )
    except InvalidInput:
        return None
