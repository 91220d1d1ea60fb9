"""The order of MIG placements in their profile's slice across a node's GPUs: our placement policy (first fit).

Rule (docs/adr-032-dra-slices-by-profile.md, which amends ADR 021): each MIG profile has one
slice across the node's GPUs, so this order decides the GPU as well as the placement. Within a
profile, the placement the core would choose first comes first: the one whose GPU gains the
least fragmentation against the demand mix (`gpupart.core.dynamic.fragmentation`), then the
one on the busier GPU (more memory slices taken: small instances gather, whole GPUs stay free
for 4g and 7g), then the one that leaves the most room for later layouts on its GPU (the exact
solver's own ranking, `layouts_with_counts`), then the lowest start, then the lowest GPU index.
Placements that cannot be added beside what is taken now come last, by start (the counters
refuse them anyway; they come back when the holder leaves).
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


Rank = tuple[float, ...]
"""A device's place in its slice across the node's GPUs, lower first (`pool_slices` sorts by it)."""


def placement_ranks(
    model: GpuModel,
    index: int,
    placements: Iterable[MigInstance],
    taken: Iterable[MigInstance],
    mix: Mix,
) -> dict[MigInstance, Rank]:
    """The rank of each of GPU `index`'s `placements` given the instances `taken` on it now
    (ours and others'). Only this GPU's state enters, so a change on one GPU re-ranks its own
    placements only."""
    held = tuple(sorted(set(taken)))
    held_set = frozenset(held)
    before = fragmentation(model, held, mix)
    busy = sum(i.placement.size for i in held)
    ranks: dict[MigInstance, Rank] = {}
    for instance in set(placements):
        if instance not in held_set and fits_beside(model, held, instance):
            # rounded: equal states on two GPUs must rank equal, whatever the float noise
            gain = round(fragmentation(model, (*held, instance), mix) - before, 9)
            room = _room_rank(model, held, instance)
            ranks[instance] = (0, gain, -busy, room, instance.placement.start, index)
        else:
            ranks[instance] = (1, 0.0, 0, 0, instance.placement.start, index)
    return ranks


def node_choice(
    gpus: Iterable[tuple[int, GpuModel, Sequence[MigInstance]]],
    profile: str,
    mix: Mix | None = None,
) -> tuple[int, MigInstance] | None:
    """The GPU and placement the core picks for one more `profile` on a node whose GPUs
    (index, model, instances taken) are given: the least-ranked placement that fits; None
    when none fits. First fit over our published order picks exactly this."""
    mix = mix or Mix()
    best: tuple[Rank, int, MigInstance] | None = None
    for index, model, taken in gpus:
        wanted = model.find_profile(profile)
        if wanted is None:
            continue
        candidates = [
            MigInstance(Placement(start, wanted.memory_slices), wanted.name)
            for start in wanted.starts
        ]
        for instance, rank in placement_ranks(model, index, candidates, taken, mix).items():
            if rank[0] == 0 and (best is None or (rank, index) < best[:2]):
                best = (rank, index, instance)
    return None if best is None else (best[1], best[2])


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
