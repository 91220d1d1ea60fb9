"""The dynamic MIG planner: pending demand in, per-GPU NVML steps and a reservation per instance out.

Rules, in order:
- An instance in use or reserved is never destroyed or moved: it is `keep` for the exact solver
  (`gpupart.core.mig.layout.fit_layout`), and `plan_layout` refuses a plan that would touch it anyway.
- Pods are served by priority (higher first), then by how long they have waited (aging, so a
  large request is not starved by a stream of small ones), then by name; a pod is served only
  if every instance it asks for fits on one node, together with everything served before it.
- Among the ways to serve a pod: fewest instance operations (reusing an idle instance costs
  none, a create one, destroying an idle instance one), then least fragmentation left against
  the observed mix (`fragmentation`), then node name and GPU index.
- An idle instance is destroyed only when a pending pod's creation needs its slices, or, once
  older than the policy's `min_idle_s` (the hysteresis), to restore the warm mix on a GPU that
  holds nothing in use or reserved. The hysteresis never makes a pending pod wait: measured on
  the saturated W2 workload it did (ADR 004). Nothing else changes, so a steady demand reaches
  a fixed point.

Within a node the choice is exact: when the greedy choice of GPUs fails, the pods planned on that
node in this round are repacked over its GPUs by a bounded depth-first search.
Pure and deterministic: no clock (the caller passes `now`), no randomness.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import combinations

from gpupart.core.dynamic.fragmentation import fragmentation
from gpupart.core.dynamic.model import Demand, Gpu, Mix, Use
from gpupart.core.errors import InvalidInput
from gpupart.core.mig.catalogue import GpuModel, parse_profile_name
from gpupart.core.mig.layout import Layout, MigInstance, Placement, fit_layout, layout_counts
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
idle instance is reused as is only when that does not strand more than a slice elsewhere."""
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
class GpuPlan:
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
class Plan:
    """The planner's answer: steps per GPU (only GPUs that change), reservations, reasons."""

    gpus: tuple[GpuPlan, ...]
    reservations: tuple[Reservation, ...]
    unserved: tuple[tuple[str, str], ...]
    """(pod, why) for every pending pod this plan does not serve."""

    @property
    def operations(self) -> int:
        """Instance operations: GPU instances created plus destroyed."""
        return sum(plan.creates + plan.destroys for plan in self.gpus)

    def served(self) -> frozenset[str]:
        return frozenset(r.pod for r in self.reservations)


@dataclass(frozen=True, slots=True)
class _Option:
    """One way to give a GPU its claims: the layout, what it creates and destroys, its cost."""

    layout: Layout
    created: tuple[MigInstance, ...]
    destroyed: tuple[MigInstance, ...]
    frag: float

    @property
    def ops(self) -> int:
        return len(self.created) + len(self.destroyed)

    @property
    def cost(self) -> float:
        return OPS_WEIGHT * self.ops + self.frag


_Key = tuple[
    GpuModel, tuple[MigInstance, ...], tuple[MigInstance, ...], tuple[str, ...] | None, bool
]
"""A GPU up to its name: model, fixed instances, idle instances, allowed profiles, carve."""
_Claims = tuple[tuple[str, int], ...]


class _Work:
    """One GPU while a plan is made: its instances sorted by what may happen to them, its claims."""

    __slots__ = ("gpu", "fixed", "idle", "young", "key", "state", "claims", "warm")

    def __init__(self, gpu: Gpu, now: float) -> None:
        self.gpu = gpu
        self.fixed = tuple(sorted(i for i in gpu.instances if i.fixed))
        self.idle = tuple(sorted(i for i in gpu.instances if not i.fixed))
        self.young = tuple(i for i in self.idle if now - i.since < gpu.policy.min_idle_s)
        """Idle instances the warm mix may not destroy yet (a pending pod may)."""
        self.key: _Key = (
            gpu.model,
            tuple(i.instance for i in self.fixed),
            tuple(i.instance for i in self.idle),
            gpu.policy.profiles,
            gpu.policy.carve_idle_gpus,
        )
        self.state = -1
        """The solver's number for `key` (set by `plan`)."""
        self.claims: list[tuple[str, str]] = []
        """(pod, profile) served on this GPU by this plan."""
        self.warm: _Option | None = None
        """The change that restores the warm mix, on a GPU without claims."""


def _claims_key(profiles: Iterable[str]) -> _Claims:
    return tuple(sorted(Counter(profiles).items()))


class _Solver:
    """Memoised per-GPU options: GPUs in the same state share every answer."""

    def __init__(self, mix: Mix) -> None:
        self.mix = mix
        self.memo: dict[tuple[int, _Claims], _Option | None] = {}
        self.states: dict[_Key, int] = {}
        self.sums: dict[tuple[_Claims, str], _Claims] = {}
        self.keys: list[_Key] = []
        self.frag_memo: dict[tuple[GpuModel, Layout], float] = {}

    def frag(self, model: GpuModel, layout: Layout) -> float:
        key = (model, layout)
        value = self.frag_memo.get(key)
        if value is None:
            value = self.frag_memo[key] = fragmentation(model, layout, self.mix)
        return value

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
        """A small number for a GPU state: memo keys then hash an int, not the whole model."""
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

    def _solve(self, key: _Key, claims: _Claims) -> _Option | None:
        """The cheapest layout that keeps the fixed instances and covers `claims`.

        Exact: every subset of idle instances to destroy is tried, fewest first, until
        destroying more cannot be cheaper than the best found.
        """
        model, fixed, idle, allowed, carve = key
        need = dict(claims)
        if not need:
            layout = tuple(sorted((*fixed, *idle)))
            return _Option(layout, (), (), self.frag(model, layout))
        if not _may_fit(model, fixed, need):
            return None  # no subset of idle instances to destroy can make room
        best: _Option | None = None
        for drop in range(len(idle) + 1):
            if best is not None and OPS_WEIGHT * drop >= best.cost:
                break
            for dropped in combinations(idle, drop):
                left = tuple(i for i in idle if i not in dropped)
                kept = (*fixed, *left)
                idle_counts = layout_counts(left)
                new = {p: n - idle_counts.get(p, 0) for p, n in need.items()}
                new = {p: n for p, n in new.items() if n > 0}
                if any(allowed is not None and p not in allowed for p in new):
                    continue
                if new and not carve and not fixed and not idle:
                    continue
                target = layout_counts(kept)
                for p, n in new.items():
                    target[p] = target.get(p, 0) + n
                if any(model.find_profile(p) is None for p in target):
                    continue
                found = fit_layout(model, target, keep=kept)
                if found is None:
                    continue
                created = tuple(i for i in found if i not in kept)
                option = _Option(found, created, tuple(dropped), self.frag(model, found))
                if best is None or (option.cost, option.ops) < (best.cost, best.ops):
                    best = option
        return best


def _may_fit(model: GpuModel, kept: Sequence[MigInstance], need: Mapping[str, int]) -> bool:
    """A necessary condition for `need` beside `kept`: slices and compute left, and for each
    profile a legal start clear of `kept` (cheap; the exact solver decides)."""
    used = 0
    compute = 0
    for instance in kept:
        used |= instance.placement.mask
        compute += model.require_profile(instance.profile).compute_slices
    memory = compute_needed = 0
    for name, count in need.items():
        profile = model.find_profile(name)
        if profile is None:
            return False
        memory += count * profile.memory_slices
        compute_needed += count * profile.compute_slices
        if not any(
            not Placement(start, profile.memory_slices).mask & used for start in profile.starts
        ):
            return False
    free = model.memory_slices - used.bit_count()
    return memory <= free and compute + compute_needed <= model.compute_slices


def plan(
    gpus: Sequence[Gpu],
    demand: Sequence[Demand],
    *,
    now: float,
    mix: Mix | None = None,
) -> Plan:
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
    works = [_Work(gpu, now) for gpu in sorted(gpus, key=lambda g: (g.node, g.index))]
    for work in works:
        work.state = solver.intern(work.key)
    nodes: dict[str, list[_Work]] = {}
    for work in works:
        nodes.setdefault(work.gpu.node, []).append(work)
    unserved: list[tuple[str, str]] = []
    for request in pending:
        if not request.profiles:
            continue
        if not _serve(solver, nodes, request):
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


def _serve(solver: _Solver, nodes: Mapping[str, list[_Work]], request: Demand) -> bool:
    """Claim GPUs for every instance of `request` on the best node; False when no node can."""
    profiles = sorted(request.profiles, key=_size)
    best: tuple[tuple[float, int, str], list[_Work]] | None = None
    for name, node in nodes.items():
        found = _greedy(solver, node, profiles)
        if found is not None and (best is None or (*found[0], name) < best[0]):
            best = ((*found[0], name), found[1])
    if best is not None:
        for work, profile in zip(best[1], profiles, strict=True):
            work.claims.append((request.pod, profile))
        return True
    return any(_repack(solver, node, request.pod, profiles) for node in nodes.values())


def _current(solver: _Solver, work: _Work) -> _Option:
    option = solver.option(work.state, _claims_key(p for _, p in work.claims))
    if option is None:  # claims are only ever added when an option exists
        raise AssertionError("a GPU's claims have no layout")
    return option


def _greedy(
    solver: _Solver, node: list[_Work], profiles: list[str]
) -> tuple[tuple[float, int], list[_Work]] | None:
    """For each instance in turn, the GPU of `node` where adding it costs least, and the total
    cost (weighted cost, operations); None when one instance fits nowhere."""
    extra: dict[int, list[str]] = {}
    chosen: list[_Work] = []
    cost, ops = 0.0, 0
    for profile in profiles:
        best: tuple[tuple[float, int, int], _Work] | None = None
        for position, work in enumerate(node):
            if position in extra:
                base = _claims_key([*(p for _, p in work.claims), *extra[position]])
            else:
                base = _claims_key(p for _, p in work.claims) if work.claims else ()
            before = solver.option(work.state, base)
            after = solver.option(work.state, solver.plus(base, profile))
            if before is None or after is None:
                continue
            key = (after.cost - before.cost, after.ops - before.ops, position)
            if best is None or key < best[0]:
                best = (key, work)
        if best is None:
            return None
        (delta_cost, delta_ops, position), work = best
        extra.setdefault(position, []).append(profile)
        chosen.append(work)
        cost += delta_cost
        ops += delta_ops
    return (cost, ops), chosen


def _repack(solver: _Solver, node: list[_Work], pod: str, profiles: list[str]) -> bool:
    """Redistribute this round's claims on `node` plus `pod`'s over its GPUs; exact within budget."""
    items = [(c_pod, p) for work in node for c_pod, p in work.claims]
    if not items and len(profiles) == 1:
        return False  # the greedy pass already tried every GPU for this one instance
    items += [(pod, p) for p in profiles]
    if _slices(node, (p for _, p in items)) > sum(_free_slices(work) for work in node):
        return False
    items.sort(key=lambda item: _size(item[1]))
    assignment: list[list[tuple[str, str]]] = [[] for _ in node]
    budget = [REPACK_BUDGET]

    def place(position: int) -> bool:
        if position == len(items):
            return True
        tried: set[tuple[int, _Claims]] = set()
        for g, work in enumerate(node):
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
            if place(position + 1):
                return True
            assignment[g].pop()
        return False

    if not place(0):
        return False
    for work, claims in zip(node, assignment, strict=True):
        work.claims = claims
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
        created = tuple(i for i in layout if i not in present)
        destroyed = tuple(i for i in present if i not in layout)
        work.warm = _Option(layout, created, destroyed, solver.frag(work.gpu.model, layout))


def _result(solver: _Solver, works: list[_Work], unserved: list[tuple[str, str]]) -> Plan:
    plans: list[GpuPlan] = []
    reservations: list[Reservation] = []
    for work in works:
        option = work.warm or _current(solver, work)
        gpu = work.gpu
        if option.ops:
            actual = [GpuInstanceState(i.instance, in_use=i.fixed) for i in gpu.instances]
            steps = plan_layout(gpu.index, actual, option.layout)
            plans.append(GpuPlan(gpu.node, gpu.index, steps, option.layout))
        reusable = sorted(i.instance for i in work.idle if i.instance in option.layout)
        created = sorted(option.created)
        for pod, profile in work.claims:
            pick = next((i for i in reusable if i.profile == profile), None)
            if pick is not None:
                reusable.remove(pick)
                reservations.append(Reservation(pod, gpu.node, gpu.index, pick, False))
                continue
            pick = next(i for i in created if i.profile == profile)
            created.remove(pick)
            reservations.append(Reservation(pod, gpu.node, gpu.index, pick, True))
    return Plan(tuple(plans), tuple(reservations), tuple(unserved))


def _reason(works: list[_Work], request: Demand, now: float) -> str:
    """Why `request` is not served, for a person: the profile, then the GPUs closest to taking it."""
    asked = ", ".join(f"{n} × {p}" for p, n in Counter(request.profiles).items())
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


def _holds(work: _Work, request: Demand, now: float) -> str:
    disallowed = [p for p in request.profiles if not work.gpu.policy.allows(p)]
    if disallowed:
        return f"may not create {disallowed[0]} (not in its partition's profiles)"
    parts = [i.describe(now) for i in work.fixed]
    parts += [f"{p} planned for {pod}" for pod, p in work.claims]
    if not work.gpu.instances and not work.gpu.policy.carve_idle_gpus and not work.claims:
        return "is empty and its partition does not carve idle GPUs"
    return "holds " + (", ".join(parts) if parts else "nothing it may not destroy")
