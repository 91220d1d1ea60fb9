"""Dynamic MIG simulator: accounting on hand-made workloads with known answers, and each baseline's
defining behaviour (so that the comparison is honest)."""

import pytest

from gpupart.core.mig.catalogue import require_gpu_model
from gpupart.core.mig.layout import MigInstance, Placement
from gpupart.core.mig.planning import DestroyComputeInstance, DestroyGpuInstance
from gpupart.sim.dynamic.policies import (
    Nos,
    Ours,
    PerPod,
    Static,
    geometries,
    run_policy,
)
from gpupart.sim.dynamic.simulation import (
    Change,
    Decision,
    Latencies,
    SimNode,
    SimPod,
    simulate,
)
from gpupart.sim.dynamic.workloads import from_trace, profile_for_share
from gpupart.sim.trace import Pod

A100 = require_gpu_model("A100-SXM4-80GB")
ONE_GPU = [SimNode("node-0", A100, 1)]
LAT = Latencies(create=1.0, destroy=0.5, advertise=0.2, plugin_restart=60.0)


def test_accounting_of_allocation_bind_time_and_operations():
    pods = [SimPod("a", ("7g.80gb",), 0.0, 25.0), SimPod("b", ("7g.80gb",), 100.0, 10.0)]
    ours = simulate(ONE_GPU, pods, Ours(), latencies=LAT)
    # a waits for create + advertise; b reuses the idle instance a left
    assert ours.bind_s == (0.0, pytest.approx(1.2))
    assert ours.operations == 1 and ours.served == 2 and ours.disruptions == 0
    # window [0, 100]: a holds all 8 memory slices from 1.2 to 26.2
    assert ours.allocation == pytest.approx(25.0)
    static = simulate(ONE_GPU, pods, Static((("7g.80gb", 1),)), latencies=LAT)
    assert static.bind_s == (0.0, 0.0) and static.operations == 0
    assert static.allocation == pytest.approx(25.0)
    assert static.percentile(50) == 0.0 and static.percentile(99) == 0.0


def test_a_pod_that_never_fits_is_not_served_and_waits_are_queued():
    pods = [
        SimPod("first", ("7g.80gb",), 0.0, 50.0),
        SimPod("second", ("7g.80gb",), 1.0, 50.0),
        SimPod("nowhere", ("7g.80gb", "7g.80gb"), 2.0, 5.0),
    ]
    result = simulate(ONE_GPU, pods, Static((("7g.80gb", 1),)), latencies=LAT)
    assert result.served == 2
    assert result.bind_s == (0.0, 49.0)  # second binds when first leaves at 50


def test_hami_creates_per_pod_at_its_fixed_placement_order_and_destroys_on_exit():
    pods = [SimPod("small", ("1g.10gb",), 0.0, 10.0), SimPod("mid", ("3g.40gb",), 0.0, 10.0)]
    hami = PerPod("hami")
    seen = []

    class Watch(PerPod):
        def decide(self, cluster, now):
            decision = hami.decide(cluster, now)
            seen.extend(i for c in decision.changes for _, i in c.reservations)
            return decision

    result = simulate(ONE_GPU, pods, Watch("hami"), latencies=LAT)
    # 3g from the highest start first (slot 4), then 1g from the highest free start (slot 3)
    assert set(seen) == {
        MigInstance(Placement(4, 4), "3g.40gb"),
        MigInstance(Placement(3, 1), "1g.10gb"),
    }
    assert result.operations == 4  # two creates, two destroys on exit


def test_hami_takes_the_smallest_profile_whose_memory_covers_the_request():
    hami = PerPod("hami")
    assert hami._choose(A100, [], "1g.10gb") == MigInstance(Placement(6, 1), "1g.10gb")
    # 2g.20gb's memory: 1g.20gb has it but too little compute, so 2g.20gb from the lowest start
    assert hami._choose(A100, [], "2g.20gb") == MigInstance(Placement(0, 2), "2g.20gb")


def test_first_fit_takes_the_first_free_placement_in_device_order():
    first = PerPod("first_fit")
    assert first._choose(A100, [], "1g.10gb") == MigInstance(Placement(0, 1), "1g.10gb")
    taken = [MigInstance(Placement(0, 1), "1g.10gb")]
    assert first._choose(A100, taken, "3g.40gb") == MigInstance(Placement(4, 4), "3g.40gb")


def test_nos_batches_restarts_the_plugin_and_plans_counts_only():
    pods = [SimPod("p", ("1g.10gb",), 0.0, 30.0)]
    result = simulate(ONE_GPU, pods, Nos(LAT.plugin_restart), latencies=LAT)
    # idle window 10 s; the initial 7g (fewest slices) is free, so destroyed; then the geometry
    # with the most 1g (7 of them, no placements asked) is created; then the plugin restarts
    assert result.bind_s == (pytest.approx(10 + 0.5 + 7 * 1.0 + 0.2 + 60),)
    assert result.operations == 1 + 7
    assert all(isinstance(g, tuple) for g in geometries(A100))
    assert (("1g.10gb", 7),) in geometries(A100)


def test_nos_keeps_one_plan_in_flight_cluster_wide():
    nodes = [SimNode("node-0", A100, 1), SimNode("node-1", A100, 1)]
    pods = [SimPod("a", ("3g.40gb",), 0.0, 500.0), SimPod("b", ("3g.40gb",), 0.0, 500.0)]
    pods += [SimPod("c", ("1g.10gb",), 15.0, 500.0)]
    result = simulate(nodes, pods, Nos(LAT.plugin_restart), latencies=LAT)
    assert result.served == 3
    # c arrives while the first plan is in flight: it waits for that plan, then its own batch
    assert max(result.bind_s) > 2 * LAT.plugin_restart


def test_ours_reuses_idle_instances_and_never_disrupts():
    pods = [SimPod(f"p{k}", ("1g.10gb",), 10.0 * k, 5.0) for k in range(6)]
    result = simulate(ONE_GPU, pods, Ours(), latencies=LAT)
    assert result.operations == 1 and result.disruptions == 0 and result.served == 6


def test_the_engine_counts_a_destroyed_instance_in_use_as_a_disruption():
    class Destroyer(Static):
        def decide(self, cluster, _now):
            for key, gpu in cluster.gpus.items():
                for instance, state in gpu.items():
                    if state.bound:
                        steps = (
                            DestroyComputeInstance(key[1], instance),
                            DestroyGpuInstance(key[1], instance),
                        )
                        return Decision((Change(key, steps),))
            return Decision()

    pods = [SimPod("victim", ("7g.80gb",), 0.0, 100.0), SimPod("next", ("7g.80gb",), 1.0, 5.0)]
    result = simulate(ONE_GPU, pods, Destroyer((("7g.80gb", 1),)), latencies=LAT)
    assert result.disruptions == 1


def test_static_best_picks_the_layout_serving_most_with_hindsight():
    pods = [SimPod(f"p{k}", ("3g.40gb",), float(k), 100.0) for k in range(2)]
    result, note = run_policy("static_best", ONE_GPU, pods, latencies=LAT)
    assert result.served == 2 and "2 x 3g.40gb" in note


def test_trace_pods_map_to_the_smallest_covering_profile():
    assert [profile_for_share(m) for m in (100, 125, 200, 460, 571, 600)] == [
        "1g.10gb",
        "1g.10gb",
        "2g.20gb",
        "3g.40gb",
        "4g.40gb",
        "7g.80gb",
    ]
    pods = [
        Pod("b", 1, 1, 2, 1000, qos="BE", creation_time=50, deletion_time=80),
        Pod("a", 1, 1, 1, 460, qos="LS", creation_time=10, deletion_time=20),
        Pod("cpu", 1, 1, 0, 0, creation_time=0, deletion_time=5),
    ]
    mapped = from_trace(pods)
    assert [(p.name, p.profiles, p.arrival, p.duration, p.priority) for p in mapped] == [
        ("a", ("3g.40gb",), 0.0, 10.0, 2),
        ("b", ("7g.80gb", "7g.80gb"), 40.0, 30.0, 0),
    ]
