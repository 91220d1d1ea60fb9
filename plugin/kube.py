"""Kubernetes API adapter of the node agent: its own Node only (watch, annotations) and its pending shared pods."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Mapping
from typing import Any

from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException

from gpupart.core.devices import AssignedPod
from gpupart.core.errors import GpupartError
from gpupart.core.resources import parse_pod_request
from gpupart.core.wire import (
    ASSIGNMENT_ANNOTATION,
    DESIRED_ANNOTATION,
    INVENTORY_ANNOTATION,
    STATE_ANNOTATION,
    decode_assignment,
)

log = logging.getLogger(__name__)


class NodeClient:
    """The agent's only door to the API server; every list and watch is scoped to this node."""

    def __init__(self, api: client.ApiClient, node: str, *, timeout_s: float = 10.0) -> None:
        self.core = client.CoreV1Api(api)
        self.node = node
        self.timeout_s = timeout_s

    def desired(self) -> str | None:
        node = self.core.read_node(self.node, _request_timeout=self.timeout_s)
        return _annotations(node).get(DESIRED_ANNOTATION)

    def watch_desired(self, stop: threading.Event, *, resync_s: float) -> Iterator[str | None]:
        """The desired annotation now, on every change, and at least every `resync_s` (drift)."""
        last: object = object()
        while not stop.is_set():
            try:
                current = self.desired()
                yield current
                last = current
                stream = watch.Watch().stream(
                    self.core.list_node,
                    field_selector=f"metadata.name={self.node}",
                    timeout_seconds=max(1, int(resync_s)),
                    _request_timeout=resync_s + self.timeout_s,
                )
                for event in stream:
                    if stop.is_set():
                        return
                    value = _annotations(event["object"]).get(DESIRED_ANNOTATION)
                    if value != last:
                        last = value
                        yield value
            except (ApiException, OSError) as error:
                log.warning("Failed to watch node node=%s err=%s", self.node, error)
                stop.wait(2.0)

    def publish(self, state: str, inventory: str) -> None:
        body = {
            "metadata": {"annotations": {STATE_ANNOTATION: state, INVENTORY_ANNOTATION: inventory}}
        }
        self.core.patch_node(self.node, body, _request_timeout=self.timeout_s)

    def assigned_pods(self) -> tuple[AssignedPod, ...]:
        """Pending pods bound here that carry the extender's assignment (malformed ones skipped)."""
        pods = self.core.list_pod_for_all_namespaces(
            field_selector=f"spec.nodeName={self.node},status.phase=Pending",
            _request_timeout=self.timeout_s,
        )
        found = []
        for pod in pods.items:
            # Parse at the edge: the plain dict form, where every field is what the API sent.
            raw: Mapping[str, Any] = self.core.api_client.sanitize_for_serialization(pod)
            meta: Mapping[str, Any] = raw.get("metadata") or {}
            text = (meta.get("annotations") or {}).get(ASSIGNMENT_ANNOTATION)
            if text is None:
                continue
            try:
                found.append(
                    AssignedPod(
                        uid=str(meta.get("uid", "")),
                        namespace=str(meta.get("namespace", "")),
                        name=str(meta.get("name", "")),
                        created=str(meta.get("creationTimestamp", "")),
                        request=parse_pod_request(raw),
                        assignment=decode_assignment(text),
                    )
                )
            except GpupartError as error:
                log.warning(
                    "Skipped pod pod=%s/%s err=%s", meta.get("namespace"), meta.get("name"), error
                )
        return tuple(found)


def _annotations(obj: Any) -> Mapping[str, str]:
    meta = obj.metadata
    return (meta.annotations if meta is not None else None) or {}
