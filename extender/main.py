"""`gpupart extender`: read settings, build the cache, watcher, service and app, serve with uvicorn."""

from __future__ import annotations

import argparse
import cProfile
import gc
import logging
import socket
import sys
import threading
import time
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from gpupart import logs
from gpupart.core.errors import InvalidInput

from . import settings as settings_module
from .app import create_app
from .cache import ClusterCache
from .kube import ApiBinder, Watcher, api_client
from .metrics import Metrics
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
    return sock


def server(app: FastAPI, settings: ExtenderSettings) -> uvicorn.Server:
    """uvicorn as production runs it: uvloop and the C HTTP parser (httptools).

    At 5,000 nodes a filter request carries ~70 KB of names and its answer ~300 KB; the
    pure-Python h11 parser and the default event loop cost more than the decision itself.
    """
    return uvicorn.Server(
        uvicorn.Config(
            app,
            loop="uvloop",
            http="httptools",
            log_level=settings.log_level.lower(),
            access_log=False,
            ssl_certfile=str(settings.tls_cert_file) if settings.tls_cert_file else None,
            ssl_keyfile=str(settings.tls_key_file) if settings.tls_key_file else None,
        )
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    settings_module.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    try:
        settings = settings_module.from_args(args)
    except InvalidInput as error:
        sys.stderr.write(f"gpupart extender: {error}\n")
        return 2
    logs.configure(settings.log_level)
    profilers = start_profiling(settings.profile)
    api = api_client(settings.kubeconfig)
    cache = ClusterCache()
    service = ExtenderService(
        cache,
        settings.scoring(),
        binder=ApiBinder(api),
        metrics=Metrics(),
        ttl_seconds=settings.reservation_ttl_seconds,
        admission_wait_seconds=settings.admission_wait_seconds,
        refresh_seconds=settings.fragmentation_refresh_seconds,
        memo_size=settings.memo_size,
    )
    watcher = Watcher(api, cache, timeout_seconds=settings.resync_seconds)
    watcher.start()
    tune_gc()
    log.info(
        "Started extender",
        extra=logs.kv(host=settings.host, port=settings.port, prefix=settings.prefix),
    )
    try:
        app = create_app(settings, service)
        # uvicorn re-raises SIGTERM after its graceful shutdown: dump from the shutdown hook.
        if settings.profile is not None:
            profile = settings.profile
            app.router.on_shutdown.append(lambda: dump_profile(profilers, profile))
        server(app, settings).run(sockets=[listen(settings.host, settings.port)])
    finally:
        watcher.stop()
    return 0
