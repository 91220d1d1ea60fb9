"""Benchmark: a scheduler's filter calls over TLS with client certificates, quiet and beside 1,000 half-open.

The extender runs in a child process as `gpupart extender` serves (uvicorn, uvloop, httptools,
`server()` with tls_cert_file, tls_key_file and tls_client_ca_file: client certificates
required, the default bounds: `tls_handshake_timeout_seconds` 5, `max_connections` 1024), fed the
synthetic cluster of extender_latency.py (1,000 nodes by default). The parent plays
kube-scheduler: one keep-alive HTTPS connection with a client certificate, POST filter with
every node name in a new order for each pod (the pods of extender_latency.py, cycling through
its shapes), one call at a time, each timed from the request's first byte to the reply
decoded. It also times new connections (TCP connect, TLS handshake with the certificate, one
filter), as kube-scheduler makes one after an idle close.

Twice: quiet, then while a third process holds `--half-open` TLS connections open that never
complete a handshake (every other one sends nothing, the rest the first bytes of a
ClientHello), re-opening each one the server drops (at the handshake bound), so that as many
are always open or being re-opened. Nothing is timed in the flood phase before all of them are
open.

File descriptors: this process and the flood's raise RLIMIT_NOFILE's soft limit to the hard
one (the flood needs one per connection); the extender raises its own (`descriptor_room`).

The last line is JSON: {"quiet_ms": {"p50", "p99"}, "flood_ms": {"p50", "p99"},
"flood_p99_over_quiet", "half_open", "answered", "errors", "reopened", "nodes",
"new_connection_ms": {"quiet": {"p50", "p99"}, "flood": {"p50", "p99"}}}: "answered" the
filter calls answered 200 in the flood phase (of "asked"; "quiet_answered" the quiet phase's),
"errors" the calls of either
phase that failed, "reopened" the half-open connections the server dropped and the flood
opened again while it ran.

Each phase makes at least `--requests` calls and lasts at least `--seconds` (12: the flood's
connections are dropped at the 5 s handshake bound and re-opened while calls are timed).

Run: .venv/bin/python tests/bench/extender_tls_flood.py [--requests 500] [--seconds 12]
    [--nodes 1000] [--half-open 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import signal
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from extender_latency import KEYS, Http, NoBinder, _asked, _percentiles, cluster

from gpupart_extender.app import create_app
from gpupart_extender.cache import NAMESPACE, NODE, POD, ClusterCache
from gpupart_extender.main import listen, server, tune_gc
from gpupart_extender.metrics import Metrics
from gpupart_extender.service import ExtenderService
from gpupart_extender.settings import ExtenderSettings
from gpupart_testsupport.polling import wait_for

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "extender"))
from test_extender_tls import Pki, client_context, write_pki  # noqa: E402  # its certificates

LOOPBACK = "127.0.0.1"
PARTIAL_CLIENT_HELLO = b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 16
"""A TLS record header announcing a 512-byte ClientHello, and its first bytes only."""
NEW_CONNECTIONS = 50


def raise_nofile() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def serve(nodes: int, pki_dir: Path, port_file: Path) -> None:
    """The extender's app, TLS with client certificates, on a loopback port (written whole to
    `port_file`)."""
    raise_nofile()
    pki = _pki(pki_dir)
    cache = ClusterCache(keys=lambda: KEYS)
    node_objs, pods = cluster(nodes)
    cache.replace(NODE, node_objs)
    cache.replace(POD, pods)
    cache.replace(NAMESPACE, [])  # every kind listed: /readyz says 200
    settings = ExtenderSettings(
        log_level="WARNING",
        host=LOOPBACK,
        tls_cert_file=pki.server[0],
        tls_key_file=pki.server[1],
        tls_client_ca_file=pki.ca,
    )
    service = ExtenderService(
        cache, settings.scoring(), binder=NoBinder(), metrics=Metrics(), keys=lambda: KEYS
    )
    app = create_app(settings, service)
    tune_gc()
    sock = listen(LOOPBACK, 0)
    written = port_file.with_suffix(".tmp")
    written.write_text(str(sock.getsockname()[1]))
    os.replace(written, port_file)
    server(app, settings).run(sockets=[sock])


def _pki(d: Path) -> Pki:
    return Pki(
        d / "ca.crt",
        (d / "server.crt", d / "server.key"),
        (d / "client.crt", d / "client.key"),
        (d / "stranger.crt", d / "stranger.key"),
    )


def flood(port: int, count: int, status_file: Path) -> None:
    """Hold `count` half-open TLS connections to `port` until SIGTERM, re-opening each one the
    server closes; writes {"held", "opened", "reopened"} to `status_file` every 0.2 s."""
    raise_nofile()

    async def run() -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        counts = {"held": 0, "opened": 0, "reopened": 0}

        class HalfOpen(asyncio.Protocol):
            def __init__(self, index: int) -> None:
                self.index = index

            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                counts["held"] += 1
                counts["opened"] += 1
                if self.index % 2:
                    transport.write(PARTIAL_CLIENT_HELLO)  # type: ignore[attr-defined]

            def connection_lost(self, _exc: Exception | None) -> None:
                counts["held"] -= 1
                if not stop.is_set():
                    counts["reopened"] += 1
                    loop.create_task(connect(self.index))

        async def connect(index: int) -> None:
            while not stop.is_set():
                try:
                    await loop.create_connection(lambda: HalfOpen(index), LOOPBACK, port)
                    return
                except OSError:
                    await asyncio.sleep(0.05)

        async def report() -> None:
            while not stop.is_set():
                written = status_file.with_suffix(".tmp")
                written.write_text(json.dumps(counts))
                os.replace(written, status_file)
                await asyncio.sleep(0.2)

        reporter = loop.create_task(report())
        for start in range(0, count, 100):  # in batches: the listen backlog is 2048
            await asyncio.gather(*(connect(i) for i in range(start, min(count, start + 100))))
        await stop.wait()
        await reporter

    asyncio.run(run())


@contextmanager
def child(args: list[str]) -> Iterator[subprocess.Popen[bytes]]:
    process = subprocess.Popen([sys.executable, __file__, *args])
    try:
        yield process
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text()) if path.exists() else None


def filter_calls(
    http: Http, names: list[str], pods: range, errors: list[str], *, seconds: float = 0
) -> list[float]:
    """Milliseconds of each answered filter call, one pod after another: the pods of `pods`,
    and more after them until `seconds` have passed."""
    order = random.Random(7)
    timings = []
    until = time.monotonic() + seconds
    i = pods.start - 1
    while i + 1 < pods.stop or time.monotonic() < until:
        i += 1
        order.shuffle(names)
        body = {"Pod": _asked(i), "Nodes": None, "NodeNames": names}
        started = time.perf_counter()
        try:
            status, answer = http.request("POST", "/gpupart/filter", body)
            reply = json.loads(answer)
        except (OSError, ValueError) as error:
            errors.append(f"filter p{i}: {error!r}")
            continue
        elapsed = (time.perf_counter() - started) * 1000
        if status != 200 or reply.get("Error"):
            errors.append(f"filter p{i}: {status} {answer[:200]!r}")
            continue
        timings.append(elapsed)
    return timings


def new_connections(
    port: int, context: ssl.SSLContext, names: list[str], errors: list[str]
) -> list[float]:
    """Milliseconds from connect to a filter's answer on a fresh connection, NEW_CONNECTIONS times."""
    timings = []
    for i in range(NEW_CONNECTIONS):
        started = time.perf_counter()
        try:
            http = Http(port, context, timeout=30)
        except OSError as error:
            errors.append(f"new connection {i}: {error!r}")
            continue
        try:
            status, _ = http.request(
                "POST", "/gpupart/filter", {"Pod": _asked(i), "NodeNames": names}
            )
        except OSError as error:
            errors.append(f"new connection {i}: {error!r}")
            continue
        finally:
            http.close()
        if status != 200:
            errors.append(f"new connection {i}: {status}")
            continue
        timings.append((time.perf_counter() - started) * 1000)
    return timings


def _summary(timings: list[float]) -> dict[str, float | None]:
    if not timings:
        return {"p50": None, "p99": None}
    p50, p99 = _percentiles(timings)
    return {"p50": round(p50, 2), "p99": round(p99, 2)}


def measure(nodes: int, requests: int, half_open: int, seconds: float) -> dict[str, Any]:
    raise_nofile()
    with tempfile.TemporaryDirectory(prefix="gpupart-tls-flood-") as tmp:
        d = Path(tmp)
        pki = write_pki(d)
        port_file, status_file = d / "port", d / "flood.json"
        context = client_context(pki, pki.client)
        names = [f"node-{n:05d}" for n in range(nodes)]
        errors: list[str] = []
        with child(["--serve", str(nodes), "--pki", str(d), "--port-file", str(port_file)]) as ext:

            def port() -> int | None:
                if ext.poll() is not None:
                    raise SystemExit(f"the extender process exited with {ext.returncode}")
                return int(port_file.read_text()) if port_file.exists() else None

            listening = wait_for(port, 300, "the extender process to write its port")

            def ready() -> bool:
                http = Http(listening, context, timeout=30)
                try:
                    return http.request("GET", "/readyz")[0] == 200
                finally:
                    http.close()

            wait_for(ready, 300, "the extender to answer /readyz over TLS")
            http = Http(listening, context, timeout=30)
            warm = len(names) // 100 + 8
            filter_calls(http, names, range(warm), errors)  # the memo, one pod of each shape
            quiet = filter_calls(http, names, range(warm, warm + requests), errors, seconds=seconds)
            quiet_new = new_connections(listening, context, names, errors)
            flood_args = ["--flood", str(listening), "--half-open", str(half_open)]
            with child([*flood_args, "--status-file", str(status_file)]) as flooder:

                def all_open() -> bool:
                    if flooder.poll() is not None:
                        raise SystemExit(f"the flood process exited with {flooder.returncode}")
                    status = _read_json(status_file)
                    return status is not None and status["held"] >= half_open

                wait_for(all_open, 120, f"{half_open} half-open connections", interval=0.05)
                failed = len(errors)
                first = 1_000_000  # pod names apart from the quiet phase's
                flooded = filter_calls(
                    http, names, range(first, first + requests), errors, seconds=seconds
                )
                asked = len(flooded) + len(errors) - failed
                flooded_new = new_connections(listening, context, names, errors)
                status = _read_json(status_file)
            http.close()
    quiet_ms, flood_ms = _summary(quiet), _summary(flooded)
    ratio = (
        round(flood_ms["p99"] / quiet_ms["p99"], 2)
        if flood_ms["p99"] is not None and quiet_ms["p99"]
        else None
    )
    for error in errors[:10]:
        print(error)
    print(
        f"{nodes} nodes, filter over TLS: quiet p50 {quiet_ms['p50']} ms p99 {quiet_ms['p99']} ms; "
        f"beside {half_open} half-open: p50 {flood_ms['p50']} ms p99 {flood_ms['p99']} ms "
        f"({len(flooded)}/{asked} answered, {len(quiet)} quiet; {status['reopened']} half-open re-opened after "
        "the server dropped them)"
    )
    return {
        "quiet_ms": quiet_ms,
        "flood_ms": flood_ms,
        "flood_p99_over_quiet": ratio,
        "half_open": half_open,
        "answered": len(flooded),
        "asked": asked,
        "quiet_answered": len(quiet),
        "errors": len(errors),
        "reopened": status["reopened"],
        "nodes": nodes,
        "new_connection_ms": {"quiet": _summary(quiet_new), "flood": _summary(flooded_new)},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--half-open", type=int, default=1000)
    parser.add_argument(
        "--seconds",
        type=float,
        default=12,
        help="each phase lasts at least this long (above the 5 s handshake bound: the flood's "
        "connections are dropped and re-opened while the scheduler's calls are timed)",
    )
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--pki", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--port-file", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--flood", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--status-file", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve is not None:
        serve(args.serve, args.pki, args.port_file)
        return
    if args.flood is not None:
        flood(args.flood, args.half_open, args.status_file)
        return
    print(json.dumps(measure(args.nodes, args.requests, args.half_open, args.seconds)))


if __name__ == "__main__":
    main()
