"""The operator's one door to the API server: lists page by page, and writes, each write contained to its object.

Both loops use one `Writer`: the partition pass (desired annotations, status, Events) and the
dynamic MIG rounds (plans, status.dynamicMig, pod Events). It holds the API clients (built once,
passed in) and the pool that sends a pass's writes in parallel. A refusal of one write (4xx) or
a bug on one object's data is logged and costs that object only; an unreachable or failing API
server fails the caller, which retries.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

from gpupart import logs
from gpupart.core.api.wire import MIG_PLAN_ANNOTATION, MigPlan, encode_mig_plan
from gpupart.core.cluster.partitioning import PartitionStatus
from gpupart.kubeconfig import describe_api_error
from gpupart_operator.metrics import Metrics
from gpupart_operator.model import (
    GROUP,
    PLURAL,
    VERSION,
    PartitionObject,
    condition_events,
    event_manifest,
    merge_patch,
    old_conditions,
    partition_event,
    status_document,
    status_patch,
)
from gpupart_operator.settings import OperatorSettings

log = logging.getLogger("gpupart.operator")

MERGE_PATCH = "application/merge-patch+json"
LIST_PAGE = 500


def utc_now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class Writer:
    """Lists and writes for both loops; safe to call from their worker threads."""

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
        """The timestamps written into status conditions and Events."""
        self._pool = ThreadPoolExecutor(settings.write_workers, thread_name_prefix="gpupart-write")

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    @property
    def configuration(self) -> client.Configuration:
        """The API client's configuration (kopf logs in with the same credentials)."""
        configuration: client.Configuration = self.core.api_client.configuration
        return configuration

    # -- reads --

    def list_partitions(self) -> list[Mapping[str, Any]]:
        def page(**kwargs: Any) -> Any:
            return self.custom.list_cluster_custom_object(GROUP, VERSION, PLURAL, **kwargs)

        return _list(page)

    def list_nodes(self) -> list[Mapping[str, Any]]:
        return _list(self.core.list_node)

    def list_pods(self) -> list[Mapping[str, Any]]:
        return _list(self.core.list_pod_for_all_namespaces)

    # -- the partition pass --

    def set_desired(self, patches: Mapping[str, dict[str, Any]]) -> int:
        """Each node's desired-annotation merge patch, in parallel; the writes done."""
        return sum(
            self._pool.map(
                lambda item: self._contained(
                    "set desired configuration", item[0], self._patch_node, *item
                ),
                patches.items(),
            )
        )

    def write_status(self, partition: PartitionObject, status: PartitionStatus, now: str) -> int:
        """The partition's status where it differs, and an Event per changed condition."""
        return self._contained(
            "write status", partition.name, self._write_status, partition, status, now
        )

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

    # -- dynamic MIG rounds --

    def write_plans(self, plans: Mapping[str, MigPlan | None]) -> set[str]:
        """Each node's MIG plan (None removes it), in parallel; the nodes written."""
        done = self._pool.map(lambda item: self._write_plan(*item), plans.items())
        return {name for name, ok in zip(plans, done, strict=True) if ok}

    def write_dynamic_status(
        self, name: str, old: Mapping[str, Any], document: Mapping[str, Any]
    ) -> None:
        self._contained(
            "write dynamic MIG status", name, self._patch_dynamic_status, name, old, document
        )

    def remove_dynamic_status(self, name: str) -> None:
        """status.dynamicMig of a partition the rounds no longer plan for (it moved to DRA)."""
        self._contained("remove dynamic MIG status", name, self._remove_dynamic_status, name)

    # -- both --

    def post_event(self, body: dict[str, Any]) -> int:
        """Events are best effort: a failure is logged and never fails the caller."""
        try:
            _drain(
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

    # -- one object each --

    def _contained(self, action: str, name: str, write: Callable[..., int], *args: Any) -> int:
        """`write(*args)` for one object; its refusal (a 4xx) or a bug on its data is logged with the
        API server's reason and costs that object only. The API being unreachable, or failing
        (5xx), fails the caller, which retries."""
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

    def _patch_node(self, name: str, patch: dict[str, Any]) -> int:
        try:
            _drain(
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

    def _write_plan(self, node: str, plan: MigPlan | None) -> bool:
        text = None if plan is None else encode_mig_plan(plan)
        patch = {"metadata": {"annotations": {MIG_PLAN_ANNOTATION: text}}}
        try:
            return bool(self._contained("write MIG plan", node, self._patch_node, node, patch))
        except Exception as error:  # noqa: BLE001 - the API failing: this node waits a round
            log.warning("Failed to write MIG plan", extra=logs.kv(node=node, err=error))
            return False

    def _patch_status(self, name: str, patch: dict[str, Any]) -> None:
        _drain(
            self.custom.patch_cluster_custom_object_status(
                GROUP,
                VERSION,
                PLURAL,
                name,
                patch,
                _content_type=MERGE_PATCH,
                _preload_content=False,
            )
        )
        self.metrics.writes.labels(kind="status").inc()

    def _write_status(self, partition: PartitionObject, status: PartitionStatus, now: str) -> int:
        before = old_conditions(partition.status)
        document = status_document(status, before, now=now)
        patch = status_patch(partition.status, document)
        if not patch:
            return 0
        try:
            self._patch_status(partition.name, patch)
        except ApiException as error:
            if error.status == 404:
                return 0
            raise
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

    def _patch_dynamic_status(
        self, name: str, old: Mapping[str, Any], document: Mapping[str, Any]
    ) -> int:
        # A merge patch from the old document: nodes that left are set to null, lists replaced.
        self._patch_status(name, {"status": {"dynamicMig": merge_patch(old, document)}})
        return 1

    def _remove_dynamic_status(self, name: str) -> int:
        self._patch_status(name, {"status": {"dynamicMig": None}})
        return 1


def _list(call: Callable[..., Any]) -> list[Mapping[str, Any]]:
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


def _drain(response: Any) -> None:
    """Read a raw response to the end, so its connection goes back to the pool."""
    response.data  # noqa: B018 - the property reads the body


def _refused(error: ApiException) -> bool:
    """A refusal of this one request (bad data, gone, conflict), not of the whole operator."""
    status = error.status or 0
    return 400 <= status < 500 and status not in (401, 403, 408, 429)
