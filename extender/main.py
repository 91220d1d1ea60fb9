"""`gpupart extender`: read settings, build the cache, watcher, service and app, serve with uvicorn."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import uvicorn

from . import logs
from .app import create_app
from .cache import ClusterCache
from .kube import ApiBinder, Watcher, api_client
from .metrics import Metrics
from .service import ExtenderService
from .settings import load_settings

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, help="YAML settings file (see docs/extender.md)")
    parser.add_argument("--host", help="listen address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="listen port (default 8888)")
    parser.add_argument("--kubeconfig", type=Path, help="kubeconfig (default: in-cluster)")
    parser.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"])


def run(args: argparse.Namespace) -> int:
    settings = load_settings(
        args.config,
        host=args.host,
        port=args.port,
        kubeconfig=args.kubeconfig,
        log_level=args.log_level,
    )
    logs.configure(settings.log_level)
    api = api_client(settings.kubeconfig)
    cache = ClusterCache()
    service = ExtenderService(
        cache,
        settings.scoring(),
        binder=ApiBinder(api),
        metrics=Metrics(),
        ttl_seconds=settings.reservation_ttl_seconds,
        refresh_seconds=settings.fragmentation_refresh_seconds,
        memo_size=settings.memo_size,
    )
    watcher = Watcher(api, cache, timeout_seconds=settings.resync_seconds)
    watcher.start()
    log.info(
        "Started extender",
        extra={"kv": {"host": settings.host, "port": settings.port, "prefix": settings.prefix}},
    )
    try:
        uvicorn.run(
            create_app(settings, service),
            host=settings.host,
            port=settings.port,
            log_level=settings.log_level.lower(),
            access_log=False,
            ssl_certfile=str(settings.tls_cert_file) if settings.tls_cert_file else None,
            ssl_keyfile=str(settings.tls_key_file) if settings.tls_key_file else None,
        )
    finally:
        watcher.stop()
    return 0
