"""One level-triggered pass: list every GpuPartition and Node, resolve with the core, write only what differs.

This is the operator's only writer. It holds the API clients (built once, passed in) and is
called from a worker thread; a lock keeps passes from overlapping. Comparing the computed
state with the listed objects is what makes a resync with nothing new write nothing.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

from gpupart import logs
from gpupart.core.cluster.partitioning import (
    LabeledNode,
    Partition,
    PartitionStatus,
    Resolution,
    resolve,
)
from gpupart.kubeconfig import describe_api_error
from gpupart_operator.metrics import Metrics
from gpupart_operator.model import (
    GROUP,
    PLURAL,
    VERSION,
    InventoryCache,
    NodeObject,
    PartitionObject,
    condition_events,
    desired_patches,
    event_manifest,
    invalid_status,
    old_conditions,
    partition_event,
    read_node,
    read_partition,
    status_document,
    status_patch,
)
from gpupart_operator.settings import OperatorSettings

log = logging.getLogger("gpupart.operator")

MERGE_PATCH = "application/merge-patch+json"
LIST_PAGE = 500


def drain(response: Any) -> None:
    """Read a raw response to the end, so its connection goes back to the pool."""
    response.data  # noqa: B018 - the property reads the body


def utc_now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


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
    def __init__(
        self,
        api_client: client.ApiClient,
        settings: OperatorSettings,
        metrics: Metrics,
        *,
        clock: Callable[[], str] = utc_now,
    ) -> None:
        self.core = client.CoreV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)
        self.settings = settings
        self.metrics = metrics
        self.clock = clock
        self.writes = 0
        """Every write this reconciler sent, for tests and the benchmark."""
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(settings.write_workers, thread_name_prefix="gpupart-write")
        self._inventories = InventoryCache()
        self._said: dict[str, str] = {}
        """node -> the last problem with its GPU count logged, so each is logged once."""

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    # -- the pass --

    def reconcile_all(self) -> PassResult:
        with self._lock:
            started = time.monotonic()
            try:
                result = self._pass(started)
            except Exception:
                self.metrics.errors.inc()
                raise
            finally:
                self.metrics.reconciles.inc()
                self.metrics.duration.observe(time.monotonic() - started)
            return result

    def _pass(self, started: float) -> PassResult:
        partitions = tuple(read_partition(raw) for raw in self.list_partitions())
        nodes = tuple(
            read_node(raw, self._inventories) for raw in self.list_all(self.core.list_node)
        )
        self._inventories.keep({n.name for n in nodes})
        for node in nodes:
            if node.report_error:
                log.warning(
                    "Ignored node state", extra=logs.kv(node=node.name, err=node.report_error)
                )
        self._log_gpu_counts(nodes)
        resolution, broken = _resolve_each(
            [p.partition for p in partitions if p.partition is not None], [n.view for n in nodes]
        )
        writes = 0
        # Desired state first: status and Events describe it.
        patches = desired_patches(resolution.desired, nodes)
        writes += sum(
            self._pool.map(
                lambda item: self.contained(
                    "set desired configuration", item[0], self.patch_node, *item
                ),
                patches.items(),
            )
        )
        now = self.clock()
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
            writes += self.contained(
                "write status", partition.name, self._write_status, partition, status, now
            )
            ready = next(c for c in status.conditions if c.type == "Ready")
            by_state[ready.reason] += 1
        self.metrics.set_partitions(by_state)
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

    def contained(self, action: str, name: str, write: Callable[..., int], *args: Any) -> int:
        """`write(*args)` for one object; its refusal (a 4xx) or a bug on its data is logged with the
        API server's reason and costs that object only. The API being unreachable, or failing
        (5xx), fails the pass, which is retried."""
        try:
            return write(*args)
        except ApiException as error:
            if not _refused(error):
                raise
            problem = describe_api_error(error)
        except (HTTPError, OSError):
            raise
        except Exception as error:  # noqa: BLE001 - one object's data never stops the pass
            log.exception("Failed to write object", extra=logs.kv(action=action, object=name))
            problem = describe_api_error(error)
        self.metrics.refused.inc()
        log.warning(
            "API refused a write", extra=logs.kv(action=action, object=name, reason=problem)
        )
        return 0

    # -- reads --

    def list_partitions(self) -> list[Mapping[str, Any]]:
        def page(**kwargs: Any) -> Any:
            return self.custom.list_cluster_custom_object(GROUP, VERSION, PLURAL, **kwargs)

        return self.list_all(page)

    @staticmethod
    def list_all(call: Callable[..., Any]) -> list[Mapping[str, Any]]:
        """All items of a list call, page by page, as plain dicts (no model deserialisation)."""
        items: list[Mapping[str, Any]] = []
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"limit": LIST_PAGE, "_preload_content": False}
            if token:
                kwargs["_continue"] = token
            body = json.loads(call(**kwargs).data)
            items.extend(body.get("items") or [])
            token = (body.get("metadata") or {}).get("continue")
            if not token:
                return items

    # -- writes --

    def patch_node(self, name: str, patch: dict[str, Any]) -> int:
        try:
            drain(
                self.core.patch_node(name, patch, _content_type=MERGE_PATCH, _preload_content=False)
            )
        except ApiException as error:
            if error.status == 404:  # gone since the list: nothing left to configure
                return 0
            raise
        self.metrics.writes.labels(kind="node").inc()
        value = patch["metadata"]["annotations"]
        removed = next(iter(value.values())) is None
        log.debug(
            "Removed desired configuration" if removed else "Set desired configuration",
            extra=logs.kv(node=name),
        )
        return 1

    def _write_status(self, partition: PartitionObject, status: PartitionStatus, now: str) -> int:
        before = old_conditions(partition.status)
        document = status_document(status, before, now=now)
        patch = status_patch(partition.status, document)
        if not patch:
            return 0
        try:
            drain(
                self.custom.patch_cluster_custom_object_status(
                    GROUP,
                    VERSION,
                    PLURAL,
                    partition.name,
                    patch,
                    _content_type=MERGE_PATCH,
                    _preload_content=False,
                )
            )
        except ApiException as error:
            if error.status == 404:
                return 0
            raise
        self.metrics.writes.labels(kind="status").inc()
        writes = 1
        for condition in condition_events(before, status.conditions):
            writes += self.post_event(
                event_manifest(
                    partition,
                    condition,
                    namespace=self.settings.event_namespace,
                    now=now,
                    instance=self.settings.instance,
                )
            )
            log.info(
                "Changed condition",
                extra=logs.kv(
                    gpupartition=partition.name,
                    type=condition.type,
                    status=condition.status,
                    reason=condition.reason,
                ),
            )
        return writes

    def warn(self, name: str, uid: str, reason: str, message: str) -> None:
        """A Warning Event about the GpuPartition `name`, best effort."""
        self.post_event(
            partition_event(
                name,
                uid,
                reason=reason,
                message=message,
                kind="Warning",
                namespace=self.settings.event_namespace,
                now=self.clock(),
                instance=self.settings.instance,
            )
        )

    def post_event(self, body: dict[str, Any]) -> int:
        """Events are best effort: a failure is logged and never fails the pass."""
        try:
            drain(
                self.core.create_namespaced_event(
                    body["metadata"]["namespace"],
                    client.CoreV1Event.model_validate(body),
                    _preload_content=False,
                )
            )
        except Exception as error:  # noqa: BLE001 - best effort, whatever the failure
            log.warning(
                "Did not post Event",
                extra=logs.kv(reason=body["reason"], err=describe_api_error(error)),
            )
            return 0
        self.metrics.writes.labels(kind="event").inc()
        return 1


def _refused(error: ApiException) -> bool:
    """A refusal of this one request (bad data, gone, conflict), not of the whole operator."""
    status = error.status or 0
    return 400 <= status < 500 and status not in (401, 403, 408, 429)


def _resolve_each(
    partitions: list[Partition], nodes: list[LabeledNode]
) -> tuple[Resolution, dict[str, str]]:
    """`resolve`, with any partition that makes it fail set apart: name -> why, for InvalidSpec.

    The core raises nothing for a parsed partition; this is the net under a bug in it, so one
    partition's bug never stops the others (each is tried alone only after a failure).
    """
    try:
        return resolve(partitions, nodes), {}
    except Exception:  # noqa: BLE001 - find the partition that breaks it, below
        log.exception("Failed to resolve GpuPartitions together; resolving each alone")
    broken: dict[str, str] = {}
    for partition in partitions:
        try:
            resolve([partition], nodes)
        except Exception as error:  # noqa: BLE001 - this one is set apart
            broken[partition.spec.name] = (
                f"cannot be evaluated ({type(error).__name__}: {str(error)[:300]})"
            )
    return resolve([p for p in partitions if p.spec.name not in broken], nodes), broken
