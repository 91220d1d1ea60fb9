"""Scoring: FGD's fragmentation (fast form against the paper's definition), typical pods, policies."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from gpupart.core.scheduling.scoring import (
    FragmentationModel,
    NodeLeftover,
    Policy,
    Request,
    TypicalPod,
    bestfit_score,
    fits,
    score_node,
    score_placement,
    take,
    typical_pods,
)
from gpupart.sim.trace import Pod

MODELS = ("T4", "G2")


def naive_fragmentation(state: NodeLeftover, typical: tuple[TypicalPod, ...]) -> float:
    """FGD's F(n) exactly as the authors' NodeGpuShareFragAmount computes it (the oracle)."""
    left = sum(state.gpu_left)
    total = 0.0
    for pod in typical:
        r = pod.request
        if r.gpu_milli == 0 or (r.gpu_spec and state.model not in r.gpu_spec):
            total += pod.weight * left
            continue
        fitting = sum(1 for share in state.gpu_left if share >= r.gpu_milli)
        if fitting >= r.num_gpu and state.cpu_left >= r.cpu_milli:
            total += pod.weight * sum(s for s in state.gpu_left if s < r.gpu_milli)
        else:
            total += pod.weight * left
    return total


requests = st.builds(
    Request,
    cpu_milli=st.sampled_from([0, 2000, 4000, 8000, 16000]),
    memory_mib=st.just(0),
    num_gpu=st.just(1),
    gpu_milli=st.sampled_from([100, 250, 470, 810, 1000]),
    gpu_spec=st.sampled_from([(), ("T4",), ("G2",)]),
) | st.builds(
    Request,
    cpu_milli=st.sampled_from([1000, 8000]),
    memory_mib=st.just(0),
    num_gpu=st.sampled_from([0, 2, 4]),
    gpu_milli=st.just(1000),
)
mixes = st.lists(st.tuples(requests, st.integers(1, 20)), min_size=1, max_size=6).map(
    lambda items: tuple(
        TypicalPod(
            Request(r.cpu_milli, 0, r.num_gpu, r.gpu_milli if r.num_gpu else 0, r.gpu_spec),
            weight / sum(w for _, w in items),
        )
        for r, weight in items
    )
)
states = st.builds(
    NodeLeftover,
    cpu_left=st.integers(0, 20).map(lambda c: c * 1000),
    memory_left=st.just(10**6),
    gpu_left=st.lists(st.sampled_from([0, 60, 190, 530, 1000]), min_size=0, max_size=8).map(tuple),
    model=st.sampled_from(MODELS),
)


@given(mix=mixes, state=states)
@settings(max_examples=200, deadline=None)
def test_law_fast_fragmentation_equals_the_papers_definition(
    mix: tuple[TypicalPod, ...], state: NodeLeftover
) -> None:
    model = FragmentationModel.of(mix)
    assert abs(model.fragmentation(state) - naive_fragmentation(state, mix)) < 1e-6
    assert -1e-6 <= model.fragmentation(state) <= state.gpu_left_total + 1e-6  # float sums


@given(state=states, request=requests, policy=st.sampled_from(list(Policy)))
@settings(max_examples=200, deadline=None)
def test_law_a_placement_only_uses_gpus_that_fit(
    state: NodeLeftover, request: Request, policy: Policy
) -> None:
    model = FragmentationModel.of(typical_pods([Pod("p", 1000, 0, 1, 500)]))
    placement = score_node(policy, state, request, model=model, rng=random.Random(0))
    assert (placement is None) == (not fits(state, request))
    if placement is None:
        return
    assert len(placement.gpus) == request.num_gpu
    assert len(set(placement.gpus)) == len(placement.gpus)
    after = take(state, request, placement.gpus)
    assert all(0 <= share <= 1000 for share in after.gpu_left)
    assert after.cpu_left >= 0 and after.memory_left >= 0


def test_typical_pods_cover_95_percent_most_popular_first() -> None:
    pods = [Pod(f"a{i}", 1000, 0, 1, 500) for i in range(90)]
    pods += [Pod(f"b{i}", 2000, 0, 1, 1000) for i in range(8)]
    pods += [Pod("c", 0, 0, 0, 0), Pod("d", 3000, 0, 2, 1000)]
    mix = typical_pods(pods)
    assert [t.request.gpu_milli for t in mix] == [500, 1000]
    assert abs(sum(t.weight for t in mix) - 1.0) < 1e-9
    assert mix[0].weight == 90 / 98
    # a CPU-less pod counts as asking 100m, as kube-scheduler scores it
    assert typical_pods([Pod("c", 0, 0, 0, 0)])[0].request.cpu_milli == 100


def test_bestfit_prefers_the_fuller_node() -> None:
    request = Request(4000, 0, 1, 500)
    empty = NodeLeftover(64000, 1, (1000,) * 4, "T4")
    busy = NodeLeftover(16000, 1, (1000, 600, 0, 0), "T4")
    assert bestfit_score(busy, request) > bestfit_score(empty, request)
    placement = score_node(Policy.BESTFIT, busy, request, model=FragmentationModel.of(()))
    assert placement is not None and placement.gpus == (1,)  # the tightest GPU that fits


def test_fgd_fills_the_hole_that_no_typical_pod_could_use() -> None:
    model = FragmentationModel.of(typical_pods([Pod("p", 1000, 0, 1, 500)]))
    state = NodeLeftover(64000, 1, (1000, 300), "T4")
    placement = score_node(Policy.FGD, state, Request(1000, 0, 1, 300), model=model)
    assert placement is not None and placement.gpus == (1,)


def test_whole_gpu_pods_take_the_lowest_free_indices() -> None:
    model = FragmentationModel.of(())
    state = NodeLeftover(64000, 1, (500, 1000, 1000, 1000), "T4")
    for policy in Policy:
        placement = score_node(
            policy, state, Request(1000, 0, 2, 1000), model=model, rng=random.Random(1)
        )
        assert placement is not None and placement.gpus == (1, 2)


def test_nothing_fits_a_node_of_the_wrong_model() -> None:
    state = NodeLeftover(64000, 1, (1000,), "T4")
    assert not fits(state, Request(1000, 0, 1, 500, ("G2",)))
    assert fits(state, Request(1000, 0, 0, 0, ("G2",)))  # CPU-only pods ignore GPU models


def test_mig_requests_take_the_smallest_profile_that_fits() -> None:
    from gpupart.core.mig.catalogue import require_gpu_model
    from gpupart.sim.mig_packing import lower_bound, smallest_profile

    a100 = require_gpu_model("A100-SXM4-80GB")
    assert smallest_profile(a100, 142).name == "1g.10gb"
    assert smallest_profile(a100, 300).compute_slices == 3
    assert smallest_profile(a100, 810).compute_slices == 7  # no 6g profile: 810 rounds to 7g
    four = smallest_profile(a100, 571)
    assert lower_bound([four, four], 0) == 2  # two 4g instances never share a GPU
    assert lower_bound([smallest_profile(a100, 142)] * 7, 1) == 2


@given(mix=mixes, state=states)
@settings(max_examples=200, deadline=None)
def test_law_stranded_share_is_the_free_gpu_share_the_free_cpu_cannot_feed(
    mix: tuple[TypicalPod, ...], state: NodeLeftover
) -> None:
    model = FragmentationModel.of(mix)
    stranded = model.stranded(state)
    assert 0.0 <= stranded <= state.gpu_left_total
    if model.cpu_per_gpu > 0:
        expected = max(0.0, state.gpu_left_total - state.cpu_left / model.cpu_per_gpu)
        assert abs(stranded - expected) < 1e-9
    else:
        assert stranded == 0.0


def test_cpu_per_gpu_is_the_mixs_weighted_cpu_over_gpu_share_of_gpu_pods() -> None:
    mix = (
        TypicalPod(Request(4000, 0, 1, 1000), 0.25),
        TypicalPod(Request(16000, 0, 1, 500), 0.25),
        TypicalPod(Request(32000, 0, 0, 0), 0.5),  # CPU-only pods do not count
    )
    model = FragmentationModel.of(mix)
    assert abs(model.cpu_per_gpu - (0.25 * 4000 + 0.25 * 16000) / (0.25 * 1000 + 0.25 * 500)) < 1e-9
    assert FragmentationModel.of((TypicalPod(Request(1000, 0, 0, 0), 1.0),)).cpu_per_gpu == 0.0


@given(mix=mixes, state=states, request=requests)
@settings(max_examples=200, deadline=None)
def test_law_gpupart_is_fgd_on_nodes_with_cpu_to_spare(
    mix: tuple[TypicalPod, ...], state: NodeLeftover, request: Request
) -> None:
    model = FragmentationModel.of(mix)
    rich = NodeLeftover(10**9, state.memory_left, state.gpu_left, state.model)
    ours = score_node(Policy.GPUPART, rich, request, model=model)
    fgd = score_node(Policy.FGD, rich, request, model=model)
    assert (ours is None) == (fgd is None)
    if ours is not None and fgd is not None:
        assert ours.score == fgd.score
        assert len(ours.gpus) == len(fgd.gpus)


@given(mix=mixes, state=states, request=requests)
@settings(max_examples=100, deadline=None)
def test_law_gpupart_is_deterministic(
    mix: tuple[TypicalPod, ...], state: NodeLeftover, request: Request
) -> None:
    first = score_node(Policy.GPUPART, state, request, model=FragmentationModel.of(mix))
    again = score_node(Policy.GPUPART, state, request, model=FragmentationModel.of(mix))
    assert first == again


def test_gpupart_keeps_cpu_for_free_gpus_where_fgd_sees_a_tie() -> None:
    # the mix asks 10 cores per GPU; both nodes can still host every typical pod afterwards
    model = FragmentationModel.of(
        (TypicalPod(Request(4000, 0, 1, 1000), 0.5), TypicalPod(Request(16000, 0, 1, 1000), 0.5))
    )
    hungry = Request(20000, 0, 1, 1000)
    lean = NodeLeftover(36000, 1, (1000,) * 3, "T4")  # leaves 16 cores for 2 GPUs: 0.4 GPU idle
    rich = NodeLeftover(104000, 1, (1000,) * 3, "T4")
    fgd_lean = score_node(Policy.FGD, lean, hungry, model=model)
    fgd_rich = score_node(Policy.FGD, rich, hungry, model=model)
    assert fgd_lean is not None and fgd_rich is not None and fgd_lean.score == fgd_rich.score
    ours_lean = score_node(Policy.GPUPART, lean, hungry, model=model)
    ours_rich = score_node(Policy.GPUPART, rich, hungry, model=model)
    assert ours_lean is not None and ours_rich is not None
    assert ours_rich.score > ours_lean.score


def test_gpupart_puts_a_shared_pod_in_the_tightest_of_equal_holes() -> None:
    model = FragmentationModel.of(typical_pods([Pod("p", 1000, 0, 1, 1000)]))
    state = NodeLeftover(64000, 1, (1000, 700, 400), "T4")
    placement = score_node(Policy.GPUPART, state, Request(1000, 0, 1, 300), model=model)
    assert placement is not None and placement.gpus == (2,)


def test_gpupart_sends_a_cpu_only_pod_to_gpu_share_already_lost_to_fragmentation() -> None:
    # the mix asks 10 cores per whole GPU; a 1-core CPU-only pod
    model = FragmentationModel.of((TypicalPod(Request(10000, 0, 1, 1000), 1.0),))
    cpu_only = Request(1000, 0, 0, 0)
    slivers = NodeLeftover(2000, 1, (150, 150), "T4")  # no typical pod fits: all 300 already lost
    whole = NodeLeftover(20000, 1, (1000, 1000), "T4")  # after the pod, 19 cores for 2 GPUs
    fgd = [score_node(Policy.FGD, s, cpu_only, model=model) for s in (slivers, whole)]
    assert fgd[0] is not None and fgd[1] is not None and fgd[0].score == fgd[1].score
    ours = [score_node(Policy.GPUPART, s, cpu_only, model=model) for s in (slivers, whole)]
    assert ours[0] is not None and ours[1] is not None
    # the CPU beside whole free GPUs is worth more: the slivers' share strands nothing new
    assert ours[0].score > ours[1].score
    assert ours[0].score == fgd[0].score  # max(F, S) = F there


# Typical pods: half a GPU with 4 cores (the extender's tests use the same mix).
_CPU_MODEL = FragmentationModel.of(typical_pods([Request(4000, 0, 1, 500)] * 10))


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
    state = NodeLeftover(cpu_left, 1 << 20, tuple(gpus), "H100")
    request = Request(cpu, 0, 1, milli) if milli < 1000 else Request(cpu, 0, num, 1000)
    for policy in (Policy.GPUPART, Policy.FGD):
        placement = score_node(policy, state, request, model=_CPU_MODEL)
        if placement is None:
            continue
        assert (
            score_placement(policy, state, request, placement.gpus, model=_CPU_MODEL)
            == placement.score
        )
        if request.is_shared:
            fitting = [i for i, share in enumerate(gpus) if share >= milli]
            best = max(
                score_placement(policy, state, request, (i,), model=_CPU_MODEL) for i in fitting
            )
            assert best == placement.score
