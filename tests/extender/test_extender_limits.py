"""Bounded requests over real HTTP (uvicorn as `gpupart extender` sets it up), and the health-only app.

We test these aspects:
- a body over `max_request_bytes` is refused (413) before the rest of it is read, whether it
  says its length or not; a request naming more than `max_request_nodes` nodes (filter,
  prioritize, preempt, diagnose) is refused (413) naming the setting;
- one request more than `max_concurrent_requests` is answered 503 at once (Retry-After), and
  the bodies held at once stay within their budget (503 beyond); the server answers normally
  once the requests in flight are done;
- a request head longer than the bound gets 431 and its connection closed;
- the health app answers /healthz, /readyz and /metrics only: every verb, and the API docs,
  are 404 there, and the metrics name no pod and no namespace.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
from extender_objects import FakeBinder, args
from extender_server import served
from fastapi.testclient import TestClient

from gpupart_extender.app import create_app, create_health_app
from gpupart_extender.cache import NAMESPACE, NODE, POD, ClusterCache
from gpupart_extender.limits import MAX_HEAD_BYTES
from gpupart_extender.metrics import Metrics
from gpupart_extender.service import ExtenderService
from gpupart_extender.settings import ExtenderSettings
from gpupart_testsupport.objects import keys, node, pod, shared, shared_gpu


class HeldBinder(FakeBinder):
    """Holds every pod read until `release` is set; `entered` counts the reads under way."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.entered = threading.Semaphore(0)

    def pod(self, namespace: str, name: str) -> Mapping[str, Any]:
        self.entered.release()
        assert self.release.wait(30), "the test never released the bind"
        return super().pod(namespace, name)


def service_of(binder: FakeBinder) -> ExtenderService:
    cache = ClusterCache(keys=keys)
    cache.replace(NODE, [node("n1", [shared_gpu(0, memory=40000)]), node("n2", None)])
    cache.replace(POD, [])
    cache.replace(NAMESPACE, [])
    return ExtenderService(
        cache, ExtenderSettings().scoring(), binder=binder, metrics=Metrics(), keys=keys
    )


LIMITS = ExtenderSettings(max_request_bytes=4096, max_request_nodes=3, max_concurrent_requests=3)


@pytest.fixture
def http() -> Iterator[Any]:
    with served(create_app(LIMITS, service_of(FakeBinder())), LIMITS) as client:
        yield client


def raw(port: int, data: bytes) -> bytes:
    """What the server answers to `data` sent as is, up to its closing the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(data)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
        return answer


def port_of(http: Any) -> int:
    return int(str(http.base_url).rsplit(":", 1)[1].strip("/"))


def test_a_body_over_the_size_bound_is_refused_before_it_is_read(http: Any) -> None:
    # Says 10 MB and sends 10 bytes: answered at once, without waiting for the rest.
    head = b"POST /gpupart/filter HTTP/1.1\r\nHost: x\r\nContent-Length: 10000000\r\n\r\n"
    answer = raw(port_of(http), head + b'{"Pod": {}')
    assert answer.startswith(b"HTTP/1.1 413 "), answer
    body = json.loads(answer.split(b"\r\n\r\n", 1)[1])
    assert body == {
        "Error": "request body of 10000000 bytes; at most 4096 (setting max_request_bytes)"
    }
    # Chunked, no length: refused once past the bound.
    head = b"POST /gpupart/filter HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    chunk = b"1000\r\n" + b" " * 4096 + b"\r\n"
    answer = raw(port_of(http), head + chunk + chunk)
    assert answer.startswith(b"HTTP/1.1 413 "), answer
    assert b"more than 4096 bytes" in answer
    # Within the bound, the same server answers as usual.
    ok = http.post("/gpupart/filter", json=args(pod("p", shared(1000)), ["n1"]))
    assert ok.status_code == 200 and ok.json()["NodeNames"] == ["n1"]
    assert (
        'gpupart_extender_requests_refused_total{reason="too_large"} 2.0'
        in http.get("/metrics").text
    )


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/gpupart/filter", args(pod("p", shared(1)), ["a", "b", "c", "d"])),
        ("/gpupart/prioritize", args(pod("p", shared(1)), ["a", "b", "c", "d"])),
        (
            "/gpupart/filter",
            {"Pod": pod("p", shared(1)), "Nodes": {"items": [node(n, None) for n in "abcd"]}},
        ),
        (
            "/gpupart/preempt",
            {
                "Pod": pod("p", shared(1)),
                "NodeNameToMetaVictims": {n: {"Pods": []} for n in "abcd"},
            },
        ),
        ("/gpupart/diagnose?node=a&node=b&node=c&node=d", pod("p", shared(1))),
    ],
    ids=["filter", "prioritize", "filter NodeList", "preempt", "diagnose"],
)
def test_a_request_naming_too_many_nodes_is_refused(http: Any, path: str, body: Any) -> None:
    answer = http.post(path, json=body)
    assert answer.status_code == 413, answer.text
    assert answer.json()["Error"].startswith("the request names 4 ")
    assert "at most 3 (setting max_request_nodes)" in answer.json()["Error"]


def test_three_nodes_are_within_the_bound(http: Any) -> None:
    answer = http.post("/gpupart/filter", json=args(pod("p", shared(1)), ["n1", "n2", "n3"]))
    assert answer.status_code == 200 and answer.json()["NodeNames"] == ["n1"]


def bind_body(name: str, pad: int = 0) -> bytes:
    body = {"PodName": name, "PodNamespace": "team-a", "PodUID": f"uid-team-a-{name}", "Node": "n1"}
    return json.dumps(body).encode() + b" " * pad


def test_requests_beyond_the_bound_in_flight_get_503_at_once() -> None:
    binder = HeldBinder()
    service = service_of(binder)
    settings = ExtenderSettings(max_request_bytes=4096, max_concurrent_requests=2)
    with served(create_app(settings, service), settings) as http:
        results: list[Any] = []
        threads = []
        for name in ("a", "b"):
            p = binder.live(pod(name, shared(1000)))
            assert http.post("/gpupart/filter", json=args(p, ["n1"])).json()["NodeNames"] == ["n1"]
            content = bind_body(name)
            threads.append(
                threading.Thread(
                    target=lambda c=content: results.append(
                        http.post(
                            "/gpupart/bind", content=c, headers={"content-type": "application/json"}
                        )
                    )
                )
            )
            threads[-1].start()
        for _ in threads:
            assert binder.entered.acquire(timeout=30)  # both binds in flight, held
        busy = http.post("/gpupart/filter", json=args(pod("c", shared(1)), ["n1"]))
        assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
        assert "2 requests in flight, at most 2 (setting max_concurrent_requests)" in busy.text
        binder.release.set()
        for t in threads:
            t.join(30)
        assert sorted(r.json()["Error"] for r in results) == ["", ""]
        again = http.post("/gpupart/filter", json=args(pod("c", shared(1)), ["n1"]))
        assert again.status_code == 200 and again.json()["NodeNames"] == ["n1"]


def test_the_bodies_held_at_once_stay_within_their_budget() -> None:
    """Budget: 2 x 4096 bytes. Two held binds of ~4000 bytes each leave no room for a third
    body of 1000 bytes, though the request count allows it."""
    binder = HeldBinder()
    service = service_of(binder)
    settings = ExtenderSettings(max_request_bytes=4096, max_concurrent_requests=10)
    with served(create_app(settings, service), settings) as http:
        threads = []
        for name in ("a", "b"):
            p = binder.live(pod(name, shared(1000)))
            http.post("/gpupart/filter", json=args(p, ["n1"]))
            content = bind_body(name, pad=3900)
            threads.append(
                threading.Thread(
                    target=lambda c=content: http.post(
                        "/gpupart/bind", content=c, headers={"content-type": "application/json"}
                    )
                )
            )
            threads[-1].start()
        for _ in threads:
            assert binder.entered.acquire(timeout=30)
        body = json.dumps(args(pod("c", shared(1)), ["n1"])).encode() + b" " * 600
        busy = http.post(
            "/gpupart/filter", content=body, headers={"content-type": "application/json"}
        )
        assert busy.status_code == 503, busy.text
        assert "the bodies in flight would exceed 8192 bytes" in busy.text
        binder.release.set()
        for t in threads:
            t.join(30)
        fine = http.post(
            "/gpupart/filter", content=body, headers={"content-type": "application/json"}
        )
        assert fine.status_code == 200 and fine.json()["NodeNames"] == ["n1"]


def test_a_request_head_over_the_bound_gets_431_and_the_connection_closed(http: Any) -> None:
    """A head still incomplete past the bound (httptools alone would buffer it whole)."""
    url = b"GET /healthz?" + b"a" * (MAX_HEAD_BYTES + 1)
    assert raw(port_of(http), url).startswith(b"HTTP/1.1 431 ")
    header = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"b" * (MAX_HEAD_BYTES + 1)
    answer = raw(port_of(http), header)
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    assert b"request line and headers longer than 65536 bytes" in answer
    assert http.get("/healthz").text == "ok"


# --- the health app ----------------------------------------------------------------------------


def test_the_health_app_serves_health_and_metrics_only() -> None:
    binder = FakeBinder()
    service = service_of(binder)
    secret = binder.live(pod("secret-pod", shared(1000), namespace="tenant-x"))
    with TestClient(create_app(ExtenderSettings(), service)) as verbs:
        verbs.post("/gpupart/filter", json=args(secret, ["n1", "n2"]))
        bound = verbs.post(
            "/gpupart/bind",
            content=bind_body("secret-pod").replace(b"team-a", b"tenant-x"),
            headers={"content-type": "application/json"},
        )
        assert bound.json() == {"Error": ""}
    with TestClient(create_health_app(service)) as health:
        assert health.get("/healthz").text == "ok"
        assert health.get("/readyz").status_code == 200
        metrics = health.get("/metrics")
        assert metrics.status_code == 200
        assert 'gpupart_extender_decisions_total{outcome="ok",verb="bind"} 1.0' in metrics.text
        for name in ("secret-pod", "tenant-x", "n1", "n2"):
            assert name not in metrics.text, name
        for path in ("/gpupart/filter", "/gpupart/prioritize", "/gpupart/bind",
                     "/gpupart/preempt", "/gpupart/diagnose"):  # fmt: skip
            assert health.post(path, json={}).status_code == 404, path
        for path in ("/docs", "/openapi.json", "/redoc"):
            assert health.get(path).status_code == 404, path
