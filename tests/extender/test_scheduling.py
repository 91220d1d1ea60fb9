"""The extender's pure scheduling terms (gpupart.core.scheduling).

Covers: each term's formula and direction (headroom binpack/spread, priority, anti-affinity,
fragmentation through the simulator's model), combining into 0-10 with the reserve cap,
MIG / whole / shared evaluation with the reasons a person reads, GPU choice for shared pods
(reserve, anti-affinity, required podAntiAffinity), and parsing a pod into a Demand.
"""

from __future__ import annotations

import pytest
from extender_objects import H100_MIB, mig_gpu, pod, shared, shared_gpu, whole_gpu
from hypothesis import given
from hypothesis import strategies as st

from gpupart.core.errors import InvalidInput
from gpupart.core.resources import GpuRequest
from gpupart.core.scheduling import (
    AffinityScope,
    Conflict,
    Demand,
    FailureKind,
    Fit,
    NoFit,
    PlacedPod,
    ScoringConfig,
    Strategy,
    Tenant,
    Terms,
    Weights,
    anti_affinity_term,
    assemble_node,
    combine,
    evaluate,
    fragmentation_model,
    fragmentation_term,
    headroom_term,
    node_state,
    parse_demand,
    priority_term,
    share_milli,
)
from gpupart.core.scoring import NodeState, Request
from gpupart.core.spec import Mode
from gpupart.core.wire import PodAssignment

CONFIG = ScoringConfig()
MODEL = fragmentation_model([(1, 250)] * 5 + [(1, 1000)] * 5)


def tenant(
    name: str,
    *,
    app: str = "",
    memory: int = 0,
    compute: int = 0,
    count: int = 1,
    profile: str = "",
    ns: str = "team-a",
) -> Tenant:
    labels = (("app", app),) if app else ()
    return Tenant(f"{ns}/{name}", ns, labels, 0, count, profile, memory, compute)


def on_gpu(t: Tenant, gpu: int, node: str = "n1") -> PlacedPod:
    request = GpuRequest(shared=t.count, memory_mib=t.memory_mib, compute_percent=t.compute_percent)
    return PlacedPod(t, request, PodAssignment(node, gpu, f"GPU-{gpu:04d}", t.memory_mib))


def demand(request: GpuRequest, *, group: str = "", priority: int = 0, terms=()) -> Demand:  # type: ignore[no-untyped-def]
    return Demand("team-a/new", "team-a", request, priority, group, terms)


# --- terms ---------------------------------------------------------------------------------


def test_headroom_binpack_prefers_less_left_and_spread_more() -> None:
    assert headroom_term(10, 100, Strategy.BINPACK) == pytest.approx(0.9)
    assert headroom_term(10, 100, Strategy.SPREAD) == pytest.approx(0.1)
    assert headroom_term(0, 100, Strategy.BINPACK) == 1.0
    assert headroom_term(5, 0, Strategy.SPREAD) == 0.0  # no capacity: no credit
    assert headroom_term(-5, 100, Strategy.SPREAD) == 0.0  # clamped


@given(st.floats(0, 1), st.integers(-10, 2000))
def test_priority_term_is_in_unit_range(contention: float, priority: int) -> None:
    assert 0.0 <= priority_term(priority, contention, CONFIG) <= 1.0


def test_priority_high_wants_low_contention_low_packs() -> None:
    high, low = CONFIG.high_priority, CONFIG.low_priority
    assert priority_term(high, 0.1, CONFIG) > priority_term(high, 0.9, CONFIG)
    assert priority_term(low, 0.9, CONFIG) > priority_term(low, 0.1, CONFIG)
    assert priority_term((high + low) // 2, 0.3, CONFIG) == pytest.approx(0.5)


def test_anti_affinity_term_by_scope() -> None:
    gpu, node = AffinityScope.GPU, AffinityScope.NODE
    assert anti_affinity_term(Conflict.NONE, gpu) == 1.0
    assert anti_affinity_term(Conflict.GPU, gpu) == 0.0
    assert anti_affinity_term(Conflict.NODE, gpu) == 1.0
    assert anti_affinity_term(Conflict.NODE, node) == 0.0
    assert anti_affinity_term(Conflict.MAYBE_GPU, gpu) == 0.5
    assert anti_affinity_term(Conflict.MAYBE_GPU, node) == 0.0


def test_fragmentation_term_prefers_the_gpu_that_keeps_typical_sizes_placeable() -> None:
    # Typical pods want 250 or a whole 1000. Free: GPU0 300, GPU1 1000. A 250 pod on GPU0 leaves
    # 50 (fragment) but keeps GPU1 whole; on GPU1 it breaks the only whole GPU.
    state = NodeState(1 << 40, 1 << 40, (300, 1000), "H100")
    request = Request(0, 0, 1, 250)
    on_small = fragmentation_term(MODEL, state, request, (0,))
    on_whole = fragmentation_term(MODEL, state, request, (1,))
    assert on_small > on_whole
    assert 0.0 < on_whole < on_small < 1.0


def test_fragmentation_model_uses_the_simulators_typical_pods() -> None:
    model = fragmentation_model([(1, 500)] * 99 + [(2, 1000)])
    shapes = {(t.request.num_gpu, t.request.gpu_milli) for t in model.typical}
    assert shapes == {(1, 500)}  # the 1 % shape falls outside the 95 % coverage
    assert fragmentation_model([]).typical == ()


def test_combine_is_a_weighted_mean_scaled_to_ten() -> None:
    assert combine(Terms(1, 1, 1, 1), Weights()) == 10
    assert combine(Terms(0, 0, 0, 0), Weights()) == 0
    assert combine(Terms(1, 0, 0, 0), Weights(1, 0, 0, 0)) == 10
    assert combine(Terms(1, 0, 1, 0), Weights(1, 1, 1, 1)) == 5
    assert combine(Terms(1, 1, 1, 1), Weights(0, 0, 0, 0)) == 0
    assert combine(Terms(1, 1, 1, 1, eats_reserve=True), Weights()) == 1


def test_share_milli_is_the_larger_of_memory_and_compute() -> None:
    gpu = assemble_node("n", (shared_gpu(0, memory=1000, clients=4),), ()).gpus[0]
    assert share_milli(250, 0, gpu) == 250
    assert share_milli(100, 40, gpu) == 400
    assert share_milli(0, 0, gpu) == 250  # one of four client slots


def test_node_state_counts_whole_gpus_in_use_and_skips_mig() -> None:
    inv = (whole_gpu(0), whole_gpu(1), mig_gpu(2, [("1g.10gb", 0, 1)]), shared_gpu(3, memory=1000))
    pods = [
        PlacedPod(tenant("w"), GpuRequest(whole_gpus=1)),
        on_gpu(tenant("s", memory=400), 3),
    ]
    state = node_state(assemble_node("n", inv, pods))
    assert state.gpu_left == (0, 1000, 600)


# --- MIG -----------------------------------------------------------------------------------


def mig_node(used: int) -> object:
    inv = (mig_gpu(0, [("3g.40gb", 0, 4)]), mig_gpu(1, [("3g.40gb", 0, 4), ("1g.10gb", 4, 1)]))
    pods = [
        PlacedPod(tenant(f"train-{i}", profile="3g.40gb"), GpuRequest(mig=(("3g.40gb", 1),)))
        for i in range(used)
    ]
    return assemble_node("node-7", inv, pods)


def test_mig_fits_when_a_slice_of_the_profile_is_free() -> None:
    verdict = evaluate(
        mig_node(1), demand(GpuRequest(mig=(("3g.40gb", 1),))), config=CONFIG, model=MODEL
    )
    assert isinstance(verdict, Fit) and verdict.gpu is None and 0 <= verdict.score <= 10


def test_mig_all_in_use_names_the_pods() -> None:
    verdict = evaluate(
        mig_node(2), demand(GpuRequest(mig=(("3g.40gb", 1),))), config=CONFIG, model=MODEL
    )
    assert isinstance(verdict, NoFit)
    assert verdict.reason == (
        "node-7: 2 GPUs, no free 3g.40gb slice (all 2 in use by team-a/train-0, team-a/train-1)"
    )
    assert not verdict.unresolvable and verdict.kind is FailureKind.IN_USE


def test_mig_profile_absent_is_unresolvable() -> None:
    verdict = evaluate(
        mig_node(0), demand(GpuRequest(mig=(("7g.80gb", 1),))), config=CONFIG, model=MODEL
    )
    assert isinstance(verdict, NoFit) and verdict.unresolvable
    assert "none with a 7g.80gb slice (MIG slices here: 1g.10gb×1, 3g.40gb×2)" in verdict.reason


def test_mig_more_than_the_node_has_is_unresolvable() -> None:
    verdict = evaluate(
        mig_node(0), demand(GpuRequest(mig=(("3g.40gb", 3),))), config=CONFIG, model=MODEL
    )
    assert (
        isinstance(verdict, NoFit)
        and verdict.unresolvable
        and verdict.kind is FailureKind.TOO_SMALL
    )


def test_mig_binpack_prefers_the_fuller_node() -> None:
    request = demand(GpuRequest(mig=(("3g.40gb", 1),)))
    fuller = evaluate(mig_node(1), request, config=CONFIG, model=MODEL)
    emptier = evaluate(mig_node(0), request, config=CONFIG, model=MODEL)
    assert isinstance(fuller, Fit) and isinstance(emptier, Fit)
    assert fuller.terms.headroom > emptier.terms.headroom


# --- whole GPUs ------------------------------------------------------------------------------


def test_whole_gpus_counted_per_node() -> None:
    inv = (whole_gpu(0), whole_gpu(1))
    one_used = assemble_node("n", inv, [PlacedPod(tenant("a"), GpuRequest(whole_gpus=1))])
    assert isinstance(
        evaluate(one_used, demand(GpuRequest(whole_gpus=1)), config=CONFIG, model=MODEL), Fit
    )
    verdict = evaluate(one_used, demand(GpuRequest(whole_gpus=2)), config=CONFIG, model=MODEL)
    assert isinstance(verdict, NoFit) and not verdict.unresolvable
    assert verdict.reason == "n: 2 GPUs, needs 2 whole GPUs, 1 free (in use by team-a/a)"
    too_many = evaluate(one_used, demand(GpuRequest(whole_gpus=3)), config=CONFIG, model=MODEL)
    assert isinstance(too_many, NoFit) and too_many.unresolvable


def test_node_without_inventory_is_unresolvable() -> None:
    verdict = evaluate(
        assemble_node("n", None, (), problem="no GPU inventory"),
        demand(GpuRequest(whole_gpus=1)),
        config=CONFIG,
        model=MODEL,
    )
    assert verdict == NoFit("n: no GPU inventory", FailureKind.NO_INVENTORY, True)


# --- shared GPUs -----------------------------------------------------------------------------


def test_shared_memory_is_per_gpu_not_per_node() -> None:
    # 30 GiB free in total, but no single GPU has 20 GiB free.
    inv = (shared_gpu(0, memory=20000), shared_gpu(1, memory=20000))
    pods = [on_gpu(tenant("a", memory=5000), 0), on_gpu(tenant("b", memory=5000), 1)]
    verdict = evaluate(
        assemble_node("n", inv, pods),
        demand(GpuRequest(shared=1, memory_mib=16000)),
        config=CONFIG,
        model=MODEL,
    )
    assert isinstance(verdict, NoFit) and not verdict.unresolvable
    assert "GPU 0: 15000 of 20000 MiB free (used by team-a/a)" in verdict.reason
    assert "no shared GPU with 16000 MiB free and 1 client slot" in verdict.reason


def test_shared_request_larger_than_any_gpu_is_unresolvable() -> None:
    node = assemble_node("n", (shared_gpu(0, memory=20000),), ())
    verdict = evaluate(
        node, demand(GpuRequest(shared=1, memory_mib=30000)), config=CONFIG, model=MODEL
    )
    assert (
        isinstance(verdict, NoFit)
        and verdict.unresolvable
        and verdict.kind is FailureKind.TOO_SMALL
    )


def test_shared_client_slots_and_compute_are_limits() -> None:
    inv = (shared_gpu(0, clients=2),)
    full = assemble_node("n", inv, [on_gpu(tenant("a"), 0), on_gpu(tenant("b"), 0)])
    verdict = evaluate(full, demand(GpuRequest(shared=1)), config=CONFIG, model=MODEL)
    assert isinstance(verdict, NoFit) and "all 2 client slots taken" in verdict.reason
    busy = assemble_node("n", (shared_gpu(0),), [on_gpu(tenant("a", compute=80), 0)])
    verdict = evaluate(
        busy, demand(GpuRequest(shared=1, compute_percent=30)), config=CONFIG, model=MODEL
    )
    assert isinstance(verdict, NoFit) and "20% compute free" in verdict.reason


def test_binpack_picks_the_fuller_gpu_and_spread_the_emptier() -> None:
    inv = (shared_gpu(0, memory=40000), shared_gpu(1, memory=40000))
    node = assemble_node("n", inv, [on_gpu(tenant("a", memory=20000), 1)])
    request = demand(GpuRequest(shared=1, memory_mib=10000))
    only_headroom = Weights(1, 0, 0, 0)
    pack = evaluate(node, request, config=ScoringConfig(weights=only_headroom), model=MODEL)
    spread = evaluate(
        node,
        request,
        config=ScoringConfig(weights=only_headroom, strategy=Strategy.SPREAD),
        model=MODEL,
    )
    assert isinstance(pack, Fit) and pack.gpu == 1
    assert isinstance(spread, Fit) and spread.gpu == 0


def test_reserve_is_kept_while_another_gpu_fits() -> None:
    # GPU 1 fits 10000 MiB exactly (reserve 1500 eaten); GPU 0 fits with room to spare.
    inv = (shared_gpu(0, memory=40000), shared_gpu(1, memory=40000))
    node = assemble_node("n", inv, [on_gpu(tenant("a", memory=30000), 1)])
    verdict = evaluate(
        node, demand(GpuRequest(shared=1, memory_mib=10000)), config=CONFIG, model=MODEL
    )
    assert isinstance(verdict, Fit) and verdict.gpu == 0 and not verdict.terms.eats_reserve
    # With only the tight GPU left, the pod still fits but the node scores at most 1.
    tight = assemble_node("n", (inv[1],), [on_gpu(tenant("a", memory=30000), 1)])
    verdict = evaluate(
        tight, demand(GpuRequest(shared=1, memory_mib=10000)), config=CONFIG, model=MODEL
    )
    assert isinstance(verdict, Fit) and verdict.terms.eats_reserve and verdict.score <= 1


def test_same_app_avoids_sharing_a_gpu() -> None:
    inv = (shared_gpu(0), shared_gpu(1))
    node = assemble_node("n", inv, [on_gpu(tenant("web-1", app="web", memory=30000), 0)])
    request = demand(GpuRequest(shared=1, memory_mib=10000), group="web")
    verdict = evaluate(node, request, config=CONFIG, model=MODEL)
    assert isinstance(verdict, Fit) and verdict.gpu == 1 and verdict.terms.anti_affinity == 1.0
    other_app = evaluate(
        node,
        demand(GpuRequest(shared=1, memory_mib=10000), group="db"),
        config=ScoringConfig(weights=Weights(1, 0, 1, 0)),
        model=MODEL,
    )
    assert isinstance(other_app, Fit) and other_app.gpu == 0  # binpack onto the used GPU


def test_node_scope_penalises_a_same_app_pod_on_another_gpu() -> None:
    inv = (shared_gpu(0), shared_gpu(1))
    node = assemble_node("n", inv, [on_gpu(tenant("web-1", app="web", memory=30000), 0)])
    request = demand(GpuRequest(shared=1, memory_mib=10000), group="web")
    verdict = evaluate(
        node, request, config=ScoringConfig(anti_affinity_scope=AffinityScope.NODE), model=MODEL
    )
    assert isinstance(verdict, Fit) and verdict.terms.anti_affinity == 0.0


def test_required_pod_anti_affinity_excludes_the_gpu() -> None:
    affinity = {
        "podAntiAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {"labelSelector": {"matchLabels": {"app": "db"}}, "topologyKey": "gpupart.io/gpu"}
            ]
        }
    }
    new = parse_demand(pod("new", shared(1000), affinity=affinity), group_label="app")
    node = assemble_node("n", (shared_gpu(0),), [on_gpu(tenant("db-0", app="db"), 0)])
    verdict = evaluate(node, new, config=CONFIG, model=MODEL)
    assert isinstance(verdict, NoFit) and verdict.kind is FailureKind.ANTI_AFFINITY
    assert "required podAntiAffinity with team-a/db-0" in verdict.reason
    # A pod in another namespace does not match a term without namespaces.
    elsewhere = assemble_node(
        "n", (shared_gpu(0),), [on_gpu(tenant("db-0", app="db", ns="other"), 0)]
    )
    assert isinstance(evaluate(elsewhere, new, config=CONFIG, model=MODEL), Fit)


def test_high_priority_goes_where_contention_is_lowest() -> None:
    inv = (shared_gpu(0), shared_gpu(1))
    node = assemble_node("n", inv, [on_gpu(tenant("a", memory=40000, compute=50), 0)])
    only_priority = ScoringConfig(weights=Weights(0, 1, 0, 0))
    high = evaluate(
        node,
        demand(GpuRequest(shared=1, memory_mib=1000), priority=1000),
        config=only_priority,
        model=MODEL,
    )
    low = evaluate(
        node,
        demand(GpuRequest(shared=1, memory_mib=1000), priority=0),
        config=only_priority,
        model=MODEL,
    )
    assert isinstance(high, Fit) and high.gpu == 1
    assert isinstance(low, Fit) and low.gpu == 0


def test_pods_without_a_readable_gpu_count_against_the_node() -> None:
    inv = (shared_gpu(0, memory=20000),)
    lost = PlacedPod(tenant("lost", memory=15000), GpuRequest(shared=1, memory_mib=15000), None)
    node = assemble_node("n", inv, [lost])
    assert node.unplaced_tenants and not node.gpus[0].tenants
    verdict = evaluate(
        node, demand(GpuRequest(shared=1, memory_mib=10000)), config=CONFIG, model=MODEL
    )
    assert (
        isinstance(verdict, NoFit)
        and "pods without a GPU assignment (team-a/lost)" in verdict.reason
    )


def test_shared_pod_on_a_node_with_only_mig_is_unresolvable() -> None:
    node = assemble_node("n", (mig_gpu(0, [("7g.80gb", 0, 8)]),), ())
    verdict = evaluate(node, demand(GpuRequest(shared=1)), config=CONFIG, model=MODEL)
    assert (
        isinstance(verdict, NoFit)
        and verdict.unresolvable
        and "none shared by MPS" in verdict.reason
    )


@given(
    used=st.lists(st.integers(0, 40000), min_size=1, max_size=4),
    ask=st.integers(1, H100_MIB),
    prio=st.integers(-5, 5000),
)
def test_a_fit_never_overcommits_memory_and_scores_in_range(
    used: list[int], ask: int, prio: int
) -> None:
    inv = tuple(shared_gpu(i) for i in range(len(used)))
    pods = [on_gpu(tenant(f"p{i}", memory=m), i) for i, m in enumerate(used) if m]
    node = assemble_node("n", inv, pods)
    verdict = evaluate(
        node,
        demand(GpuRequest(shared=1, memory_mib=ask), priority=prio),
        config=CONFIG,
        model=MODEL,
    )
    if isinstance(verdict, Fit):
        assert verdict.gpu is not None and used[verdict.gpu] + ask <= H100_MIB
        assert 0 <= verdict.score <= 10
    else:
        assert all(u + ask > H100_MIB for u in used)


# --- parsing a pod ---------------------------------------------------------------------------


def test_parse_demand_reads_priority_group_and_request() -> None:
    d = parse_demand(
        pod("p", shared(2048, 25), labels={"app": "web"}, priority=500), group_label="app"
    )
    assert d.pod == "team-a/p" and d.priority == 500 and d.group == "web"
    assert d.request == GpuRequest(shared=1, memory_mib=2048, compute_percent=25)


@pytest.mark.parametrize(
    ("resources", "where"),
    [
        ({"nvidia.com/gpu.shared": "-1"}, "nvidia.com/gpu.shared"),
        ({"nvidia.com/gpu.shared": 1, "gpupart.io/gpu-memory": "10Gi"}, "gpupart.io/gpu-memory"),
        ({"nvidia.com/gpu.shared": 1, "gpupart.io/gpu-compute": 150}, "percentage"),
        ({"nvidia.com/gpu": "lots"}, "not a Kubernetes quantity"),
    ],
)
def test_parse_demand_refuses_bad_quantities(resources: dict[str, str | int], where: str) -> None:
    with pytest.raises(InvalidInput, match=where):
        parse_demand(pod("p", resources), group_label="app")


def test_parse_demand_refuses_a_bad_priority_and_selector() -> None:
    raw = pod("p", shared())
    raw["spec"]["priority"] = "high"
    with pytest.raises(InvalidInput, match="priority"):
        parse_demand(raw, group_label="app")
    bad_op = {
        "podAntiAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {"labelSelector": {"matchExpressions": [{"key": "app", "operator": "Near"}]}}
            ]
        }
    }
    with pytest.raises(InvalidInput, match="unknown operator"):
        parse_demand(pod("p", shared(), affinity=bad_op), group_label="app")


def test_modes_of_inventory_are_honoured() -> None:
    ts = assemble_node("n", (shared_gpu(0, mode=Mode.TIME_SLICING, clients=4),), ())
    assert isinstance(evaluate(ts, demand(GpuRequest(shared=1)), config=CONFIG, model=MODEL), Fit)
