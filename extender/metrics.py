"""Prometheus metrics of one extender instance, in its own registry (no process-wide globals)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from .snapshot import Snapshot

# Latency buckets around the 10 ms goal at 5,000 nodes, and up to the scheduler's timeout.
_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.latency = Histogram(
            "gpupart_extender_request_duration_seconds",
            "Time to answer one extender call, by verb",
            ["verb"],
            buckets=_BUCKETS,
            registry=self.registry,
        )
        self.decisions = Counter(
            "gpupart_extender_decisions_total",
            "Extender calls by verb and outcome (ok, error, unschedulable)",
            ["verb", "outcome"],
            registry=self.registry,
        )
        self.filtered = Counter(
            "gpupart_extender_filtered_nodes_total",
            "Nodes filtered out, by reason",
            ["reason"],
            registry=self.registry,
        )
        self.preemptions = Counter(
            "gpupart_extender_preemption_requests_total",
            "Preempt calls answered (kube-scheduler's preemption asking which victims free a GPU)",
            registry=self.registry,
        )
        self.victims = Counter(
            "gpupart_extender_preemption_victims_total",
            "Victims proposed in preempt answers, summed over the candidate nodes kept",
            registry=self.registry,
        )
        self.dropped = Counter(
            "gpupart_extender_preemption_nodes_dropped_total",
            "Candidate nodes dropped from preempt answers: no set of lower-priority pods on one "
            "GPU lets the pod fit, or the victims shown free no slice of its profile",
            registry=self.registry,
        )
        self.refused = Counter(
            "gpupart_extender_requests_refused_total",
            "Requests refused before they were read in full: too_large (413: over "
            "max_request_bytes or max_request_nodes), busy (503: over max_concurrent_requests, "
            "or the bodies in flight over their budget)",
            ["reason"],
            registry=self.registry,
        )
        self.cache = Gauge(
            "gpupart_extender_cache_objects",
            "Objects in the watch cache",
            ["kind"],
            registry=self.registry,
        )
        self.mig_reservations = Gauge(
            "gpupart_extender_mig_reservations",
            "Live MIG slice reservations honoured: named by a Node's gpupart.io/mig-plan, on a "
            "MIG device of its inventory, not expired, their pod not bound yet",
            registry=self.registry,
        )
        self.unreadable = Gauge(
            "gpupart_extender_unreadable_objects",
            "Objects the watch cache could not read, by kind: Pods skipped, Nodes kept with "
            "the problem as their reason (diagnose lists them)",
            ["kind"],
            registry=self.registry,
        )

    def observe(self, snapshot: Callable[[], Snapshot], wall: Callable[[], float]) -> None:
        """The cluster state's gauges read the current snapshot whenever they are scraped (a
        scrape changes nothing): its counts, its unreadable objects, and its MIG reservations
        not expired by `wall` (Unix seconds, the clock they expire by)."""
        empty = Snapshot.empty()
        for kind in empty.counts():
            self.cache.labels(kind).set_function(partial(_count, snapshot, kind))
        for kind in empty.unreadable_counts():
            self.unreadable.labels(kind).set_function(partial(_unreadable, snapshot, kind))
        self.mig_reservations.set_function(lambda: snapshot().mig_reservations(wall()))


def _count(snapshot: Callable[[], Snapshot], kind: str) -> float:
    return snapshot().counts()[kind]


def _unreadable(snapshot: Callable[[], Snapshot], kind: str) -> float:
    return snapshot().unreadable_counts()[kind]
