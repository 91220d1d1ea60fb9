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

        self.plans = Counter(
            "gpupart_dynamic_mig_plans",
            "MIG plans written to nodes, and node agents' answers to them (written, applied, "
            "failed)",
            ["result"],
            registry=self.registry,
        )
        self.operations = Counter(
            "gpupart_dynamic_mig_instance_operations",
            "GPU instances the written MIG plans create or destroy",
            ["op"],
            registry=self.registry,
        )
        self.reservations_expired = Counter(
            "gpupart_dynamic_mig_reservations_expired",
            "Slices reserved for a pod that was not bound within the reservation TTL",
            registry=self.registry,
        )
        self.disruptions = Counter(
            "gpupart_dynamic_mig_disruptions",
            "Instances a written plan would destroy while the node agent reports them used "
            "(the node agent refuses them; 0 unless a pod took an idle instance after a plan "
            "destroying it was written)",
            registry=self.registry,
        )
        self.pending_to_bound = Histogram(
            "gpupart_dynamic_mig_pending_to_bound_seconds",
            "From a pod's creation to its binding, for pods a MIG plan reserved a slice for",
            buckets=(0.5, 1, 2, 3, 5, 7.5, 10, 15, 30, 60, 120, 300),
            registry=self.registry,
        )
        self.demand_duration = Histogram(
            "gpupart_dynamic_mig_round_duration_seconds",
            "Duration of one dynamic MIG round: listing, planning and writes",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=self.registry,
        )

    def set_partitions(self, by_state: Mapping[str, int]) -> None:
        self.partitions.clear()
        for state, count in by_state.items():
            self.partitions.labels(state=state).set(count)

    def serve(self, address: str, port: int) -> None:
        start_http_server(port, addr=address, registry=self.registry)
