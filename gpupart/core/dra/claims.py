"""What our allocated ResourceClaims hold in one node's pool: per GPU, the claims and the MIG placements.

From the claims as read back (`read.read_claims`) and our own device names (`names`): a
result of another pool, or a device name we never publish, is left out with its reason, so
one odd claim affects only itself. The node agent uses it to decide when a GPU may leave DRA
(`gpupart.core.node.interface`) and which placements are in use when it publishes.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from gpupart.core.dra import names
from gpupart.core.dra.read import AllocationResult, ClaimView, Skipped
from gpupart.core.mig.catalogue import GpuModel
from gpupart.core.mig.layout import MigInstance, Placement
from gpupart.core.node.interface import ClaimUse

_DEVICE = re.compile(r"gpu-([0-9]{1,2})(?:-shared|-mig-([a-z0-9-]+)-([0-9]{1,2}))?")


@dataclass(frozen=True, slots=True)
class PoolUse:
    """The devices of one pool that claims hold: GPU index → (claim, device name) pairs."""

    devices: Mapping[int, tuple[tuple[str, str], ...]] = field(default_factory=dict)
    skipped: tuple[Skipped, ...] = ()

    def claim_use(self) -> ClaimUse:
        return ClaimUse(
            {i: tuple(sorted({c for c, _ in held})) for i, held in self.devices.items()}
        )

    def device_names(self, index: int) -> frozenset[str]:
        return frozenset(d for _, d in self.devices.get(index, ()))


def gpu_index(device: str) -> int | None:
    """The GPU index one of our device names carries; None when it is not one of ours."""
    match = _DEVICE.fullmatch(device)
    return int(match[1]) if match else None


def pool_use(claims: Iterable[ClaimView], pool: str) -> PoolUse:
    """Every allocated result of `claims` (already our driver's) in `pool`, by GPU; an admin
    access is no allocation (the scheduler does not count it, so neither does the order)."""
    found: dict[int, list[tuple[str, str]]] = {}
    skipped = []
    for claim in claims:
        for result in claim.allocated:
            if result.pool != pool:
                continue
            index = gpu_index(result.device)
            if index is None:
                skipped.append(
                    Skipped(
                        "ResourceClaim",
                        claim.key,
                        f"ResourceClaim {claim.key}.status.allocation.devices.results: "
                        f"{result.device[: names.MAX_DNS_LABEL]!r} is not a device of ours",
                    )
                )
                continue
            found.setdefault(index, []).append((claim.key, result.device))
    return PoolUse({i: tuple(sorted(v)) for i, v in found.items()}, tuple(skipped))


def claimed_placements(
    model: GpuModel, index: int, devices: Iterable[str]
) -> tuple[MigInstance, ...]:
    """The MIG placements that these held device names of GPU `index` stand for (others:
    the whole GPU, a shared device, or a name of no profile of `model`, are not placements)."""
    by_name = {
        names.mig_device_name(index, p.name, start): MigInstance(
            Placement(start, p.memory_slices), p.name
        )
        for p in model.profiles
        for start in p.starts
    }
    return tuple(sorted({by_name[d] for d in devices if d in by_name}))


def holding_claim(
    pool: str, placements: Mapping[int, Iterable[MigInstance]], namespace: str = "held"
) -> ClaimView:
    """One claim that holds these MIG placements (GPU index → instances) of `pool`: how the
    simulator and the benchmarks tell the allocator model what is allocated."""
    results = tuple(
        AllocationResult(
            "held",
            names.DRIVER,
            pool,
            names.mig_device_name(index, i.profile, i.placement.start),
        )
        for index, instances in sorted(placements.items())
        for i in instances
    )
    return ClaimView(namespace, f"{pool}-held", "", results)
