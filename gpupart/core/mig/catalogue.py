"""GPU catalogue: MIG-capable NVIDIA products, their MIG profiles, and product-name matching.

The tables are the fallback and the test oracle. On a node with a GPU, the node agent builds a
`GpuModel` from NVML's own profile and placement answers (`gpu_model`), and those win.

Sources: NVIDIA MIG User Guide "Supported MIG Profiles" and `nvidia-smi mig -lgip/-lgipp`
outputs published by NVIDIA engineers (mig-parted, gpu-operator). Memory in MiB is what NVML's
`memorySizeMB` reports where such output was seen; rows marked `derived` are the share of the
card's memory by memory slices, to be replaced by NVML's figure when a GPU is at hand.

Over 400 lines on purpose: most of it is the product tables, which read best as one list.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction
from functools import cache

from gpupart.core.errors import InvalidInput, UnknownProduct, UnknownProfile, shown

PROFILE_PATTERN = re.compile(r"(?:([1-7])c\.)?([1-7])g\.([0-9]+)gb(\+me(?:\.all)?|-me|\+gfx)?")
"""A profile name NVIDIA's parser (go-nvlib) reads the same way: matched whole (`fullmatch`, so
no trailing newline), ASCII digits only."""
_MAX_GB_DIGITS = 18
"""More digits than any GPU's gigabytes; an int for go-nvlib's `strconv.Atoi` too."""


@dataclass(frozen=True, slots=True, order=True)
class MediaEngines:
    """Media engines, the MIG User Guide's "Hardware Units": a GPU has a fixed number of each,
    and every GPU instance takes the ones its profile names (NVML's decoderCount, encoderCount,
    jpegCount and ofaCount), so they are a GPU-wide resource like memory slices."""

    decoders: int = 0
    """NVDEC video decoders."""
    encoders: int = 0
    """NVENC video encoders."""
    jpeg: int = 0
    """NVJPG JPEG decoders."""
    ofa: int = 0
    """Optical flow accelerators."""

    def __add__(self, other: MediaEngines) -> MediaEngines:
        return MediaEngines(
            self.decoders + other.decoders,
            self.encoders + other.encoders,
            self.jpeg + other.jpeg,
            self.ofa + other.ofa,
        )

    def times(self, count: int) -> MediaEngines:
        return MediaEngines(
            self.decoders * count, self.encoders * count, self.jpeg * count, self.ofa * count
        )

    def within(self, capacity: MediaEngines) -> bool:
        return not self.beyond(capacity)

    def beyond(self, capacity: MediaEngines) -> list[str]:
        """The kinds of engine of which there are more here than in `capacity`."""
        return [
            unit
            for (n, unit), (limit, _) in zip(self._units(), capacity._units(), strict=True)
            if n > limit
        ]

    def _units(self) -> tuple[tuple[int, str], ...]:
        return (
            (self.decoders, "NVDEC"),
            (self.encoders, "NVENC"),
            (self.jpeg, "JPEG"),
            (self.ofa, "OFA"),
        )

    def __str__(self) -> str:
        return ", ".join(f"{n} {unit}" for n, unit in self._units() if n) or "no media engine"


NO_MEDIA = MediaEngines()


@dataclass(frozen=True, slots=True)
class MigProfile:
    """One GPU-instance profile as NVML describes it, e.g. ``3g.40gb`` on an A100-80GB."""

    name: str
    compute_slices: int
    memory_slices: int
    memory_mib: int
    max_count: int
    starts: tuple[int, ...]
    """Memory-slice indices where an instance of this profile may start (NVML placements)."""
    profile_id: int | None = None
    """NVML's product-specific profile ID (what create calls take); None when unknown."""
    engines: MediaEngines = NO_MEDIA
    """The media engines an instance of this profile takes from the GPU."""


@dataclass(frozen=True, slots=True)
class GpuModel:
    """A GPU product's MIG geometry: slice counts, instance limit, media engines, offered profiles."""

    product: str
    memory_mib: int
    compute_slices: int
    memory_slices: int
    max_instances: int
    profiles: tuple[MigProfile, ...]
    engines: MediaEngines = NO_MEDIA
    """The media engines the whole GPU has (what its whole-GPU profile takes)."""

    def find_profile(self, name: str) -> MigProfile | None:
        for profile in self.profiles:
            if profile.name == name:
                return profile
        return None

    def require_profile(self, name: str) -> MigProfile:
        profile = self.find_profile(name)
        if profile is None:
            raise UnknownProfile(name, self.product, self.profile_names)
        return profile

    @property
    def profile_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.profiles)


def parse_profile_name(name: str, *, where: str = "") -> tuple[int, int, int, str]:
    """Split ``[Cc.]Gg.Mgb[suffix]`` into (compute, gpu slices, GB, suffix); reject the rest.

    Every name read here means the same profile to go-nvlib's parser (tests/core/
    test_reference_kubernetes.py asks it); any text, however long, is read or InvalidInput.
    """
    if not isinstance(name, str):
        raise InvalidInput(where, f"must be a MIG profile name, got {shown(repr(name))}")
    match = PROFILE_PATTERN.fullmatch(name)
    gigabytes = match.group(3).lstrip("0") if match else ""
    if match is None or len(gigabytes) > _MAX_GB_DIGITS:
        raise InvalidInput(
            where,
            f"{shown(name)} is not a MIG profile name (expected e.g. 1g.10gb, 3g.40gb, 1g.10gb+me)",
        )
    compute, slices, _, suffix = match.groups()
    gpu_slices = int(slices)
    return (
        int(compute) if compute else gpu_slices,
        gpu_slices,
        int(gigabytes or "0"),
        suffix or "",
    )


def gpu_model(
    product: str,
    *,
    memory_mib: int,
    compute_slices: int,
    memory_slices: int,
    max_instances: int,
    profiles: tuple[MigProfile, ...],
    engines: MediaEngines | None = None,
) -> GpuModel:
    """Build a model from any source (catalogue or NVML), checking it is self-consistent.

    `engines` defaults to those of the whole-GPU profile (the one with every memory and compute
    slice), which NVML gives every engine of the GPU.
    """
    if engines is None:
        whole = max(profiles, key=lambda p: (p.memory_slices, p.compute_slices), default=None)
        engines = whole.engines if whole is not None else NO_MEDIA
    for profile in profiles:
        last_start = memory_slices - profile.memory_slices
        if not profile.starts or any(s < 0 or s > last_start for s in profile.starts):
            raise InvalidInput(
                f"{product} {profile.name}",
                f"placement starts {profile.starts} do not fit {memory_slices} memory slices",
            )
        if profile.compute_slices > compute_slices or profile.max_count < 1:
            raise InvalidInput(f"{product} {profile.name}", "profile exceeds the GPU")
        if not profile.engines.within(engines):
            raise InvalidInput(
                f"{product} {profile.name}",
                f"takes {profile.engines}, more media engines than the GPU's {engines}",
            )
    return GpuModel(
        product, memory_mib, compute_slices, memory_slices, max_instances, profiles, engines
    )


# Media engines per 8-slice shape, from the MIG User Guide's "Hardware Units" and -lgip outputs:
# Ampere (A100) has 5 NVDEC, 1 JPEG and 1 OFA; Hopper and Blackwell one NVDEC and one JPEG
# per compute slice and one OFA. Only the +me profile and the whole GPU get the OFA.
_AMPERE_ENGINES = {
    "1g": MediaEngines(),
    "1g+me": MediaEngines(decoders=1, jpeg=1, ofa=1),
    "1g2x": MediaEngines(decoders=1),
    "2g": MediaEngines(decoders=1),
    "3g": MediaEngines(decoders=2),
    "4g": MediaEngines(decoders=2),
    "7g": MediaEngines(decoders=5, jpeg=1, ofa=1),
}
_HOPPER_ENGINES = {
    "1g": MediaEngines(decoders=1, jpeg=1),
    "1g+me": MediaEngines(decoders=1, jpeg=1, ofa=1),
    "1g2x": MediaEngines(decoders=1, jpeg=1),
    "2g": MediaEngines(decoders=2, jpeg=2),
    "3g": MediaEngines(decoders=3, jpeg=3),
    "4g": MediaEngines(decoders=4, jpeg=4),
    "7g": MediaEngines(decoders=7, jpeg=7, ofa=1),
}

# (shape, compute, memory slices, max, starts, NVML profile id): the same on every 8-slice
# product (-lgipp of A100, H100, H100 NVL, H200, B200, GB200, GB300 seen).
_EIGHT_SLICE_SHAPES: tuple[tuple[str, int, int, int, tuple[int, ...], int], ...] = (
    ("1g", 1, 1, 7, (0, 1, 2, 3, 4, 5, 6), 19),
    ("1g+me", 1, 1, 1, (0, 1, 2, 3, 4, 5, 6), 20),
    ("1g2x", 1, 2, 4, (0, 2, 4, 6), 15),
    ("2g", 2, 2, 3, (0, 2, 4), 14),
    ("3g", 3, 4, 2, (0, 4), 9),
    ("4g", 4, 4, 1, (0,), 5),
    ("7g", 7, 8, 1, (0,), 0),
)


@dataclass(frozen=True, slots=True)
class _Memory:
    """An 8-slice product's profile names and memory: `gb` maps memory slices to the GB in the
    profile name, `mib` to NVML's memorySizeMB."""

    gb: dict[int, int]
    mib: dict[int, int]


def _eight_slice_model(
    product: str, memory_mib: int, memory: _Memory, engines: dict[str, MediaEngines]
) -> GpuModel:
    """A100/H100/H200/B200 family: 7 compute and 8 memory slices, profile names by GB label."""
    profiles = []
    for shape, compute, slices, max_count, starts, profile_id in _EIGHT_SLICE_SHAPES:
        name = f"{compute}g.{memory.gb[slices]}gb" + ("+me" if shape.endswith("+me") else "")
        profiles.append(
            MigProfile(
                name,
                compute,
                slices,
                memory.mib[slices],
                max_count,
                starts,
                profile_id,
                engines[shape],
            )
        )
    return gpu_model(
        product,
        memory_mib=memory_mib,
        compute_slices=7,
        memory_slices=8,
        max_instances=7,
        profiles=tuple(profiles),
    )


def _derived(gb: dict[int, int], seen: dict[int, int], scale: Fraction = Fraction(1)) -> _Memory:
    """Memory where NVML's figure was not seen: `seen` (the figures an -lgip showed, in MiB)
    times `scale`, and a 4- or 8-slice instance twice the next smaller one, rounded down to
    128 MiB. Real instances hold at least that much, so the figure never promises memory that
    is not there."""
    mib = {k: int(v * scale) // 128 * 128 for k, v in seen.items()}
    for slices in (4, 8):
        mib.setdefault(slices, 2 * mib[slices // 2])
    return _Memory(gb, mib)


def _a30(product: str) -> GpuModel:
    # -lgip/-lgipp of A30 seen; engines from the MIG User Guide's A30 table.
    profiles = (
        MigProfile("1g.6gb", 1, 1, 5952, 4, (0, 1, 2, 3), 14),
        MigProfile(
            "1g.6gb+me", 1, 1, 5952, 1, (0, 1, 2, 3), 21, MediaEngines(decoders=1, jpeg=1, ofa=1)
        ),
        MigProfile("2g.12gb", 2, 2, 11968, 2, (0, 2), 5, MediaEngines(decoders=2)),
        MigProfile(
            "2g.12gb+me", 2, 2, 11968, 1, (0, 2), 6, MediaEngines(decoders=2, jpeg=1, ofa=1)
        ),
        MigProfile("4g.24gb", 4, 4, 24000, 1, (0,), 0, MediaEngines(decoders=4, jpeg=1, ofa=1)),
    )
    return gpu_model(
        product,
        memory_mib=24576,
        compute_slices=4,
        memory_slices=4,
        max_instances=4,
        profiles=profiles,
    )


def _rtx_pro_6000(product: str) -> GpuModel:
    """RTX PRO 6000 Blackwell: 4 compute and 4 memory slices, 4 NVDEC, 4 NVENC, 4 JPEG, 1 OFA.

    Profile IDs, engines and memory from -lgip (driver R580, memory shown in GiB to two decimals:
    23.62, 47.38 and 95.00 GiB); placements derived (no -lgipp seen). ``+gfx`` adds graphics,
    ``+me`` the OFA, ``+me.all`` takes every media engine, ``-me`` none.
    """
    one, two, every = (
        MediaEngines(1, 1, 1, 0),
        MediaEngines(2, 2, 2, 0),
        MediaEngines(4, 4, 4, 1),
    )
    ones, twos = (0, 1, 2, 3), (0, 2)
    profiles = (
        MigProfile("1g.24gb", 1, 1, 24192, 4, ones, 14, one),
        MigProfile("1g.24gb+me", 1, 1, 24192, 1, ones, 21, MediaEngines(1, 1, 1, 1)),
        MigProfile("1g.24gb+gfx", 1, 1, 24192, 4, ones, 47, one),
        MigProfile("1g.24gb+me.all", 1, 1, 24192, 1, ones, 65, every),
        MigProfile("1g.24gb-me", 1, 1, 24192, 4, ones, 67),
        MigProfile("2g.48gb", 2, 2, 48512, 2, twos, 5, two),
        MigProfile("2g.48gb+gfx", 2, 2, 48512, 2, twos, 35, two),
        MigProfile("2g.48gb+me.all", 2, 2, 48512, 1, twos, 64, every),
        MigProfile("2g.48gb-me", 2, 2, 48512, 2, twos, 66),
        MigProfile("4g.96gb", 4, 4, 97280, 1, (0,), 0, every),
        MigProfile("4g.96gb+gfx", 4, 4, 97280, 1, (0,), 32, every),
    )
    return gpu_model(
        product,
        memory_mib=97887,
        compute_slices=4,
        memory_slices=4,
        max_instances=4,
        profiles=profiles,
    )


@cache
def _catalogue_rows() -> tuple[tuple[GpuModel, tuple[str, ...]], ...]:
    """The one product table: each model with the names NVML and GPU Feature Discovery give it.

    Products of the same silicon and memory (A800 and A100, H800 and H100, GH200 120GB and
    480GB) are aliases of one entry. Memory figures are NVML's memorySizeMB as an -lgip showed
    it, except where a comment says derived (see `_derived`).
    """
    a100_40 = _Memory({1: 5, 2: 10, 4: 20, 8: 40}, {1: 4864, 2: 9856, 4: 19968, 8: 40192})
    a100_80 = _Memory({1: 10, 2: 20, 4: 40, 8: 80}, {1: 9728, 2: 19968, 4: 40192, 8: 80896})
    # PG506-232: A100 silicon with 96 GB; derived from A100-80GB.
    pg506 = _derived({1: 12, 2: 24, 4: 48, 8: 96}, a100_80.mib, Fraction(96, 80))
    h100_80 = _Memory({1: 10, 2: 20, 4: 40, 8: 80}, {1: 9984, 2: 20096, 4: 40448, 8: 81152})
    h100_94 = _Memory({1: 12, 2: 24, 4: 47, 8: 94}, {1: 11008, 2: 22144, 4: 47488, 8: 95360})
    h100_96 = _Memory({1: 12, 2: 24, 4: 48, 8: 96}, {1: 11264, 2: 23552, 4: 47616, 8: 95232})
    # H20: no -lgip at hand; derived as the H100 96GB it shares its geometry with.
    h20 = _derived(h100_96.gb, h100_96.mib)
    h200 = _Memory({1: 18, 2: 35, 4: 71, 8: 141}, {1: 16384, 2: 33024, 4: 71168, 8: 143104})
    # GH200 144G HBM3e: 1- and 2-slice from -lgip; 4- and 8-slice derived.
    gh200_144 = _derived({1: 18, 2: 36, 4: 72, 8: 144}, {1: 17920, 2: 36096})
    # B200: 1- and 2-slice from the -lgip of March 2025 (mig-parted's B200 4g.90gb change; the
    # R570 driver of January 2025 reported 22528 MiB for 1g.23gb); 4- and 8-slice derived.
    b200 = _derived({1: 23, 2: 45, 4: 90, 8: 180}, {1: 20992, 2: 45312})
    # GB200: 1- and 2-slice from the -lgip of production boards (August 2025); rest derived.
    gb200 = _derived({1: 23, 2: 47, 4: 93, 8: 186}, {1: 22528, 2: 46592})
    # B300 and GB300: no -lgip at hand; derived from B200 by their whole-GPU names.
    b300 = _derived({1: 34, 2: 67, 4: 135, 8: 269}, b200.mib, Fraction(269, 180))
    gb300 = _derived({1: 35, 2: 70, 4: 139, 8: 278}, b200.mib, Fraction(278, 180))
    ampere, hopper = _AMPERE_ENGINES, _HOPPER_ENGINES
    return (
        (_a30("A30-24GB"), ("NVIDIA A30", "A30")),
        (
            _eight_slice_model("A100-SXM4-40GB", 40960, a100_40, ampere),
            ("NVIDIA A100-SXM4-40GB", "A100-SXM4-40GB"),
        ),
        (
            _eight_slice_model("A100-PCIE-40GB", 40960, a100_40, ampere),
            ("NVIDIA A100-PCIE-40GB", "A100-PCIE-40GB", "NVIDIA A800 40GB Active"),
        ),
        (
            _eight_slice_model("A100-SXM4-80GB", 81920, a100_80, ampere),
            (
                "NVIDIA A100-SXM4-80GB",
                "A100-SXM4-80GB",
                "NVIDIA A100-SXM-80GB",
                "NVIDIA A800-SXM4-80GB",
            ),
        ),
        (
            _eight_slice_model("A100-PCIE-80GB", 81920, a100_80, ampere),
            ("NVIDIA A100 80GB PCIe", "A100-80GB-PCIe", "A100-PCIE-80GB", "NVIDIA A800 80GB PCIe"),
        ),
        (
            _eight_slice_model("PG506-232", pg506.mib[8], pg506, ampere),
            ("NVIDIA PG506-232", "PG506-96GB"),
        ),
        (
            _eight_slice_model("H100-SXM5-80GB", 81559, h100_80, hopper),
            ("NVIDIA H100 80GB HBM3", "H100-80GB-HBM3", "H100-SXM5-80GB", "NVIDIA H800"),
        ),
        (
            _eight_slice_model("H100-PCIE-80GB", 81559, h100_80, hopper),
            ("NVIDIA H100 PCIe", "H100-PCIe", "H100-PCIE-80GB", "NVIDIA H800 PCIe"),
        ),
        (
            _eight_slice_model("H100-NVL-94GB", 95830, h100_94, hopper),
            ("NVIDIA H100 NVL", "H100-NVL", "H100-NVL-94GB", "NVIDIA H800 NVL"),
        ),
        (
            _eight_slice_model("H100-96GB", 97871, h100_96, hopper),
            ("NVIDIA GH200 480GB", "GH200-480GB", "H100-96GB", "NVIDIA GH200 120GB"),
        ),
        (
            _eight_slice_model("H20-96GB", 97871, h20, hopper),
            ("NVIDIA H20", "H20", "H20-96GB"),
        ),
        (
            _eight_slice_model("H200-141GB", 143771, h200, hopper),
            ("NVIDIA H200", "NVIDIA H200 NVL", "H200", "H200-NVL", "H200-141GB"),
        ),
        (
            _eight_slice_model("GH200-144GB", gh200_144.mib[8], gh200_144, hopper),
            ("NVIDIA GH200 144G HBM3e", "GH200-144GB"),
        ),
        (
            _eight_slice_model("B200-180GB", 183359, b200, hopper),
            ("NVIDIA B200", "B200", "B200-180GB"),
        ),
        (
            _eight_slice_model("GB200-186GB", gb200.mib[8], gb200, hopper),
            ("NVIDIA GB200", "GB200", "GB200-186GB"),
        ),
        (
            _eight_slice_model("B300-269GB", b300.mib[8], b300, hopper),
            ("NVIDIA B300 SXM6 AC", "B300", "B300-269GB"),
        ),
        (
            _eight_slice_model("GB300-278GB", gb300.mib[8], gb300, hopper),
            ("NVIDIA GB300", "GB300", "GB300-278GB"),
        ),
        (
            _rtx_pro_6000("RTX-PRO-6000-96GB"),
            ("NVIDIA RTX PRO 6000 Blackwell Server Edition", "RTX-PRO-6000-96GB"),
        ),
    )


def _normalise(name: str) -> str:
    """One spelling for NVML names ("NVIDIA A100-SXM4-80GB") and GFD labels ("NVIDIA-A100-SXM4-80GB").

    GFD appends ``-SHARED`` when the GPU is shared and ``-MIG-<profile>`` under the single MIG
    strategy; both name the same product.
    """
    text = re.sub(r"[\s_]+", "-", name.strip()).upper()
    text = re.sub(r"-MIG-.*$", "", text)
    text = re.sub(r"-SHARED$", "", text)
    return text.removeprefix("NVIDIA-")


@cache
def _index() -> dict[str, GpuModel]:
    index: dict[str, GpuModel] = {}
    for model, aliases in _catalogue_rows():
        for alias in (model.product, *aliases):
            other = index.setdefault(_normalise(alias), model)
            if other is not model:
                raise AssertionError(f"{alias!r} names both {other.product} and {model.product}")
    return index


def catalogue() -> tuple[GpuModel, ...]:
    """Every catalogued model, in catalogue order."""
    return tuple(model for model, _ in _catalogue_rows())


def find_gpu_model(product: str) -> GpuModel | None:
    return _index().get(_normalise(product))


def require_gpu_model(product: str) -> GpuModel:
    """The model for an NVML name or a GFD `nvidia.com/gpu.product` label; never a guess."""
    model = find_gpu_model(product)
    if model is None:
        raise UnknownProduct(product, tuple(m.product for m in catalogue()))
    return model


@dataclass(frozen=True, slots=True)
class ProfileDifference:
    """Where NVML's answer for a profile differs from the catalogue's (value None: absent)."""

    profile: str
    field: str
    nvml: object
    catalogue: object

    @property
    def structural(self) -> bool:
        """Geometry (slices, placements, profile id, presence): the solver's plans depend on it.
        Memory MiB is informative only: NVML's answer wins at run time."""
        return self.field != "memory_mib"

    def __str__(self) -> str:
        return f"{self.profile}: {self.field} is {self.nvml!r} in NVML, {self.catalogue!r} here"


_COMPARED = (
    "profile_id",
    "compute_slices",
    "memory_slices",
    "max_count",
    "starts",
    "engines",
    "memory_mib",
)


def compare_models(nvml: GpuModel, known: GpuModel) -> list[ProfileDifference]:
    """Every difference between what NVML reports for a GPU and the catalogue entry for it."""
    differences = []
    found = {p.name: p for p in nvml.profiles}
    expected = {p.name: p for p in known.profiles}
    for name in sorted(found.keys() | expected.keys()):
        a, b = found.get(name), expected.get(name)
        if a is None or b is None:
            differences.append(ProfileDifference(name, "present", a is not None, b is not None))
            continue
        for field in _COMPARED:
            if getattr(a, field) != getattr(b, field):
                differences.append(
                    ProfileDifference(name, field, getattr(a, field), getattr(b, field))
                )
    return differences
