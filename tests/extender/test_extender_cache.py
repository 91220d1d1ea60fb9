"""The watch cache fed with events: node inventory and allocatable CPU, pods holding GPUs and
CPU, relists, assumed pods, and live scoring from what the cache saw."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from extender_objects import FakeBinder

from gpupart.core.api.resources import GpuRequest
from gpupart.core.api.wire import PodAssignment
from gpupart.core.scheduling.shares import fragmentation_model_of
from gpupart.core.scheduling.views import PlacedPod, Tenant
from gpupart_extender.cache import NAMESPACE, NODE, PDB, POD, ClusterCache
from gpupart_extender.metrics import Metrics
from gpupart_extender.objects import PodEntry, uid_of
from gpupart_extender.service import ExtenderService
from gpupart_extender.settings import ExtenderSettings
from gpupart_testsupport.objects import keys, namespace, node, pod, shared, shared_gpu


def test_events_build_node_views_with_versions() -> None:
    c = ClusterCache(keys=keys)
    c.apply(NODE, "ADDED", node("n1", [shared_gpu(0, memory=1000)]))
    v1 = c.snapshot.view("n1")
    assert v1 is not None and v1.gpus[0].memory_mib == 1000 and not v1.problem
    # A Node update that does not touch the inventory keeps the view (and the memo) valid.
    c.apply(NODE, "MODIFIED", node("n1", [shared_gpu(0, memory=1000)]))
    assert c.snapshot.view("n1") is v1
    c.apply(NODE, "MODIFIED", node("n1", [shared_gpu(0, memory=1200)]))  # read again
    bigger = c.snapshot.view("n1")
    assert bigger is not None and bigger.gpus[0].memory_mib == 1200
    c.apply(NODE, "MODIFIED", node("n1", [shared_gpu(0, memory=1000)]))
    v1 = c.snapshot.view("n1")
    assert v1 is not None and v1.gpus[0].memory_mib == 1000
    placed = pod("a", shared(400), node="n1", assignment=PodAssignment("n1", 0, "GPU-0000", 400))
    c.apply(POD, "ADDED", placed)
    v2 = c.snapshot.view("n1")
    assert v2 is not None and v2.version > v1.version and v2.gpus[0].used_memory_mib == 400
    placed["status"]["phase"] = "Succeeded"
    c.apply(POD, "MODIFIED", placed)
    v3 = c.snapshot.view("n1")
    assert v3 is not None and v3.gpus[0].used_memory_mib == 0
    c.apply(NODE, "DELETED", node("n1", None))
    assert c.snapshot.view("n1") is None


def test_pending_pods_hold_nothing_and_pods_without_gpus_hold_only_cpu() -> None:
    c = ClusterCache(keys=keys)
    c.apply(NODE, "ADDED", node("n1", [shared_gpu(0)], cpu="8"))
    c.apply(POD, "ADDED", pod("pending", {**shared(100), "cpu": "2"}))
    c.apply(POD, "ADDED", pod("none", {}, node="n1"))
    c.apply(POD, "ADDED", pod("cpu", {"cpu": "1"}, node="n1"))
    c.apply(POD, "ADDED", pod("broken", {"nvidia.com/gpu": "lots", "cpu": "250m"}, node="n1"))
    c.apply(POD, "BOOKMARK", {"metadata": {"resourceVersion": "9"}})
    assert c.snapshot.counts()["pods"] == 1  # "cpu"; "broken" is skipped and listed as unreadable
    assert [(u.kind, u.name) for u in c.snapshot.unreadable] == [(POD, "team-a/broken")]
    view = c.snapshot.view("n1")
    assert view is not None and view.cpu_milli == 8000 and view.cpu_used_milli == 1000
    assert not view.gpus[0].tenants and not view.unplaced_tenants and not view.whole_tenants
    assert c.snapshot.mix == Counter()


def test_cpu_is_part_of_the_node_state_and_of_the_mix() -> None:
    c = ClusterCache(keys=keys)
    c.replace(NODE, [node("n1", [shared_gpu(0)], cpu="16"), node("n2", [shared_gpu(0)], cpu="16")])
    c.replace(POD, [])
    assert c.snapshot.signatures["n1"][1] == c.snapshot.signatures["n2"][1]
    c.apply(POD, "ADDED", pod("batch", {"cpu": "3500m"}, node="n1"))
    assert (
        c.snapshot.signatures["n1"][1] != c.snapshot.signatures["n2"][1]
    )  # CPU use alone tells them apart
    c.apply(POD, "ADDED", pod("batch", {"cpu": "3500m"}, node="n2", namespace="team-b"))
    assert c.snapshot.signatures["n1"][1] == c.snapshot.signatures["n2"][1]
    # A GPU pod's CPU request is in its mix shape: (GPU count, milli per GPU, CPU).
    a = PodAssignment("n1", 0, "GPU-0000", 0)
    c.apply(POD, "ADDED", pod("gpu", {"nvidia.com/gpu": 1, "cpu": "4"}, node="n1"))
    c.apply(POD, "ADDED", pod("mps", {**shared(compute=50), "cpu": "2"}, node="n1", assignment=a))
    assert c.snapshot.mix == Counter({(1, 1000, 4000): 1, (1, 500, 2000): 1})
    view = c.snapshot.view("n1")
    assert view is not None and view.cpu_used_milli == 3500 + 4000 + 2000
    # An allocatable change is a node change; a Node without allocatable CPU says None.
    before = c.snapshot.signatures["n2"]
    c.apply(NODE, "MODIFIED", node("n2", [shared_gpu(0)], cpu="32"))
    assert c.snapshot.signatures["n2"] is not before and c.snapshot.view("n2").cpu_milli == 32000  # type: ignore[union-attr]
    c.apply(NODE, "MODIFIED", node("n2", [shared_gpu(0)]))
    assert c.snapshot.view("n2").cpu_milli is None  # type: ignore[union-attr]


def test_bad_inventory_is_a_problem_not_a_crash() -> None:
    c = ClusterCache(keys=keys)
    bad = node("n1", None)
    bad["metadata"]["annotations"]["gpupart.io/inventory"] = '{"version":"v9"}'
    c.apply(NODE, "ADDED", bad)
    view = c.snapshot.view("n1")
    assert view is not None and "GPU inventory unreadable" in view.problem and "v9" in view.problem


def test_relist_drops_what_is_gone() -> None:
    c = ClusterCache(keys=keys)
    c.replace(NODE, [node("n1", [shared_gpu(0)]), node("n2", [shared_gpu(0)])])
    c.replace(POD, [pod("a", shared(10), node="n1"), pod("b", shared(10), node="n2")])
    assert not all(c.synced.values()), "not before the Namespaces are listed too"
    c.replace(NAMESPACE, [namespace("team-a"), namespace("team-b")])
    assert all(c.synced.values()) and c.snapshot.counts() == {
        "nodes": 2,
        "pods": 2,
        "assumed": 0,
        "nominated": 0,
        "budgets": 0,
        "namespaces": 2,
    }
    c.replace(NODE, [node("n1", [shared_gpu(0)])])
    c.replace(POD, [pod("a", shared(10), node="n1")])
    c.replace(NAMESPACE, [namespace("team-a")])
    assert c.snapshot.node_names() == ["n1"] and c.snapshot.counts()["pods"] == 1
    assert list(c.snapshot.namespaces) == ["team-a"]


def test_assumed_pod_counts_until_the_watch_confirms_it() -> None:
    c = ClusterCache(keys=keys)
    c.apply(NODE, "ADDED", node("n1", [shared_gpu(0, memory=1000)]))
    request = GpuRequest(shared=1, memory_mib=600)
    assignment = PodAssignment("n1", 0, "GPU-0000", 600)
    entry = PodEntry(
        "uid-team-a-a",
        "team-a/a",
        "n1",
        PlacedPod(Tenant("team-a/a", "team-a", memory_mib=600), request, assignment),
    )
    c.assume(entry, expires=10.0)
    assert c.snapshot.view("n1").gpus[0].used_memory_mib == 600  # type: ignore[union-attr]
    c.apply(POD, "ADDED", pod("a", shared(600), node="n1", assignment=assignment))
    assert c.snapshot.counts()["assumed"] == 0
    assert c.snapshot.view("n1").gpus[0].used_memory_mib == 600  # type: ignore[union-attr]  # counted once
    c.assume(PodEntry("uid-x", "team-a/x", "n1", entry.placed), expires=10.0)
    assert c.expire(9.0) == 0 and c.expire(10.0) == 1


def test_live_scoring_avoids_the_node_whose_cpu_is_drained() -> None:
    """Watched objects only: allocatable CPU from the Nodes, CPU requests from every bound pod,
    the mix (and its CPU per GPU share) from the bound GPU pods."""
    gpus = [shared_gpu(0, memory=40000), shared_gpu(1, memory=40000)]
    c = ClusterCache(keys=keys)
    c.replace(NODE, [node(n, gpus, cpu="64") for n in ("ref", "roomy", "drained")])
    c.replace(
        POD,
        [
            # The mix: half a GPU with 4 cores, i.e. 8 cores per GPU.
            *(
                pod(
                    f"infer-{g}",
                    {**shared(20000), "cpu": "4"},
                    node="ref",
                    assignment=PodAssignment("ref", g, f"GPU-{g:04d}", 20000),
                )
                for g in (0, 1)
            ),
            pod("batch", {"cpu": "36"}, node="drained"),
        ],
    )
    assert c.snapshot.mix == Counter({(1, 500, 4000): 2})
    assert fragmentation_model_of(c.snapshot.mix).cpu_per_gpu == 8.0
    binder = FakeBinder()
    service = ExtenderService(
        c, ExtenderSettings().scoring(), keys=keys, binder=binder, metrics=Metrics()
    )
    hungry = binder.live(pod("new", {**shared(10000), "cpu": "24"}))
    scores = dict(service.prioritize(hungry, ["roomy", "drained"]))
    assert scores["roomy"] > scores["drained"]
    # A pod asking little CPU strands nothing on either node: they score alike.
    light = pod("light", {**shared(10000), "cpu": "1"})
    scores = dict(service.prioritize(light, ["roomy", "drained"]))
    assert scores["roomy"] == scores["drained"]
    # Bound by us, the pod's CPU counts on the node before the watch shows it.
    assert service.filter(hungry, ["roomy"]).passed == ["roomy"]
    assert service.bind("team-a", "new", "uid-team-a-new", "roomy") == ""
    assert c.snapshot.view("roomy").cpu_used_milli == 24000  # type: ignore[union-attr]


def test_a_published_snapshot_never_changes_whatever_the_writer_does_next() -> None:
    """Requests read a snapshot without a lock: everything it maps must stay as published
    while the writer goes on (nodes added, changed and deleted, pods, nominations, proposals,
    budgets, namespaces, a relist)."""
    c = ClusterCache(keys=keys)
    c.replace(NODE, [node("n1", [shared_gpu(0)]), node("n2", [shared_gpu(0)])])
    on_gpu = PodAssignment("n1", 0, "GPU-0000", 10)
    c.replace(POD, [pod("a", shared(10), node="n1", assignment=on_gpu)])
    c.replace(PDB, [])
    c.replace(NAMESPACE, [namespace("team-a")])
    old = c.snapshot
    assert old.mix, "a bound GPU pod is in the policy's mix"

    def contents(s: Any) -> tuple[Any, ...]:
        return (
            dict(s.nodes), dict(s.signatures), dict(s.nominations),
            {k: dict(v) for k, v in s.proposals.items()}, s.budgets,
            {k: dict(v) for k, v in s.namespaces.items()}, dict(s.mix), s.clock,
            list(s.log[: s.clock - s.log_start]), s.unreadable, s.counts(), dict(s.reserved),
        )  # fmt: skip

    published = contents(old)
    nominated = pod("p", shared(20), labels={"app": "x"})
    nominated["status"]["nominatedNodeName"] = "n2"
    b = pod("b", shared(10), node="n1", assignment=replace(on_gpu, memory_mib=10))
    changes: list[Callable[[], None]] = [
        lambda: c.apply(POD, "ADDED", b),
        lambda: c.apply(NODE, "ADDED", node("n3", [shared_gpu(0), shared_gpu(1)])),
        lambda: c.apply(NODE, "MODIFIED", node("n1", [shared_gpu(0), shared_gpu(1)])),
        lambda: c.apply(NODE, "DELETED", node("n2", None)),
        lambda: c.apply(POD, "ADDED", nominated),
        lambda: c.propose(uid_of(nominated), "n3", 1, [], expires=2e9),
        lambda: c.apply(PDB, "ADDED", {"metadata": {"name": "b", "namespace": "team-a"}}),
        lambda: c.apply(NAMESPACE, "MODIFIED", namespace("team-a", {"tier": "gold"})),
        lambda: c.apply(NAMESPACE, "ADDED", {"metadata": {"name": "bad", "labels": {"-": "x"}}}),
        lambda: c.replace(POD, []),
    ]
    for n, change in enumerate(changes):
        before = contents(c.snapshot)
        change()
        assert contents(c.snapshot) != before, f"change {n} changed nothing"
        assert contents(old) == published, f"change {n} changed a published snapshot"
