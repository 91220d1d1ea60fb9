"""Warning Events on pods, posted best effort: the one adapter the node agent and the extender share."""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Any

from kubernetes import client

from gpupart import logs
from gpupart.core.api.events import object_event
from gpupart.kubeconfig import describe_api_error

log = logging.getLogger(__name__)


def warn_pod(
    core: client.CoreV1Api,
    *,
    name: str,
    namespace: str,
    uid: str,
    reason: str,
    message: str,
    component: str,
    instance: str,
    timeout_s: float,
) -> None:
    """Post a Warning Event about one pod (RBAC `events: create`); never raises: a component
    that cannot tell a pod why goes on, and logs it."""
    involved = {"apiVersion": "v1", "kind": "Pod", "name": name, "namespace": namespace, "uid": uid}
    body = object_event(
        involved,
        reason=reason,
        message=message,
        kind="Warning",
        namespace=namespace,
        now=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        component=component,
        instance=instance,
    )
    try:
        response: Any = core.create_namespaced_event(
            namespace,
            client.CoreV1Event.model_validate(body),
            _preload_content=False,
            _request_timeout=timeout_s,
        )
        response.data  # noqa: B018 - read to the end: the connection goes back to the pool
    except Exception as error:  # noqa: BLE001 - best effort, whatever the failure
        log.warning(
            "Failed to post event",
            extra=logs.kv(pod=f"{namespace}/{name}", reason=reason, err=describe_api_error(error)),
        )
