"""Benchmark: filter + prioritize over HTTP for one pod against 1,000 and 5,000 candidate nodes.

The extender runs in a child process (uvicorn on 127.0.0.1 as `gpupart extender` runs it, the
same app and cache as in production, fed with a synthetic cluster: 60 % MPS nodes, 25 % MIG
nodes, 15 % whole-GPU nodes, 8 GPUs each, with a random share already in use). The parent plays kube-scheduler: for
each pod, POST filter with every node name (shuffled: kube-scheduler's parallel filter lists
feasible nodes in a new order for each pod), then prioritize with the survivors, and times the
pair; then it binds the pod to the best node (not timed; the extender's binder writes nothing
here, but the pod counts on that node from then on), so every pod meets a changed cluster.
Pods cycle through a few request shapes, each with its own uid, as a real queue would.
The last line is JSON: {"p50_ms_1000", "p99_ms_1000", "p50_ms_5000", "p99_ms_5000"}, and per
node count "server_p50_ms_N" / "server_p99_ms_N": the extender's own part of each pair, from
the server receiving a request to its last byte sent (body parsing and the HTTP stack
included, the client's JSON and the loopback not), timed around the app inside the server.

--client go asks through tests/bench/schedulerclient instead: kube-scheduler's own request code
(the extender API's Go types, encoding/json, net/http; built once, see gpupart_testsupport.goclients), so the
figures include what decoding the replies costs kube-scheduler itself.

Preempt: one preempt call (nodeCacheCapable form) for a high-priority shared-GPU pod with 100
candidate nodes and 20 victims each (kube-scheduler's dry run names every pod of the node),
on a cluster of 8-GPU MPS nodes with 20 lower-priority pods each; the extender picks the pods
of one GPU per node. Timed from the client as the pairs are: "preempt_p50_ms", "preempt_p99_ms".
`--preempt-only` runs just that.

--floor also runs each size against a server that decides nothing: the same uvicorn setup
replaying, per pod shape, the reply bytes the real extender gave once ("floor_p50_ms_N",
"floor_p99_ms_N": what HTTP and the client's JSON cost at these sizes).

The synthetic cluster's shared-GPU pods carry assignments signed with a bench key, as the
extender writes them (the cache verifies each one), and binds re-read the pod (from the bench's
binder, which answers at once: the API round trip a real bind adds is not in these figures).

Each child writes its port file whole (a rename) and nothing is timed before it answers /readyz
over the measurements' own kind of connection (the preempt figure once died with
ConnectionRefused, connecting before the extender listened).

Run: .venv/bin/python tests/bench/extender_latency.py [--requests 300] [--client go] [--floor]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import ssl
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
from starlette.types import ASGIApp, Receive, Scope, Send

from gpupart.core.api.provenance import sign
from gpupart.core.api.spec import Mode
from gpupart.core.api.wire import (
    ASSIGNMENT_ANNOTATION,
    INVENTORY_ANNOTATION,
    Inventory,
    InventoryGpu,
    MigDevice,
    PodAssignment,
    encode_assignment,
    encode_inventory,
)
from gpupart.core.mig.layout import MigInstance, Placement
from gpupart.signing import PrivateKeys
from gpupart_extender.app import create_app
from gpupart_extender.cache import NAMESPACE, NODE, POD, ClusterCache
from gpupart_extender.main import listen, server, tune_gc
from gpupart_extender.metrics import Metrics
from gpupart_extender.replies import filter_reply
from gpupart_extender.service import ExtenderService
from gpupart_extender.settings import ExtenderSettings
from gpupart_testsupport import goclients
from gpupart_testsupport.polling import wait_for

GPUS = 8
MIB = 81559


KEYS = PrivateKeys((b"gpupart-bench-assignment-key-000",))
SCHEDULER = "gpupart-scheduler"


class NoBinder:
    """Binds nothing: the extender's own bookkeeping (the assumed pod) is all that happens.
    The live pod it answers is the bench's pod of that name, pending."""

    def pod(self, namespace: str, name: str) -> dict[str, Any]:
        asked = _asked(int(name.removeprefix("p")))
        assert asked["metadata"]["namespace"] == namespace
        return asked

    def bind(self, *_: Any) -> None: ...


def _signed(assignment: PodAssignment, uid: str) -> str:
    return encode_assignment(sign(replace(assignment, pod_uid=uid), KEYS))


def _pod(
    name: str, node: str, limits: dict[str, str], app: str, assignment: PodAssignment | None = None
) -> dict[str, Any]:
    uid = f"uid-{name}"
    return {
        "metadata": {
            "name": name,
            "namespace": "bench",
            "uid": uid,
            "labels": {"app": app},
            "annotations": {ASSIGNMENT_ANNOTATION: _signed(assignment, uid)} if assignment else {},
        },
        "spec": {"nodeName": node, "containers": [{"resources": {"limits": limits}}]},
        "status": {"phase": "Running"},
    }


def cluster(nodes: int, seed: int = 1) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    rng = random.Random(seed)
    node_objs, pods = [], []
    for n in range(nodes):
        name = f"node-{n:05d}"
        kind = rng.random()
        if kind < 0.60:
            gpus = [
                InventoryGpu(i, f"GPU-{n}-{i}", "H100", MIB, Mode.MPS, (), 16) for i in range(GPUS)
            ]
            for i in range(GPUS):
                for k in range(rng.randrange(0, 5)):
                    mem = rng.choice((4096, 8192, 10240, 20480))
                    a = PodAssignment(name, i, f"GPU-{n}-{i}", mem)
                    pods.append(
                        _pod(
                            f"s-{n}-{i}-{k}",
                            name,
                            {"nvidia.com/gpu.shared": "1", "gpupart.io/gpu-memory": str(mem)},
                            rng.choice("abcdef"),
                            a,
                        )
                    )
        elif kind < 0.85:
            devices = tuple(
                MigDevice(f"MIG-{n}-{i}-{s}", MigInstance(Placement(s, 1), "1g.10gb"))
                for i in range(GPUS)
                for s in range(7)
            )
            gpus = [
                InventoryGpu(i, f"GPU-{n}-{i}", "H100", MIB, Mode.MIG, devices[i * 7 : i * 7 + 7])
                for i in range(GPUS)
            ]
            for k in range(rng.randrange(0, 57)):
                pods.append(
                    _pod(f"m-{n}-{k}", name, {"nvidia.com/mig-1g.10gb": "1"}, rng.choice("abcdef"))
                )
        else:
            gpus = [InventoryGpu(i, f"GPU-{n}-{i}", "H100", MIB, Mode.NONE) for i in range(GPUS)]
            for k in range(rng.randrange(0, GPUS + 1)):
                pods.append(_pod(f"w-{n}-{k}", name, {"nvidia.com/gpu": "1"}, rng.choice("abcdef")))
        node_objs.append(
            {
                "metadata": {
                    "name": name,
                    "annotations": {INVENTORY_ANNOTATION: encode_inventory(Inventory(tuple(gpus)))},
                }
            }
        )
    return node_objs, pods


TIMINGS = "/bench/timings"
"""The timed app's extra route: the seconds each filter and prioritize took in the server."""


def timed(app: ASGIApp) -> ASGIApp:
    """`app`, timing each filter and prioritize call from its start to its last byte sent."""
    spent: dict[str, list[float]] = {"filter": [], "prioritize": []}

    async def wrapper(scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if path == TIMINGS:
            body = json.dumps(spent).encode()
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": body})
            return
        started = time.perf_counter()
        await app(scope, receive, send)
        verb = path.rpartition("/")[2]
        if verb in spent:
            spent[verb].append(time.perf_counter() - started)

    return wrapper


PREEMPT_NODES = 100
PREEMPT_VICTIMS = 20
PREEMPTOR = {
    "metadata": {"name": "urgent", "namespace": "bench", "uid": "u-urgent"},
    "spec": {
        "priority": 1000,
        "containers": [
            {
                "resources": {
                    "limits": {"nvidia.com/gpu.shared": "1", "gpupart.io/gpu-memory": "60000"}
                }
            }
        ],
    },
}
"""60000 MiB with the 15 % reserve: 69000 free on one GPU, two of its pods have to go."""


def preempt_cluster(seed: int = 3) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """PREEMPT_NODES MPS nodes of 8 GPUs; PREEMPT_VICTIMS pods of 25000 MiB on each, 2-3 a GPU,
    of random priority below the preemptor's."""
    rng = random.Random(seed)
    node_objs, pods = [], []
    for n in range(PREEMPT_NODES):
        name = f"node-{n:05d}"
        gpus = [InventoryGpu(i, f"GPU-{n}-{i}", "H100", MIB, Mode.MPS, (), 16) for i in range(GPUS)]
        for k in range(PREEMPT_VICTIMS):
            i = k % GPUS
            a = PodAssignment(name, i, f"GPU-{n}-{i}", 25000)
            pod = _pod(
                f"v-{n}-{k}",
                name,
                {"nvidia.com/gpu.shared": "1", "gpupart.io/gpu-memory": "25000"},
                rng.choice("abcdef"),
                a,
            )
            pod["spec"]["priority"] = rng.randrange(0, 1000)
            pods.append(pod)
        annotations = {INVENTORY_ANNOTATION: encode_inventory(Inventory(tuple(gpus)))}
        node_objs.append({"metadata": {"name": name, "annotations": annotations}})
    return node_objs, pods


def serve(nodes: int, port_file: Path, *, floor: bool) -> None:
    cache = ClusterCache(keys=lambda: KEYS)
    node_objs, pods = preempt_cluster() if nodes == PREEMPT_NODES else cluster(nodes)
    cache.replace(NODE, node_objs)
    cache.replace(POD, pods)
    cache.replace(NAMESPACE, [])  # every kind listed: /readyz, which the parent waits for, says 200
    settings = ExtenderSettings(log_level="WARNING")
    service = ExtenderService(
        cache, settings.scoring(), binder=NoBinder(), metrics=Metrics(), keys=lambda: KEYS
    )
    app = replay(service, nodes) if floor else create_app(settings, service)
    tune_gc()
    sock = listen("127.0.0.1", 0)
    # Whole or not at all: the parent must never read half a port number.
    written = port_file.with_suffix(".tmp")
    written.write_text(str(sock.getsockname()[1]))
    os.replace(written, port_file)
    server(timed(app), settings).run(sockets=[sock])  # type: ignore[arg-type]  # an ASGI app


def replay(service: ExtenderService, nodes: int) -> ASGIApp:
    """The floor: an app that decides nothing and answers each pod shape with the reply bytes
    the real extender gave it once; what HTTP and the client's JSON cost at these sizes."""
    names = [f"node-{n:05d}" for n in range(nodes)]
    replies = []
    for i in range(len(SHAPES)):
        outcome = service.filter(_asked(i), names)
        assert outcome.encoded is not None, outcome.error
        filtered = filter_reply(*outcome.encoded)
        scores = service.prioritize_json(_asked(i), outcome.passed)
        replies.append({"filter": filtered.encode(), "prioritize": scores.encode()})
    # The shapes' limits, told apart in the first bytes of the body (the Pod comes first).
    marks = [json.dumps(limits)[:-1].encode() for limits, _ in SHAPES]

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        body = b""
        more = True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        head = body[:400]
        shape = next((n for n, mark in enumerate(marks) if mark in head), 0)
        verb = scope.get("path", "").rpartition("/")[2]
        out = replies[shape].get(verb, b'{"Error":""}')
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(out))]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": out})

    return app


SHAPES = [
    ({"nvidia.com/gpu.shared": "1", "gpupart.io/gpu-memory": "10240"}, "web"),
    (
        {
            "nvidia.com/gpu.shared": "1",
            "gpupart.io/gpu-memory": "4096",
            "gpupart.io/gpu-compute": "20",
        },
        "a",
    ),
    ({"nvidia.com/mig-1g.10gb": "1"}, "train"),
    ({"nvidia.com/gpu": "2"}, "big"),
]


class Http:
    """A minimal keep-alive HTTP/1.1 client with TCP_NODELAY, one write per request, as Go's;
    over TLS when given a context (extender_tls_flood.py: a client certificate).

    httpx writes headers and body separately without TCP_NODELAY; Nagle plus delayed ACK then
    adds ~40 ms per call, which is the client's cost, not the extender's.
    """

    def __init__(
        self, port: int, context: ssl.SSLContext | None = None, *, timeout: float | None = None
    ) -> None:
        sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = (
            sock if context is None else context.wrap_socket(sock, server_hostname="127.0.0.1")
        )
        self.reader = self.sock.makefile("rb")

    def request(self, method: str, path: str, body: Any = None) -> tuple[int, bytes]:
        """(status, body) of one request; status 0 when the answer is no HTTP."""
        data = b"" if body is None else json.dumps(body).encode()
        head = (
            f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n"
        ).encode()
        self.sock.sendall(head + data)
        status = self.reader.readline()
        length = 0
        while (line := self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            if name.lower() == "content-length":
                length = int(value)
        answer = self.reader.read(length)
        return (int(status.split()[1]) if status.startswith(b"HTTP/") else 0), answer

    def post(self, path: str, body: Any) -> Any:
        status, answer = self.request("POST", path, body)
        if status != 200:
            raise RuntimeError(f"{path}: status {status}")
        return json.loads(answer)

    def get(self, path: str) -> int:
        """The status of a GET (its body read and dropped)."""
        return self.request("GET", path)[0]

    def close(self) -> None:
        self.reader.close()
        self.sock.close()


def _percentiles(timings: list[float]) -> tuple[float, float]:
    timings = sorted(timings)
    return statistics.median(timings), timings[min(len(timings) - 1, int(0.99 * len(timings)))]


def _asked(i: int) -> dict[str, Any]:
    """The i-th pod to place (not in the cluster yet)."""
    limits, app = SHAPES[i % len(SHAPES)]
    return {
        "metadata": {"name": f"p{i}", "namespace": "bench", "uid": f"u{i}", "labels": {"app": app}},
        "spec": {"schedulerName": SCHEDULER, "containers": [{"resources": {"limits": limits}}]},
    }


def python_client(port: int, names: list[str], pods: int) -> list[float]:
    """Milliseconds of each pod's filter+prioritize pair, asked from this process."""
    order = random.Random(7)
    timings = []
    http = Http(port)
    try:
        for i in range(pods):
            pod = _asked(i)
            order.shuffle(names)  # kube-scheduler's parallel filter finds nodes in any order
            started = time.perf_counter()
            out = http.post("/gpupart/filter", {"Pod": pod, "Nodes": None, "NodeNames": names})
            survivors = {"Pod": pod, "Nodes": None, "NodeNames": out["NodeNames"]}
            scores = http.post("/gpupart/prioritize", survivors)
            timings.append((time.perf_counter() - started) * 1000)
            if scores:
                # Bind (not timed) to the best node, as kube-scheduler would: the pod then
                # counts on that node, so the next pod sees a changed cluster.
                best = max(scores, key=lambda s: s["Score"])["Host"]
                binding = {"PodName": f"p{i}", "PodNamespace": "bench", "PodUID": f"u{i}"}
                bound = http.post("/gpupart/bind", {**binding, "Node": best})
                if bound.get("Error"):  # every pod must land, or later pods see another cluster
                    raise RuntimeError(f"bind of p{i} to {best} refused: {bound['Error']}")
    finally:
        http.close()
    return timings


def go_client(binary: Path, url: str, names: list[str], pods: int) -> list[float]:
    """The same pods asked by tests/bench/schedulerclient: kube-scheduler's own request code
    (its extender API types, encoding/json, net/http), in its own process."""
    plan = {
        "names": names,
        "shapes": [{"limits": limits, "app": app} for limits, app in SHAPES],
        "seed": 7,
    }
    out = subprocess.run(
        [str(binary), "-url", f"{url}/gpupart", "-requests", str(pods)],
        input=json.dumps(plan),
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    if out.returncode != 0:
        raise SystemExit(f"schedulerclient failed: {out.stderr.strip()}")
    timings: list[float] = json.loads(out.stdout)["ms"]
    return timings


@contextmanager
def extender_process(nodes: int, *, floor: bool = False) -> Iterator[int]:
    """The extender (or the floor) serving the synthetic cluster of `nodes` in a child process;
    yields its port."""
    port_file = Path(f"/tmp/gpupart-bench-port-{nodes}-{time.time_ns()}")
    serve_args = ["--serve", str(nodes), "--port-file", str(port_file)]
    child = subprocess.Popen(
        [sys.executable, __file__, *serve_args, *(["--floor"] if floor else [])]
    )

    def alive() -> None:
        if child.poll() is not None:
            raise SystemExit(f"the extender process exited with {child.returncode}")

    def port() -> int | None:
        alive()
        return int(port_file.read_text()) if port_file.exists() else None

    def answering(port: int) -> bool:
        """/readyz over the very kind of connection the measurements use (the listener
        accepts it, the app answers, the cache is listed): nothing is timed before that."""
        alive()
        http = Http(port)
        try:
            return http.get("/readyz") == 200
        finally:
            http.close()

    try:
        listening = wait_for(port, 300, "the extender process to write its port")
        wait_for(lambda: answering(listening), 300, "the extender to answer /readyz")
        yield listening
    finally:
        child.terminate()
        child.wait(10)
        port_file.unlink(missing_ok=True)


def measure(nodes: int, requests: int, go: Path | None, *, floor: bool = False) -> dict[str, float]:
    with extender_process(nodes, floor=floor) as port:
        url = f"http://127.0.0.1:{port}"
        names = [f"node-{n:05d}" for n in range(nodes)]
        if go is None:
            every = python_client(port, names, requests + len(SHAPES))
        else:
            every = go_client(go, url, names, requests + len(SHAPES))
        spent = json.loads(httpx.get(f"{url}{TIMINGS}", timeout=5).content)
        cold, timings = every[0], every[len(SHAPES) :]  # the first of each shape fills the memo
        p50, p99 = _percentiles(timings)
        pairs = [(f + p) * 1000 for f, p in zip(spent["filter"], spent["prioritize"], strict=True)]
        server_p50, server_p99 = _percentiles(pairs[len(SHAPES) :])
        print(
            f"{nodes} nodes{' (floor)' if floor else ''}: p50 {p50:.2f} ms, p99 {p99:.2f} ms, "
            f"first (cold) {cold:.1f} ms, {len(timings)} pods; "
            f"in the server: p50 {server_p50:.2f} ms, p99 {server_p99:.2f} ms"
        )
        if floor:
            return {f"floor_p50_ms_{nodes}": round(p50, 2), f"floor_p99_ms_{nodes}": round(p99, 2)}
        return {
            f"p50_ms_{nodes}": round(p50, 2),
            f"p99_ms_{nodes}": round(p99, 2),
            f"server_p50_ms_{nodes}": round(server_p50, 2),
            f"server_p99_ms_{nodes}": round(server_p99, 2),
        }


def measure_preempt(requests: int) -> dict[str, float]:
    """Milliseconds of one preempt call over HTTP: 100 candidate nodes, 20 victims each."""
    with extender_process(PREEMPT_NODES) as port:
        http = Http(port)
        _, pods = preempt_cluster()
        victims = {
            f"node-{n:05d}": {
                "Pods": [
                    {"UID": p["metadata"]["uid"]}
                    for p in pods
                    if p["spec"]["nodeName"] == f"node-{n:05d}"
                ],
                "NumPDBViolations": 0,
            }
            for n in range(PREEMPT_NODES)
        }
        body = {"Pod": PREEMPTOR, "NodeNameToMetaVictims": victims}
        timings = []
        try:
            for _ in range(requests + 1):
                started = time.perf_counter()
                out = http.post("/gpupart/preempt", body)
                timings.append((time.perf_counter() - started) * 1000)
        finally:
            http.close()
        kept = out["NodeNameToMetaVictims"]
        assert len(kept) == PREEMPT_NODES, f"{len(kept)} nodes kept"
        sizes = sorted({len(v["Pods"]) for v in kept.values()})
        p50, p99 = _percentiles(timings[1:])
        print(
            f"preempt, {PREEMPT_NODES} nodes x {PREEMPT_VICTIMS} victims: p50 {p50:.2f} ms, "
            f"p99 {p99:.2f} ms, first {timings[0]:.1f} ms; victims kept per node {sizes}"
        )
        return {"preempt_p50_ms": round(p50, 2), "preempt_p99_ms": round(p99, 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument(
        "--client",
        choices=["python", "go"],
        default="python",
        help="who asks: this process, or tests/bench/schedulerclient (kube-scheduler's own code)",
    )
    parser.add_argument(
        "--floor",
        action="store_true",
        help="also time a server that replays the real replies without deciding anything",
    )
    parser.add_argument(
        "--preempt-only", action="store_true", help="only the preempt figure (100 nodes)"
    )
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port-file", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.port_file, floor=args.floor)
        return 0
    go = goclients.build("schedulerclient") if args.client == "go" else None
    figures: dict[str, float | str] = {"client": "python" if go is None else "go"}
    figures.update(measure_preempt(args.requests))
    for nodes in () if args.preempt_only else (1000, 5000):
        figures.update(measure(nodes, args.requests, go))
        if args.floor:
            figures.update(measure(nodes, args.requests, go, floor=True))
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
