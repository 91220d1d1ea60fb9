"""The kubelet plugin's API reads: a ResourceClaim by name, and whether a pod it is reserved for is on this node."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Mapping
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from gpupart import logs
from gpupart.core.dra.read import Consumer
from gpupart.core.errors import GpupartError
from gpupart.kubeconfig import describe_api_error
from gpupart.watch import Event, Failed, Listed, list_watch

log = logging.getLogger(__name__)

MAX_OBJECT_BYTES = 3 * 1024 * 1024
"""etcd's default request limit is 1.5 MiB; an answer twice that is not one object."""


class ClaimUnavailable(GpupartError):
    """The API server did not give the claim or pod (missing, forbidden, unreachable)."""


PodKey = tuple[str, str, str]
"""(uid, namespace, name) of a pod."""


class NodePods:
    """The pods bound to this node, from a list+watch of `spec.nodeName=<node>`: what the
    prepare's pod check asks first (a LIST per claim costs a round trip and a JSON answer).

    It only ever says yes: a pod of that uid and name was bound to this node by the scheduler
    (neither changes once set). A pod not seen yet, the watch behind or down, is asked of the
    API by `ClaimReader`.
    """

    def __init__(self, api: client.ApiClient, node: str, *, relist_s: float = 300.0) -> None:
        self.core = client.CoreV1Api(api)
        self.node = node
        self.relist_s = relist_s
        self._lock = threading.Lock()
        self._pods: frozenset[PodKey] = frozenset()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def holds(self, uid: str, namespace: str, name: str) -> bool:
        with self._lock:
            return (uid, namespace, name) in self._pods

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="dra-pods", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _key(self, pod: Mapping[str, Any]) -> PodKey | None:
        """The pod's key when it is bound to this node (checked here too, not only by the
        server's selector), else None."""
        metadata, spec = pod.get("metadata"), pod.get("spec")
        if not isinstance(metadata, Mapping) or not isinstance(spec, Mapping):
            return None
        if spec.get("nodeName") != self.node:
            return None
        uid, namespace, name = (metadata.get(k) for k in ("uid", "namespace", "name"))
        if isinstance(uid, str) and isinstance(namespace, str) and isinstance(name, str):
            return (uid, namespace, name) if uid and namespace and name else None
        return None

    def _run(self) -> None:
        for item in list_watch(
            self.core.list_pod_for_all_namespaces,
            self._stop,
            decode=lambda obj: obj,
            timeout_s=self.relist_s,
            field_selector=f"spec.nodeName={self.node}",
        ):
            if isinstance(item, Listed):
                found = frozenset(k for k in map(self._key, item.items) if k is not None)
                with self._lock:
                    self._pods = found
            elif isinstance(item, Event):
                key = self._key(item.object)
                if key is None:
                    continue
                with self._lock:
                    if item.type == "DELETED":
                        self._pods = self._pods - {key}
                    else:
                        self._pods = self._pods | {key}
            elif isinstance(item, Failed):
                log.warning(
                    "Failed to watch this node's pods for DRA; prepare lists them",
                    extra=logs.kv(err=item.problem, retryAfter=f"{item.retry_after:g}s"),
                )


class ClaimReader:
    """Reads through one API client what prepare needs, with the verbs the agent already holds:
    `list` of resourceclaims and of pods, each by a field selector on one name (a consistent
    read, as a GET would be). The pod check asks `pods` (this node's pod watch) first."""

    def __init__(
        self,
        api: client.ApiClient,
        node: str,
        *,
        pods: NodePods | None = None,
        timeout_s: float = 10.0,
    ) -> None:
        self.api = api
        self.node = node
        self.pods = pods
        self.timeout_s = timeout_s

    def claim(self, namespace: str, name: str) -> object:
        """The claim as the API's JSON; ClaimUnavailable when there is none of that name."""
        return self._one(
            "/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims",
            namespace,
            f"metadata.name={name}",
            what=f"resourceclaim {namespace}/{name}",
        )

    def pods_here(self, namespace: str, consumers: tuple[Consumer, ...]) -> frozenset[str]:
        """The uids among the `pods` consumers that the API says are bound to this node.

        Stops at the first (one suffices to prepare); a consumer it cannot read counts as not here.
        """
        wanted = [c for c in consumers if c.resource == "pods" and c.uid]
        for consumer in wanted:
            if self.pods is not None and self.pods.holds(consumer.uid, namespace, consumer.name):
                return frozenset({consumer.uid})
        for consumer in wanted:
            try:
                pod = self._one(
                    "/api/v1/namespaces/{namespace}/pods",
                    namespace,
                    f"metadata.name={consumer.name},spec.nodeName={self.node}",
                    what=f"pod {namespace}/{consumer.name}",
                )
            except ClaimUnavailable:
                continue
            metadata = pod.get("metadata") if isinstance(pod, dict) else None
            spec = pod.get("spec") if isinstance(pod, dict) else None
            if (
                isinstance(metadata, dict)
                and isinstance(spec, dict)
                and metadata.get("uid") == consumer.uid
                and spec.get("nodeName") == self.node
            ):
                return frozenset({consumer.uid})
        return frozenset()

    def _one(self, path: str, namespace: str, selector: str, *, what: str) -> Any:
        """The one object a field selector on its name lists."""
        method, url, headers, data, _ = self.api.param_serialize(
            method="GET",
            resource_path=path,
            path_params={"namespace": namespace},
            query_params=[("fieldSelector", selector), ("limit", 2)],
            header_params={"Accept": "application/json"},
            auth_settings=["BearerToken"],
        )
        try:
            response = self.api.call_api(
                method, url, header_params=headers, body=data, _request_timeout=self.timeout_s
            )
            body = response.read()
        except Exception as error:  # noqa: BLE001 - the connection's failure, in words
            raise ClaimUnavailable(f"list {what}: {describe_api_error(error)}") from None
        if not 200 <= response.status < 300:
            refused = ApiException(http_resp=response)
            raise ClaimUnavailable(f"list {what}: {describe_api_error(refused)}")
        if len(body) > MAX_OBJECT_BYTES:
            raise ClaimUnavailable(f"list {what}: answer too large")
        try:
            found = json.loads(body)
        except ValueError:
            raise ClaimUnavailable(f"list {what}: not JSON") from None
        items = found.get("items") if isinstance(found, dict) else None
        if not isinstance(items, list) or len(items) != 1:
            count = len(items) if isinstance(items, list) else "no list of"
            raise ClaimUnavailable(f"list {what}: {count} objects of that name")
        return items[0]
