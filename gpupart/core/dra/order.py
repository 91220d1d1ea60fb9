"""The order of a GPU's MIG placements in its slice: our placement policy, since the scheduler takes the first fit.

Rule (docs/adr-021-dra-device-order.md): smaller profiles first (a request that several
profiles satisfy takes the smallest), and within a profile the placement the core would choose
first: the one that leaves the least fragmentation against the demand mix
(`gpupart.core.dynamic.fragmentation`), ties broken by the room it leaves for later layouts
(the exact solver's own ranking, `layouts_with_counts`), then by start. Placements that cannot
be added beside what is taken now come last, by start (the counters refuse them anyway; they
come back when the holder leaves).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from gpupart.core.dynamic.fragmentation import fragmentation
from gpupart.core.dynamic.model import Mix
from gpupart.core.errors import InfeasibleLayout
from gpupart.core.mig.catalogue import GpuModel
from gpupart.core.mig.layout import (
    MigInstance,
    Placement,
    check_layout,
    layout_counts,
    layouts_with_counts,
)


def fits_beside(model: GpuModel, taken: Iterable[MigInstance], instance: MigInstance) -> bool:
    """Whether `instance` may be added to the GPU holding `taken` (`check_layout` accepts both)."""
    try:
        check_layout(model, (*taken, instance))
    except InfeasibleLayout:
        return False
    return True


def choice_key(
    model: GpuModel, taken: Sequence[MigInstance], instance: MigInstance, mix: Mix
) -> tuple[float, int, int]:
    """How good adding `instance` beside `taken` is, lower first: (fragmentation left, room rank,
    start). Only meaningful where `fits_beside` holds."""
    return (
        fragmentation(model, (*taken, instance), mix),
        _room_rank(model, taken, instance),
        instance.placement.start,
    )


def core_choice(
    model: GpuModel, taken: Iterable[MigInstance], profile: str, mix: Mix | None = None
) -> MigInstance | None:
    """The placement the core picks for one more `profile` beside `taken`: the
    fragmentation-least one (then most room, then lowest start); None when none fits."""
    held = tuple(taken)
    mix = mix or Mix()
    wanted = model.require_profile(profile)
    candidates = [
        MigInstance(Placement(start, wanted.memory_slices), profile) for start in wanted.starts
    ]
    fitting = [c for c in candidates if fits_beside(model, held, c)]
    if not fitting:
        return None
    return min(fitting, key=lambda c: choice_key(model, held, c, mix))


def placement_order(
    model: GpuModel, placements: Iterable[MigInstance], taken: Iterable[MigInstance], mix: Mix
) -> tuple[MigInstance, ...]:
    """`placements` in publishing order given the instances `taken` now (ours and others')."""
    held = tuple(sorted(set(taken)))
    held_set = frozenset(held)

    def key(instance: MigInstance) -> tuple[int, int, str, int, float, int, int]:
        profile = model.require_profile(instance.profile)
        size = (profile.memory_slices, profile.compute_slices, profile.name)
        others = tuple(i for i in held if i != instance)
        if instance not in held_set and fits_beside(model, others, instance):
            frag, rank, start = choice_key(model, others, instance, mix)
            return (*size, 0, frag, rank, start)
        return (*size, 1, 0.0, 0, instance.placement.start)

    return tuple(sorted(set(placements), key=key))


def _room_rank(model: GpuModel, taken: Sequence[MigInstance], instance: MigInstance) -> int:
    """Where the exact solver ranks the layout `taken` + `instance` among those with the same
    profile counts that keep `taken` (0: the one `fit_layout` would pick)."""
    counts = layout_counts((*taken, instance))
    keep = frozenset(taken)
    rank = 0
    for layout in layouts_with_counts(model, counts):
        present = frozenset(layout)
        if not keep <= present:
            continue
        if instance in present:
            return rank
        rank += 1
    return rank
