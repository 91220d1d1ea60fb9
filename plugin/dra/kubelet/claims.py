"""The kubelet plugin's API reads: a ResourceClaim by name, and whether a pod it is reserved for is on this node."""

from __future__ import annotations

import http.client
import ssl
import threading
from typing import Any
from urllib.parse import quote, urlencode, urlsplit

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from gpupart.core.api.jsontext import loads
from gpupart.core.dra.read import Consumer
from gpupart.core.errors import GpupartError, InvalidInput
from gpupart.kubeconfig import describe_api_error
from gpupart_plugin.kube import NodePods

MAX_OBJECT_BYTES = 3 * 1024 * 1024
"""etcd's default request limit is 1.5 MiB; an answer twice that is not one object."""
KEPT_IDLE = 8
"""Idle connections kept for the next reads (the kubelet prepares a burst's pods at once)."""


class ClaimUnavailable(GpupartError):
    """The API server did not give the claim or pod (missing, forbidden, unreachable)."""


class ApiGets:
    """GETs to the API server over kept-alive `http.client` connections, with the client
    configuration's server, TLS and credentials (its token read at each request, so a
    rotated service-account token is followed).

    The kubelet waits on the claim read of every NodePrepareResources, and there the
    Kubernetes client's request path (urllib3's pool, retries, wrappers) cost more CPU than
    the request itself: 0.66 against 0.28 ms a GET on an idle machine, and a pod start's
    load multiplies both (ADR 031). `of` gives None for a configuration that needs what this
    path lacks (a proxy, a TLS server name or host check other than the URL's host).
    """

    def __init__(self, configuration: client.Configuration, timeout_s: float) -> None:
        url = urlsplit(configuration.host)
        self.configuration = configuration
        self.host = url.hostname or ""
        self.port = url.port or 443
        self.prefix = url.path.rstrip("/")
        self.timeout_s = timeout_s
        if configuration.verify_ssl:
            self.context = ssl.create_default_context(cafile=configuration.ssl_ca_cert)
        else:
            self.context = ssl.create_default_context()
            self.context.check_hostname = False
            self.context.verify_mode = ssl.CERT_NONE
        if configuration.cert_file:
            self.context.load_cert_chain(configuration.cert_file, configuration.key_file)
        self._idle: list[http.client.HTTPSConnection] = []
        self._lock = threading.Lock()

    @classmethod
    def of(cls, configuration: client.Configuration, timeout_s: float) -> ApiGets | None:
        url = urlsplit(configuration.host)
        if (
            url.scheme != "https"
            or not url.hostname
            or configuration.proxy
            or configuration.tls_server_name
            or configuration.assert_hostname is not None
        ):
            return None
        return cls(configuration, timeout_s)

    def get(self, path: str, query: dict[str, str]) -> tuple[int, str, bytes]:
        """(status, reason, body of at most MAX_OBJECT_BYTES + 1 bytes); OSError or
        http.client.HTTPException when the connection fails."""
        target = self.prefix + path + (f"?{urlencode(query)}" if query else "")
        headers = {"Accept": "application/json", "User-Agent": "gpupart-node"}
        auth = self.configuration.auth_settings().get("BearerToken")
        if auth and auth.get("value"):
            headers["Authorization"] = str(auth["value"])
        with self._lock:
            kept = self._idle.pop() if self._idle else None
        if kept is not None:
            try:
                return self._exchange(kept, target, headers)
            except (OSError, http.client.HTTPException):
                pass  # the server closed the kept-alive connection: once more, anew
        return self._exchange(self._connect(), target, headers)

    def _connect(self) -> http.client.HTTPSConnection:
        return http.client.HTTPSConnection(
            self.host, self.port, timeout=self.timeout_s, context=self.context
        )

    def _exchange(
        self, conn: http.client.HTTPSConnection, target: str, headers: dict[str, str]
    ) -> tuple[int, str, bytes]:
        """One GET on `conn`, which is kept for the next one when its answer was read whole."""
        try:
            conn.request("GET", target, headers=headers)
            response = conn.getresponse()
            body = response.read(MAX_OBJECT_BYTES + 1)
        except BaseException:
            conn.close()
            raise
        with self._lock:
            keep = response.isclosed() and len(self._idle) < KEPT_IDLE
            if keep:
                self._idle.append(conn)
        if not keep:
            conn.close()
        return response.status, response.reason, body


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
        self.gets = ApiGets.of(api.configuration, timeout_s)
        """The lean path of the reads; None: through the client (a proxy, say)."""

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
        try:
            if self.gets is not None:
                filled = path.format(**{k: quote(v, safe="") for k, v in path_params.items()})
                status, reason, body = self.gets.get(filled, {k: str(v) for k, v in query})
            else:
                status, reason, body = self._read_through_client(path, path_params, query)
        except Exception as error:  # noqa: BLE001 - the connection's failure, in words
            raise ClaimUnavailable(f"{what}: {describe_api_error(error)}") from None
        if not 200 <= status < 300:
            refused = ApiException(
                status=status, reason=reason, body=body.decode("utf-8", "replace")
            )
            raise ClaimUnavailable(f"{what}: {describe_api_error(refused)}")
        if len(body) > MAX_OBJECT_BYTES:
            raise ClaimUnavailable(f"{what}: answer too large")
        try:
            return loads(body, what)
        except InvalidInput as error:
            raise ClaimUnavailable(str(error)) from None

    def _read_through_client(
        self, path: str, path_params: dict[str, str], query: list[tuple[str, Any]]
    ) -> tuple[int, str, bytes]:
        method, url, headers, data, _ = self.api.param_serialize(
            method="GET",
            resource_path=path,
            path_params=path_params,
            query_params=query,
            header_params={"Accept": "application/json"},
            auth_settings=["BearerToken"],
        )
        response = self.api.call_api(
            method, url, header_params=headers, body=data, _request_timeout=self.timeout_s
        )
        return response.status, str(response.reason), response.read()
