"""FGD's fragmentation idea on MIG placements: free memory slices the demand mix can no longer use.

For a GPU layout and a mix of profiles with shares, the fragmentation is the expected number of
free memory slices that a request drawn from the mix could not cover with any legal placement:
a free slot 7 on an A100 is lost to 2g.20gb (starts 0, 2, 4) but not to 1g.10gb. A profile that
cannot be added at all (no compute left, its count maxed, instances or media engines used up)
loses every free slice. 0 on a fully used GPU.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from gpupart.core.dynamic.model import Mix
from gpupart.core.mig.catalogue import NO_MEDIA, GpuModel, MediaEngines
from gpupart.core.mig.layout import MigInstance, Placement


def fragmentation(model: GpuModel, layout: Iterable[MigInstance], mix: Mix) -> float:
    used = compute = instances = 0
    engines = NO_MEDIA
    counts: dict[str, int] = {}
    for instance in layout:
        taken = model.require_profile(instance.profile)
        used |= instance.placement.mask
        compute += taken.compute_slices
        instances += 1
        engines += taken.engines
        counts[taken.name] = counts.get(taken.name, 0) + 1
    return stranded(model, used, compute, instances, engines, counts, mix)


def stranded(
    model: GpuModel,
    used: int,
    compute: int,
    instances: int,
    engines: MediaEngines,
    counts: Mapping[str, int],
    mix: Mix,
) -> float:
    """`fragmentation` of a layout given by its totals: the used-slice mask, compute slices,
    instance count, media engines and instances per profile."""
    free = ((1 << model.memory_slices) - 1) & ~used
    if not free:
        return 0.0
    free_slices = free.bit_count()
    total = 0.0
    for name, share in mix.shares:
        profile = model.find_profile(name)
        if profile is None:
            continue  # another model's profile: this GPU is not where it goes
        addable = (
            compute + profile.compute_slices <= model.compute_slices
            and instances < model.max_instances
            and counts.get(name, 0) < profile.max_count
            and (engines + profile.engines).within(model.engines)
        )
        covered = 0
        if addable:
            for start in profile.starts:
                mask = Placement(start, profile.memory_slices).mask
                if not mask & used:
                    covered |= mask
        total += share * (free_slices - (free & covered).bit_count())
    return total
