"""The kubelet plugin's API reads: a ResourceClaim by name, and whether a pod it is reserved for is on this node."""

from __future__ import annotations

import json
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from gpupart.core.dra.read import Consumer
from gpupart.core.errors import GpupartError
from gpupart.kubeconfig import describe_api_error
from gpupart_plugin.kube import NodePods

MAX_OBJECT_BYTES = 3 * 1024 * 1024
"""etcd's default request limit is 1.5 MiB; an answer twice that is not one object."""


class ClaimUnavailable(GpupartError):
    """The API server did not give the claim or pod (missing, forbidden, unreachable)."""


class ClaimReader:
    """Reads through one API client what prepare needs, each a consistent read: the claim by a
    GET of its name (as the Go drivers' helper does), the pod by a LIST with a field selector on
    its name and node. The pod check asks `pods` (this node's pod watch) first."""

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
        """The claim as the API's JSON; ClaimUnavailable when there is none of that name.

        A GET, not a LIST by name: a LIST is served from the API server's watch cache once
        that cache has caught up with etcd, and right when the kubelet asks, the scheduler,
        the kubelet and the resourceclaim controller have just written; a GET reads etcd
        (ADR 031)."""
        found = self._read(
            "/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/{name}",
            {"namespace": namespace, "name": name},
            [],
            what=f"get resourceclaim {namespace}/{name}",
        )
        if not isinstance(found, dict):
            raise ClaimUnavailable(f"get resourceclaim {namespace}/{name}: not an object")
        return found

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
                    what=f"list pod {namespace}/{consumer.name}",
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
        found = self._read(
            path,
            {"namespace": namespace},
            [("fieldSelector", selector), ("limit", 2)],
            what=what,
        )
        items = found.get("items") if isinstance(found, dict) else None
        if not isinstance(items, list) or len(items) != 1:
            count = len(items) if isinstance(items, list) else "no list of"
            raise ClaimUnavailable(f"{what}: {count} objects of that name")
        return items[0]

    def _read(
        self, path: str, path_params: dict[str, str], query: list[tuple[str, Any]], *, what: str
    ) -> Any:
        """The JSON answer of one GET (bounded); ClaimUnavailable naming `what` otherwise."""
        method, url, headers, data, _ = self.api.param_serialize(
            method="GET",
            resource_path=path,
            path_params=path_params,
            query_params=query,
            header_params={"Accept": "application/json"},
            auth_settings=["BearerToken"],
        )
        try:
            response = self.api.call_api(
                method, url, header_params=headers, body=data, _request_timeout=self.timeout_s
            )
            body = response.read()
        except Exception as error:  # noqa: BLE001 - the connection's failure, in words
            raise ClaimUnavailable(f"{what}: {describe_api_error(error)}") from None
        if not 200 <= response.status < 300:
            refused = ApiException(http_resp=response)
            raise ClaimUnavailable(f"{what}: {describe_api_error(refused)}")
        if len(body) > MAX_OBJECT_BYTES:
            raise ClaimUnavailable(f"{what}: answer too large")
        try:
            return json.loads(body)
        except ValueError:
            raise ClaimUnavailable(f"{what}: not JSON") from None
