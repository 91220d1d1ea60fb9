"""Prometheus metrics of the node agent and the small HTTP server for /metrics and /healthz."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from gpupart.core.node.devices import Listing


class NodeMetrics:
    """One registry per agent (no global default registry), filled by the agent and the servicers."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.devices = Gauge(
            "gpupart_node_devices",
            "Devices advertised to the kubelet, by resource and health",
            ["resource", "health"],
            registry=self.registry,
        )
        self.allocations = Counter(
            "gpupart_node_allocations",
            "Allocate calls per container, by resource and result",
            ["resource", "result"],
            registry=self.registry,
        )
        self.apply_seconds = Histogram(
            "gpupart_node_apply_seconds",
            "Duration of one reconcile pass (read NVML, plan, apply, report)",
            registry=self.registry,
            buckets=(0.01, 0.05, 0.1, 0.5, 1, 5, 15, 60, 300),
        )
        self.apply_failures = Counter(
            "gpupart_node_apply_failures",
            "GPUs whose layout could not be applied in a pass",
            registry=self.registry,
        )

    def count_devices(self, listings: Mapping[str, Listing]) -> None:
        """The devices per resource as ListAndWatch sends them (`DeviceHub.listings`)."""
        for resource, listing in sorted(listings.items()):
            healthy = len(listing.healthy)
            self.devices.labels(resource, "Healthy").set(healthy)
            self.devices.labels(resource, "Unhealthy").set(len(listing.ids) - healthy)

    def allocated(self, resource: str, ok: bool) -> None:
        self.allocations.labels(resource, "ok" if ok else "error").inc()


def serve_http(
    metrics: NodeMetrics, healthy: Callable[[], bool], *, host: str, port: int
) -> ThreadingHTTPServer:
    """Start /metrics and /healthz on a daemon thread; the caller shuts the server down."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path == "/metrics":
                body, status, kind = generate_latest(metrics.registry), 200, CONTENT_TYPE_LATEST
            elif self.path == "/healthz":
                ok = healthy()
                body, status, kind = (
                    (b"ok" if ok else b"unhealthy"),
                    200 if ok else 503,
                    "text/plain",
                )
            else:
                body, status, kind = b"not found", 404, "text/plain"
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            pass  # scrapes every few seconds would drown the agent's log

    server = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server
