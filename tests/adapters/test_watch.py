"""gpupart.watch against a scripted API server over real HTTP: resourceVersions, bookmarks, 410 Gone, backoff."""

from __future__ import annotations

import json
import queue
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest
from kubernetes import client

from gpupart.watch import Backoff, Event, Expired, Failed, Listed, Resumed, list_watch
from gpupart_testsupport.ports import LOOPBACK


def node(name: str, version: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "resourceVersion": version}}


def listing(version: str, *names: str) -> tuple[int, bytes]:
    body = {"metadata": {"resourceVersion": version}, "items": [node(n, version) for n in names]}
    return 200, json.dumps(body).encode()


def stream(*events: tuple[str, dict[str, Any]]) -> tuple[int, bytes]:
    return 200, b"".join(json.dumps({"type": t, "object": o}).encode() + b"\n" for t, o in events)


class ScriptedApi:
    """Answers GET /api/v1/nodes with the next scripted (status, body); records each query."""

    def __init__(self) -> None:
        self.script: queue.Queue[tuple[int, bytes]] = queue.Queue()
        self.queries: list[dict[str, str]] = []
        api = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the http.server hook
                url = urlparse(self.path)
                api.queries.append({k: v[0] for k, v in parse_qs(url.query).items()})
                try:
                    status, body = api.script.get(timeout=5)
                except queue.Empty:
                    status, body = 503, b"script ended"
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_: object) -> None:
                pass

        self.server = ThreadingHTTPServer((LOOPBACK, 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def lister(self) -> Any:
        configuration = client.Configuration()
        configuration.host = f"http://{LOOPBACK}:{self.server.server_address[1]}"
        configuration.retries = 0
        return client.CoreV1Api(client.ApiClient(configuration)).list_node


@pytest.fixture
def api() -> Iterator[ScriptedApi]:
    scripted = ScriptedApi()
    yield scripted
    scripted.server.shutdown()


def test_lists_watches_from_the_version_resumes_relists_on_gone_and_backs_off(
    api: ScriptedApi,
) -> None:
    for response in (
        listing("5", "a"),
        stream(
            ("ADDED", node("b", "6")), ("MODIFIED", node("a", "7")), ("BOOKMARK", node("", "9"))
        ),
        stream(("ERROR", {"code": 410, "message": "too old resource version: 9 (12)"})),
        listing("20", "a", "b"),
        (500, b'{"kind":"Status","message":"etcd leader changed"}'),
        (500, b"{}"),
        (500, b"{}"),
        (500, b"{}"),
        listing("21", "a"),
    ):
        api.script.put(response)
    stop = threading.Event()
    waits: list[float] = []
    seen: list[object] = []
    for item in list_watch(
        api.lister(),
        stop,
        decode=lambda obj: obj["metadata"]["name"],
        timeout_s=30,
        backoff=Backoff(0.01, 0.04),
        sleep=waits.append,
    ):
        seen.append(item)
        if isinstance(item, Listed) and item.version == "21":
            stop.set()
    assert seen[:4] == [
        Listed((node("a", "5"),), "5"),
        Event("ADDED", "b"),
        Event("MODIFIED", "a"),
        Resumed("9"),  # the bookmark moved the version on and is not an event
    ]
    assert seen[4] == Expired()
    assert seen[5] == Listed((node("a", "20"), node("b", "20")), "20")
    failures = seen[6:10]
    assert all(isinstance(f, Failed) for f in failures), failures
    assert "500" in failures[0].problem and "etcd leader changed" in failures[0].problem  # type: ignore[union-attr]
    # Doubling from the first wait to the cap; each wait is the one announced.
    assert waits == [0.01, 0.02, 0.04, 0.04] == [f.retry_after for f in failures]  # type: ignore[union-attr]
    assert seen[10] == Listed((node("a", "21"),), "21") and len(seen) == 11
    # Each watch starts at the version it was given: the list's, then the bookmark's.
    watches = [q for q in api.queries if q.get("watch") == "true"]
    assert [w["resourceVersion"] for w in watches[:3]] == ["5", "9", "20"]
    assert all(w["allowWatchBookmarks"] == "true" and w["timeoutSeconds"] == "30" for w in watches)
    assert [q.get("watch") for q in api.queries] == [
        None, "true", "true", None, "true", None, None, None, None
    ]  # fmt: skip


def test_the_backoff_resets_once_the_api_server_answers(api: ScriptedApi) -> None:
    for response in (
        (500, b"{}"),
        (500, b"{}"),
        listing("3"),
        (500, b"{}"),
        listing("4"),
    ):
        api.script.put(response)
    stop = threading.Event()
    waits: list[float] = []
    for item in list_watch(
        api.lister(), stop, decode=dict, timeout_s=5, backoff=Backoff(1, 8), sleep=waits.append
    ):
        if isinstance(item, Listed) and item.version == "4":
            stop.set()
    assert waits == [1, 2, 1]


def test_a_malformed_stream_is_a_failure_not_a_crash(api: ScriptedApi) -> None:
    api.script.put(listing("1"))
    api.script.put((200, b"{not json\n"))
    api.script.put(listing("2"))
    stop = threading.Event()
    seen: list[object] = []
    for item in list_watch(
        api.lister(),
        stop,
        decode=dict,
        timeout_s=5,
        backoff=Backoff(0.01, 0.01),
        sleep=lambda _: None,
    ):
        seen.append(item)
        if isinstance(item, Listed) and item.version == "2":
            stop.set()
    assert [type(i).__name__ for i in seen] == ["Listed", "Failed", "Listed"]
    assert "a watch event: not JSON" in seen[1].problem  # type: ignore[attr-defined]


def test_backoff_refuses_a_nonsense_range() -> None:
    with pytest.raises(ValueError, match="first <= longest"):
        Backoff(2, 1)
