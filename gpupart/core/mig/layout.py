"""MIG layouts of one GPU: placements, validity, and an exact solver from profile counts to placements.

The solver is exact by construction: it enumerates, once per GPU model, every valid set of
GPU instances (a few thousand on an 8-slice GPU) and indexes them by their profile counts, so
"impossible" is only ever said when no layout exists. Among the layouts with the requested
counts it keeps the instances that are in use, then those that already exist, then leaves the
free memory slices most useful for later requests.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cache

from gpupart.core.errors import InfeasibleLayout, InvalidInput, UnknownProfile
from gpupart.core.mig.catalogue import NO_MEDIA, GpuModel, MediaEngines, MigProfile


@dataclass(frozen=True, slots=True, order=True)
class Placement:
    """A GPU instance's memory slices: ``[start, start + size)``, as NVML reports placements."""

    start: int
    size: int

    @property
    def mask(self) -> int:
        return ((1 << self.size) - 1) << self.start

    def overlaps(self, other: Placement) -> bool:
        return self.start < other.start + other.size and other.start < self.start + self.size

    def __str__(self) -> str:
        if self.size == 1:
            return f"slot {self.start}"
        return f"slots {self.start}-{self.start + self.size - 1}"


@dataclass(frozen=True, slots=True, order=True)
class MigInstance:
    """A GPU instance (with its one full-size compute instance) of `profile` at `placement`."""

    placement: Placement
    profile: str

    def __str__(self) -> str:
        return f"{self.profile} at {self.placement}"


Layout = tuple[MigInstance, ...]
"""One GPU's MIG layout, sorted by placement."""


def layout_counts(layout: Iterable[MigInstance]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for instance in layout:
        counts[instance.profile] = counts.get(instance.profile, 0) + 1
    return counts


def require_counts(
    model: GpuModel, counts: Mapping[str, int], *, where: str = ""
) -> tuple[int, ...]:
    """Profile counts as a vector in the model's profile order; bad names and counts raise."""
    for name, count in counts.items():
        model.require_profile(name)
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise InvalidInput(
                f"{where}.{name}" if where else name,
                f"count must be a whole number ≥ 0, got {count!r}",
            )
    return tuple(counts.get(p.name, 0) for p in model.profiles)


def check_layout(model: GpuModel, layout: Iterable[MigInstance]) -> None:
    """Raise InfeasibleLayout naming the first rule a concrete layout breaks."""
    placed: list[MigInstance] = []
    for instance in sorted(layout):
        profile = model.find_profile(instance.profile)
        if profile is None:
            raise UnknownProfile(instance.profile, model.product, model.profile_names)
        if (
            instance.placement.start not in profile.starts
            or instance.placement.size != profile.memory_slices
        ):
            raise InfeasibleLayout(
                f"{instance} is not a placement of {profile.name} on {model.product}: "
                f"it needs {_starts_text(profile)}, {profile.memory_slices} memory slices"
            )
        for other in placed:
            if other.placement.overlaps(instance.placement):
                raise InfeasibleLayout(f"{instance} overlaps {other}")
        placed.append(instance)
    problem = _count_problem(model, layout_counts(placed))
    if problem:
        raise InfeasibleLayout(problem)


def fit_layout(
    model: GpuModel,
    counts: Mapping[str, int],
    *,
    keep: Iterable[MigInstance] = (),
    prefer: Iterable[MigInstance] = (),
) -> Layout | None:
    """A layout with exactly `counts`, containing every `keep` instance; None if none exists.

    Among the candidates it maximises the `prefer` instances kept (existing ones: fewer
    destroy/create steps), then the room left for more instances.
    """
    vector = require_counts(model, counts)
    table = _layout_table(model)
    candidates = table.by_counts.get(vector, ())
    keep_set, prefer_set = frozenset(keep), frozenset(prefer)
    if not keep_set and not prefer_set:
        return candidates[0] if candidates else None
    best: Layout | None = None
    best_kept = -1
    for layout in candidates:  # already sorted best-room first, so the first maximum wins
        present = frozenset(layout)
        if keep_set <= present:
            kept = len(prefer_set & present)
            if kept > best_kept:
                best, best_kept = layout, kept
    return best


def layouts_with_counts(model: GpuModel, counts: Mapping[str, int]) -> tuple[Layout, ...]:
    """Every valid layout with exactly `counts`, in the order `fit_layout` prefers (most room
    for more instances first), for callers that search them many times."""
    return _layout_table(model).by_counts.get(require_counts(model, counts), ())


def solve_layout(
    model: GpuModel,
    counts: Mapping[str, int],
    *,
    keep: Iterable[MigInstance] = (),
    prefer: Iterable[MigInstance] = (),
) -> Layout:
    """Like `fit_layout`, but a missing layout raises InfeasibleLayout with a reason for a person."""
    keep = tuple(keep)
    layout = fit_layout(model, counts, keep=keep, prefer=prefer)
    if layout is None:
        raise InfeasibleLayout(explain_infeasible(model, counts, keep=keep))
    return layout


def explain_infeasible(
    model: GpuModel, counts: Mapping[str, int], *, keep: Iterable[MigInstance] = ()
) -> str:
    """Why no layout has `counts` (and keeps `keep`): the first limit broken, in words."""
    wanted = {name: n for name, n in counts.items() if n > 0}
    keep = tuple(sorted(keep))
    asked = _counts_text(wanted) or "nothing"
    prefix = f"{asked} cannot be placed on one {model.product}"
    kept = layout_counts(keep)
    dropped = [i for i in keep if kept[i.profile] > wanted.get(i.profile, 0)]
    if dropped:
        return f"{prefix}: the instance {dropped[0]} is in use and is not among the requested"
    problem = _count_problem(model, wanted)
    if problem:
        return f"{prefix}: {problem}"
    # Totals fit, so placement is the problem: show the arrangement that places the most
    # memory and the profile left without a free start slot.
    vector = require_counts(model, wanted)
    keep_set = frozenset(keep)
    best: Layout = ()
    best_key = (-1, -1)
    for layout in _layout_table(model).all_layouts:
        got = layout_counts(layout)
        if keep_set <= frozenset(layout) and all(
            got.get(p.name, 0) <= n for p, n in zip(model.profiles, vector, strict=True)
        ):
            key = (_memory_of(model, layout), len(layout))
            if key > best_key:
                best, best_key = layout, key
    placed = layout_counts(best)
    missing = [p for p in model.profiles if wanted.get(p.name, 0) > placed.get(p.name, 0)]
    profile = max(missing, key=lambda p: (p.memory_slices, p.compute_slices))
    blockers = []
    for start in profile.starts:
        spot = Placement(start, profile.memory_slices)
        taken = [
            f"{other}" + (" (in use)" if other in keep_set else "")
            for other in best
            if other.placement.overlaps(spot)
        ]
        blockers.append(f"start {start} overlaps {' and '.join(taken)}")
    arrangement = ", ".join(str(i) for i in best) or "nothing"
    return (
        f"{prefix}: {profile.name} needs {_starts_text(profile)}; with {arrangement}, "
        f"{'; '.join(blockers)}"
    )


def _count_problem(model: GpuModel, counts: Mapping[str, int]) -> str:
    """The first per-profile or whole-GPU total that `counts` exceeds, or ''."""
    total_instances = total_memory = total_compute = 0
    engines = NO_MEDIA
    for name, count in counts.items():
        profile = model.require_profile(name)
        if count > profile.max_count:
            return f"{count} × {name} requested, at most {profile.max_count} fit on one {model.product}"
        total_instances += count
        total_memory += count * profile.memory_slices
        total_compute += count * profile.compute_slices
        engines += profile.engines.times(count)
    if total_instances > model.max_instances:
        return (
            f"{total_instances} instances requested, at most {model.max_instances} fit on one GPU"
        )
    if total_memory > model.memory_slices:
        return f"they need {total_memory} memory slices, the GPU has {model.memory_slices}"
    if total_compute > model.compute_slices:
        return f"they need {total_compute} compute slices, the GPU has {model.compute_slices}"
    short = engines.beyond(model.engines)
    if short:
        return (
            f"they need media engines {engines}, the GPU has {model.engines}: "
            f"too few {' and '.join(short)} for these instances together"
        )
    return ""


def _memory_of(model: GpuModel, layout: Layout) -> int:
    return sum(model.require_profile(i.profile).memory_slices for i in layout)


def _starts_text(profile: MigProfile) -> str:
    starts = [str(s) for s in profile.starts]
    if len(starts) == 1:
        return f"start slot {starts[0]}"
    return f"start slot {', '.join(starts[:-1])} or {starts[-1]}"


def _counts_text(counts: Mapping[str, int]) -> str:
    return ", ".join(f"{n} × {name}" for name, n in counts.items() if n > 0)


@dataclass(frozen=True, slots=True)
class _LayoutTable:
    all_layouts: tuple[Layout, ...]
    by_counts: Mapping[tuple[int, ...], tuple[Layout, ...]]
    """Layouts per count vector, best room-for-more first."""


@cache
def _layout_table(model: GpuModel) -> _LayoutTable:
    """Every valid layout of `model`, found by depth-first search over placements in start order."""
    candidates = [
        (index, profile, Placement(start, profile.memory_slices))
        for index, profile in enumerate(model.profiles)
        for start in profile.starts
    ]
    candidates.sort(key=lambda c: (c[2].start, c[0]))
    width = len(model.profiles)
    found: list[tuple[tuple[int, ...], int, Layout]] = []

    def extend(
        first: int,
        used: int,
        vector: list[int],
        compute: int,
        engines: MediaEngines,
        chosen: list[MigInstance],
    ) -> None:
        found.append((tuple(vector), used, tuple(chosen)))
        if len(chosen) == model.max_instances:
            return
        for position in range(first, len(candidates)):
            index, profile, placement = candidates[position]
            if (
                used & placement.mask
                or vector[index] == profile.max_count
                or compute + profile.compute_slices > model.compute_slices
            ):
                continue
            taken = engines + profile.engines
            if not taken.within(model.engines):
                continue
            vector[index] += 1
            chosen.append(MigInstance(placement, profile.name))
            extend(
                position + 1,
                used | placement.mask,
                vector,
                compute + profile.compute_slices,
                taken,
                chosen,
            )
            chosen.pop()
            vector[index] -= 1

    extend(0, 0, [0] * width, 0, NO_MEDIA, [])
    room = _room_by_free_mask(model, [(vector, used) for vector, used, _ in found])
    by_counts: dict[tuple[int, ...], list[tuple[int, Layout]]] = {}
    for vector, used, layout in found:
        by_counts.setdefault(vector, []).append((room[used], layout))
    ordered = {
        vector: tuple(layout for _, layout in sorted(entries, key=lambda e: (-e[0], e[1])))
        for vector, entries in by_counts.items()
    }
    return _LayoutTable(tuple(layout for _, _, layout in found), ordered)


def _room_by_free_mask(
    model: GpuModel, layouts: list[tuple[tuple[int, ...], int]]
) -> dict[int, int]:
    """For each used-slice mask, how many distinct count vectors still fit in the free slices.

    This is the room a layout leaves for later requests: a 1g instance at slot 6 rather than 0
    keeps 4g.40gb possible, so more count vectors stay reachable and that layout ranks first.
    """
    full = (1 << model.memory_slices) - 1
    room: dict[int, int] = {}
    for used in {used for _, used in layouts}:
        free = full & ~used
        room[used] = len({vector for vector, other in layouts if not other & ~free})
    return room
