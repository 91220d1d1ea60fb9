"""The DRA benchmark's offline bound (tests/bench/dra_bound.py) against exhaustive search and the simulator."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Sequence
from functools import cache
from pathlib import Path
from types import ModuleType

from hypothesis import given, settings
from hypothesis import strategies as st

from gpupart.core.dra.devices import Order
from gpupart.core.errors import InfeasibleLayout
from gpupart.core.mig.catalogue import GpuModel, require_gpu_model
from gpupart.core.mig.layout import MigInstance, Placement, check_layout
from gpupart.sim.dynamic.dra import DraOrder
from gpupart.sim.dynamic.simulation import Latencies, SimNode, SimPod, simulate
from gpupart.sim.dynamic.workloads import w4_mixed_sizes


def _load_bench(name: str) -> ModuleType:
    """A module of tests/bench (a directory of scripts, not a package), imported by its path."""
    path = Path(__file__).resolve().parents[1] / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


dra_bound = _load_bench("dra_bound")
H100 = require_gpu_model("H100-SXM5-80GB")
A30 = require_gpu_model("A30")
large = dra_bound.large
GpuStates = tuple[tuple[tuple[MigInstance, float], ...], ...]
"""Per GPU, its instances and when each leaves."""


def exhaustive(
    model: GpuModel,
    gpus: int,
    pods: Sequence[SimPod],
    is_large: Callable[[str], bool] = large,
) -> tuple[int, int]:
    """The most pods and the most large pods bound (each over its own schedules), over every
    choice of accepting each pod at its arrival and of its GPU and placement, kept till it
    leaves; a departure at t frees the room for an arrival at t."""
    order = sorted(pods, key=lambda p: (p.arrival, p.name))

    @cache
    def best(k: int, state: GpuStates) -> tuple[int, int]:
        if k == len(order):
            return 0, 0
        pod = order[k]
        now, profile = pod.arrival, model.require_profile(pod.profiles[0])
        alive = tuple(tuple(held for held in gpu if held[1] > now) for gpu in state)
        total, big = best(k + 1, _canonical(alive))  # refused
        for g, gpu in enumerate(alive):
            for start in profile.starts:
                instance = MigInstance(Placement(start, profile.memory_slices), profile.name)
                try:
                    check_layout(model, [i for i, _ in gpu] + [instance])
                except InfeasibleLayout:
                    continue
                after = list(alive)
                after[g] = (*gpu, (instance, now + pod.duration))
                more, more_big = best(k + 1, _canonical(tuple(after)))
                total = max(total, more + 1)
                big = max(big, more_big + int(is_large(profile.name)))
        return total, big

    return best(0, tuple(() for _ in range(gpus)))


def _canonical(state: GpuStates) -> GpuStates:
    return tuple(sorted(tuple(sorted(gpu)) for gpu in state))


def pods_of(spec: Sequence[tuple[str, int, int]]) -> list[SimPod]:
    return [
        SimPod(f"p{k}", (profile,), float(arrival), float(duration))
        for k, (profile, arrival, duration) in enumerate(spec)
    ]


def replays(model: GpuModel) -> st.SearchStrategy[list[SimPod]]:
    return st.lists(
        st.tuples(
            st.sampled_from(model.profile_names),
            st.integers(min_value=0, max_value=12),
            st.integers(min_value=1, max_value=12),
        ),
        min_size=1,
        max_size=6,
    ).map(pods_of)


@settings(max_examples=40, deadline=None)
@given(pods=replays(H100), gpus=st.integers(min_value=1, max_value=2))
def test_the_bound_is_at_least_any_schedule_and_the_4g_bound_is_exact_on_an_h100(
    pods: list[SimPod], gpus: int
) -> None:
    most, most_large = exhaustive(H100, gpus, pods)
    relaxed = dra_bound.offline_bound(H100, gpus, pods, large)
    assert relaxed["bound"] >= most
    assert relaxed["bound_4g_plus"] == most_large
    exact = dra_bound.offline_bound(H100, gpus, pods, large, exact_time_limit_s=30.0)
    assert exact["bound_exact"] == 1
    assert exact["bound"] == most
    assert exact["bound_4g_plus"] == most_large


@settings(max_examples=25, deadline=None)
@given(pods=replays(A30), gpus=st.integers(min_value=1, max_value=2))
def test_the_bound_holds_on_another_model(pods: list[SimPod], gpus: int) -> None:
    most, most_large = exhaustive(A30, gpus, pods)
    figures = dra_bound.offline_bound(A30, gpus, pods, large, exact_time_limit_s=30.0)
    assert figures == {"bound": most, "bound_4g_plus": most_large, "bound_exact": 1}


def three_g_and_up(profile: str) -> bool:
    return profile.startswith(("3g.", "4g.", "7g."))


@settings(max_examples=25, deadline=None)
@given(pods=replays(H100), gpus=st.integers(min_value=1, max_value=2))
def test_large_profiles_that_share_a_gpu_fall_back_to_an_upper_bound(
    pods: list[SimPod], gpus: int
) -> None:
    # two 3g.40gb share an H100: the interval argument does not hold, the relaxation is used
    assert not dra_bound.large_ones_exclusive(H100, [H100.require_profile("3g.40gb")])
    _, most_large = exhaustive(H100, gpus, pods, three_g_and_up)
    figures = dra_bound.offline_bound(H100, gpus, pods, three_g_and_up)
    assert figures["bound_4g_plus"] >= most_large


def test_the_large_profiles_of_an_h100_never_share_a_gpu() -> None:
    big = [p for p in H100.profiles if large(p.name)]
    assert {p.name for p in big} == {"4g.40gb", "7g.80gb"}
    assert dra_bound.large_ones_exclusive(H100, big)


def test_a_departure_frees_its_room_for_an_arrival_at_the_same_instant() -> None:
    back_to_back = pods_of([("7g.80gb", 0, 10), ("7g.80gb", 10, 10)])
    overlapping = pods_of([("7g.80gb", 0, 10), ("7g.80gb", 9, 10)])
    assert dra_bound.offline_bound(H100, 1, back_to_back, large)["bound"] == 2
    assert dra_bound.offline_bound(H100, 1, overlapping, large)["bound"] == 1
    assert exhaustive(H100, 1, back_to_back) == (2, 2)
    # the simulator agrees, with instances made at once (else a pod leaves its latencies late):
    # the second 7g binds on the GPU the first leaves at that instant
    result = simulate(
        [SimNode("n", H100, 1)],
        back_to_back,
        DraOrder(Order.NVIDIA, patience_s=0.0),
        latencies=Latencies(create=0.0, destroy=0.0, advertise=0.0),
    )
    assert result.bind_s == (0.0, 0.0)
    assert result.served == 2


def test_the_relaxation_lets_pods_move_and_the_exact_model_does_not() -> None:
    # two 4g.40gb, then a 1g and a 3g that cannot share a 4g's GPU with each other (the 3g
    # needs slots 4-7), so each GPU keeps one of them after the 4g leave and the 7g finds no
    # empty GPU; per instant, 1g + 3g fit on one GPU and the 7g on the other
    pods = pods_of(
        [
            ("4g.40gb", 0, 50),
            ("4g.40gb", 0, 50),
            ("1g.10gb", 1, 99),
            ("3g.40gb", 2, 98),
            ("7g.80gb", 60, 10),
        ]
    )
    assert exhaustive(H100, 2, pods) == (4, 3)
    assert dra_bound.offline_bound(H100, 2, pods, large)["bound"] == 5
    exact = dra_bound.offline_bound(H100, 2, pods, large, exact_time_limit_s=30.0)
    assert exact == {"bound": 4, "bound_4g_plus": 3, "bound_exact": 1}


def test_the_bound_is_at_least_what_the_dra_policies_bind_on_a_w4_replay() -> None:
    gpus = 4
    pods = w4_mixed_sizes(seed=0, gpus=gpus, arrivals=100)
    figures = dra_bound.offline_bound(H100, gpus, pods, large)
    for order in (Order.NVIDIA, Order.GPUPART):
        result = simulate([SimNode("node-0", H100, gpus)], pods, DraOrder(order, patience_s=0.0))
        bound = {name for name, _ in result.waits}
        bound_large = sum(1 for p in pods if p.name in bound and any(map(large, p.profiles)))
        assert figures["bound"] >= len(bound), order
        assert figures["bound_4g_plus"] >= bound_large, order
    assert figures["bound"] <= len(pods)
