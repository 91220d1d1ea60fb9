"""The poison corpus against the extender: as pods in the watch cache, and as request bodies.

Aspects: unreadable pods are skipped, listed (diagnose, metric) and logged once per
resourceVersion while every other pod still counts, so a pod that does not fit is still
refused; an unreadable Node fails with its reason; a watch that keeps failing against a real
(unreachable) API address turns /readyz false and back; absurd quantities and malformed bodies
in filter, prioritize, diagnose and bind get a 4xx or an Error naming the field, never a 5xx,
and `1e99999999` is refused by a bound (the error text says so).
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

import pytest
from extender_objects import FakeBinder, args
from fastapi.testclient import TestClient
from kubernetes import client as kube
from poison import ABSURD_QUANTITIES, HUGE, LONG

from gpupart.core.api.wire import INVENTORY_ANNOTATION, PodAssignment
from gpupart_extender.app import create_app
from gpupart_extender.cache import NAMESPACE, NODE, PDB, POD, ClusterCache
from gpupart_extender.kube import Watcher
from gpupart_extender.metrics import Metrics
from gpupart_extender.objects import read_pod
from gpupart_extender.service import ExtenderService
from gpupart_extender.settings import ExtenderSettings
from gpupart_testsupport.objects import keys, node, pod, shared, shared_gpu
from gpupart_testsupport.ports import free_port

GPU_MIB = 81920


def poison_pods() -> list[dict[str, Any]]:
    """Bound pods, each with one bad field; names say which."""
    pods = []
    for n, q in enumerate(ABSURD_QUANTITIES):
        pods.append(pod(f"memory-{n}", {**shared(), "gpupart.io/gpu-memory": q}, node="n1"))
        pods.append(pod(f"gpus-{n}", {"nvidia.com/gpu": q}, node="n1"))
        pods.append(pod(f"cpu-{n}", {"cpu": q}, node="n1"))
    odd = pod("odd-limits", {}, node="n1")
    odd["spec"]["containers"][0]["resources"] = {"limits": ["nvidia.com/gpu"]}
    pods.append(odd)
    pods.append(pod("long-profile", {f"nvidia.com/mig-1g.{HUGE}gb": 1}, node="n1"))
    wrong = pod("containers-a-map", {}, node="n1")
    wrong["spec"]["containers"] = {"main": {}}
    pods.append(wrong)
    return pods


def cache_with_poison() -> ClusterCache:
    cache = ClusterCache(keys=keys)
    cache.replace(NODE, [node("n1", [shared_gpu(0, memory=GPU_MIB)], cpu="64")])
    holder = pod(
        "holder",
        {**shared(50000), "cpu": "1"},
        node="n1",
        assignment=PodAssignment("n1", 0, "GPU-0000", 50000),
    )
    cache.replace(POD, [holder, *poison_pods()])
    cache.replace(NAMESPACE, [])
    return cache


def service_for(cache: ClusterCache) -> ExtenderService:
    settings = ExtenderSettings(url_prefix="/gpupart")
    return ExtenderService(
        cache, settings.scoring(), keys=keys, binder=FakeBinder(), metrics=Metrics()
    )


def test_poison_pods_are_skipped_and_listed_and_the_other_pods_still_count() -> None:
    cache = cache_with_poison()
    skipped = {u.name: u.problem for u in cache.snapshot.unreadable}
    # The three: each skipped, with the field and the bound that refused it.
    memory = "resources.limits.gpupart.io/gpu-memory"
    for q in ("1E", "1Ei", "1e99999999"):
        n = ABSURD_QUANTITIES.index(q)
        assert memory in skipped[f"team-a/memory-{n}"], skipped[f"team-a/memory-{n}"]
    assert (
        "more than a quantity can hold"
        in skipped[f"team-a/memory-{ABSURD_QUANTITIES.index('1e99999999')}"]
    )
    assert "team-a/odd-limits" in skipped and "team-a/long-profile" in skipped
    assert all(len(problem) <= 500 for problem in skipped.values())
    view = cache.snapshot.view("n1")
    assert view is not None and view.gpus[0].used_memory_mib == 50000, "the holder still counts"
    # Every pod is counted, or listed, or holds nothing: none vanished without a word.
    for p in poison_pods():
        name = f"team-a/{p['metadata']['name']}"
        on = cache.snapshot.pods_on(p["spec"].get("nodeName") or "")
        counted = any(e.uid == p["metadata"]["uid"] for e in on)
        assert counted or name in skipped or read_pod(p) is None

    service = service_for(cache)
    with TestClient(create_app(ExtenderSettings(url_prefix="/gpupart"), service)) as http:
        assert http.get("/readyz").status_code == 200, "unreadable pods never fail the watch"
        big = pod("big", shared(50000))
        out = http.post("/gpupart/filter", json=args(big, ["n1"])).json()
        assert out["NodeNames"] == [] and "n1" in out["FailedNodes"], out
        fits = http.post("/gpupart/filter", json=args(pod("small", shared(20000)), ["n1"])).json()
        assert fits["NodeNames"] == ["n1"], fits
        diagnosis = http.post("/gpupart/diagnose", json=big).json()
        assert diagnosis["Unreadable"] == {f"Pod {name}": p for name, p in skipped.items()}
        metrics = http.get("/metrics").text
        assert f'gpupart_extender_unreadable_objects{{kind="Pod"}} {len(skipped)}.0' in metrics


def test_an_unreadable_pod_is_logged_once_per_resource_version(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cache = ClusterCache(keys=keys)
    bad = pod("bad", {**shared(), "gpupart.io/gpu-memory": "1E"}, node="n1")
    bad["metadata"]["resourceVersion"] = "7"
    with caplog.at_level(logging.WARNING, logger="gpupart_extender.cache"):
        for _ in range(3):
            cache.apply(POD, "MODIFIED", bad)
        bad["metadata"]["resourceVersion"] = "8"
        cache.apply(POD, "MODIFIED", bad)
    skipped = [r for r in caplog.records if r.getMessage() == "Skipped unreadable object"]
    assert [r.kv["rv"] for r in skipped] == ["7", "8"]  # type: ignore[attr-defined]
    cache.apply(POD, "DELETED", bad)
    assert cache.snapshot.unreadable == ()


@pytest.mark.parametrize(
    "raw",
    [
        {"metadata": {"name": "n2", "annotations": {INVENTORY_ANNOTATION: "{"}}},
        {"metadata": {"name": "n2", "annotations": {INVENTORY_ANNOTATION: LONG}}},
        {"metadata": {"name": "n2", "annotations": ["x"]}},
        {"metadata": {"name": "n2"}, "status": {"allocatable": {"cpu": "1e99999999"}}},
    ],
)
def test_an_unreadable_node_fails_with_its_reason_and_the_others_go_on(raw: Any) -> None:
    cache = ClusterCache(keys=keys)
    cache.replace(NODE, [node("n1", [shared_gpu(0)]), raw])
    cache.replace(POD, [])
    service = service_for(cache)
    outcome = service.filter(pod("p", shared(1000)), ["n1", "n2"])
    assert outcome.passed == ["n1"]
    assert "n2" in {**outcome.failed, **outcome.unresolvable}


def test_a_watch_that_keeps_failing_turns_readyz_false_and_back() -> None:
    port = free_port()  # nothing listens on it: every request is refused
    configuration = kube.Configuration()
    configuration.host = f"http://127.0.0.1:{port}"
    configuration.retries = 0
    cache = ClusterCache(keys=keys)
    cache.replace(NODE, [])
    cache.replace(POD, [])
    cache.replace(NAMESPACE, [])
    attempts = threading.Semaphore(0)

    def sleep(_: float) -> None:
        attempts.release()

    watcher = Watcher(kube.ApiClient(configuration), cache, sleep=sleep)
    service = service_for(cache)
    app = create_app(ExtenderSettings(url_prefix="/gpupart"), service, watcher.health)
    with TestClient(app) as http:
        assert http.get("/readyz").status_code == 200
        watcher.start()
        try:
            for _ in range(12):  # four kinds: one of them at least FAILING_AFTER times
                assert attempts.acquire(timeout=30)
        finally:
            watcher.stop()
        res = http.get("/readyz")
        assert res.status_code == 503, res.text
        assert "failed" in res.text and "times in a row" in res.text, res.text
        for thread in watcher.threads:
            thread.join(30)
        for kind in (NODE, POD, PDB, NAMESPACE):  # a fresh list of each: ready at once
            watcher.health.worked(kind)
        assert http.get("/readyz").status_code == 200


# --- request bodies ---------------------------------------------------------------------------


@pytest.fixture
def http() -> Any:
    cache = cache_with_poison()
    with TestClient(create_app(ExtenderSettings(url_prefix="/gpupart"), service_for(cache))) as c:
        yield c


@pytest.mark.parametrize("quantity", ABSURD_QUANTITIES)
@pytest.mark.parametrize("resource", ["gpupart.io/gpu-memory", "nvidia.com/gpu", "cpu"])
def test_absurd_quantities_in_every_verb_are_answered_never_5xx(
    http: TestClient, quantity: str, resource: str
) -> None:
    asked = pod("asked", {**({} if resource == "nvidia.com/gpu" else shared()), resource: quantity})
    filtered = http.post("/gpupart/filter", json=args(asked, ["n1"]))
    assert filtered.status_code == 200, filtered.text
    error = filtered.json()["Error"]
    if error:
        assert error.startswith("invalid pod: Pod.spec.containers[0].resources"), error
        assert len(error) < 600
    scored = http.post("/gpupart/prioritize", json=args(asked, ["n1"]))
    assert scored.status_code in (200, 400), scored.text
    diagnosed = http.post("/gpupart/diagnose", json=asked)
    assert diagnosed.status_code in (200, 400), diagnosed.text
    if quantity in ("1e99999999", "1E99999999", HUGE):
        # Refused by a bound, before any arithmetic on the number.
        assert "more than a quantity can hold" in error or "characters long" in error, error


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (b"\xff\xfe{}", "malformed request"),
        (b'{"Pod":{"metadata":{"name":"\xff"}},"NodeNames":["n1"]}', "malformed request"),
        (b"[" * 100_000 + b"]" * 100_000, "malformed request"),
        (b'{"Pod":{},"Pod":{"spec":[]},"NodeNames":["n1"]}', "invalid pod"),
        (json.dumps({"Pod": {"metadata": {"name": LONG}}, "NodeNames": [LONG]}).encode(), ""),
        (json.dumps({"Pod": {}, "NodeNames": ["n1"] * 100_001}).encode(), "malformed request"),
    ],
)
def test_malformed_bodies_get_4xx_or_an_error_never_5xx(
    http: TestClient, body: bytes, words: str
) -> None:
    for verb in ("filter", "prioritize", "diagnose", "bind"):
        res = http.post(
            f"/gpupart/{verb}", content=body, headers={"content-type": "application/json"}
        )
        assert res.status_code < 500, (verb, res.text[:300])
        if verb == "filter" and words:
            assert words in res.text, res.text[:300]


@pytest.mark.parametrize(
    "binding",
    [
        {"PodName": "", "PodNamespace": "a", "PodUID": "u", "Node": "n1"},
        {"PodName": LONG, "PodNamespace": "a", "PodUID": "u", "Node": "n1"},
        {"PodName": 1, "PodNamespace": [], "PodUID": None, "Node": {}},
        {"PodName": "p", "PodNamespace": "a", "PodUID": "u", "Node": "n1"},
    ],
)
def test_bind_bodies_are_answered_never_5xx(http: TestClient, binding: dict[str, Any]) -> None:
    res = http.post("/gpupart/bind", json=binding)
    assert res.status_code in (200, 400), res.text[:300]
    if res.status_code == 200:
        assert "no filter decision" in res.json()["Error"]
