"""The simulator's DRA policies: legal layouts at every step, the order's effect on a 4g, the CLI names."""

from __future__ import annotations

import json
from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from gpupart.cli import main
from gpupart.core.dra.devices import Order
from gpupart.core.mig.catalogue import require_gpu_model
from gpupart.core.mig.layout import MigInstance, Placement, check_layout
from gpupart.core.mig.planning import CreateGpuInstance, DestroyGpuInstance
from gpupart.sim.dynamic.dra import DraOrder, Refusal, refusal_cause
from gpupart.sim.dynamic.policies import POLICY_NAMES, run_policy
from gpupart.sim.dynamic.simulation import (
    Cluster,
    Decision,
    GpuKey,
    SimNode,
    SimPod,
    simulate,
)
from gpupart.sim.dynamic.workloads import w4_mixed_sizes

H100 = require_gpu_model("H100-SXM5-80GB")
PROFILES = ("1g.10gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb")


class Checked:
    """A DRA policy whose every decision is checked against the GPUs it lands on: after the
    change, no two instances overlap and `check_layout` (the counters' law) accepts each GPU."""

    binds_free = False

    def __init__(self, order: Order) -> None:
        self.inner = DraOrder(order)
        self.name = self.inner.name
        self.steps = 0

    def initial(self, node: SimNode) -> tuple[MigInstance, ...]:
        return tuple(self.inner.initial(node))

    def decide(self, cluster: Cluster, now: float) -> Decision:
        return self._checked(cluster, self.inner.decide(cluster, now))

    def departed(
        self, cluster: Cluster, now: float, freed: Sequence[tuple[GpuKey, MigInstance]]
    ) -> Decision:
        return self._checked(cluster, self.inner.departed(cluster, now, freed))

    def _checked(self, cluster: Cluster, decision: Decision) -> Decision:
        after = {key: set(gpu) for key, gpu in cluster.gpus.items()}
        for change in decision.changes:
            for step in change.steps:
                if isinstance(step, CreateGpuInstance):
                    assert step.instance not in after[change.gpu]
                    after[change.gpu].add(step.instance)
                elif isinstance(step, DestroyGpuInstance):
                    after[change.gpu].remove(step.instance)
        for (n, _), instances in after.items():
            layout = sorted(instances)
            for k, one in enumerate(layout):
                assert not any(one.placement.overlaps(o.placement) for o in layout[k + 1 :])
            check_layout(cluster.nodes[n].model, layout)
        self.steps += 1
        return decision


pod_strategy = st.tuples(
    st.lists(st.sampled_from(PROFILES), min_size=1, max_size=2),
    st.floats(0, 600),
    st.floats(1, 900),
)


@settings(max_examples=25, deadline=None)
@given(
    st.sampled_from(list(Order)),
    st.integers(1, 2),
    st.integers(1, 3),
    st.lists(pod_strategy, min_size=1, max_size=25),
)
def test_no_order_ever_places_overlapping_or_over_counted_instances(
    order: Order, nodes: int, gpus: int, raw: list[tuple[list[str], float, float]]
) -> None:
    cluster = [SimNode(f"node-{k}", H100, gpus) for k in range(nodes)]
    pods = [
        SimPod(f"p{k}", tuple(profiles), arrival, duration)
        for k, (profiles, arrival, duration) in enumerate(raw)
    ]
    policy = Checked(order)
    result = simulate(cluster, pods, policy)
    assert policy.steps > 0
    assert result.served <= len(pods)
    assert result.disruptions == 0


def test_nvidia_order_strands_a_4g_that_ours_places() -> None:
    # a long 1g, then a 4g: by name the 1g takes slot 0, the 4g's only start; ours keeps it free
    one_gpu = [SimNode("node-0", H100, 1)]
    pods = [
        SimPod("small", ("1g.10gb",), 0.0, 100_000.0),
        SimPod("large", ("4g.40gb",), 10.0, 100.0),
    ]
    by_name = DraOrder(Order.NVIDIA)
    nvidia = simulate(one_gpu, pods, by_name)
    ours = simulate(one_gpu, pods, DraOrder(Order.GPUPART))
    assert [name for name, _ in nvidia.waits] == ["small"]
    assert [name for name, _ in ours.waits] == ["large", "small"]
    # the GPU had room for a 4g, only not at slot 0: the order within the GPU missed it
    assert by_name.refused == {"large": ("4g.40gb", Refusal.PLACEMENT)}


def test_both_policies_are_registered_and_run_by_name() -> None:
    assert {"dra_nvidia_order", "dra_gpupart_order"} <= set(POLICY_NAMES)
    pods = [SimPod("a", ("3g.40gb",), 0.0, 10.0)]
    for name in ("dra_nvidia_order", "dra_gpupart_order"):
        result, note = run_policy(name, [SimNode("node-0", H100, 1)], pods)
        assert result.policy == name and result.served == 1 and note == ""


def test_the_cli_accepts_the_dra_policies_and_prints_them(capsys) -> None:  # type: ignore[no-untyped-def]
    argv = ["simulate", "--mig", "--dynamic", "--max-pods", "20"]
    assert main([*argv, "--policy", "dra_nvidia_order,dra_gpupart_order", "--json"]) == 0
    data = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert set(data["policies"]) == {"dra_nvidia_order", "dra_gpupart_order"}
    assert main([*argv, "--policy", "dra_gpupart_order"]) == 0
    assert "\ndra_gpupart_order " in capsys.readouterr().out


def test_with_no_patience_a_pod_that_does_not_fit_at_arrival_is_given_up() -> None:
    one_gpu = [SimNode("node-0", H100, 1)]
    pods = [
        SimPod("first", ("7g.80gb",), 0.0, 50.0),
        SimPod("second", ("7g.80gb",), 10.0, 50.0),
    ]
    waiting = simulate(one_gpu, pods, DraOrder(Order.GPUPART))
    lost = simulate(one_gpu, pods, DraOrder(Order.GPUPART, patience_s=0.0))
    assert [name for name, _ in waiting.waits] == ["first", "second"]
    assert [name for name, _ in lost.waits] == ["first"]


def test_w4_mixes_every_size_at_the_asked_load() -> None:
    pods = w4_mixed_sizes(seed=3, gpus=8, arrivals=2000)
    assert len(pods) == 2000
    assert {p.profiles for p in pods} == {(p,) for p in PROFILES}
    mean_rate = len(pods) / pods[-1].arrival
    # 8 GPUs x 8 slices at load 1, mean run 600 s, mean slices 2.95: about 0.036 pods/s
    assert 0.03 < mean_rate < 0.038


def at(profile: str, start: int) -> MigInstance:
    return MigInstance(Placement(start, H100.require_profile(profile).memory_slices), profile)


def test_a_refusal_says_whether_a_gpu_an_order_across_gpus_or_nothing_could_have_helped() -> None:
    # slot 0 taken, 6 compute and 7 memory slices free: a 4g fits there in count, not in place
    assert refusal_cause(H100, [[at("1g.10gb", 0)]], "4g.40gb") is Refusal.PLACEMENT
    # two GPUs with 3 compute slices free each: 6 in all, but no GPU has the 4g's 4
    two = [[at("4g.40gb", 0)], [at("4g.40gb", 0)]]
    assert refusal_cause(H100, two, "4g.40gb") is Refusal.SPREAD
    # a full GPU, and a second one with a 3g's room only: no order makes a 7g fit
    assert refusal_cause(H100, [[at("7g.80gb", 0)], [at("4g.40gb", 0)]], "7g.80gb") is Refusal.FULL
    # seven 1g take every compute slice: a memory slice is left, but no 1g can be added
    seven = [[at("1g.10gb", s) for s in range(7)]]
    assert refusal_cause(H100, seven, "1g.10gb") is Refusal.FULL
