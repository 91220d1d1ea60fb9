"""Prometheus metrics of the operator, in a registry of its own (never the process-global one)."""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server


class Metrics:
    """Reconciles, errors, pass duration, API writes by kind, partitions by Ready reason."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.reconciles = Counter(
            "gpupart_operator_reconciles",
            "Reconcile passes over all GpuPartitions and Nodes",
            registry=self.registry,
        )
        self.errors = Counter(
            "gpupart_operator_reconcile_errors",
            "Reconcile passes that failed (API errors); the pass is retried",
            registry=self.registry,
        )
        self.refused = Counter(
            "gpupart_operator_refused_writes",
            "Writes to one object that the API server refused (4xx) or its data broke; the "
            "log names the object and the API server's reason",
            registry=self.registry,
        )
        self.duration = Histogram(
            "gpupart_operator_reconcile_duration_seconds",
            "Duration of one reconcile pass, listing and writes included",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=self.registry,
        )
        self.writes = Counter(
            "gpupart_operator_api_writes",
            "Writes sent to the API server, by kind (node, status, event)",
            ["kind"],
            registry=self.registry,
        )
        self.partitions = Gauge(
            "gpupart_operator_partitions",
            "GpuPartitions by the reason of their Ready condition",
            ["state"],
            registry=self.registry,
        )

    def set_partitions(self, by_state: Mapping[str, int]) -> None:
        self.partitions.clear()
        for state, count in by_state.items():
            self.partitions.labels(state=state).set(count)

    def serve(self, address: str, port: int) -> None:
        start_http_server(port, addr=address, registry=self.registry)
