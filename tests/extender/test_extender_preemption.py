"""Preemption in the extender: the preempt verb over HTTP, PodDisruptionBudgets in the cache, and
the reservation a nominated pod holds.

Covers: both wire forms with upstream's golden JSON, multi-container pods, MIG victims checked
for a free MIG device, nodes dropped, and a nominated pod's reservation (others kept out, the
pod itself let in, dropped at bind or when the nomination clears). The victim selection itself
is the core's (tests/core/test_preemption.py).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from extender_objects import FakeBinder
from fastapi.testclient import TestClient

from gpupart.core.api.wire import PodAssignment
from gpupart.core.scheduling.terms import ScoringConfig
from gpupart_extender.app import create_app
from gpupart_extender.cache import NODE, PDB, POD, ClusterCache
from gpupart_extender.metrics import Metrics
from gpupart_extender.models import ExtenderPreemptionArgs
from gpupart_extender.preemption import NodeVictims
from gpupart_extender.service import ExtenderService
from gpupart_extender.settings import ExtenderSettings
from gpupart_testsupport.objects import keys, mig_gpu, node, pod, shared_gpu

MPS = {"nvidia.com/gpu.shared": 1, "gpupart.io/gpu-memory": 20000}


def _cluster() -> ClusterCache:
    """n1: GPU 0 two priority-0 pods, GPU 1 a priority-1000 and a priority-0 pod; n2: the same
    with priority 500 on GPU 0 (so n1's GPU 0 is the cheaper); n-mig: one 3g.40gb slice, held."""
    cache = ClusterCache(keys=keys)
    cache.replace(
        NODE,
        [
            node("n1", [shared_gpu(0, memory=40000), shared_gpu(1, memory=40000)]),
            node("n2", [shared_gpu(0, memory=40000), shared_gpu(1, memory=40000)]),
            node("n-mig", [mig_gpu(0, [("3g.40gb", 0, 4)])]),
        ],
    )
    placed = {
        "a": ("n1", 0, 0), "b": ("n1", 0, 0), "c": ("n1", 1, 1000), "d": ("n1", 1, 0),
        "e": ("n2", 0, 500), "f": ("n2", 0, 0), "g": ("n2", 1, 2000), "h": ("n2", 1, 0),
    }  # fmt: skip
    pods = [
        pod(n, MPS, node=where, priority=prio, labels={"app": n},
            assignment=PodAssignment(where, g, f"GPU-{g:04d}", 20000))
        for n, (where, g, prio) in placed.items()
    ]  # fmt: skip
    pods.append(pod("train", {"nvidia.com/mig-3g.40gb": 1}, node="n-mig", priority=0))
    pods.append(pod("cpu-only", {"cpu": "2"}, node="n1", priority=0))
    cache.replace(POD, pods)
    cache.replace(PDB, [])
    return cache


@pytest.fixture
def preempting() -> tuple[TestClient, ExtenderService]:
    settings_ = ExtenderSettings()
    service = ExtenderService(
        _cluster(),
        settings_.scoring(),
        keys=keys,
        binder=FakeBinder(),
        metrics=Metrics(),
        ttl_seconds=30,
    )
    return TestClient(create_app(settings_, service)), service


def uid(name: str) -> str:
    return f"uid-team-a-{name}"


def _meta(victims: dict[str, list[str]]) -> dict[str, Any]:
    return {
        n: {"Pods": [{"UID": uid(v)} for v in vs], "NumPDBViolations": 0}
        for n, vs in victims.items()
    }


def test_preempt_keeps_the_victims_on_one_gpu_and_drops_what_frees_nothing(
    preempting: tuple[TestClient, ExtenderService],
) -> None:
    client, service = preempting
    high = pod("infer", {"nvidia.com/gpu.shared": 1, "gpupart.io/gpu-memory": 40000}, priority=1000)
    # kube-scheduler's dry run picked one slot's worth of victims on each node, on GPU 1 of n1
    # (which frees no room: its other pod has priority 1000) and a CPU-only pod it needed.
    body = {"Pod": high, "NodeNameToMetaVictims": _meta({"n1": ["d", "cpu-only"], "n2": ["h"]})}
    reply = client.post("/gpupart/preempt", json=body)
    assert reply.status_code == 200, reply.text
    result = reply.json()["NodeNameToMetaVictims"]
    assert result == {
        "n1": {
            "Pods": [{"UID": uid("a")}, {"UID": uid("b")}, {"UID": uid("cpu-only")}],
            "NumPDBViolations": 0,
        },
        "n2": {"Pods": [{"UID": uid("e")}, {"UID": uid("f")}], "NumPDBViolations": 0},
    }
    text = client.get("/metrics").text
    assert "gpupart_extender_preemption_requests_total 1.0" in text
    assert "gpupart_extender_preemption_victims_total 5.0" in text
    # More than a GPU holds: every node dropped, nothing evicted.
    body["Pod"] = pod(
        "huge", {"nvidia.com/gpu.shared": 1, "gpupart.io/gpu-memory": 50000}, priority=1000
    )
    assert client.post("/gpupart/preempt", json=body).json() == {"NodeNameToMetaVictims": {}}
    assert "gpupart_extender_preemption_nodes_dropped_total 2.0" in client.get("/metrics").text


def test_preempt_full_victims_form_and_upstream_golden_json(
    preempting: tuple[TestClient, ExtenderService],
) -> None:
    client, service = preempting
    # kubernetes/kube-scheduler extender/v1 types_test.go (TestCompatibility), args and result.
    golden_args = (
        '{"Pod":{"metadata":{"name":"podname","creationTimestamp":null},"spec":{"containers":null},"status":{}},'
        '"NodeNameToVictims":{"foo":{"Pods":[{"metadata":{"name":"podname","creationTimestamp":null},'
        '"spec":{"containers":null},"status":{}}],"NumPDBViolations":1}},'
        '"NodeNameToMetaVictims":{"foo":{"Pods":[{"UID":"myuid"}],"NumPDBViolations":1}}}'
    )
    args = ExtenderPreemptionArgs.model_validate_json(golden_args)
    assert args.NodeNameToMetaVictims is not None and args.NodeNameToVictims is not None
    assert args.NodeNameToMetaVictims["foo"].Pods[0].UID == "myuid"  # type: ignore[union-attr,index]
    assert args.NodeNameToVictims["foo"].NumPDBViolations == 1  # type: ignore[union-attr]
    # Not a GPU pod: the extender has nothing to check and passes the victims through.
    reply = client.post("/gpupart/preempt", content=golden_args)
    assert (
        reply.text
        == '{"NodeNameToMetaVictims": {"foo": {"Pods": [{"UID": "myuid"}], "NumPDBViolations": 1}}}'
    )
    assert json.loads(reply.text) == json.loads(
        '{"NodeNameToMetaVictims":{"foo":{"Pods":[{"UID":"myuid"}],"NumPDBViolations":1}}}'
    )
    # nodeCacheCapable false: full Pods in, UIDs out; a PDB counted.
    service.cache.replace(
        PDB,
        [{"metadata": {"name": "keep", "namespace": "team-a"},
          "spec": {"selector": {"matchLabels": {"app": "a"}}}, "status": {"disruptionsAllowed": 0}}],
    )  # fmt: skip
    high = pod("infer", {"nvidia.com/gpu.shared": 1, "gpupart.io/gpu-memory": 40000}, priority=1000)
    full = {
        "Pod": high,
        "NodeNameToVictims": {
            "n1": {"Pods": [pod("d", MPS, node="n1", priority=0)], "NumPDBViolations": 0}
        },
    }
    result = client.post("/gpupart/preempt", json=full).json()["NodeNameToMetaVictims"]
    assert result == {"n1": {"Pods": [{"UID": uid("a")}, {"UID": uid("b")}], "NumPDBViolations": 1}}


def test_mig_victims_are_checked_for_a_free_slice(
    preempting: tuple[TestClient, ExtenderService],
) -> None:
    client, _ = preempting
    mig = pod("mig", {"nvidia.com/mig-3g.40gb": 1}, priority=1000)
    kept = client.post(
        "/gpupart/preempt", json={"Pod": mig, "NodeNameToMetaVictims": _meta({"n-mig": ["train"]})}
    )
    assert kept.json()["NodeNameToMetaVictims"] == _meta({"n-mig": ["train"]})
    wrong = client.post(
        "/gpupart/preempt",
        json={"Pod": mig, "NodeNameToMetaVictims": _meta({"n-mig": ["cpu-only"]})},
    )
    assert wrong.json() == {"NodeNameToMetaVictims": {}}


def test_preempt_refuses_a_pod_it_cannot_read(
    preempting: tuple[TestClient, ExtenderService],
) -> None:
    client, _ = preempting
    bad = pod("bad", {"nvidia.com/gpu.shared": 1, "gpupart.io/gpu-memory": "-5"})
    reply = client.post("/gpupart/preempt", json={"Pod": bad, "NodeNameToMetaVictims": {}})
    assert (
        reply.status_code == 400 and "invalid pod: Pod.spec.containers[0]" in reply.json()["Error"]
    )
    assert client.post("/gpupart/preempt", content=b"{").status_code == 400


def test_a_multi_container_pod_frees_all_its_containers_ask() -> None:
    cache = ClusterCache(keys=keys)
    cache.replace(NODE, [node("n", [shared_gpu(0, memory=40000, clients=3)])])
    two = pod("two", MPS, node="n", priority=0, assignment=PodAssignment("n", 0, "GPU-0000", 30000))
    two["spec"]["containers"].append(
        {
            "name": "side",
            "image": "x",
            "resources": {
                "limits": {"nvidia.com/gpu.shared": "1", "gpupart.io/gpu-memory": "10000"}
            },
        }
    )
    one = pod("one", {"nvidia.com/gpu.shared": 1, "gpupart.io/gpu-memory": 5000}, node="n", priority=0,
              assignment=PodAssignment("n", 0, "GPU-0000", 5000))  # fmt: skip
    cache.replace(POD, [two, one])
    service = ExtenderService(
        cache, ScoringConfig(reserve_fraction=0), keys=keys, binder=FakeBinder(), metrics=Metrics()
    )
    # 2 slots and 30000 MiB: only the two-container pod frees both at once.
    high = pod("infer", {"nvidia.com/gpu.shared": 2, "gpupart.io/gpu-memory": 30000}, priority=1000)
    kept = service.preempt(high, {"n": NodeVictims((uid("one"),), 0)})
    assert kept == {"n": NodeVictims((uid("two"),), 0)}


def test_a_nominated_pod_keeps_the_room_its_victims_freed() -> None:
    cache = _cluster()
    binder = FakeBinder()
    service = ExtenderService(
        cache, ScoringConfig(), keys=keys, binder=binder, metrics=Metrics(), ttl_seconds=30
    )
    high = pod("infer", {"nvidia.com/gpu.shared": 1, "gpupart.io/gpu-memory": 40000}, priority=1000)
    service.preempt(high, {"n1": NodeVictims((uid("d"),), 0)})
    # kube-scheduler evicts a and b, and nominates the pod to n1.
    for victim in ("a", "b"):
        cache.apply(POD, "DELETED", pod(victim, MPS, node="n1"))
    high["status"]["nominatedNodeName"] = "n1"
    cache.apply(POD, "MODIFIED", high)
    view = cache.snapshot.view("n1")
    assert view is not None
    assert [t.pod for t in view.gpus[0].tenants] == ["team-a/infer"]  # on the GPU preempt freed
    low = pod("batch", {"nvidia.com/gpu.shared": 1, "gpupart.io/gpu-memory": 30000}, priority=0)
    assert "n1" in service.filter(low, ["n1"]).failed  # kept out
    assert service.filter(high, ["n1"]).passed == ["n1"]  # the pod itself is let in
    binder.live(high)
    assert service.bind("team-a", "infer", uid("infer"), "n1") == ""
    assert cache.snapshot.nomination(uid("infer")) is None  # assumed (bound) now, not nominated
    view = cache.snapshot.view("n1")
    assert view is not None and [t.pod for t in view.gpus[0].tenants] == ["team-a/infer"]
    # A nomination cleared (e.g. a higher-priority pod took the node) frees the room.
    other = pod("other", {"nvidia.com/gpu.shared": 1, "gpupart.io/gpu-memory": 10000}, priority=500)
    other["status"]["nominatedNodeName"] = "n2"
    cache.apply(POD, "ADDED", other)
    assert cache.snapshot.nomination(uid("other")) is not None
    other["status"]["nominatedNodeName"] = ""
    cache.apply(POD, "MODIFIED", other)
    assert (
        cache.snapshot.nomination(uid("other")) is None
        and cache.snapshot.counts()["nominated"] == 0
    )


def test_an_unreadable_budget_is_listed_and_not_counted() -> None:
    cache = ClusterCache(keys=keys)
    cache.replace(
        PDB,
        [{"metadata": {"name": "bad", "namespace": "x"}, "spec": {"selector": {"matchLabels": 5}}}],
    )
    assert list(cache.snapshot.budgets) == [] and cache.snapshot.unreadable_counts()[PDB] == 1
    cache.apply(
        PDB, "MODIFIED", {"metadata": {"name": "bad", "namespace": "x"}, "spec": {}, "status": {}}
    )
    assert len(list(cache.snapshot.budgets)) == 1 and cache.snapshot.unreadable_counts()[PDB] == 0
    cache.apply(PDB, "DELETED", {"metadata": {"name": "bad", "namespace": "x"}})
    assert list(cache.snapshot.budgets) == []


def test_a_nominated_pod_holds_the_gpu_its_victims_free_not_the_first_one() -> None:
    """GPU 0 holds a pod above the preemptor's priority, so only GPU 1's pod can go: the
    reservation goes where that victim's own assignment says it ran, GPU 1."""
    cache = ClusterCache(keys=keys)
    cache.replace(NODE, [node("n", [shared_gpu(0, memory=40000), shared_gpu(1, memory=40000)])])
    top = pod("top", {**MPS, "gpupart.io/gpu-memory": 20000}, node="n", priority=2000,
              assignment=PodAssignment("n", 0, "GPU-0000", 20000))  # fmt: skip
    low = pod("low", {**MPS, "gpupart.io/gpu-memory": 40000}, node="n", priority=0,
              assignment=PodAssignment("n", 1, "GPU-0001", 40000))  # fmt: skip
    cache.replace(POD, [top, low])
    cache.replace(PDB, [])
    service = ExtenderService(
        cache, ScoringConfig(reserve_fraction=0), keys=keys, binder=FakeBinder(), metrics=Metrics()
    )
    high = pod("high", {**MPS, "gpupart.io/gpu-memory": 40000}, priority=1000)
    kept = service.preempt(high, {"n": NodeVictims((uid("top"), uid("low")), 0)})
    assert kept == {"n": NodeVictims((uid("low"),), 0)}
    cache.apply(POD, "DELETED", low)
    high["status"]["nominatedNodeName"] = "n"
    cache.apply(POD, "MODIFIED", high)
    held = cache.snapshot.nomination(uid("high"))
    assert held is not None and held.placed.assignment is not None
    assert (held.placed.assignment.gpu, held.placed.assignment.gpu_uuid) == (1, "GPU-0001")
    # GPU 0 has 20000 MiB free, GPU 1 is held: a 30000 MiB pod fits nowhere until high binds.
    other = pod("other", {**MPS, "gpupart.io/gpu-memory": 30000}, priority=0)
    assert "n" in service.filter(other, ["n"]).failed
    assert service.filter(pod("small", MPS, priority=0), ["n"]).passed == ["n"]  # on GPU 0


def test_bind_counts_the_victims_until_the_watch_shows_them_gone() -> None:
    """Filter lets a nominated pod in as if its victims were gone (kube-scheduler evicted
    them); bind must not: while a victim still holds its GPU, binding would over-commit it."""
    cache = ClusterCache(keys=keys)
    cache.replace(NODE, [node("n", [shared_gpu(0, memory=40000)])])
    low = pod("low", {**MPS, "gpupart.io/gpu-memory": 40000}, node="n", priority=0,
              assignment=PodAssignment("n", 0, "GPU-0000", 40000))  # fmt: skip
    cache.replace(POD, [low])
    cache.replace(PDB, [])
    binder = FakeBinder()
    service = ExtenderService(
        cache, ScoringConfig(reserve_fraction=0), keys=keys, binder=binder, metrics=Metrics()
    )
    high = pod("high", {**MPS, "gpupart.io/gpu-memory": 40000}, priority=1000)
    assert service.preempt(high, {"n": NodeVictims((uid("low"),), 0)}) == {
        "n": NodeVictims((uid("low"),), 0)
    }
    high["status"]["nominatedNodeName"] = "n"
    cache.apply(POD, "MODIFIED", high)
    assert service.filter(high, ["n"]).passed == ["n"]
    binder.live(high)
    refused = service.bind("team-a", "high", uid("high"), "n")
    assert refused.startswith("node changed since filter: "), refused
    assert binder.bindings == []
    cache.apply(POD, "DELETED", low)  # the victim is gone now
    assert service.bind("team-a", "high", uid("high"), "n") == ""
    assert binder.bindings == [("team-a", "high", uid("high"), "n")]


@pytest.mark.parametrize(("peer", "kept"), [(500, True), (1000, False), (2000, False)])
def test_a_nomination_of_lower_priority_gives_way_and_one_of_equal_or_higher_holds(
    peer: int, kept: bool
) -> None:
    """kube-scheduler clears the nominations of lower-priority pods on the node a pod preempts
    for; an equal or higher one keeps its room (20000 of the GPU's 40000 MiB here)."""
    cache = ClusterCache(keys=keys)
    cache.replace(NODE, [node("n", [shared_gpu(0, memory=40000)])])
    low = pod("low", MPS, node="n", priority=0,
              assignment=PodAssignment("n", 0, "GPU-0000", 20000))  # fmt: skip
    nominated = pod("peer", MPS, priority=peer)
    nominated["status"]["nominatedNodeName"] = "n"
    cache.replace(POD, [low, nominated])
    cache.replace(PDB, [])
    service = ExtenderService(
        cache, ScoringConfig(reserve_fraction=0), keys=keys, binder=FakeBinder(), metrics=Metrics()
    )
    high = pod("high", {**MPS, "gpupart.io/gpu-memory": 40000}, priority=1000)
    answer = service.preempt(high, {"n": NodeVictims((uid("low"),), 0)})
    assert answer == ({"n": NodeVictims((uid("low"),), 0)} if kept else {})
