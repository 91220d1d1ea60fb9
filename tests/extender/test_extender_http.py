"""The extender over HTTP (ASGI app through httpx, and once through real uvicorn).

Covers: the exact PascalCase wire shapes (golden strings from kube-scheduler's types_test.go),
filter with reasons and unresolvable nodes, prioritize scores, bind writing the assignment and
the Binding, holds and assumed pods, bad input answered with 4xx or `Error` (never 500),
nodeCacheCapable false with full NodeLists, health, readiness and metrics.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest
from extender_objects import FakeBinder, args
from extender_server import served
from fastapi.testclient import TestClient

from gpupart.core.api.wire import ASSIGNMENT_ANNOTATION, PodAssignment, decode_assignment
from gpupart_extender.answers import DETAILED_NODES
from gpupart_extender.app import create_app
from gpupart_extender.cache import NAMESPACE, NODE, POD, ClusterCache
from gpupart_extender.metrics import Metrics
from gpupart_extender.models import ExtenderArgs, ExtenderBindingArgs, ExtenderFilterResult
from gpupart_extender.service import ExtenderService
from gpupart_extender.settings import ExtenderSettings
from gpupart_testsupport.objects import keys, mig_gpu, node, pod, shared, shared_gpu

ALL = ["node-mig", "node-mps", "node-whole", "node-bare"]

# --- golden strings (kubernetes/kube-scheduler extender/v1/types_test.go) ----------------------


def test_golden_extender_args_parse() -> None:
    text = (
        '{"Pod":{"metadata":{"name":"p"}},'
        '"Nodes":{"metadata":{},"items":[{"metadata":{"name":"node1"}}]},"NodeNames":["node1"]}'
    )
    parsed = ExtenderArgs.model_validate_json(text)
    assert parsed.NodeNames == ["node1"] and parsed.Nodes is not None
    assert parsed.Nodes.items == [{"metadata": {"name": "node1"}}]


def test_golden_filter_result_and_binding_shapes() -> None:
    result = ExtenderFilterResult(
        NodeNames=["node1"],
        FailedNodes={"foo": "bar"},
        FailedAndUnresolvableNodes={"baz": "qux"},
        Error="myerror",
    )
    assert json.loads(result.model_dump_json(exclude={"Nodes"})) == json.loads(
        '{"NodeNames":["node1"],"FailedNodes":{"foo":"bar"},"FailedAndUnresolvableNodes":{"baz":"qux"},"Error":"myerror"}'
    )
    binding = ExtenderBindingArgs.model_validate_json(
        '{"PodName":"mypodname","PodNamespace":"mypodnamespace","PodUID":"mypoduid","Node":"mynode"}'
    )
    assert (binding.PodName, binding.PodNamespace, binding.PodUID, binding.Node) == (
        "mypodname",
        "mypodnamespace",
        "mypoduid",
        "mynode",
    )


def test_lowercase_keys_are_accepted_like_gos_decoder() -> None:
    parsed = ExtenderArgs.model_validate_json('{"pod":{"metadata":{}},"nodeNames":["a"]}')
    assert parsed.NodeNames == ["a"]


# --- filter -------------------------------------------------------------------------------------


def test_filter_mig_pod_says_why_in_words(client: TestClient) -> None:
    body = client.post("/gpupart/filter", json=args(pod("new", {"nvidia.com/mig-3g.40gb": 1}), ALL))
    assert body.status_code == 200
    out = body.json()
    assert set(out) == {"NodeNames", "FailedNodes", "FailedAndUnresolvableNodes", "Error"}
    assert out["NodeNames"] == [] and out["Error"] == ""
    assert out["FailedNodes"] == {
        "node-mig": "node-mig: 2 GPUs, no free 3g.40gb slice (all 2 in use by team-a/train-1, team-b/train-2)"
    }
    assert set(out["FailedAndUnresolvableNodes"]) == {"node-mps", "node-whole", "node-bare"}
    assert "gpupart.io/inventory" in out["FailedAndUnresolvableNodes"]["node-bare"]


def test_reasons_stay_a_few_lines_however_many_nodes_fail(
    cache: ClusterCache, client: TestClient
) -> None:
    """kube-scheduler counts FailedNodes by text ("0/N nodes are available: 120 node(s) had ...")
    into the pod's event and condition: all but DETAILED_NODES nodes carry a summary."""
    busy = [f"busy-{n:03d}" for n in range(120)]
    for name in busy:
        cache.apply(NODE, "ADDED", node(name, [mig_gpu(0, [("3g.40gb", 0, 4)])]))
        cache.apply(POD, "ADDED", pod(f"train-{name}", {"nvidia.com/mig-3g.40gb": 1}, node=name))
    names = list(reversed(busy)) + ALL
    out = client.post(
        "/gpupart/filter", json=args(pod("new", {"nvidia.com/mig-3g.40gb": 1}), names)
    )
    failed = out.json()["FailedNodes"]
    assert set(failed) == {*busy, "node-mig"}
    in_full = {"busy-000", "busy-001", "busy-002"}  # resolvable first, then by name
    assert len(in_full) == DETAILED_NODES
    for name, text in failed.items():
        if name in in_full:
            assert text == (
                f"{name}: 1 GPU, no free 3g.40gb slice (all 1 in use by team-a/train-{name})"
            )
        else:
            assert text == "node(s) had no free 3g.40gb MIG slice"
    histogram = Counter([*failed.values(), *out.json()["FailedAndUnresolvableNodes"].values()])
    assert len(histogram) == DETAILED_NODES + 3  # + in use, no such slice, no inventory


def test_the_nodes_closest_to_fitting_are_the_ones_given_in_full(
    cache: ClusterCache, client: TestClient
) -> None:
    # 40000 MiB GPUs, the pod asks 30000: a-* nodes have 5000 free, z-* nodes 25000.
    for prefix, used in (("a", 35000), ("z", 15000)):
        for n in range(5):
            name = f"{prefix}-{n}"
            cache.apply(NODE, "ADDED", node(name, [shared_gpu(0, memory=40000)]))
            taken = PodAssignment(name, 0, "GPU-0000", used)
            cache.apply(POD, "ADDED", pod(f"t-{name}", shared(used), node=name, assignment=taken))
    names = [f"{p}-{n}" for p in "az" for n in range(5)]
    out = client.post("/gpupart/filter", json=args(pod("new", shared(30000)), names)).json()
    in_full = {n for n, text in out["FailedNodes"].items() if text.startswith(f"{n}: ")}
    assert in_full == {"z-0", "z-1", "z-2"}  # 5000 MiB short, before the a-* nodes' 25000


def test_diagnose_gives_every_node_its_reason_in_full(
    cache: ClusterCache, client: TestClient
) -> None:
    """What a person asks after the filter reply gave 3 reasons in full: all of them."""
    busy = [f"busy-{n:03d}" for n in range(20)]
    for name in busy:
        cache.apply(NODE, "ADDED", node(name, [mig_gpu(0, [("3g.40gb", 0, 4)])]))
        cache.apply(POD, "ADDED", pod(f"train-{name}", {"nvidia.com/mig-3g.40gb": 1}, node=name))
    new = pod("new", {"nvidia.com/mig-3g.40gb": 1})
    out = client.post("/gpupart/diagnose", json=new).json()
    assert out["Pod"] == "team-a/new" and out["Scores"] == {}
    assert set(out["FailedNodes"]) == {*busy, "node-mig"}
    for name in busy:
        assert out["FailedNodes"][name] == (
            f"{name}: 1 GPU, no free 3g.40gb slice (all 1 in use by team-a/train-{name})"
        )
    assert set(out["FailedAndUnresolvableNodes"]) == {"node-mps", "node-whole", "node-bare"}
    one = client.post("/gpupart/diagnose?node=node-mps&node=nowhere", json=pod("s", shared(8000)))
    assert one.status_code == 200
    assert (
        one.json()["Scores"].keys() == {"node-mps"} and 0 <= one.json()["Scores"]["node-mps"] <= 10
    )
    assert "not known to the gpupart extender" in one.json()["FailedNodes"]["nowhere"]
    bad = client.post("/gpupart/diagnose", json=pod("x", {"gpupart.io/gpu-memory": "-5"}))
    assert bad.status_code == 400 and "invalid pod" in bad.json()["Error"]


@pytest.mark.parametrize(
    "content_type",
    ["application/x-www-form-urlencoded", "text/plain", None],
    ids=["curl-data-binary", "text", "none"],
)
def test_diagnose_reads_the_pod_whatever_the_content_type(
    client: TestClient, content_type: str | None
) -> None:
    """`kubectl get pod -o json | curl --data-binary @- .../diagnose`, as docs/extender.md
    writes it, sends curl's form Content-Type: the body is the Pod all the same."""
    body = json.dumps(pod("new", {"nvidia.com/mig-3g.40gb": 1})).encode()
    headers = {} if content_type is None else {"Content-Type": content_type}
    out = client.post("/gpupart/diagnose", content=body, headers=headers)
    assert out.status_code == 200, out.text
    assert out.json()["FailedNodes"]["node-mig"].startswith("node-mig: 2 GPUs, no free 3g.40gb")
    for wrong, problem in ((b"not json", "malformed request: "), (b"[1]", "malformed request: ")):
        refused = client.post("/gpupart/diagnose", content=wrong, headers=headers)
        assert refused.status_code == 400 and refused.json()["Error"].startswith(problem)


def test_filter_returns_survivors_and_prioritize_scores(client: TestClient) -> None:
    p = pod("new", shared(8000))
    out = client.post("/gpupart/filter", json=args(p, ALL)).json()
    assert out["NodeNames"] == ["node-mps"]
    scores = client.post("/gpupart/prioritize", json=args(p, ["node-mps", "node-whole"])).json()
    assert [s["Host"] for s in scores] == ["node-mps", "node-whole"]
    assert all(set(s) == {"Host", "Score"} and 0 <= s["Score"] <= 10 for s in scores)
    assert scores[1]["Score"] == 0 and scores[0]["Score"] > 0


def test_unknown_node_is_failed_not_an_error(client: TestClient) -> None:
    out = client.post("/gpupart/filter", json=args(pod("new", shared()), ["node-9"])).json()
    assert (
        out["NodeNames"] == []
        and "not known to the gpupart extender" in out["FailedNodes"]["node-9"]
    )


def test_invalid_pod_request_is_an_error_field(client: TestClient) -> None:
    bad = pod("new", {"nvidia.com/gpu.shared": 1, "gpupart.io/gpu-memory": "-5"})
    out = client.post("/gpupart/filter", json=args(bad, ALL))
    assert out.status_code == 200
    assert out.json()["Error"].startswith("invalid pod: Pod.spec.containers[0].resources")
    assert out.json()["NodeNames"] == []
    scores = client.post("/gpupart/prioritize", json=args(bad, ALL))
    assert scores.status_code == 400 and "invalid pod" in scores.json()["Error"]


@pytest.mark.parametrize(
    "body",
    [
        "not json",
        "[]",
        '{"NodeNames":["a"]}',
        '{"Pod":"x","NodeNames":["a"]}',
        '{"Pod":{},"NodeNames":"a"}',
        '{"Pod":{"metadata":[]},"NodeNames":["a"]}',
        '{"Pod":{"spec":{"containers":{}}},"NodeNames":["a"]}',
        '{"Pod":{"spec":{"containers":[{"resources":{"limits":{"nvidia.com/gpu":"1e99"}}}]}},"NodeNames":["a"]}',
    ],
)
def test_malformed_bodies_get_4xx_or_error_never_500(client: TestClient, body: str) -> None:
    for verb in ("filter", "prioritize"):
        res = client.post(
            f"/gpupart/{verb}", content=body, headers={"content-type": "application/json"}
        )
        assert res.status_code < 500, res.text
        assert res.status_code in (200, 400, 422)
        if res.status_code == 200 and verb == "filter":
            assert res.json()["Error"] or res.json()["NodeNames"] is not None


def test_full_node_list_mode_returns_nodes(client: TestClient) -> None:
    items = [
        node("node-mps", [shared_gpu(0)]),
        node("fresh", [shared_gpu(0)]),
        node("node-bare", None),
    ]
    body = {
        "Pod": pod("new", shared(1000)),
        "Nodes": {"metadata": {}, "items": items},
        "NodeNames": None,
    }
    out = client.post("/gpupart/filter", json=body).json()
    assert [n["metadata"]["name"] for n in out["Nodes"]["items"]] == ["node-mps", "fresh"]
    assert out["NodeNames"] is None
    assert "node-bare" in out["FailedAndUnresolvableNodes"]


# --- bind ---------------------------------------------------------------------------------------


def test_bind_writes_assignment_then_binding_and_reserves(
    client: TestClient, binder: FakeBinder, cache: ClusterCache
) -> None:
    p = binder.live(pod("new", shared(8000), labels={"app": "infer"}))
    client.post("/gpupart/filter", json=args(p, ["node-mps"]))
    res = client.post(
        "/gpupart/bind",
        json={
            "PodName": "new",
            "PodNamespace": "team-a",
            "PodUID": "uid-team-a-new",
            "Node": "node-mps",
        },
    )
    assert res.json() == {"Error": ""}
    assert binder.bindings == [("team-a", "new", "uid-team-a-new", "node-mps")]
    ((ns, name, uid, annotations),) = binder.annotations
    assignment = decode_assignment(annotations[ASSIGNMENT_ANNOTATION])
    # Same app as infer-1 on GPU 0: the extender picks GPU 1.
    assert (assignment.node, assignment.gpu, assignment.memory_mib) == ("node-mps", 1, 8000)
    view = cache.snapshot.view("node-mps")
    assert view is not None and view.gpus[1].used_memory_mib == 8000  # assumed until watched


def test_assumed_pods_block_capacity_until_ttl(
    client: TestClient, clock: Any, binder: FakeBinder
) -> None:
    for n in range(5):
        p = binder.live(pod(f"big-{n}", shared(9000)))
        client.post("/gpupart/filter", json=args(p, ["node-mps"]))
        res = client.post(
            "/gpupart/bind",
            json={
                "PodName": f"big-{n}",
                "PodNamespace": "team-a",
                "PodUID": f"uid-team-a-big-{n}",
                "Node": "node-mps",
            },
        )
        assert res.json()["Error"] == "", n
    # GPU 0: 30000 + 9000 of 40000 used, GPU 1: 4 × 9000: a sixth 9000 MiB pod fits nowhere.
    out = client.post("/gpupart/filter", json=args(pod("big-x", shared(9000)), ["node-mps"])).json()
    assert (
        out["NodeNames"] == []
        and "no shared GPU with 9000 MiB free" in out["FailedNodes"]["node-mps"]
    )
    clock.now += 31  # the watch never confirmed them: the reservations lapse
    out = client.post("/gpupart/filter", json=args(pod("big-6", shared(9000)), ["node-mps"])).json()
    assert out["NodeNames"] == ["node-mps"]


def test_bind_without_filter_or_on_a_full_node_is_an_error(
    client: TestClient, binder: FakeBinder
) -> None:
    res = client.post(
        "/gpupart/bind",
        json={"PodName": "x", "PodNamespace": "team-a", "PodUID": "u", "Node": "node-mps"},
    )
    assert "no filter decision" in res.json()["Error"]
    m = binder.live(pod("m", {"nvidia.com/mig-3g.40gb": 1}))
    client.post("/gpupart/filter", json=args(m, ["node-mig"]))
    res = client.post(
        "/gpupart/bind",
        json={
            "PodName": "m",
            "PodNamespace": "team-a",
            "PodUID": "uid-team-a-m",
            "Node": "node-mig",
        },
    )
    assert res.json()["Error"].startswith("node changed since filter: node-mig: 2 GPUs, no free")
    assert binder.bindings == []


def test_failed_api_write_releases_the_reservation(
    client: TestClient, binder: FakeBinder, cache: ClusterCache
) -> None:
    binder.fail = RuntimeError("conflict")
    new = binder.live(pod("new", shared(8000)))
    client.post("/gpupart/filter", json=args(new, ["node-mps"]))
    res = client.post(
        "/gpupart/bind",
        json={
            "PodName": "new",
            "PodNamespace": "team-a",
            "PodUID": "uid-team-a-new",
            "Node": "node-mps",
        },
    )
    assert "binding team-a/new to node-mps failed" in res.json()["Error"]
    assert cache.snapshot.counts()["assumed"] == 0


def test_bind_args_are_validated(client: TestClient) -> None:
    assert client.post("/gpupart/bind", json={"PodName": "x"}).status_code == 400
    assert (
        client.post(
            "/gpupart/bind", content=b"{", headers={"content-type": "application/json"}
        ).status_code
        == 400
    )


# --- health, readiness, metrics ------------------------------------------------------------------


def test_health_readiness_and_metrics(client: TestClient) -> None:
    assert client.get("/healthz").text == "ok"
    assert client.get("/readyz").status_code == 200
    client.post("/gpupart/filter", json=args(pod("new", {"nvidia.com/mig-3g.40gb": 1}), ALL))
    text = client.get("/metrics").text
    assert 'gpupart_extender_request_duration_seconds_count{verb="filter"} 1.0' in text
    assert 'gpupart_extender_filtered_nodes_total{reason="in_use"} 1.0' in text
    assert 'gpupart_extender_decisions_total{outcome="unschedulable",verb="filter"} 1.0' in text
    assert 'gpupart_extender_cache_objects{kind="nodes"} 4.0' in text


def test_not_ready_until_every_list_arrived(settings: ExtenderSettings) -> None:
    cache = ClusterCache(keys=keys)
    service = ExtenderService(
        cache, settings.scoring(), keys=keys, binder=FakeBinder(), metrics=Metrics()
    )
    with TestClient(create_app(settings, service)) as c:
        res = c.get("/readyz")
        assert res.status_code == 503 and "Node, Pod, Namespace" in res.text
        cache.replace(NODE, [])
        cache.replace(POD, [])
        res = c.get("/readyz")
        assert res.status_code == 503 and res.text == "watch cache not synced: Namespace"
        cache.replace(NAMESPACE, [])
        assert c.get("/readyz").status_code == 200


# --- real uvicorn ------------------------------------------------------------------------------------


def test_real_uvicorn_on_loopback(settings: ExtenderSettings, service: ExtenderService) -> None:
    with served(create_app(settings, service)) as http:
        out = http.post("/gpupart/filter", json=args(pod("new", shared(1000)), ALL)).json()
        assert out["NodeNames"] == ["node-mps"]
