"""Dynamic MIG rounds against the API server: list, let the pure room decide, write plans, Events and status.

`DemandRounds.run_round` is level-triggered like the partition pass (ADR 007): every round
lists what is there now, `gpupart_operator.demand` (around the core's `plan_round`) decides,
and only nodes whose plan changes are written, in parallel, through the `Writer` the partition
pass uses too. Its memory is one `demand.Memory` value, replaced by each round.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping

from gpupart import logs
from gpupart.core.dynamic.live import Round
from gpupart_operator import demand
from gpupart_operator.metrics import Metrics
from gpupart_operator.model import InventoryCache, Resolutions, read_node, read_partition
from gpupart_operator.settings import OperatorSettings
from gpupart_operator.writer import Writer, utc_now

log = logging.getLogger("gpupart.operator")


class DemandRounds:
    """Runs dynamic MIG rounds, one at a time; `clock` is the rounds' time (Unix seconds)."""

    def __init__(
        self,
        writer: Writer,
        settings: OperatorSettings,
        metrics: Metrics,
        resolutions: Resolutions,
        *,
        clock: Callable[[], float] = time.time,
        stamp: Callable[[], str] = utc_now,
    ) -> None:
        self._writer = writer
        self._settings = settings
        self._metrics = metrics
        self._resolutions = resolutions
        self._clock = clock
        self._stamp = stamp
        """The timestamps of the Events posted about pods."""
        self._lock = threading.Lock()
        self._inventories = InventoryCache()
        self._memory = demand.Memory()

    def run_round(self) -> Round | None:
        with self._lock:
            started = time.monotonic()
            try:
                return self._round()
            finally:
                self._metrics.demand_duration.observe(time.monotonic() - started)

    def _round(self) -> Round | None:
        now = self._clock()
        settings, metrics = self._settings, self._metrics
        partitions = [read_partition(raw) for raw in self._writer.list_partitions()]
        raw_nodes = self._writer.list_nodes()
        nodes = [read_node(raw, self._inventories) for raw in raw_nodes]
        self._inventories.keep({n.name for n in nodes})
        surveyed = demand.survey(partitions, raw_nodes, nodes, resolve=self._resolutions.resolve)
        if surveyed.stale:  # a node no dynamic partition holds any more keeps no plan
            self._writer.write_plans(dict.fromkeys(surveyed.stale))
        for partition in partitions:  # moved to DRA: the rounds no longer speak for it
            spec = partition.partition.spec if partition.partition is not None else None
            if (
                spec is not None
                and spec.dynamic is not None
                and not demand.planned_by_rounds(spec)
                and partition.status.get("dynamicMig") is not None
            ):
                self._writer.remove_dynamic_status(partition.name)
        if not surveyed.live:
            return None
        pods = demand.read_pods(self._writer.list_pods())
        for pod, error in pods.skipped:
            log.debug("Skipped pod", extra=logs.kv(pod=pod, err=error))
        for view in surveyed.nodes:
            for annotation, error in view.ignored:
                log.warning(
                    "Ignored annotation",
                    extra=logs.kv(node=view.name, annotation=annotation, err=error),
                )
        self._memory, planned = demand.plan_demand(
            self._memory,
            surveyed,
            pods,
            now=now,
            ttl_s=settings.reservation_ttl_seconds,
            retry_s=settings.plan_retry_seconds,
        )
        for answer in planned.answers:
            metrics.plans.labels(result=answer).inc()
        result = planned.round
        written = self._writer.write_plans({n: c.plan for n, c in result.changes.items()})
        facts = {f.name: f for f in planned.facts}
        for name in written:
            change = result.changes[name]
            metrics.plans.labels(result="written").inc()
            metrics.operations.labels(op="create").inc(len(change.created))
            metrics.operations.labels(op="destroy").inc(len(change.destroyed))
            for gpu, count in demand.disruptions(change.plan, facts.get(name)):
                metrics.disruptions.inc(count)
                log.error(
                    "Planned to destroy a used instance",
                    extra=logs.kv(node=name, gpu=gpu, count=count),
                )
            log.info(
                "Wrote MIG plan",
                extra=logs.kv(
                    node=name,
                    plan=change.plan.id,
                    creates=len(change.created),
                    destroys=len(change.destroyed),
                    reservations=len(change.plan.reservations),
                ),
            )
        metrics.reservations_expired.inc(len(result.expired))
        self._memory, settled = demand.settle(
            self._memory, planned, written, pods, now=now, ttl_s=settings.reservation_ttl_seconds
        )
        for news in settled.news:
            self._writer.post_event(
                demand.pod_event(news, now=self._stamp(), instance=settings.instance)
            )
        for seconds in settled.bound_seconds:
            metrics.pending_to_bound.observe(seconds)
        for partition in partitions:
            if partition.partition is None or not demand.planned_by_rounds(
                partition.partition.spec
            ):
                continue
            document = demand.dynamic_status(partition.name, planned, surveyed, self._memory)
            old = partition.status.get("dynamicMig")
            old = old if isinstance(old, Mapping) else {}
            if old != document:
                self._writer.write_dynamic_status(partition.name, old, document)
        return result
