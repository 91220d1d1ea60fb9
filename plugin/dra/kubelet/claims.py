"""The kubelet plugin's API reads: a ResourceClaim by name, and whether a pod it is reserved for is on this node."""

from __future__ import annotations

import json
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from gpupart.core.dra.read import Consumer
from gpupart.core.errors import GpupartError
from gpupart.kubeconfig import describe_api_error

MAX_OBJECT_BYTES = 3 * 1024 * 1024
"""etcd's default request limit is 1.5 MiB; an answer twice that is not one object."""


class ClaimUnavailable(GpupartError):
    """The API server did not give the claim or pod (missing, forbidden, unreachable)."""


class ClaimReader:
    """GETs through one API client, scoped to what prepare needs: `get resourceclaims`, `get pods`."""

    def __init__(self, api: client.ApiClient, node: str, *, timeout_s: float = 10.0) -> None:
        self.api = api
        self.node = node
        self.timeout_s = timeout_s

    def claim(self, namespace: str, name: str) -> object:
        """The claim as the API's JSON."""
        return self._get(
            "/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/{name}",
            namespace,
            name,
            what="resourceclaim",
        )

    def pods_here(self, namespace: str, consumers: tuple[Consumer, ...]) -> frozenset[str]:
        """The uids among the `pods` consumers that the API says are bound to this node.

        Stops at the first (one suffices to prepare); a consumer it cannot read counts as not here.
        """
        for consumer in consumers:
            if consumer.resource != "pods" or not consumer.uid:
                continue
            try:
                pod = self._get(
                    "/api/v1/namespaces/{namespace}/pods/{name}",
                    namespace,
                    consumer.name,
                    what="pod",
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

    def _get(self, path: str, namespace: str, name: str, *, what: str) -> Any:
        method, url, headers, data, _ = self.api.param_serialize(
            method="GET",
            resource_path=path,
            path_params={"namespace": namespace, "name": name},
            header_params={"Accept": "application/json"},
            auth_settings=["BearerToken"],
        )
        try:
            response = self.api.call_api(
                method, url, header_params=headers, body=data, _request_timeout=self.timeout_s
            )
            body = response.read()
        except Exception as error:  # noqa: BLE001 - the connection's failure, in words
            raise ClaimUnavailable(
                f"get {what} {namespace}/{name}: {describe_api_error(error)}"
            ) from None
        if not 200 <= response.status < 300:
            refused = ApiException(http_resp=response)
            raise ClaimUnavailable(f"get {what} {namespace}/{name}: {describe_api_error(refused)}")
        if len(body) > MAX_OBJECT_BYTES:
            raise ClaimUnavailable(f"get {what} {namespace}/{name}: answer too large")
        try:
            return json.loads(body)
        except ValueError:
            raise ClaimUnavailable(f"get {what} {namespace}/{name}: not JSON") from None
