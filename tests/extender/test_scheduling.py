"""The extender's pure scheduling terms (gpupart.core.scheduling.evaluation).

Covers: each term's formula and direction (headroom binpack/spread, priority, anti-affinity,
fragmentation: the simulator's default gpupart policy, same code and same numbers as
`scoring.score_node`, CPU-starved nodes avoided, FGD when CPU is unknown), combining into 0-10
with the reserve cap,
MIG / whole / shared evaluation with the reasons a person reads, GPU choice for shared pods
(reserve, anti-affinity, required podAntiAffinity), and parsing a pod into a Demand (CPU request included).
"""

from __future__ import annotations

import pytest
from extender_objects import H100_MIB, mig_gpu, pod, shared, shared_gpu, whole_gpu
from hypothesis import given
from hypothesis import strategies as st

from gpupart.core.api.resources import GpuRequest
from gpupart.core.api.spec import Mode
from gpupart.core.api.wire import PodAssignment
from gpupart.core.errors import InvalidInput
from gpupart.core.scheduling.evaluate import FailureKind, Fit, NoFit, evaluate
from gpupart.core.scheduling.pods import Demand, node_cpu_milli, parse_demand, pod_cpu_milli
from gpupart.core.scheduling.scoring import (
    DEFAULT_POLICY,
    NodeState,
    Policy,
    Request,
    score_node,
    score_placement,
)
from gpupart.core.scheduling.shares import (
    fragmentation_model,
    fragmentation_term,
    node_state,
    share_milli,
)
from gpupart.core.scheduling.terms import (
    AffinityScope,
    Conflict,
    ScoringConfig,
    Strategy,
    Terms,
    Weights,
    anti_affinity_term,
    combine,
    headroom_term,
    priority_term,
)
from gpupart.core.scheduling.views import NodeView, PlacedPod, Tenant, assemble_node

CONFIG = ScoringConfig()
MODEL = fragmentation_model([(1, 250, 0)] * 5 + [(1, 1000, 0)] * 5)


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
    model = fragmentation_model([(1, 500, 0)] * 99 + [(2, 1000, 0)])
    shapes = {(t.request.num_gpu, t.request.gpu_milli) for t in model.typical}
    assert shapes == {(1, 500)}  # the 1 % shape falls outside the 95 % coverage
    assert fragmentation_model([]).typical == ()


# --- the simulator's policy as the fragmentation term -----------------------------------------

# Typical pods: half a GPU with 4 cores, so the mix asks 8 millicores per GPU thousandth.
CPU_MODEL = fragmentation_model([(1, 500, 4000)] * 10)


def cpu_node(name: str, *, allocatable: int | None, used: int, gpu_used: int = 0) -> NodeView:
    """Two 40000 MiB MPS GPUs; GPU 0 holds a `gpu_used` MiB pod; CPU-only pods use `used` m."""
    inv = (shared_gpu(0, memory=40000), shared_gpu(1, memory=40000))
    pods = [PlacedPod(tenant("batch"), GpuRequest(), cpu_milli=used)]
    if gpu_used:
        pods.append(on_gpu(tenant("infer", memory=gpu_used), 0, name))
    return assemble_node(name, inv, pods, cpu_milli=allocatable)


def test_the_node_that_would_strand_gpu_share_without_cpu_scores_lower() -> None:
    # Same GPUs, same allocatable CPU; "drained" has 28 cores left, "roomy" 64. The pod takes a
    # quarter GPU and 24 cores: on "drained" 4 cores would be left for 1.75 free GPUs, which feed
    # only half a GPU at the mix's 8 cores per GPU.
    pod_demand = Demand(
        "team-a/new", "team-a", GpuRequest(shared=1, memory_mib=10000), cpu_milli=24000
    )
    roomy = cpu_node("roomy", allocatable=64000, used=0)
    drained = cpu_node("drained", allocatable=64000, used=36000)
    on_roomy = evaluate(roomy, pod_demand, config=CONFIG, model=CPU_MODEL)
    on_drained = evaluate(drained, pod_demand, config=CONFIG, model=CPU_MODEL)
    assert isinstance(on_roomy, Fit) and isinstance(on_drained, Fit)
    assert on_roomy.terms.fragmentation == 0.5  # nothing stranded before or after
    assert on_drained.terms.fragmentation == 0.22  # int(sigmoid(-1250 / 1000) * 100) / 100
    assert on_roomy.score > on_drained.score  # kube-scheduler sees the difference
    # FGD's F alone sees no difference: 4 cores still host a typical pod.
    for view in (roomy, drained):
        state = node_state(view)
        fgd = fragmentation_term(
            CPU_MODEL, state, Request(24000, 0, 1, 250), (0,), policy=Policy.FGD
        )
        assert fgd == 0.5
    # Without allocatable CPU the node degrades to FGD (S = 0): both score alike.
    blind = [
        evaluate(cpu_node(n, allocatable=None, used=u), pod_demand, config=CONFIG, model=CPU_MODEL)
        for n, u in (("a", 0), ("b", 36000))
    ]
    assert blind[0] == blind[1] == on_roomy


def test_the_fragmentation_term_is_score_node_of_the_default_policy() -> None:
    assert DEFAULT_POLICY is Policy.GPUPART
    # Extender side: GPU 0 has 30000 of 40000 MiB used (250 free thousandths), GPU 1 is empty;
    # 20 of 32 cores requested. The pod asks 8000 MiB (200 thousandths) and 6 cores.
    view = cpu_node("n1", allocatable=32000, used=20000, gpu_used=30000)
    pod_demand = Demand(
        "team-a/new", "team-a", GpuRequest(shared=1, memory_mib=8000), cpu_milli=6000
    )
    fit = evaluate(view, pod_demand, config=CONFIG, model=CPU_MODEL)
    assert isinstance(fit, Fit)
    # Simulator side: the same node and pod as the replay engine states them.
    state = NodeState(12000, 256 * 1024, (250, 1000), shared_gpu(0).product)
    request = Request(6000, 0, 1, 200)
    placement = score_node(DEFAULT_POLICY, state, request, model=CPU_MODEL)
    assert placement is not None and placement.gpus == (fit.gpu,) == (0,)
    assert fit.terms.fragmentation == placement.score / 100 == 0.47
    assert node_state(view).cpu_left == state.cpu_left
    assert node_state(view).gpu_left == state.gpu_left
    # Whole GPUs too: the lowest free GPUs, scored as score_node scores them.
    whole = Demand("team-a/new", "team-a", GpuRequest(whole_gpus=1), cpu_milli=6000)
    inv = (whole_gpu(0), whole_gpu(1))
    pods = [PlacedPod(tenant("w"), GpuRequest(whole_gpus=1), cpu_milli=20000)]
    wfit = evaluate(
        assemble_node("w", inv, pods, cpu_milli=32000), whole, config=CONFIG, model=CPU_MODEL
    )
    wplace = score_node(
        DEFAULT_POLICY,
        NodeState(12000, 1 << 20, (0, 1000), "H100"),
        Request(6000, 0, 1, 1000),
        model=CPU_MODEL,
    )
    assert isinstance(wfit, Fit) and wplace is not None
    assert wfit.terms.fragmentation == wplace.score / 100


@given(
    cpu_left=st.integers(0, 64000),
    gpus=st.lists(st.sampled_from([0, 100, 250, 500, 750, 1000]), min_size=1, max_size=8),
    cpu=st.sampled_from([0, 1000, 4000, 16000]),
    milli=st.sampled_from([100, 250, 500, 1000]),
    num=st.integers(1, 2),
)
def test_score_placement_is_what_score_node_scores(
    cpu_left: int, gpus: list[int], cpu: int, milli: int, num: int
) -> None:
    """The per-GPU helper the extender calls agrees with score_node on every state: it is the
    score of score_node's own pick and no candidate GPU scores higher."""
    state = NodeState(cpu_left, 1 << 20, tuple(gpus), "H100")
    request = Request(cpu, 0, 1, milli) if milli < 1000 else Request(cpu, 0, num, 1000)
    for policy in (Policy.GPUPART, Policy.FGD):
        placement = score_node(policy, state, request, model=CPU_MODEL)
        if placement is None:
            continue
        assert (
            score_placement(policy, state, request, placement.gpus, model=CPU_MODEL)
            == placement.score
        )
        if request.is_shared:
            fitting = [i for i, share in enumerate(gpus) if share >= milli]
            best = max(
                score_placement(policy, state, request, (i,), model=CPU_MODEL) for i in fitting
            )
            assert best == placement.score


def test_cpu_of_a_pod_and_of_a_node_as_kube_scheduler_counts_them() -> None:
    raw = pod("p", {**shared(1000), "cpu": "1500m"})
    raw["spec"]["containers"].append({"name": "side", "resources": {"limits": {"cpu": "500m"}}})
    assert parse_demand(raw, group_label="app").cpu_milli == 2000
    raw["spec"]["initContainers"] = [
        {"name": "sidecar", "restartPolicy": "Always", "resources": {"requests": {"cpu": "1"}}},
        {"name": "setup", "resources": {"requests": {"cpu": "2500m"}}},
    ]
    raw["spec"]["overhead"] = {"cpu": "100m"}
    # max(containers 2 + sidecar 1, setup 2.5 + sidecar 1) + overhead 0.1
    assert pod_cpu_milli(raw) == 3600
    assert pod_cpu_milli(pod("q", shared())) == 0
    raw["spec"]["overhead"] = {"cpu": "lots"}
    with pytest.raises(InvalidInput, match="overhead.cpu"):
        parse_demand(raw, group_label="app")
    assert node_cpu_milli({"status": {"allocatable": {"cpu": "7910m"}}}) == 7910
    assert node_cpu_milli({"status": {"allocatable": {"cpu": "8"}}}) == 8000
    assert node_cpu_milli({"status": {"allocatable": {"memory": "1Gi"}}}) is None
    assert node_cpu_milli({"status": {"allocatable": {"cpu": "many"}}}) is None
    assert node_cpu_milli({}) is None


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
    assert verdict.summary == "node(s) had no free 3g.40gb MIG slice"


def test_summaries_are_equal_for_nodes_failing_alike() -> None:
    """What kube-scheduler counts under one reason: no node, GPU or pod names in the summary."""
    request = demand(GpuRequest(shared=1, memory_mib=16000))
    verdicts = [
        evaluate(
            assemble_node(
                f"n{n}", (shared_gpu(0, memory=20000),), [on_gpu(tenant(t, memory=m), 0)]
            ),
            request,
            config=CONFIG,
            model=MODEL,
        )
        for n, (t, m) in enumerate((("a", 5000), ("b", 9000)))
    ]
    assert all(isinstance(v, NoFit) for v in verdicts)
    first, second = (v for v in verdicts if isinstance(v, NoFit))
    assert first.reason != second.reason
    assert (
        first.summary
        == second.summary
        == ("node(s) had no shared GPU with 16000 MiB free and 1 client slot (in use)")
    )


def test_shortfall_says_how_far_from_fitting() -> None:
    """Thousandths of the request missing on the closest GPU (or slices, or whole GPUs)."""
    request = demand(GpuRequest(shared=1, memory_mib=16000))
    inv = (shared_gpu(0, memory=20000), shared_gpu(1, memory=20000))
    pods = [on_gpu(tenant("a", memory=8000), 0), on_gpu(tenant("b", memory=12000), 1)]
    verdict = evaluate(assemble_node("n", inv, pods), request, config=CONFIG, model=MODEL)
    # GPU 0 has 12000 of 16000 free: a quarter short; GPU 1 half short.
    assert isinstance(verdict, NoFit) and verdict.shortfall == 250
    mig = evaluate(
        mig_node(2), demand(GpuRequest(mig=(("3g.40gb", 1),))), config=CONFIG, model=MODEL
    )
    assert isinstance(mig, NoFit) and mig.shortfall == 1000


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
    assert verdict == NoFit(
        "n: no GPU inventory",
        "node(s) had no GPU inventory from the gpupart node agent",
        FailureKind.NO_INVENTORY,
        True,
    )


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
