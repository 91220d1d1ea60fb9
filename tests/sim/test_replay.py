"""Replay engine: the paper's protocol (tuning, order, ties), invariants, determinism, and the
reproduction of the FGD authors' cached results on the real default trace."""

from __future__ import annotations

import csv
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpupart.core.scheduling.scoring import Policy
from gpupart.sim.replay import arrivals, replay
from gpupart.sim.trace import Node, Pod, parse_nodes, parse_pods

TRACES = Path(__file__).resolve().parents[2] / ".." / "shared" / "traces"

nodes_strategy = st.lists(
    st.builds(
        Node,
        name=st.just(""),
        cpu_milli=st.sampled_from([8000, 32000, 96000]),
        memory_mib=st.just(10**6),
        gpus=st.sampled_from([1, 2, 4, 8]),
        model=st.sampled_from(["T4", "G2"]),
    ),
    min_size=1,
    max_size=6,
).map(
    lambda nodes: tuple(
        Node(f"n{i}", n.cpu_milli, 10**6, n.gpus, n.model) for i, n in enumerate(nodes)
    )
)
pods_strategy = st.lists(
    st.one_of(
        st.builds(
            lambda m, c: (c, 1, m),
            st.sampled_from([110, 250, 470, 810]),
            st.sampled_from([1000, 4000]),
        ),
        st.builds(
            lambda k, c: (c, k, 1000), st.sampled_from([1, 2, 8]), st.sampled_from([2000, 8000])
        ),
        st.builds(lambda c: (c, 0, 0), st.sampled_from([1000, 16000])),
    ),
    min_size=1,
    max_size=40,
).map(lambda shapes: tuple(Pod(f"p{i:03d}", c, 1, k, m) for i, (c, k, m) in enumerate(shapes)))


@given(
    nodes=nodes_strategy,
    pods=pods_strategy,
    policy=st.sampled_from(list(Policy)),
    seed=st.integers(0, 9),
)
@settings(max_examples=60, deadline=None)
def test_law_replay_never_overcommits_and_accounts_for_every_pod(
    nodes: tuple[Node, ...], pods: tuple[Pod, ...], policy: Policy, seed: int
) -> None:
    result = replay(nodes, pods, policy=policy, seed=seed, load=1.3)
    assert result.placed + result.failed == result.pods
    assert 0 <= result.allocated_milli <= result.capacity_milli
    assert len(result.curve) == 131
    assert all(a <= b + 1e-9 for a, b in zip(result.curve, result.curve[1:], strict=False))
    assert result.curve[-1] == pytest.approx(result.allocation_ratio)
    for node, state in result.final_states:
        assert all(0 <= share <= 1000 for share in state.gpu_left)
        assert 0 <= state.cpu_left <= node.cpu_milli
    used = sum(node.gpu_milli - sum(state.gpu_left) for node, state in result.final_states)
    assert used == result.allocated_milli


@given(
    nodes=nodes_strategy,
    pods=pods_strategy,
    policy=st.sampled_from(list(Policy)),
    seed=st.integers(0, 9),
)
@settings(max_examples=30, deadline=None)
def test_law_replay_is_deterministic_for_a_seed(
    nodes: tuple[Node, ...], pods: tuple[Pod, ...], policy: Policy, seed: int
) -> None:
    first = replay(nodes, pods, policy=policy, seed=seed)
    again = replay(tuple(reversed(nodes)), tuple(reversed(pods)), policy=policy, seed=seed)
    assert first == again


def test_arrivals_shuffle_then_append_copies_up_to_the_load() -> None:
    pods = [Pod(f"p{i}", 1000, 1, 1, 500) for i in range(10)] + [Pod("cpu", 1000, 1, 0, 0)]
    sequence = arrivals(pods, 10_000, load=1.3, rng=random.Random(3))
    assert sorted(p.name for p in sequence[:11]) == sorted(p.name for p in pods)
    assert sequence[:11] != sorted(pods, key=lambda p: p.name)  # shuffled
    total = sum(p.total_gpu_milli for p in sequence)
    assert 13_000 - 500 < total <= 13_000
    assert all("-tuned-" in p.name for p in sequence[11:])
    assert len({p.name for p in sequence}) == len(sequence)


def test_arrivals_drop_random_pods_when_the_trace_is_above_the_load() -> None:
    pods = [Pod(f"p{i}", 1000, 1, 1, 1000) for i in range(20)]
    sequence = arrivals(pods, 10_000, load=1.0, rng=random.Random(3))
    assert sum(p.total_gpu_milli for p in sequence) == 10_000


def test_ties_go_to_the_smallest_node_name_without_shuffling() -> None:
    nodes = tuple(Node(name, 8000, 10**6, 1, "T4") for name in ("b", "a", "c"))
    result = replay(
        nodes, (Pod("p", 1000, 1, 1, 1000),), policy=Policy.FGD, seed=1, load=0, shuffle_nodes=False
    )
    used = [node.name for node, state in result.final_states if state.gpu_left == (0,)]
    assert used == ["a"]


def test_a_pod_that_fits_nowhere_fails_and_is_counted_by_kind() -> None:
    nodes = (Node("n", 8000, 10**6, 1, "T4"),)
    pods = (Pod("a", 1000, 1, 1, 1000), Pod("b", 1000, 1, 1, 1000), Pod("c", 1000, 1, 1, 300))
    result = replay(nodes, pods, policy=Policy.BESTFIT, seed=0, load=0)
    assert (result.placed, result.failed) == (1, 2)
    assert sum(result.failed_by_kind.values()) == 2


def _authors_mean(trace: str, policy: str) -> float:
    with (TRACES / "fgd-expected" / "analysis_allo_discrete.csv").open() as handle:
        values = [
            float(row["130"])
            for row in csv.DictReader(handle)
            if row["workload"] == f"openb_pod_list_{trace}" and row["sc_policy"] == policy
        ]
    return sum(values) / len(values)


@pytest.mark.skipif(not TRACES.is_dir(), reason="../shared/traces is not here")
@pytest.mark.parametrize(
    ("policy", "authors"), [(Policy.BESTFIT, "05-BestFit"), (Policy.FGD, "06-FGD")]
)
def test_baseline_reproduces_the_authors_number_on_the_default_trace(
    policy: Policy, authors: str
) -> None:
    folder = TRACES / "alibaba-gpu-v2023"
    nodes = parse_nodes((folder / "openb_node_list_gpu_node.csv").read_text(), source="nodes")
    pods = parse_pods((folder / "openb_pod_list_default.csv").read_text(), source="pods")
    result = replay(nodes, pods, policy=policy, seed=42, load=1.3)
    assert abs(result.allocation_ratio - _authors_mean("default", authors)) < 0.5


def test_a_pod_no_node_could_host_is_counted_as_unplaceable_and_the_replay_goes_on() -> None:
    nodes = (Node("n", 8000, 10**6, 2, "T4"), Node("m", 8000, 10**6, 1, "P100"))
    pods = (
        Pod("too-many-gpus", 1000, 1, 4, 1000, line=2),
        Pod("no-such-model", 1000, 1, 1, 500, ("V100",), line=3),
        Pod("fits", 1000, 1, 1, 1000, line=4),
        Pod("too-much-cpu", 9000, 1, 0, 0, line=5),
    )
    for policy in Policy:
        result = replay(nodes, pods, policy=policy, seed=3, load=0)
        assert (result.pods, result.placed, result.failed, result.unplaceable) == (4, 1, 3, 3)
        assert result.failed_by_kind == {"4-gpu": 1, "shared": 1, "cpu-only": 1}
        assert len(result.unplaceable_examples) == 3
        assert all("larger than any node" in why for why in result.unplaceable_examples)
    # copies of an unplaceable pod are unplaceable too, and counted each time
    heavy = (Pod("whole", 1000, 1, 1, 1000), Pod("huge", 1000, 1, 8, 1000, line=9))
    result = replay(nodes, heavy, policy=Policy.FGD, seed=0, load=10.0)
    copies = sum(1 for p in arrivals(heavy, 3000, load=10.0, rng=random.Random(0)) if p.line)
    assert result.unplaceable == copies > 1 and result.placed + result.failed == result.pods
    assert result.unplaceable_examples == (
        "pod 'huge' (line 9): cpu 1000m, memory 1 MiB, 8 x 1000m GPU is larger than any node",
    )
