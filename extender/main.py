"""`gpupart extender`: read settings, build the cache, watcher, service and apps, serve them with uvicorn.

Two listeners on one event loop: the verbs (and health) on `host:port`, HTTPS with required
client certificates when `tls_client_ca_file` is set (else loopback only, unless
`allow_unauthenticated`), and the plain-HTTP health port (`health_host:health_port`) serving
only /healthz, /readyz and /metrics.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import gc
import logging
import resource
import socket
import ssl
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import uvicorn
from fastapi import FastAPI
from uvicorn.config import create_ssl_context

from gpupart import logs
from gpupart.core.api.provenance import config_map_ref
from gpupart.core.errors import InvalidInput
from gpupart.keyfile import KeyFile, KeyFileUnreadable
from gpupart.publickeys import ConfigMapKeys, KeyPublisher

from . import settings as settings_module
from .app import create_app, create_health_app
from .cache import ClusterCache
from .kube import ApiBinder, ApiEvents, Watcher, api_client
from .limits import BoundedHttpTools, Connections, gated
from .metrics import Metrics
from .pending import PendingPods, Reporter
from .service import ExtenderService
from .settings import ExtenderSettings

log = logging.getLogger(__name__)


def tune_gc() -> None:
    """Fewer full collections: the cache and verdict memo hold hundreds of thousands of
    long-lived objects, and a full pass over them costs more than a whole filter call."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 50, 1000)


def start_profiling(path: Path | None) -> list[cProfile.Profile] | None:
    """--profile=<file> (GPUPART_EXTENDER_PROFILE): cProfile every thread (event loop, watch,
    bind pool); the merged stats are dumped to <file> at shutdown. Off (None) by default."""
    if path is None:
        return None
    profilers: list[cProfile.Profile] = []

    def per_thread(*_: object) -> None:
        profiler = cProfile.Profile(time.thread_time)
        profilers.append(profiler)
        profiler.enable()  # replaces this hook for the calling thread

    threading.setprofile(per_thread)
    main = cProfile.Profile(time.thread_time)
    profilers.append(main)
    main.enable()
    return profilers


def dump_profile(profilers: list[cProfile.Profile] | None, path: Path) -> None:
    import pstats

    if not profilers:
        return
    for profiler in profilers:
        profiler.create_stats()
    stats = pstats.Stats(profilers[0])
    for profiler in profilers[1:]:
        stats.add(profiler)
    stats.dump_stats(str(path))


def listen(host: str, port: int) -> socket.socket:
    """The listening socket, with TCP_NODELAY (inherited by accepted connections).

    uvicorn writes response headers and body separately; without NODELAY, Nagle plus the
    client's delayed ACK add ~40 ms to every call.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    # Listening from here: a client that connects before uvicorn starts waits in the backlog
    # instead of being refused (uvicorn listens again on the same socket, which is harmless).
    sock.listen(2048)
    return sock


FD_RESERVE = 256
"""Descriptors kept beside the connections: the watch and bind pool's API connections (40
threads), the listeners, the key and certificate files, the interpreter's own."""


def descriptor_room(max_connections: int) -> int:
    """The connections the process can hold: `max_connections`, after raising the soft
    file-descriptor limit to fit it and `FD_RESERVE` (up to the hard limit); less when the
    hard limit is lower (logged). Above the limit, accept() fails with EMFILE, and libuv then
    accepts and closes every pending connection: the legitimate client's too."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = max_connections + FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < wanted:
        soft = wanted if hard == resource.RLIM_INFINITY else min(hard, wanted)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        return max_connections
    room = max(1, soft - FD_RESERVE)
    log.warning(
        "Lowered max_connections to fit the file-descriptor limit",
        extra=logs.kv(max_connections=room, setting=max_connections, nofile=soft),
    )
    return room


def tls_context(settings: ExtenderSettings) -> ssl.SSLContext | None:
    """The server's TLS context (uvicorn's own, as `ssl_certfile` etc. would build it), or None
    for plain HTTP; raises OSError or ssl.SSLError for a certificate it cannot read."""
    if settings.tls_cert_file is None:
        return None
    ca = settings.tls_client_ca_file
    return create_ssl_context(
        certfile=settings.tls_cert_file,
        keyfile=settings.tls_key_file,
        password=None,
        ssl_version=ssl.PROTOCOL_TLS_SERVER,
        cert_reqs=ssl.CERT_REQUIRED if ca is not None else ssl.CERT_NONE,
        ca_certs=ca,
        ciphers=None,
    )


def server(app: FastAPI, settings: ExtenderSettings) -> uvicorn.Server:
    """uvicorn as production runs it: uvloop and the C HTTP parser (httptools), with the
    request head bounded (`limits.BoundedHttpTools`); HTTPS when a certificate is set,
    requiring a client certificate signed by `tls_client_ca_file` when that is set (a client
    without one fails the handshake: no HTTP answer at all).

    Over TLS, each connection is counted from its accept and its handshake bounded
    (`limits.TlsGate`: `tls_handshake_timeout_seconds`, `max_connections`); uvicorn itself is
    given no TLS settings. Raises OSError or ssl.SSLError for an unreadable certificate.

    At 5,000 nodes a filter request carries ~70 KB of names and its answer ~300 KB; the
    pure-Python h11 parser and the default event loop cost more than the decision itself.
    """
    context = tls_context(settings)
    http: type[asyncio.Protocol] = BoundedHttpTools
    if context is not None:
        connections = Connections(
            context,
            handshake_timeout=settings.tls_handshake_timeout_seconds,
            max_connections=descriptor_room(settings.max_connections),
        )
        http = gated(BoundedHttpTools, connections)
    return uvicorn.Server(
        uvicorn.Config(
            app,
            loop="uvloop",
            http=http,
            log_level=settings.log_level.lower(),
            access_log=False,
            timeout_keep_alive=settings.keep_alive_timeout_seconds,
        )
    )


class _Follower(uvicorn.Server):
    """A second server on the same loop: it leaves the signals to the first one, which stops
    it when it stops (two servers each taking SIGTERM would leave one running)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def health_server(app: FastAPI, settings: ExtenderSettings) -> uvicorn.Server:
    """The plain-HTTP health port (no TLS: kubelet probes and scrapers carry no client cert)."""
    return _Follower(
        uvicorn.Config(
            app,
            loop="uvloop",
            http=BoundedHttpTools,
            lifespan="off",
            log_level=settings.log_level.lower(),
            access_log=False,
        )
    )


def serve(
    main: uvicorn.Server,
    main_socket: socket.socket,
    health: uvicorn.Server | None = None,
    health_socket: socket.socket | None = None,
) -> None:
    """Serve both until the main server stops (SIGTERM, SIGINT), then stop the health one."""

    async def both() -> None:
        followed = None
        if health is not None and health_socket is not None:
            followed = asyncio.create_task(health.serve(sockets=[health_socket]))
        try:
            await main.serve(sockets=[main_socket])
        finally:
            if health is not None and followed is not None:
                health.should_exit = True
                await followed

    with asyncio.Runner(loop_factory=main.config.get_loop_factory()) as runner:
        runner.run(both())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    settings_module.add_arguments(parser)


def _fail(problem: str) -> int:
    sys.stderr.write(f"gpupart extender: {problem}\n")
    return 2


def run(args: argparse.Namespace) -> int:
    try:
        settings = settings_module.from_args(args)
    except InvalidInput as error:
        return _fail(str(error))
    logs.configure(settings.log_level)
    try:
        api = api_client(settings.kubeconfig)  # first: no credentials is a one-line error
    except InvalidInput as error:
        return _fail(str(error))
    path = settings.assignment_key_file
    keys = None if path is None else KeyFile.private(path)
    if keys is None:
        log.warning(
            "Started without an assignment key: shared-GPU binds will be refused",
            extra=logs.kv(setting="assignment_key_file"),
        )
    else:
        try:
            keys.keys()
        except KeyFileUnreadable as error:  # it may appear later (a Secret being mounted)
            log.warning(
                "Cannot read the assignment key yet: shared-GPU binds are refused until it can",
                extra=logs.kv(err=str(error)),
            )
        except InvalidInput as error:  # e.g. public keys only: this extender could never sign
            return _fail(f"{error} (setting assignment_key_file)")
    publisher = None
    if keys is not None and settings.assignment_public_keys is not None:
        namespace, name = config_map_ref(
            settings.assignment_public_keys, where="assignment_public_keys"
        )
        publisher = KeyPublisher(keys.keys, ConfigMapKeys(api, namespace, name))
    metrics = Metrics()
    # Both listeners first: a port in use or an unreadable certificate is a one-line error.
    try:
        main_socket = listen(settings.host, settings.port)
        health_socket = (
            listen(settings.health_host, settings.health_port) if settings.health_port else None
        )
    except OSError as error:
        return _fail(f"cannot listen: {error}")
    profilers = start_profiling(settings.profile)
    cache = ClusterCache(keys=None if keys is None else keys.keys)
    service = ExtenderService(
        cache,
        settings.scoring(),
        binder=ApiBinder(api),
        metrics=metrics,
        ttl_seconds=settings.reservation_ttl_seconds,
        admission_wait_seconds=settings.admission_wait_seconds,
        refresh_seconds=settings.fragmentation_refresh_seconds,
        memo_size=settings.memo_size,
        keys=None if keys is None else keys.keys,
        scheduler_names=settings.scheduler_names,
    )
    pending = PendingPods(settings.scheduler_names) if settings.pending_reasons_seconds else None
    watcher = Watcher(api, cache, period_seconds=settings.resync_seconds, pending=pending)
    app = create_app(settings, service, watcher.health)
    health = (
        None
        if health_socket is None
        else health_server(create_health_app(service, watcher.health), settings)
    )
    try:
        main = server(app, settings)  # reads the certificates and the client CA now
        main.config.load()
    except (OSError, ssl.SSLError) as error:
        return _fail(
            f"cannot set up TLS (tls_cert_file, tls_key_file, tls_client_ca_file): {error}"
        )
    watcher.start()
    if publisher is not None:
        # The node agents read the public keys there, at start and whenever the file changes.
        threading.Thread(
            target=publisher.run, args=(watcher.stopping,), name="public-keys", daemon=True
        ).start()
    if pending is not None:
        # kube-scheduler never asks about pods its own counts rejected everywhere: say why.
        reporter = Reporter(pending, service.pending_reason, ApiEvents(api))
        threading.Thread(
            target=reporter.run,
            args=(watcher.stopping, settings.pending_reasons_seconds),
            name="pending-reasons",
            daemon=True,
        ).start()
    tune_gc()
    log.info(
        "Started extender",
        extra=logs.kv(
            host=settings.host,
            port=settings.port,
            prefix=settings.prefix,
            tls="client certificates"
            if settings.tls_client_ca_file
            else ("server only" if settings.tls_cert_file else "off"),
            health=f"{settings.health_host}:{settings.health_port}" if health else "off",
        ),
    )
    try:
        # uvicorn re-raises SIGTERM after its graceful shutdown: dump from the shutdown hook.
        if settings.profile is not None:
            profile = settings.profile
            app.router.on_shutdown.append(lambda: dump_profile(profilers, profile))
        serve(main, main_socket, health, health_socket)
    finally:
        watcher.stop()
    return 0
