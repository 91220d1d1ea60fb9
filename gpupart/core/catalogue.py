"""GPU catalogue: MIG-capable NVIDIA products, their MIG profiles, and product-name matching.

The tables are the fallback and the test oracle. On a node with a GPU, the node agent builds a
`GpuModel` from NVML's own profile and placement answers (`gpu_model`), and those win.

Sources: NVIDIA MIG User Guide "Supported MIG Profiles" and `nvidia-smi mig -lgip/-lgipp`
outputs published by NVIDIA engineers (mig-parted, gpu-operator). Memory in MiB is what NVML's
`memorySizeMB` reports where such output was seen; rows marked `derived` are the share of the
card's memory by memory slices, to be replaced by NVML's figure when a GPU is at hand.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache

from gpupart.core.errors import InvalidInput, UnknownProduct, UnknownProfile

PROFILE_PATTERN = re.compile(r"^(?:([1-7])c\.)?([1-7])g\.(\d+)gb(\+me(?:\.all)?|-me|\+gfx)?$")


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

    @property
    def media_extensions(self) -> bool:
        return "+me" in self.name


@dataclass(frozen=True, slots=True)
class GpuModel:
    """A GPU product's MIG geometry: slice counts, instance limit and offered profiles."""

    product: str
    memory_mib: int
    compute_slices: int
    memory_slices: int
    max_instances: int
    profiles: tuple[MigProfile, ...]

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
    """Split ``[Cc.]Gg.Mgb[suffix]`` into (compute, gpu slices, GB, suffix); reject the rest."""
    match = PROFILE_PATTERN.match(name)
    if match is None:
        raise InvalidInput(
            where,
            f"{name!r} is not a MIG profile name (expected e.g. 1g.10gb, 3g.40gb, 1g.10gb+me)",
        )
    compute, slices, gigabytes, suffix = match.groups()
    gpu_slices = int(slices)
    return (int(compute) if compute else gpu_slices, gpu_slices, int(gigabytes), suffix or "")


def gpu_model(
    product: str,
    *,
    memory_mib: int,
    compute_slices: int,
    memory_slices: int,
    max_instances: int,
    profiles: tuple[MigProfile, ...],
) -> GpuModel:
    """Build a model from any source (catalogue or NVML), checking it is self-consistent."""
    for profile in profiles:
        last_start = memory_slices - profile.memory_slices
        if not profile.starts or any(s < 0 or s > last_start for s in profile.starts):
            raise InvalidInput(
                f"{product} {profile.name}",
                f"placement starts {profile.starts} do not fit {memory_slices} memory slices",
            )
        if profile.compute_slices > compute_slices or profile.max_count < 1:
            raise InvalidInput(f"{product} {profile.name}", "profile exceeds the GPU")
    return GpuModel(product, memory_mib, compute_slices, memory_slices, max_instances, profiles)


# (name suffix relative to the 1g/2g/3g/4g/7g pattern, compute, memory slices, max, starts, id)
_EIGHT_SLICE_SHAPES: tuple[tuple[str, int, int, int, tuple[int, ...], int], ...] = (
    ("1g", 1, 1, 7, (0, 1, 2, 3, 4, 5, 6), 19),
    ("1g+me", 1, 1, 1, (0, 1, 2, 3, 4, 5, 6), 20),
    ("1g2x", 1, 2, 4, (0, 2, 4, 6), 15),
    ("2g", 2, 2, 3, (0, 2, 4), 14),
    ("3g", 3, 4, 2, (0, 4), 9),
    ("4g", 4, 4, 1, (0,), 5),
    ("7g", 7, 8, 1, (0,), 0),
)


def _eight_slice_model(
    product: str, memory_mib: int, gb: dict[int, int], mib: dict[int, int]
) -> GpuModel:
    """A100/H100/H200/B200 family: 7 compute and 8 memory slices, profile names by GB label.

    `gb` maps memory slices to the GB figure in the profile name, `mib` to NVML's memorySizeMB.
    """
    profiles = []
    for shape, compute, memory, max_count, starts, profile_id in _EIGHT_SLICE_SHAPES:
        media = shape.endswith("+me")
        name = f"{compute}g.{gb[memory]}gb" + ("+me" if media else "")
        profiles.append(
            MigProfile(name, compute, memory, mib[memory], max_count, starts, profile_id)
        )
    return gpu_model(
        product,
        memory_mib=memory_mib,
        compute_slices=7,
        memory_slices=8,
        max_instances=7,
        profiles=tuple(profiles),
    )


def _a30(product: str) -> GpuModel:
    profiles = (
        MigProfile("1g.6gb", 1, 1, 5952, 4, (0, 1, 2, 3), 14),
        MigProfile("1g.6gb+me", 1, 1, 5952, 1, (0, 1, 2, 3), 21),
        MigProfile("2g.12gb", 2, 2, 11968, 2, (0, 2), 5),
        MigProfile("2g.12gb+me", 2, 2, 11968, 1, (0, 2), 6),
        MigProfile("4g.24gb", 4, 4, 24000, 1, (0,), 0),
    )
    return gpu_model(
        product,
        memory_mib=24576,
        compute_slices=4,
        memory_slices=4,
        max_instances=4,
        profiles=profiles,
    )


@cache
def _catalogue_rows() -> tuple[tuple[GpuModel, tuple[str, ...]], ...]:
    """Each model with the names NVML and GPU Feature Discovery give it."""
    a100_40 = {1: 5, 2: 10, 4: 20, 8: 40}, {1: 4864, 2: 9856, 4: 20096, 8: 40448}
    a100_80 = {1: 10, 2: 20, 4: 40, 8: 80}, {1: 9728, 2: 19968, 4: 40192, 8: 80896}
    h100_80 = {1: 10, 2: 20, 4: 40, 8: 80}, {1: 9984, 2: 20096, 4: 40448, 8: 81152}
    # H100 NVL: 4g and 7g from -lgip; 1- and 2-slice memory derived.
    h100_94 = {1: 12, 2: 24, 4: 47, 8: 94}, {1: 11264, 2: 23552, 4: 47488, 8: 95360}
    # H100 96GB (GH200) and H20: derived.
    h100_96 = {1: 12, 2: 24, 4: 48, 8: 96}, {1: 11520, 2: 24064, 4: 48640, 8: 97280}
    h200 = {1: 18, 2: 35, 4: 71, 8: 141}, {1: 16384, 2: 33024, 4: 71168, 8: 143104}
    # B200: 1- and 2-slice from -lgip (driver R570); 4- and 8-slice derived.
    b200 = {1: 23, 2: 45, 4: 90, 8: 180}, {1: 22528, 2: 45312, 4: 91136, 8: 182272}
    return (
        (_a30("A30-24GB"), ("NVIDIA A30", "A30")),
        (
            _eight_slice_model("A100-SXM4-40GB", 40960, *a100_40),
            ("NVIDIA A100-SXM4-40GB", "A100-SXM4-40GB"),
        ),
        (
            _eight_slice_model("A100-PCIE-40GB", 40960, *a100_40),
            ("NVIDIA A100-PCIE-40GB", "A100-PCIE-40GB"),
        ),
        (
            _eight_slice_model("A100-SXM4-80GB", 81920, *a100_80),
            ("NVIDIA A100-SXM4-80GB", "A100-SXM4-80GB"),
        ),
        (
            _eight_slice_model("A100-PCIE-80GB", 81920, *a100_80),
            ("NVIDIA A100 80GB PCIe", "A100-80GB-PCIe", "A100-PCIE-80GB"),
        ),
        (
            _eight_slice_model("H100-SXM5-80GB", 81559, *h100_80),
            ("NVIDIA H100 80GB HBM3", "H100-80GB-HBM3", "H100-SXM5-80GB"),
        ),
        (
            _eight_slice_model("H100-PCIE-80GB", 81559, *h100_80),
            ("NVIDIA H100 PCIe", "H100-PCIe", "H100-PCIE-80GB"),
        ),
        (
            _eight_slice_model("H100-NVL-94GB", 95830, *h100_94),
            ("NVIDIA H100 NVL", "H100-NVL", "H100-NVL-94GB"),
        ),
        (
            _eight_slice_model("H100-96GB", 97871, *h100_96),
            ("NVIDIA GH200 480GB", "GH200-480GB", "H100-96GB"),
        ),
        (_eight_slice_model("H20-96GB", 97871, *h100_96), ("NVIDIA H20", "H20", "H20-96GB")),
        (
            _eight_slice_model("H200-141GB", 143771, *h200),
            ("NVIDIA H200", "NVIDIA H200 NVL", "H200", "H200-NVL", "H200-141GB"),
        ),
        (_eight_slice_model("B200-180GB", 183359, *b200), ("NVIDIA B200", "B200", "B200-180GB")),
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
            index[_normalise(alias)] = model
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


_COMPARED = ("profile_id", "compute_slices", "memory_slices", "max_count", "starts", "memory_mib")


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
