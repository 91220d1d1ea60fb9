"""Dynamic MIG planner: laws over random clusters, optimality against exhaustive search, rules.

Aspects: instances in use or reserved are never destroyed or moved; plans apply to the GPU they
were made for; reservations match the pods' requests on one node; determinism; a steady demand
reaches a fixed point with zero operations; served demand is what an exhaustive search serves
(pods taken by priority, then age); hysteresis; warm mix; reasons a person can act on.
"""

import itertools
from collections import Counter
from functools import cache

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpupart.core.api.spec import DynamicMig
from gpupart.core.dynamic.model import (
    Gpu,
    Instance,
    MigDemand,
    Mix,
    Use,
)
from gpupart.core.dynamic.planner import PlannerAnswer, plan
from gpupart.core.errors import InfeasibleLayout
from gpupart.core.mig.catalogue import GpuModel, require_gpu_model
from gpupart.core.mig.layout import (
    MigInstance,
    Placement,
    check_layout,
    fit_layout,
    layouts_with_counts,
)
from gpupart.core.mig.planning import (
    DestroyComputeInstance,
    DestroyGpuInstance,
    GpuInstanceState,
    apply_steps,
)

A100 = require_gpu_model("A100-SXM4-80GB")
H100 = require_gpu_model("H100-SXM5-80GB")
PROFILES = ("1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb")


@cache
def all_layouts(model: GpuModel) -> tuple[tuple[MigInstance, ...], ...]:
    """Independent oracle: every set of non-overlapping placements that `check_layout` accepts."""
    spots = [
        MigInstance(Placement(start, p.memory_slices), p.name)
        for p in model.profiles
        if p.name in PROFILES
        for start in p.starts
    ]
    found = []

    def extend(first: int, chosen: list[MigInstance]) -> None:
        try:
            check_layout(model, chosen)
        except InfeasibleLayout:
            return
        found.append(tuple(sorted(chosen)))
        for position in range(first, len(spots)):
            if not any(spots[position].placement.overlaps(i.placement) for i in chosen):
                extend(position + 1, [*chosen, spots[position]])

    extend(0, [])
    return tuple(found)


@st.composite
def gpus_strategy(draw, max_nodes=3, max_gpus=3):
    gpus = []
    for node in range(draw(st.integers(1, max_nodes))):
        model = draw(st.sampled_from((A100, H100)))
        policy = DynamicMig(min_idle_s=draw(st.sampled_from((0, 60))))
        for index in range(draw(st.integers(1, max_gpus))):
            layout = draw(st.sampled_from(all_layouts(model)))
            instances = tuple(
                Instance(
                    instance,
                    use := draw(st.sampled_from(tuple(Use))),
                    f"run-{node}-{index}-{k}" if use is not Use.IDLE else "",
                    since=draw(st.sampled_from((0.0, 90.0))),
                )
                for k, instance in enumerate(layout)
            )
            gpus.append(Gpu(f"node-{node}", index, model, instances, policy))
    return gpus


demand_strategy = st.lists(
    st.tuples(
        st.lists(st.sampled_from(PROFILES), min_size=1, max_size=3),
        st.integers(0, 2),
        st.sampled_from((0.0, 10.0, 50.0)),
    ),
    max_size=6,
).map(
    lambda rows: [
        MigDemand(f"pod-{k}", tuple(profiles), priority, since)
        for k, (profiles, priority, since) in enumerate(rows)
    ]
)


def apply_plan(
    gpus: list[Gpu], result: PlannerAnswer
) -> dict[tuple[str, int], tuple[MigInstance, ...]]:
    """Each GPU's layout after the plan's steps, as the simulated GPU executes them."""
    layouts = {}
    steps = {(p.node, p.gpu): p for p in result.gpus}
    for gpu in gpus:
        actual = [GpuInstanceState(i.instance, in_use=i.fixed) for i in gpu.instances]
        gpu_plan = steps.get((gpu.node, gpu.index))
        after = apply_steps(gpu.model, actual, gpu_plan.steps if gpu_plan else ())
        layouts[(gpu.node, gpu.index)] = tuple(sorted(s.instance for s in after))
        if gpu_plan:
            assert layouts[(gpu.node, gpu.index)] == gpu_plan.layout
    return layouts


@settings(deadline=None)
@given(gpus_strategy(), demand_strategy)
def test_in_use_and_reserved_instances_are_never_touched(gpus, demand):
    result = plan(gpus, demand, now=100.0)
    after = apply_plan(gpus, result)
    by_gpu = {(g.node, g.index): g for g in gpus}
    for gpu_plan in result.gpus:
        gpu = by_gpu[(gpu_plan.node, gpu_plan.gpu)]
        fixed = {i.instance for i in gpu.instances if i.fixed}
        for step in gpu_plan.steps:
            if isinstance(step, DestroyComputeInstance | DestroyGpuInstance):
                assert step.instance not in fixed
    for gpu in gpus:
        assert {i.instance for i in gpu.instances if i.fixed} <= set(after[(gpu.node, gpu.index)])


@settings(deadline=None)
@given(gpus_strategy(), demand_strategy)
def test_reservations_give_each_served_pod_its_request_on_one_node(gpus, demand):
    result = plan(gpus, demand, now=100.0)
    after = apply_plan(gpus, result)
    by_gpu = {(g.node, g.index): g for g in gpus}
    taken = set()
    for reservation in result.reservations:
        key = (reservation.node, reservation.gpu)
        assert reservation.instance in after[key]
        assert (key, reservation.instance) not in taken
        taken.add((key, reservation.instance))
        existing = {i.instance: i for i in by_gpu[key].instances}
        if reservation.created:
            assert reservation.instance not in existing
        else:
            assert existing[reservation.instance].use is Use.IDLE
    reserved_before = {i.pod for g in gpus for i in g.instances if i.use is Use.RESERVED}
    unserved = dict(result.unserved)
    for request in demand:
        mine = [r for r in result.reservations if r.pod == request.pod]
        if request.pod in reserved_before:
            assert not mine and request.pod not in unserved
            continue
        if mine:
            assert Counter(r.instance.profile for r in mine) == Counter(request.profiles)
            assert len({r.node for r in mine}) == 1
            assert request.pod not in unserved
        else:
            assert unserved[request.pod]
    # every operation serves a pod: nothing is created that no pod reserved
    created = {(r.node, r.gpu, r.instance) for r in result.reservations if r.created}
    assert sum(p.creates for p in result.gpus) == len(created)


@settings(deadline=None)
@given(gpus_strategy(), demand_strategy, st.randoms(use_true_random=False))
def test_deterministic_whatever_the_input_order(gpus, demand, rng):
    first = plan(gpus, demand, now=100.0)
    shuffled_gpus, shuffled_demand = list(gpus), list(demand)
    rng.shuffle(shuffled_gpus)
    rng.shuffle(shuffled_demand)
    assert plan(shuffled_gpus, shuffled_demand, now=100.0) == first


def bind(gpus: list[Gpu], result: PlannerAnswer, now: float) -> list[Gpu]:
    """The cluster once the plan is applied and its pods run on their reservations."""
    after = apply_plan(gpus, result)
    users = {(r.node, r.gpu, r.instance): r.pod for r in result.reservations}
    bound = []
    for gpu in gpus:
        old = {i.instance: i for i in gpu.instances}
        instances = []
        for instance in after[(gpu.node, gpu.index)]:
            pod = users.get((gpu.node, gpu.index, instance))
            if pod is not None:
                instances.append(Instance(instance, Use.IN_USE, pod))
            else:
                instances.append(old.get(instance, Instance(instance, Use.IDLE, since=now)))
        bound.append(Gpu(gpu.node, gpu.index, gpu.model, tuple(instances), gpu.policy))
    return bound


@settings(deadline=None)
@given(gpus_strategy(), demand_strategy)
def test_steady_demand_reaches_a_fixed_point_with_zero_operations(gpus, demand):
    now = 100.0  # some idle instances are younger than their hysteresis: a pod may reclaim them
    pending = list(demand)
    for _ in range(len(demand) + 2):
        result = plan(gpus, pending, now=now)
        if not result.operations and not result.reservations:
            break
        assert result.reservations  # an operation only ever serves a pod (no warm mix here)
        gpus = bind(gpus, result, now)
        pending = [d for d in pending if d.pod not in result.served()]
        now += 100.0
    else:
        pytest.fail("no fixed point")
    # time passes, nothing arrives or leaves: no churn, however long idle instances wait
    for later in (now + 1, now + 3600):
        assert plan(gpus, pending, now=later).operations == 0


def lexicographic_oracle(gpus: list[Gpu], demand: list[MigDemand], now: float) -> set[str]:
    """Exhaustive: in priority-then-age order, a pod is served iff it and every pod served
    before it can all be placed at once (each GPU: some valid layout keeping its fixed instances
    whose other instances cover what it is given; idle instances of any age may be destroyed)."""
    del now  # the hysteresis never holds a pending pod back

    def gpu_takes(gpu: Gpu, claims: Counter) -> bool:
        fixed = {i.instance for i in gpu.instances if i.fixed}
        for layout in all_layouts(gpu.model):
            if fixed <= set(layout):
                free = Counter(i.profile for i in layout if i not in fixed)
                if all(free[p] >= n for p, n in claims.items()):
                    return True
        return False

    def feasible(items: list[str]) -> bool:
        for assignment in itertools.product(range(len(gpus)), repeat=len(items)):
            claims = [Counter() for _ in gpus]
            for profile, g in zip(items, assignment, strict=True):
                claims[g][profile] += 1
            if all(gpu_takes(gpu, c) for gpu, c in zip(gpus, claims, strict=True)):
                return True
        return False

    served: list[str] = []
    names = set()
    for request in sorted(demand, key=lambda d: (-d.priority, d.pending_since, d.pod)):
        if feasible([*served, *request.profiles]):
            served.extend(request.profiles)
            names.add(request.pod)
    return names


SCENARIOS = {
    "empty": ((), ()),
    "1g in use at slot 2, idle 3g": (
        (Instance(MigInstance(Placement(2, 1), "1g.10gb"), Use.IN_USE, "a"),),
        (Instance(MigInstance(Placement(4, 4), "3g.40gb"), Use.IDLE, since=0.0),),
    ),
    "young idle 1g at slot 6, 2g in use at 0": (
        (
            Instance(MigInstance(Placement(6, 1), "1g.10gb"), Use.IDLE, since=90.0),
            Instance(MigInstance(Placement(0, 2), "2g.20gb"), Use.IN_USE, "b"),
        ),
        (Instance(MigInstance(Placement(0, 4), "4g.40gb"), Use.RESERVED, "c"),),
    ),
}


def assert_serves_what_the_oracle_serves(gpus: list[Gpu]) -> None:
    """Every multiset of one-instance pods up to a size (4 on 2 GPUs, 3 on 3), oldest first."""
    options = ("1g.10gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb")
    checked = 0
    for size in range(1, 5 if len(gpus) == 2 else 4):
        for multiset in itertools.combinations_with_replacement(options, size):
            demand = [MigDemand(f"p{k}", (p,), pending_since=k) for k, p in enumerate(multiset)]
            result = plan(gpus, demand, now=100.0)
            assert result.served() == lexicographic_oracle(gpus, demand, 100.0), multiset
            checked += 1
    assert checked > 30


@pytest.mark.parametrize("gpu_count", [2, 3])
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_served_demand_matches_an_exhaustive_search(scenario, gpu_count):
    first, second = SCENARIOS[scenario]
    gpus = [Gpu("node", 0, A100, first), Gpu("node", 1, A100, second)]
    gpus += [Gpu("node", 2, A100)] * (gpu_count - 2)
    assert_serves_what_the_oracle_serves(
        [Gpu(g.node, k, g.model, g.instances) for k, g in enumerate(gpus)]
    )


@pytest.mark.parametrize("gpu_count", [2, 3])
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_served_demand_matches_an_exhaustive_search_across_two_nodes(scenario, gpu_count):
    # nodes are chosen greedily, then repacked across nodes when a pod fails: no pod is lost
    # that the exhaustive search serves (("1g.10gb", "1g.10gb", "7g.80gb") was, before)
    first, second = SCENARIOS[scenario]
    gpus = [Gpu("node-a", 0, A100, first)]
    if gpu_count == 3:
        gpus.append(Gpu("node-a", 1, A100))
    gpus.append(Gpu("node-b", 0, A100, second))
    assert_serves_what_the_oracle_serves(gpus)


def test_layouts_are_searched_in_the_order_fit_layout_prefers():
    # the planner's solver takes the first layout holding its kept instances, as fit_layout does
    keep = (MigInstance(Placement(6, 1), "1g.10gb"),)
    for counts in ({"1g.10gb": 2}, {"1g.10gb": 1, "3g.40gb": 1}, {"2g.20gb": 2}):
        candidates = layouts_with_counts(A100, counts)
        assert candidates[0] == fit_layout(A100, counts)
        holding = [c for c in candidates if set(keep) <= set(c)]
        assert (holding[0] if holding else None) == fit_layout(A100, counts, keep=keep)


def test_a_pod_asking_two_instances_is_served_on_one_node_or_not_at_all():
    gpus = [
        Gpu(
            "node-a", 0, A100, (Instance(MigInstance(Placement(0, 4), "4g.40gb"), Use.IN_USE, "x"),)
        ),
        Gpu(
            "node-b", 0, A100, (Instance(MigInstance(Placement(4, 4), "3g.40gb"), Use.IN_USE, "y"),)
        ),
    ]
    result = plan(gpus, [MigDemand("two", ("3g.40gb", "3g.40gb"))], now=0.0)
    assert not result.reservations and result.operations == 0
    assert "no node has room for 2 × 3g.40gb together" in dict(result.unserved)["two"]


def test_priority_first_then_the_longest_waiting():
    gpus = [Gpu("node", 0, A100)]
    demand = [
        MigDemand("small-new", ("4g.40gb",), priority=0, pending_since=50.0),
        MigDemand("large-old", ("7g.80gb",), priority=0, pending_since=10.0),
        MigDemand("urgent", ("4g.40gb",), priority=5, pending_since=90.0),
    ]
    assert plan(gpus, demand, now=100.0).served() == {"urgent"}
    assert plan(gpus, demand[:2], now=100.0).served() == {"large-old"}


def test_reuse_an_idle_instance_before_creating_one():
    idle = Instance(MigInstance(Placement(4, 4), "3g.40gb"), Use.IDLE, since=0.0)
    gpus = [Gpu("node", 0, A100), Gpu("node", 1, A100, (idle,))]
    result = plan(gpus, [MigDemand("p", ("3g.40gb",))], now=100.0)
    assert result.operations == 0
    (reservation,) = result.reservations
    assert (reservation.gpu, reservation.instance, reservation.created) == (1, idle.instance, False)


def test_a_pending_pod_reclaims_young_idle_instances_and_nothing_else_does():
    young = Instance(MigInstance(Placement(6, 1), "1g.10gb"), since=70.0)
    gpus = [Gpu("node", 0, A100, (young,))]
    # a pod that needs its slices does not wait for the hysteresis: destroy the 1g, create the 7g
    served = plan(gpus, [MigDemand("whole", ("7g.80gb",))], now=100.0)
    assert served.operations == 2 and served.served() == {"whole"}
    # without such a pod, the idle instance stays, young or old
    assert plan(gpus, [], now=100.0).operations == 0
    assert plan(gpus, [], now=10_000.0).operations == 0


def test_the_warm_mix_waits_for_the_hysteresis():
    policy = DynamicMig(warm=(("3g.40gb", 2),))
    young = Instance(MigInstance(Placement(0, 4), "4g.40gb"), since=70.0)
    gpus = [Gpu("node", 0, A100, (young,), policy)]
    assert plan(gpus, [], now=100.0).operations == 0  # idle 30 s: kept
    restored = plan(gpus, [], now=130.0)  # idle 60 s: merged back into the warm mix
    assert restored.operations == 3
    assert Counter(i.profile for i in restored.gpus[0].layout) == {"3g.40gb": 2}


def test_fragmentation_decides_between_equally_cheap_gpus():
    # a 1g goes beside the 1g already in use, keeping the other GPU whole for a 7g
    busy = Instance(MigInstance(Placement(0, 1), "1g.10gb"), Use.IN_USE, "x")
    gpus = [Gpu("node", 0, A100), Gpu("node", 1, A100, (busy,))]
    mix = Mix.of({"1g.10gb": 1, "7g.80gb": 1})
    result = plan(gpus, [MigDemand("p", ("1g.10gb",))], now=0.0, mix=mix)
    assert [r.gpu for r in result.reservations] == [1]


def test_profiles_outside_the_policy_are_not_created_and_the_reason_says_so():
    policy = DynamicMig(profiles=("1g.10gb",))
    result = plan([Gpu("node", 0, A100, policy=policy)], [MigDemand("p", ("3g.40gb",))], now=0.0)
    assert not result.reservations
    assert "may not create 3g.40gb" in dict(result.unserved)["p"]


def test_idle_gpus_are_not_carved_when_the_policy_says_so():
    policy = DynamicMig(carve_idle_gpus=False)
    result = plan([Gpu("node", 0, A100, policy=policy)], [MigDemand("p", ("1g.10gb",))], now=0.0)
    assert not result.reservations
    assert "does not carve idle GPUs" in dict(result.unserved)["p"]


def test_the_reason_names_the_instances_in_the_way():
    busy = Instance(MigInstance(Placement(2, 1), "1g.10gb"), Use.IN_USE, "team-a/infer")
    gpus = [Gpu("node-3", 1, A100, (busy,))] + [
        Gpu(
            "node-4",
            k,
            A100,
            (Instance(MigInstance(Placement(0, 4), "3g.40gb"), Use.IN_USE, f"t{k}"),),
        )
        for k in range(4)
    ]
    result = plan(gpus, [MigDemand("big", ("4g.40gb",))], now=0.0)
    why = dict(result.unserved)["big"]
    assert why.startswith("no GPU has 4 free aligned memory slices for 4g.40gb (start slot 0): ")
    assert "node-3 GPU 1 holds 1g.10gb in use at slot 2 by team-a/infer" in why
    assert why.endswith("and 2 more GPUs")


def test_warm_mix_is_restored_on_idle_gpus_once_then_left_alone():
    policy = DynamicMig(warm=(("1g.10gb", 2), ("3g.40gb", 1)))
    gpus = [Gpu("node", 0, A100, policy=policy)]
    first = plan(gpus, [], now=0.0)
    assert first.operations == 3
    gpus = bind(gpus, first, 0.0)
    assert plan(gpus, [], now=1000.0).operations == 0
    # a GPU with an instance in use is not re-carved to the warm mix
    busy = Instance(MigInstance(Placement(0, 4), "4g.40gb"), Use.IN_USE, "x")
    assert plan([Gpu("node", 0, A100, (busy,), policy)], [], now=0.0).operations == 0


def test_creates_of_one_round_are_spread_over_gpus_that_make_them_one_at_a_time() -> None:
    # Without the queue cost all four land on GPU 0 (least fragmentation), and the last pod
    # waits for three creates before its own; with it, two GPUs make two each.
    gpus = [Gpu("n1", 0, H100), Gpu("n1", 1, H100)]
    demand = [MigDemand(f"ns/p{i}", ("1g.10gb",), 0, float(i)) for i in range(4)]
    result = plan(gpus, demand, now=0.0)
    assert sorted(Counter(r.gpu for r in result.reservations).values()) == [2, 2]
