"""The dynamic MIG planner: pending demand in, per-GPU NVML steps and a reservation per instance out.

Rules, in order:
- An instance in use or reserved is never destroyed or moved: every layout considered contains
  it (the layouts of `gpupart.core.mig.layout.layouts_with_counts`, as `fit_layout` ranks
  them), and `plan_layout` refuses a plan that would touch it anyway.
- Pods are served by priority (higher first), then by how long they have waited (aging, so a
  large request is not starved by a stream of small ones), then by name; a pod is served only
  if every instance it asks for fits on one node, together with everything served before it.
- Among the ways to serve a pod: least `OPS_WEIGHT` x instance operations (reusing an idle
  instance costs none, a create one, destroying an idle instance one) + fragmentation left
  against the observed mix (`fragmentation`) + `QUEUE_WEIGHT` x operations already planned on
  the GPU this round when it needs one (a GPU makes instances one at a time: spreading a
  burst's creates over GPUs binds its pods sooner), then fewest operations, node name, GPU index.
- An idle instance is destroyed only when a pending pod's creation needs its memory slices, or, once
  older than the policy's `min_idle_s` (the hysteresis), to restore the warm mix on a GPU that
  holds nothing in use or reserved. The hysteresis never makes a pending pod wait: measured on
  the saturated W2 workload it did (ADR 004). Nothing else changes, so a steady demand reaches
  a fixed point.

Within a node the choice is exact: when the greedy choice of GPUs fails, the pods planned on that
node in this round are repacked over its GPUs by a bounded depth-first search.

Speed (about 1,000 GPUs per decision): GPU states are numbered once, instances are plain tuples
(dataclass hashing dominated before), per-GPU answers are memoised by (state, claims), each
node's answer is kept until a claim changes that node, and a GPU whose lower bound on cost
cannot beat the best found is not solved (`_Solver.lower`); none of this changes an answer.
Pure and deterministic: no clock (the caller passes `now`), no randomness.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import combinations
from math import inf

from gpupart.core.dynamic.fragmentation import stranded
from gpupart.core.dynamic.model import (
    Gpu,
    Instance,
    MigDemand,
    Mix,
    Use,
)
from gpupart.core.errors import InvalidInput
from gpupart.core.mig.catalogue import NO_MEDIA, GpuModel, MediaEngines, parse_profile_name
from gpupart.core.mig.layout import (
    Layout,
    MigInstance,
    Placement,
    fit_layout,
    layout_counts,
    layouts_with_counts,
)
from gpupart.core.mig.planning import (
    CreateGpuInstance,
    DestroyGpuInstance,
    GpuInstanceState,
    Step,
    plan_layout,
)

REPACK_BUDGET = 2_000
"""Most GPU evaluations one node's repack search may make before it gives up."""
OPS_WEIGHT = 1.0
"""What one instance operation costs against one memory slice of expected fragmentation: an
idle instance is reused as is only when that does not strand more than a memory slice elsewhere."""
QUEUE_WEIGHT = 1.0
"""What one operation already planned on a GPU in the same round costs a new one there, against
one memory slice of expected fragmentation (NVML changes one GPU's instances one at a time)."""
REASON_GPUS = 3
"""How many GPUs an unserved pod's reason names (it counts the rest)."""


@dataclass(frozen=True, slots=True)
class Reservation:
    """A pod's claim on one instance: an idle one it reuses, or one the plan creates."""

    pod: str
    node: str
    gpu: int
    instance: MigInstance
    created: bool


@dataclass(frozen=True, slots=True)
class GpuSteps:
    """The ordered NVML steps for one GPU, and the layout they lead to."""

    node: str
    gpu: int
    steps: tuple[Step, ...]
    layout: Layout

    @property
    def creates(self) -> int:
        return sum(1 for step in self.steps if isinstance(step, CreateGpuInstance))

    @property
    def destroys(self) -> int:
        return sum(1 for step in self.steps if isinstance(step, DestroyGpuInstance))


@dataclass(frozen=True, slots=True)
class PlannerAnswer:
    """The planner's answer: steps per GPU (only GPUs that change), reservations, reasons."""

    gpus: tuple[GpuSteps, ...]
    reservations: tuple[Reservation, ...]
    unserved: tuple[tuple[str, str], ...]
    """(pod, why) for every pending pod this plan does not serve."""

    @property
    def operations(self) -> int:
        """Instance operations: GPU instances created plus destroyed."""
        return sum(plan.creates + plan.destroys for plan in self.gpus)

    def served(self) -> frozenset[str]:
        return frozenset(r.pod for r in self.reservations)


_Spot = tuple[int, int, str]
"""An instance inside the solver: (start slot, memory slices, profile); tuples hash fast."""


def _spot(instance: MigInstance) -> _Spot:
    return (instance.placement.start, instance.placement.size, instance.profile)


def _instance(spot: _Spot) -> MigInstance:
    return MigInstance(Placement(spot[0], spot[1]), spot[2])


@dataclass(frozen=True, slots=True)
class _Option:
    """One way to give a GPU its claims: the layout, what it creates and destroys, its cost."""

    layout: tuple[_Spot, ...]
    created: tuple[_Spot, ...]
    destroyed: tuple[_Spot, ...]
    frag: float

    @property
    def ops(self) -> int:
        return len(self.created) + len(self.destroyed)

    @property
    def cost(self) -> float:
        return OPS_WEIGHT * self.ops + self.frag


@dataclass(frozen=True, slots=True)
class _Profile:
    """A profile as the solver needs it: sizes, limits, and the slice mask of every start."""

    name: str
    index: int
    memory: int
    compute: int
    engines: MediaEngines
    masks: tuple[tuple[int, int], ...]
    """(start, mask) per legal start, in start order."""


class _Geometry:
    """One GPU model's profiles, indexed once per plan."""

    __slots__ = ("model", "profiles", "by_name", "layouts")

    def __init__(self, model: GpuModel) -> None:
        self.model = model
        self.profiles = tuple(
            _Profile(
                p.name,
                k,
                p.memory_slices,
                p.compute_slices,
                p.engines,
                tuple((start, Placement(start, p.memory_slices).mask) for start in p.starts),
            )
            for k, p in enumerate(model.profiles)
        )
        self.by_name = {p.name: p for p in self.profiles}
        self.layouts: dict[
            tuple[int, ...], tuple[tuple[frozenset[_Spot], tuple[_Spot, ...]], ...]
        ] = {}
        """Every layout per count vector as spots, most room first (`layouts_with_counts`)."""


_Key = tuple[int, tuple[_Spot, ...], tuple[_Spot, ...], tuple[str, ...] | None, bool]
"""A GPU up to its name: model number, fixed instances, idle instances, allowed profiles, carve."""
_Claims = tuple[tuple[str, int], ...]


class _Work:
    """One GPU while a plan is made: its instances sorted by what may happen to them, its claims."""

    __slots__ = ("gpu", "fixed", "idle", "young", "key", "state", "claims", "counts", "warm")

    def __init__(self, gpu: Gpu, now: float, model_number: int) -> None:
        self.gpu = gpu
        self.fixed = tuple(sorted((i for i in gpu.instances if i.fixed), key=_start))
        self.idle = tuple(sorted((i for i in gpu.instances if not i.fixed), key=_start))
        self.young = tuple(i for i in self.idle if now - i.since < gpu.policy.min_idle_s)
        """Idle instances the warm mix may not destroy yet (a pending pod may)."""
        self.key: _Key = (
            model_number,
            tuple(_spot(i.instance) for i in self.fixed),
            tuple(_spot(i.instance) for i in self.idle),
            gpu.policy.profiles,
            gpu.policy.carve_idle_gpus,
        )
        self.state = -1
        """The solver's number for `key` (set by `plan`)."""
        self.claims: list[tuple[str, str]] = []
        """(pod, profile) served on this GPU by this plan."""
        self.counts: _Claims = ()
        """`claims` as profile counts (the solver's key)."""
        self.warm: _Option | None = None
        """The change that restores the warm mix, on a GPU without claims."""

    def claim(self, pod: str, profile: str) -> None:
        self.claims.append((pod, profile))
        self.counts = _claims_key(p for _, p in self.claims)


def _start(instance: Instance) -> int:
    return instance.instance.placement.start


def _claims_key(profiles: Iterable[str]) -> _Claims:
    return tuple(sorted(Counter(profiles).items()))


class _Solver:
    """Memoised per-GPU options: GPUs in the same state share every answer."""

    def __init__(self, mix: Mix) -> None:
        self.mix = mix
        self.geometries: list[_Geometry] = []
        self.model_numbers: dict[int, int] = {}
        self.memo: dict[tuple[int, _Claims], _Option | None] = {}
        self.states: dict[_Key, int] = {}
        self.sums: dict[tuple[_Claims, str], _Claims] = {}
        self.keys: list[_Key] = []
        self.deltas: dict[tuple[int, _Claims, str], tuple[float, int] | None] = {}
        self.frag_memo: dict[tuple[int, int, tuple[int, ...]], float] = {}
        self.lowers: dict[tuple[int, str], float] = {}

    def model_number(self, model: GpuModel) -> int:
        """A small number per distinct model (by identity first: hashing a model is slow)."""
        number = self.model_numbers.get(id(model))
        if number is None:
            number = next(
                (k for k, g in enumerate(self.geometries) if g.model == model),
                len(self.geometries),
            )
            if number == len(self.geometries):
                self.geometries.append(_Geometry(model))
            self.model_numbers[id(model)] = number
        return number

    def plus(self, claims: _Claims, profile: str) -> _Claims:
        """`claims` with one more `profile` (memoised: the same few sums recur on every GPU)."""
        key = (claims, profile)
        found = self.sums.get(key)
        if found is None:
            counts = dict(claims)
            counts[profile] = counts.get(profile, 0) + 1
            found = self.sums[key] = tuple(sorted(counts.items()))
        return found

    def intern(self, key: _Key) -> int:
        """A small number for a GPU state: memo keys then hash an int, not the whole state."""
        state = self.states.get(key)
        if state is None:
            state = self.states[key] = len(self.keys)
            self.keys.append(key)
        return state

    def option(self, state: int, claims: _Claims) -> _Option | None:
        memo_key = (state, claims)
        if memo_key in self.memo:
            return self.memo[memo_key]
        found = self.memo[memo_key] = self._solve(self.keys[state], claims)
        return found

    def delta(self, state: int, claims: _Claims, profile: str) -> tuple[float, int] | None:
        """What adding one `profile` to a GPU holding `claims` costs: (weighted cost, operations)."""
        key = (state, claims, profile)
        if key in self.deltas:
            return self.deltas[key]
        before = self.option(state, claims)
        after = self.option(state, self.plus(claims, profile))
        found = None
        if before is not None and after is not None:
            found = (after.cost - before.cost, after.ops - before.ops)
        self.deltas[key] = found
        return found

    def frag(self, geometry: _Geometry, layout: Sequence[_Spot]) -> float:
        used = 0
        counts = [0] * len(geometry.profiles)
        for start, size, name in layout:
            used |= ((1 << size) - 1) << start
            counts[geometry.by_name[name].index] += 1
        key = (id(geometry), used, tuple(counts))
        value = self.frag_memo.get(key)
        if value is None:
            compute = instances = 0
            engines = NO_MEDIA
            by_name: dict[str, int] = {}
            for profile, count in zip(geometry.profiles, counts, strict=True):
                if count:
                    compute += count * profile.compute
                    instances += count
                    engines += profile.engines.times(count)
                    by_name[profile.name] = count
            value = stranded(geometry.model, used, compute, instances, engines, by_name, self.mix)
            self.frag_memo[key] = value
        return value

    def fit(
        self, geometry: _Geometry, vector: tuple[int, ...], keep: frozenset[_Spot]
    ) -> tuple[_Spot, ...] | None:
        """`fit_layout` on spots: the first layout with `vector` (counts in the model's profile
        order) holding `keep`, most room first."""
        candidates = geometry.layouts.get(vector)
        if candidates is None:
            counts = {p.name: n for p, n in zip(geometry.profiles, vector, strict=True) if n}
            candidates = geometry.layouts[vector] = tuple(
                (frozenset(spots), spots)
                for spots in (
                    tuple(sorted(_spot(i) for i in layout))
                    for layout in layouts_with_counts(geometry.model, counts)
                )
            )
        for present, spots in candidates:
            if keep <= present:
                return spots
        return None

    def lower(self, state: int, profile: str) -> float:
        """A lower bound on `delta` for a GPU without claims: 0 when an idle instance of
        `profile` is there to reuse (the layout stays as it is), else at least one operation
        against the fragmentation it may remove; `inf` when the profile cannot fit at all."""
        key = (state, profile)
        found = self.lowers.get(key)
        if found is None:
            number, fixed, idle, _, _ = self.keys[state]
            geometry = self.geometries[number]
            wanted = geometry.by_name.get(profile)
            fixed_mask = 0
            for start, size, _ in fixed:
                fixed_mask |= ((1 << size) - 1) << start
            if wanted is None or not _room(geometry, fixed, fixed_mask, [wanted]):
                found = inf
            else:
                before = self.option(state, ())
                change = OPS_WEIGHT - (before.frag if before is not None else 0.0)
                reuse = any(name == profile for _, _, name in idle)
                found = min(0.0, change) if reuse else change
            self.lowers[key] = found
        return found

    def _solve(self, key: _Key, claims: _Claims) -> _Option | None:
        """The cheapest layout that keeps the fixed instances and covers `claims`.

        Exact over which idle instances to destroy: every subset is tried, fewest first, until
        destroying more cannot be cheaper than the best found; for each, the exact solver
        (`fit_layout`) places the instances to create where they leave the most room.
        """
        number, fixed, idle, allowed, carve = key
        geometry = self.geometries[number]
        if not claims:
            layout = tuple(sorted((*fixed, *idle)))
            return _Option(layout, (), (), self.frag(geometry, layout))
        items = []
        for name, count in claims:
            profile = geometry.by_name.get(name)
            if profile is None:
                return None
            items += [profile] * count
        fixed_mask = 0
        for start, size, _ in fixed:
            fixed_mask |= ((1 << size) - 1) << start
        if not _room(geometry, fixed, fixed_mask, items):
            return None  # no subset of idle instances to destroy can make room
        index = {p.name: p.index for p in geometry.profiles}
        need = [(index[name], count) for name, count in claims]
        base = [0] * len(geometry.profiles)
        for _, _, name in fixed:
            base[index[name]] += 1
        best: _Option | None = None
        for drop in range(len(idle) + 1):
            if best is not None and OPS_WEIGHT * drop >= best.cost:
                break
            for dropped in combinations(idle, drop):
                left = [spot for spot in idle if spot not in dropped]
                idle_counts = [0] * len(base)
                for _, _, name in left:
                    idle_counts[index[name]] += 1
                new = [(k, n - idle_counts[k]) for k, n in need if n > idle_counts[k]]
                if (
                    new
                    and allowed is not None
                    and any(geometry.profiles[k].name not in allowed for k, _ in new)
                ):
                    continue
                if new and not carve and not fixed and not idle:
                    continue
                target = [a + b for a, b in zip(base, idle_counts, strict=True)]
                for k, n in new:
                    target[k] += n
                kept = frozenset((*fixed, *left))
                found = self.fit(geometry, tuple(target), kept)
                if found is None:
                    continue
                created = tuple(spot for spot in found if spot not in kept)
                option = _Option(found, created, dropped, self.frag(geometry, found))
                if best is None or (option.cost, option.ops) < (best.cost, best.ops):
                    best = option
        return best


def _room(
    geometry: _Geometry, fixed: Sequence[_Spot], fixed_mask: int, items: Sequence[_Profile]
) -> bool:
    """A necessary condition for `items` beside the fixed instances: memory slices and compute left,
    and for each profile a legal start clear of them (cheap; the exact search decides)."""
    compute = sum(geometry.by_name[name].compute for _, _, name in fixed)
    memory = sum(p.memory for p in items)
    compute += sum(p.compute for p in items)
    if memory > geometry.model.memory_slices - fixed_mask.bit_count():
        return False
    if compute > geometry.model.compute_slices:
        return False
    return all(any(not mask & fixed_mask for _, mask in p.masks) for p in set(items))


def plan(
    gpus: Sequence[Gpu],
    demand: Sequence[MigDemand],
    *,
    now: float,
    mix: Mix | None = None,
) -> PlannerAnswer:
    """Plan the MIG changes that serve `demand` on `gpus`; see the module docstring for the rules.

    `mix` is the observed demand mix the fragmentation is measured against; by default the mix
    of `demand` itself. Pods that already hold a reservation are left out (being served).
    """
    reserved = {i.pod for gpu in gpus for i in gpu.instances if i.use is Use.RESERVED}
    pending = sorted(
        (d for d in demand if d.pod not in reserved),
        key=lambda d: (-d.priority, d.pending_since, d.pod),
    )
    if mix is None:
        mix = Mix.of(Counter(p for d in pending for p in d.profiles))
    solver = _Solver(mix)
    works = [
        _Work(gpu, now, solver.model_number(gpu.model))
        for gpu in sorted(gpus, key=lambda g: (g.node, g.index))
    ]
    for work in works:
        work.state = solver.intern(work.key)
    nodes = _Nodes()
    for work in works:
        nodes.gpus.setdefault(work.gpu.node, []).append(work)
    unserved: list[tuple[str, str]] = []
    allowed = {d.pod: d for d in pending}
    for request in pending:
        if not request.profiles:
            continue
        if not _serve(solver, nodes, request, allowed):
            unserved.append((request.pod, _reason(works, request, now)))
    _warm(solver, works)
    return _result(solver, works, unserved)


def _size(profile: str) -> tuple[int, int, str]:
    """Sort key, largest instance first: memory (from the name), compute slices, name."""
    try:
        compute, _, gigabytes, _ = parse_profile_name(profile)
    except InvalidInput:
        return (0, 0, profile)  # no GPU offers it; its reason says so
    return (-gigabytes, -compute, profile)


_Choice = tuple[tuple[float, int], list[_Work]]
"""A node's cheapest way to take a request: (weighted cost, operations), GPU per instance."""


class _Nodes:
    """The GPUs by node, and each node's answer per request shape, kept until its claims change:
    one pod's claims touch one node, so the next pod re-scores only that node."""

    __slots__ = ("gpus", "versions", "answers")

    def __init__(self) -> None:
        self.gpus: dict[str, list[_Work]] = {}
        self.versions: dict[str, int] = {}
        self.answers: dict[tuple[str, tuple[str, ...]], tuple[int, float, _Choice | None]] = {}

    def choice(
        self, solver: _Solver, name: str, profiles: tuple[str, ...], bound: float
    ) -> _Choice | None:
        """The node's cheapest way to take `profiles`; an answer costlier than `bound` may be
        wrong or None (GPUs that cannot beat it are skipped), one within it is exact."""
        version = self.versions.get(name, 0)
        found = self.answers.get((name, profiles))
        if found is not None and found[0] == version and bound <= found[1]:
            return found[2]
        choice = _greedy(solver, self.gpus[name], profiles, bound)
        self.answers[(name, profiles)] = (version, bound, choice)
        return choice

    def changed(self, name: str) -> None:
        self.versions[name] = self.versions.get(name, 0) + 1


def _serve(
    solver: _Solver, nodes: _Nodes, request: MigDemand, allowed: dict[str, MigDemand]
) -> bool:
    """Claim GPUs for every instance of `request` on the best node it may use; False when none
    can. `allowed`: every pending pod by name, whose nodes a repack of its claims respects."""
    profiles = tuple(sorted(request.profiles, key=_size))
    best: tuple[tuple[float, int, str], list[_Work]] | None = None
    for name in nodes.gpus:
        if not request.may_use(name):
            continue
        bound = best[0][0] if best is not None and len(profiles) == 1 else inf
        found = nodes.choice(solver, name, profiles, bound)
        if found is not None and (best is None or (*found[0], name) < best[0]):
            best = ((*found[0], name), found[1])
    if best is not None:
        for work, profile in zip(best[1], profiles, strict=True):
            work.claim(request.pod, profile)
        nodes.changed(best[0][2])
        return True
    for name, node in nodes.gpus.items():
        if request.may_use(name) and _repack(solver, node, request.pod, profiles, allowed):
            nodes.changed(name)
            return True
    # across nodes: only when the pod fits some node without this round's claims, so that
    # moving earlier pods can help (in a saturated cluster most pods fail that cheap test)
    if len(nodes.gpus) > 1 and any(
        _greedy(solver, node, profiles, fresh=True) is not None
        for name, node in nodes.gpus.items()
        if request.may_use(name)
    ):
        works = [work for node in nodes.gpus.values() for work in node]
        if _repack(solver, works, request.pod, profiles, allowed):
            for name in nodes.gpus:
                nodes.changed(name)
            return True
    return False


def _current(solver: _Solver, work: _Work) -> _Option:
    option = solver.option(work.state, work.counts)
    if option is None:  # claims are only ever added when an option exists
        raise AssertionError("a GPU's claims have no layout")
    return option


def _greedy(
    solver: _Solver,
    node: list[_Work],
    profiles: tuple[str, ...],
    bound: float = inf,
    *,
    fresh: bool = False,
) -> _Choice | None:
    """For each instance in turn, the GPU of `node` where adding it costs least, and the total
    cost (weighted cost, operations); None when one instance fits nowhere. A GPU whose lower
    bound exceeds `bound` (or the best found) is skipped: it cannot be the answer. `fresh`:
    as if nothing were claimed on the node yet."""
    extra: dict[int, _Claims] = {}
    chosen: list[_Work] = []
    cost, ops = 0.0, 0
    for profile in profiles:
        best: tuple[tuple[float, int, int], _Work] | None = None
        for position, work in enumerate(node):
            claims = extra.get(position, () if fresh else work.counts)
            limit = bound if best is None else min(bound, best[0][0])
            if not claims and solver.lower(work.state, profile) > limit:
                continue
            found = solver.delta(work.state, claims, profile)
            if found is None:
                continue
            if found[1] and claims:
                # A GPU makes its instances one after another: each operation already planned
                # on it this round delays this one (the pod binds later), so spread creates.
                queued = solver.option(work.state, claims)
                found = (found[0] + QUEUE_WEIGHT * (queued.ops if queued else 0), found[1])
            key = (found[0], found[1], position)
            if best is None or key < best[0]:
                best = (key, work)
        if best is None:
            return None
        (delta_cost, delta_ops, position), work = best
        extra[position] = solver.plus(extra.get(position, () if fresh else work.counts), profile)
        chosen.append(work)
        cost += delta_cost
        ops += delta_ops
    return (cost, ops), chosen


def _repack(
    solver: _Solver,
    works: list[_Work],
    pod: str,
    profiles: tuple[str, ...],
    allowed: dict[str, MigDemand],
) -> bool:
    """Redistribute this round's claims on `works` plus `pod`'s over them, each pod's instances
    on one node it may use; exact within `REPACK_BUDGET` GPU evaluations."""
    items = [(c_pod, p) for work in works for c_pod, p in work.claims]
    if not items and len(profiles) == 1:
        return False  # the greedy pass already tried every GPU for this one instance
    items += [(pod, p) for p in profiles]
    if len({work.gpu.model for work in works}) == 1 and _slices(works, (p for _, p in items)) > sum(
        _free_slices(work) for work in works
    ):
        return False
    items.sort(key=lambda item: _size(item[1]))
    assignment: list[list[tuple[str, str]]] = [[] for _ in works]
    homes: dict[str, str] = {}
    """The node of each pod with an instance placed."""
    budget = [REPACK_BUDGET]

    def place(position: int) -> bool:
        if position == len(items):
            return True
        owner = items[position][0]
        home = homes.get(owner)
        tried: set[tuple[int, _Claims]] = set()
        demand = allowed.get(owner)
        for g, work in enumerate(works):
            if home is not None and work.gpu.node != home:
                continue
            if demand is not None and not demand.may_use(work.gpu.node):
                continue
            claims = _claims_key(p for _, p in (*assignment[g], items[position]))
            state = (work.state, _claims_key(p for _, p in assignment[g]))
            if state in tried:  # an identical GPU already failed for this item
                continue
            tried.add(state)
            budget[0] -= 1
            if budget[0] < 0:
                return False
            if solver.option(work.state, claims) is None:
                continue
            assignment[g].append(items[position])
            homes[owner] = work.gpu.node
            if place(position + 1):
                return True
            assignment[g].pop()
            if home is None:
                del homes[owner]
        return False

    if not place(0):
        return False
    for work, claims in zip(works, assignment, strict=True):
        work.claims = claims
        work.counts = _claims_key(p for _, p in claims)
    return True


def _slices(node: list[_Work], profiles: Iterable[str]) -> int:
    """Memory slices `profiles` take on `node`'s GPU model (a node's GPUs are of one model)."""
    model = node[0].gpu.model
    total = 0
    for name in profiles:
        profile = model.find_profile(name)
        total += profile.memory_slices if profile else model.memory_slices + 1
    return total


def _warm(solver: _Solver, works: list[_Work]) -> None:
    """Restore the warm mix on GPUs with nothing in use, reserved or claimed, where it is missing."""
    for work in works:
        warm = work.gpu.policy.warm_counts
        if not warm or work.fixed or work.claims:
            continue
        present = tuple(i.instance for i in work.idle)
        if layout_counts(present) == warm:
            continue
        if not work.gpu.policy.carve_idle_gpus and not present:
            continue
        young = tuple(i.instance for i in work.young)
        layout = fit_layout(work.gpu.model, warm, keep=young, prefer=present)
        if layout is None:
            continue  # the young idle instances are in the way until they age
        created = tuple(_spot(i) for i in layout if i not in present)
        destroyed = tuple(_spot(i) for i in present if i not in layout)
        spots = tuple(sorted(_spot(i) for i in layout))
        geometry = solver.geometries[work.key[0]]
        work.warm = _Option(spots, created, destroyed, solver.frag(geometry, spots))


def _result(solver: _Solver, works: list[_Work], unserved: list[tuple[str, str]]) -> PlannerAnswer:
    plans: list[GpuSteps] = []
    reservations: list[Reservation] = []
    for work in works:
        option = work.warm or _current(solver, work)
        gpu = work.gpu
        if option.ops:
            layout = tuple(sorted(_instance(spot) for spot in option.layout))
            actual = [GpuInstanceState(i.instance, in_use=i.fixed) for i in gpu.instances]
            steps = plan_layout(gpu.index, actual, layout)
            plans.append(GpuSteps(gpu.node, gpu.index, steps, layout))
        kept = frozenset(option.layout)
        reusable = [i.instance for i in work.idle if _spot(i.instance) in kept]
        created = [_instance(spot) for spot in option.created]
        for pod, profile in work.claims:
            pick = next((i for i in reusable if i.profile == profile), None)
            if pick is not None:
                reusable.remove(pick)
                reservations.append(Reservation(pod, gpu.node, gpu.index, pick, False))
                continue
            pick = next(i for i in created if i.profile == profile)
            created.remove(pick)
            reservations.append(Reservation(pod, gpu.node, gpu.index, pick, True))
    return PlannerAnswer(tuple(plans), tuple(reservations), tuple(unserved))


def _reason(works: list[_Work], request: MigDemand, now: float) -> str:
    """Why `request` is not served, for a person: the profile, then the GPUs closest to taking it."""
    asked = ", ".join(f"{n} × {p}" for p, n in Counter(request.profiles).items())
    if not any(request.may_use(w.gpu.node) for w in works):
        return "none of the pod's nodes (node selector, node affinity) has a dynamic MIG GPU"
    works = [w for w in works if request.may_use(w.gpu.node)]
    offering = [w for w in works if all(w.gpu.model.find_profile(p) for p in request.profiles)]
    if not offering:
        return f"no GPU offers {asked}"
    if len(request.profiles) > 1:
        prefix = f"no node has room for {asked} together"
    else:
        profile = offering[0].gpu.model.require_profile(request.profiles[0])
        prefix = (
            f"no GPU has {profile.memory_slices} free aligned memory slices for {profile.name} "
            f"(start slot {', '.join(map(str, profile.starts))})"
        )
    ranked = sorted(offering, key=lambda w: (-_free_slices(w), w.gpu.node, w.gpu.index))
    shown_gpus = [f"{w.gpu.name} {_holds(w, request, now)}" for w in ranked[:REASON_GPUS]]
    more = len(ranked) - REASON_GPUS
    tail = f"; and {more} more GPU{'s' if more != 1 else ''}" if more > 0 else ""
    return f"{prefix}: {'; '.join(shown_gpus)}{tail}"


def _free_slices(work: _Work) -> int:
    used = 0
    for i in work.fixed:
        used |= i.instance.placement.mask
    return (~used & ((1 << work.gpu.model.memory_slices) - 1)).bit_count()


def _holds(work: _Work, request: MigDemand, now: float) -> str:
    disallowed = [p for p in request.profiles if not work.gpu.policy.allows(p)]
    if disallowed:
        return f"may not create {disallowed[0]} (not in its partition's profiles)"
    parts = [i.describe(now) for i in work.fixed]
    parts += [f"{p} planned for {pod}" for pod, p in work.claims]
    if not work.gpu.instances and not work.gpu.policy.carve_idle_gpus and not work.claims:
        return "is empty and its partition does not carve idle GPUs"
    return "holds " + (", ".join(parts) if parts else "nothing it may not destroy")
