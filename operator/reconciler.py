"""One level-triggered pass: list every GpuPartition and Node, resolve with the core, write only what differs.

It is called from a worker thread; a lock keeps passes from overlapping. Comparing the computed
state with the listed objects is what makes a drift-timer pass with nothing new write nothing.
Its reads and writes go through the `Writer` it shares with the dynamic MIG rounds.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass

from gpupart import logs
from gpupart.core.cluster.partitioning import PartitionStatus, Resolution
from gpupart_operator.metrics import Metrics
from gpupart_operator.model import (
    InventoryCache,
    NodeObject,
    PartitionObject,
    Resolutions,
    desired_patches,
    invalid_status,
    read_node,
    read_partition,
)
from gpupart_operator.writer import Writer

log = logging.getLogger("gpupart.operator")


@dataclass(frozen=True, slots=True)
class PassResult:
    """What a pass saw and did; deletion reads `nodes` to know who still applies a partition."""

    nodes: tuple[NodeObject, ...]
    partitions: tuple[PartitionObject, ...]
    writes: int
    seconds: float
    resolution: Resolution = Resolution({}, {})
    """What the core decided; its `releases` say what each deletion still waits for."""


class Reconciler:
    def __init__(self, writer: Writer, metrics: Metrics, resolutions: Resolutions) -> None:
        self._writer = writer
        self._metrics = metrics
        self._resolutions = resolutions
        self.writes = 0
        """Every write this reconciler sent, for tests and the benchmark."""
        self._lock = threading.Lock()
        self._inventories = InventoryCache()
        self._said: dict[str, str] = {}
        """node -> the last problem with its GPU count logged, so each is logged once."""

    # -- the pass --

    def reconcile_all(self) -> PassResult:
        with self._lock:
            started = time.monotonic()
            try:
                result = self._pass(started)
            except Exception:
                self._metrics.errors.inc()
                raise
            finally:
                self._metrics.reconciles.inc()
                self._metrics.duration.observe(time.monotonic() - started)
            return result

    def _pass(self, started: float) -> PassResult:
        partitions = tuple(read_partition(raw) for raw in self._writer.list_partitions())
        nodes = tuple(read_node(raw, self._inventories) for raw in self._writer.list_nodes())
        self._inventories.keep({n.name for n in nodes})
        for node in nodes:
            if node.report_error:
                log.warning(
                    "Ignored node state", extra=logs.kv(node=node.name, err=node.report_error)
                )
        self._log_gpu_counts(nodes)
        contained = self._resolutions.resolve(
            [p.partition for p in partitions if p.partition is not None], [n.view for n in nodes]
        )
        if contained.error is not None:
            log.error(
                "Failed to resolve GpuPartitions together; resolving each alone",
                exc_info=contained.error,
            )
        resolution, broken = contained.resolution, contained.broken
        # Desired state first: status and Events describe it.
        writes = self._writer.set_desired(desired_patches(resolution.desired, nodes))
        now = self._writer.clock()
        by_state: Counter[str] = Counter()
        for partition in partitions:
            if partition.deleting and partition.name not in resolution.statuses:
                continue  # deleting, and nothing to restore: no status to keep up
            status: PartitionStatus | None = resolution.statuses.get(partition.name)
            if partition.partition is None or partition.name in broken:
                error = partition.error or broken[partition.name]
                status = invalid_status(partition.generation, error)
            if status is None:
                continue
            writes += self._writer.write_status(partition, status, now)
            ready = next(c for c in status.conditions if c.type == "Ready")
            by_state[ready.reason] += 1
        self._metrics.set_partitions(by_state)
        seconds = time.monotonic() - started
        if writes:
            log.info(
                "Reconciled GpuPartitions",
                extra=logs.kv(
                    partitions=len(partitions),
                    nodes=len(nodes),
                    writes=writes,
                    seconds=round(seconds, 3),
                ),
            )
        else:
            log.debug("Reconciled GpuPartitions without changes", extra=logs.kv(nodes=len(nodes)))
        self.writes += writes
        return PassResult(nodes, partitions, writes, seconds, resolution)

    def _log_gpu_counts(self, nodes: tuple[NodeObject, ...]) -> None:
        """Each node whose GPU count cannot be trusted as labelled, logged once per change."""
        said: dict[str, str] = {}
        for node in nodes:
            if node.inventory_error:
                said[node.name] = node.inventory_error
                if self._said.get(node.name) != said[node.name]:
                    log.warning(
                        "Ignored node inventory", extra=logs.kv(node=node.name, err=said[node.name])
                    )
            elif node.view.count_disagreement:
                said[node.name] = node.view.count_disagreement
                if self._said.get(node.name) != said[node.name]:
                    log.warning(
                        "Counted GPUs from the node agent's inventory, not the label",
                        extra=logs.kv(node=node.name, err=said[node.name]),
                    )
        self._said = said
