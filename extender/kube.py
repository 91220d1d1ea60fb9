"""The extender's Kubernetes I/O: list+watch Nodes, Pods and PodDisruptionBudgets into the cache, and the bind writes.

The watch keeps raw JSON (no client-model deserialisation: at thousands of pods that costs more
than everything else) and resumes from the last resourceVersion; on 410 Gone or any break it
relists. This module is the only one in the extender that talks to the API server.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException
from kubernetes.watch.watch import iter_resp_lines

from gpupart.kubeconfig import describe_api_error, load_configuration

from .cache import NODE, PDB, POD, ClusterCache

log = logging.getLogger(__name__)


HEALTHY_AFTER_SECONDS = 10.0
"""A watch open this long, applying events, counts as working again (readiness returns)."""
POOL_SIZE = 64
"""Kept-alive API connections: binds run concurrently on the server's thread pool (up to 40 in
flight), and the client's default pool (5 x CPUs) would drop the connections beyond it."""


def api_client(kubeconfig: Path | None) -> client.ApiClient:
    """In-cluster credentials when there is no kubeconfig and we run in a pod, else kubeconfig."""
    return client.ApiClient(load_configuration(kubeconfig, pool_size=POOL_SIZE))


class ApiBinder:
    """The Binding create through the API server (the `Binder` protocol)."""

    def __init__(self, api: client.ApiClient, *, timeout_s: float = 10.0) -> None:
        self.api = api
        self.timeout = timeout_s

    def bind(
        self, namespace: str, name: str, uid: str, node: str, annotations: Mapping[str, str]
    ) -> None:
        # The uid precondition makes the Binding fail if the pod was replaced under the same
        # name; its annotations land on the pod in the same write as spec.nodeName.
        meta: dict[str, Any] = {"name": name, "namespace": namespace}
        if uid:
            meta["uid"] = uid
        if annotations:
            meta["annotations"] = dict(annotations)
        body: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": meta,
            "target": {"apiVersion": "v1", "kind": "Node", "name": node},
        }
        # The ApiClient's own request path (auth, TLS, pooled connections) without the
        # generated method's argument validation, which costs more than the request itself.
        method, url, headers, data, _ = self.api.param_serialize(
            method="POST",
            resource_path="/api/v1/namespaces/{namespace}/pods/{name}/binding",
            path_params={"namespace": namespace, "name": name},
            header_params={"Content-Type": "application/json", "Accept": "application/json"},
            body=body,
            auth_settings=["BearerToken"],
        )
        response = self.api.call_api(
            method, url, header_params=headers, body=data, _request_timeout=self.timeout
        )
        # Read to the end: the connection then goes back to the pool (an unread response
        # keeps it, and the next bind would open and TLS-handshake a new one).
        response.read()
        if not 200 <= response.status < 300:
            raise ApiException(http_resp=response)


class Watcher:
    """One thread per kind: list, then watch from the list's resourceVersion, forever."""

    def __init__(
        self,
        api: client.ApiClient,
        cache: ClusterCache,
        *,
        timeout_seconds: int = 300,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.core = client.CoreV1Api(api)
        self.policy = client.PolicyV1Api(api)
        self.cache = cache
        self.timeout = timeout_seconds
        self.sleep = sleep
        self.stopping = threading.Event()
        self.threads: list[threading.Thread] = []

    def start(self) -> None:
        for kind, lister in (
            (NODE, self.core.list_node),
            (POD, self.core.list_pod_for_all_namespaces),
            # For the preempt verb's PDB violation count (kube-scheduler's own rule).
            (PDB, self.policy.list_pod_disruption_budget_for_all_namespaces),
        ):
            thread = threading.Thread(
                target=self._run, args=(kind, lister), name=f"watch-{kind}", daemon=True
            )
            thread.start()
            self.threads.append(thread)

    def stop(self) -> None:
        self.stopping.set()

    def _run(self, kind: str, lister: Callable[..., Any]) -> None:
        backoff = 1.0
        while not self.stopping.is_set():
            try:
                version = self._list(kind, lister)
                backoff = 1.0
                while not self.stopping.is_set():
                    version = self._watch(kind, lister, version)
                    self.cache.watch_ok(kind)  # a whole watch period without a failure
            except _Gone:
                log.info("Relisting after the watch expired", extra={"kv": {"kind": kind}})
            except Exception as error:  # noqa: BLE001 - the loop must survive any API failure
                problem = describe_api_error(error)
                self.cache.watch_failed(kind, problem)
                log.warning("Watch failed; relisting", extra={"kv": {"kind": kind, "err": problem}})
                self.sleep(backoff)
                backoff = min(backoff * 2, 30.0)

    def _list(self, kind: str, lister: Callable[..., Any]) -> str:
        response = lister(_preload_content=False)
        data = json.loads(response.data)
        self.cache.replace(kind, data.get("items") or [])
        version = str((data.get("metadata") or {}).get("resourceVersion") or "")
        log.info(
            "Listed objects",
            extra={"kv": {"kind": kind, "count": len(data.get("items") or []), "rv": version}},
        )
        return version

    def _watch(self, kind: str, lister: Callable[..., Any], version: str) -> str:
        response = lister(
            watch=True,
            resource_version=version,
            allow_watch_bookmarks=True,
            timeout_seconds=self.timeout,
            _preload_content=False,
        )
        try:
            started, healthy = time.monotonic(), False
            for line in iter_resp_lines(response):
                if self.stopping.is_set():
                    break
                if not healthy and time.monotonic() - started > HEALTHY_AFTER_SECONDS:
                    healthy = True
                    self.cache.watch_ok(kind)
                event = json.loads(line)
                kind_of_event = event.get("type")
                obj = event.get("object") or {}
                if kind_of_event == "ERROR":
                    if obj.get("code") == 410:
                        raise _Gone
                    raise ApiException(status=obj.get("code"), reason=obj.get("message"))
                version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
                self.cache.apply(kind, str(kind_of_event), obj)
        finally:
            response.release_conn()
        return version


class _Gone(Exception):
    """The watch's resourceVersion is too old (410 Gone): relist."""
