"""The watch cache fed with events: node inventory, pods holding GPUs, relists, assumed pods."""

from __future__ import annotations

from extender_objects import node, pod, shared, shared_gpu

from gpupart.core.resources import GpuRequest
from gpupart.core.scheduling import PlacedPod, Tenant
from gpupart.core.wire import PodAssignment
from gpupart_extender.cache import NODE, POD, ClusterCache, PodEntry


def test_events_build_node_views_with_versions() -> None:
    c = ClusterCache()
    c.apply(NODE, "ADDED", node("n1", [shared_gpu(0, memory=1000)]))
    v1 = c.view("n1")
    assert v1 is not None and v1.gpus[0].memory_mib == 1000 and not v1.problem
    # A Node update that does not touch the inventory keeps the view (and the memo) valid.
    c.apply(NODE, "MODIFIED", node("n1", [shared_gpu(0, memory=1000)]))
    assert c.view("n1") is v1
    placed = pod("a", shared(400), node="n1", assignment=PodAssignment("n1", 0, "GPU-0000", 400))
    c.apply(POD, "ADDED", placed)
    v2 = c.view("n1")
    assert v2 is not None and v2.version > v1.version and v2.gpus[0].used_memory_mib == 400
    placed["status"]["phase"] = "Succeeded"
    c.apply(POD, "MODIFIED", placed)
    v3 = c.view("n1")
    assert v3 is not None and v3.gpus[0].used_memory_mib == 0
    c.apply(NODE, "DELETED", node("n1", None))
    assert c.view("n1") is None


def test_pending_pods_and_pods_without_gpus_hold_nothing() -> None:
    c = ClusterCache()
    c.apply(NODE, "ADDED", node("n1", [shared_gpu(0)]))
    c.apply(POD, "ADDED", pod("pending", shared(100)))
    c.apply(POD, "ADDED", pod("cpu", {"cpu": "1"}, node="n1"))
    c.apply(POD, "ADDED", pod("broken", {"nvidia.com/gpu": "lots"}, node="n1"))
    c.apply(POD, "BOOKMARK", {"metadata": {"resourceVersion": "9"}})
    assert c.counts()["pods"] == 0


def test_bad_inventory_is_a_problem_not_a_crash() -> None:
    c = ClusterCache()
    bad = node("n1", None)
    bad["metadata"]["annotations"]["gpupart.io/inventory"] = '{"version":"v9"}'
    c.apply(NODE, "ADDED", bad)
    view = c.view("n1")
    assert view is not None and "GPU inventory unreadable" in view.problem and "v9" in view.problem


def test_relist_drops_what_is_gone() -> None:
    c = ClusterCache()
    c.replace(NODE, [node("n1", [shared_gpu(0)]), node("n2", [shared_gpu(0)])])
    c.replace(POD, [pod("a", shared(10), node="n1"), pod("b", shared(10), node="n2")])
    assert c.ready and c.counts() == {"nodes": 2, "pods": 2, "assumed": 0}
    c.replace(NODE, [node("n1", [shared_gpu(0)])])
    c.replace(POD, [pod("a", shared(10), node="n1")])
    assert c.node_names() == ["n1"] and c.counts()["pods"] == 1


def test_assumed_pod_counts_until_the_watch_confirms_it() -> None:
    c = ClusterCache()
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
    assert c.view("n1").gpus[0].used_memory_mib == 600  # type: ignore[union-attr]
    c.apply(POD, "ADDED", pod("a", shared(600), node="n1", assignment=assignment))
    assert c.counts()["assumed"] == 0
    assert c.view("n1").gpus[0].used_memory_mib == 600  # type: ignore[union-attr]  # counted once
    c.assume(PodEntry("uid-x", "team-a/x", "n1", entry.placed), expires=10.0)
    assert c.expire(9.0) == 0 and c.expire(10.0) == 1
