"""The extender's Kubernetes I/O: list+watch Nodes, Pods, budgets, Namespaces, DRA objects into the cache; bind writes.

The watch (gpupart.watch, shared with the node agent) keeps raw JSON and resumes from the last
resourceVersion; on 410 Gone or any break it relists. This module is the only one in the
extender that talks to the API server.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from gpupart import logs
from gpupart.core.errors import GpupartError
from gpupart.kubeconfig import describe_api_error, load_configuration
from gpupart.podevents import warn_pod
from gpupart.watch import Backoff, Event, Expired, Failed, Listed, Raw, Resumed, list_watch

from .cache import NAMESPACE, NODE, PDB, POD, ClusterCache
from .objects import DEVICE_CLASS, DRA_KINDS, RESOURCE_CLAIM, RESOURCE_SLICE, meta_of
from .pending import PendingPods
from .watchhealth import WatchHealth

log = logging.getLogger(__name__)


DRA_GROUP = "resource.k8s.io"
POOL_SIZE = 64
"""Kept-alive API connections: binds run concurrently on the server's thread pool (up to 40 in
flight), and the client's default pool (5 x CPUs) would drop the connections beyond it."""


def api_client(kubeconfig: Path | None) -> client.ApiClient:
    """In-cluster credentials when there is no kubeconfig and we run in a pod, else kubeconfig."""
    return client.ApiClient(load_configuration(kubeconfig, pool_size=POOL_SIZE))


class PodUnreadable(GpupartError):
    """The live pod could not be read before a bind (gone, forbidden, API unreachable)."""


class ApiBinder:
    """The live pod's GET and the Binding create through the API server (the `Binder`
    protocol): RBAC `pods: get` and `pods/binding: create`."""

    def __init__(self, api: client.ApiClient, *, timeout_s: float = 10.0) -> None:
        self.api = api
        self.timeout = timeout_s

    def pod(self, namespace: str, name: str) -> Mapping[str, Any]:
        """The pod as the API server has it now (bind never trusts the request or the watch
        cache for what it writes); ApiException when it cannot be read (404: gone)."""
        method, url, headers, data, _ = self.api.param_serialize(
            method="GET",
            resource_path="/api/v1/namespaces/{namespace}/pods/{name}",
            path_params={"namespace": namespace, "name": name},
            header_params={"Accept": "application/json"},
            auth_settings=["BearerToken"],
        )
        try:
            response = self.api.call_api(
                method, url, header_params=headers, body=data, _request_timeout=self.timeout
            )
            body = response.read()
        except Exception as error:  # noqa: BLE001 - the connection's failure, in words
            raise PodUnreadable(f"GET pod: {describe_api_error(error)}") from None
        if not 200 <= response.status < 300:
            refused = ApiException(http_resp=response)
            raise PodUnreadable(f"GET pod: {describe_api_error(refused)}")
        try:
            found = json.loads(body)
        except ValueError:
            found = None
        if not isinstance(found, dict):
            raise PodUnreadable("GET pod: the answer is not a JSON object")
        return found

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


class ApiEvents:
    """Warning Events on pods (the reporter's `EventSink`): RBAC `events: create`."""

    def __init__(self, api: client.ApiClient, *, timeout_s: float = 10.0) -> None:
        self.core = client.CoreV1Api(api)
        self.timeout = timeout_s
        self.instance = socket.gethostname()

    def warn(self, pod: Mapping[str, Any], reason: str, message: str) -> None:
        """Post the Event; never raises (a reason not posted is posted at the next change)."""
        meta = meta_of(pod)
        warn_pod(
            self.core,
            name=str(meta.get("name") or ""),
            namespace=str(meta.get("namespace") or "default"),
            uid=str(meta.get("uid") or ""),
            reason=reason,
            message=message,
            component="extender",
            instance=self.instance,
            timeout_s=self.timeout,
        )


class Watcher:
    """One thread per kind: list, then watch from the list's resourceVersion, forever; each
    kind's health in `health` (the readiness rule: `watchhealth`)."""

    def __init__(
        self,
        api: client.ApiClient,
        cache: ClusterCache,
        *,
        period_seconds: int = 300,
        sleep: Callable[[float], object] | None = None,
        pending: PendingPods | None = None,
        health: WatchHealth | None = None,
    ) -> None:
        self.core = client.CoreV1Api(api)
        self.policy = client.PolicyV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.cache = cache
        self.pending = pending
        """Also fed the Pod events, for the pending pods' reasons (None: not kept)."""
        self.health = health or WatchHealth()
        self.dra_health = WatchHealth()
        """The DRA kinds' own: readiness does not wait for them (a cluster without
        `resource.k8s.io/v1` keeps the device-plugin path; DRA pods then get no words)."""
        self.period = period_seconds
        """Server-side length of one watch period (setting resync_seconds); then it resumes."""
        self.stopping = threading.Event()
        self.sleep = sleep or self.stopping.wait
        """Waits out a failure's backoff (tests count the attempts)."""
        self.threads: list[threading.Thread] = []

    def start(self) -> None:
        for kind, lister in (
            (NODE, self.core.list_node),
            (POD, self.core.list_pod_for_all_namespaces),
            # For the preempt verb's PDB violation count (kube-scheduler's own rule).
            (PDB, self.policy.list_pod_disruption_budget_for_all_namespaces),
            # Labels for the namespaceSelectors of pods' anti-affinity terms.
            (NAMESPACE, self.core.list_namespace),
            # The words for pods waiting on DRA claims (read only).
            *(
                (kind, partial(self.custom.list_cluster_custom_object, DRA_GROUP, "v1", plural))
                for kind, plural in (
                    (RESOURCE_SLICE, "resourceslices"),
                    (RESOURCE_CLAIM, "resourceclaims"),
                    (DEVICE_CLASS, "deviceclasses"),
                )
            ),
        ):
            thread = threading.Thread(
                target=self._run, args=(kind, lister), name=f"watch-{kind}", daemon=True
            )
            thread.start()
            self.threads.append(thread)

    def stop(self) -> None:
        self.stopping.set()

    def _health(self, kind: str) -> WatchHealth:
        return self.dra_health if kind in DRA_KINDS else self.health

    def _run(self, kind: str, lister: Callable[..., Any]) -> None:
        backoff = Backoff(1.0, 30.0)
        while not self.stopping.is_set():
            try:
                self._follow(kind, lister, backoff)
            except Exception as error:  # noqa: BLE001 - a failure to apply is contained: relist
                problem = f"{type(error).__name__}: {error}"
                self._health(kind).failed(kind, problem)
                log.exception("Failed to apply a watch event; relisting", extra=logs.kv(kind=kind))
                self.sleep(backoff.next())

    def _follow(self, kind: str, lister: Callable[..., Any], backoff: Backoff) -> None:
        for item in list_watch(
            lister,
            self.stopping,
            decode=_raw,
            timeout_s=self.period,
            request_timeout_s=self.period + 30,
            backoff=backoff,
            sleep=self.sleep,
        ):
            if isinstance(item, Event):
                self.cache.apply(kind, item.type, item.object)
                if kind == POD and self.pending is not None:
                    self.pending.apply(item.type, item.object)
            elif isinstance(item, Listed):
                self.cache.replace(kind, item.items)
                if kind == POD and self.pending is not None:
                    self.pending.replace(item.items)
                # A fresh relist: the cache holds what the API server has now (readiness
                # returns here, not after a watch period of a kind that may see no event).
                self._health(kind).worked(kind)
                log.info(
                    "Listed objects",
                    extra=logs.kv(kind=kind, count=len(item.items), rv=item.version),
                )
            elif isinstance(item, Resumed):
                self._health(kind).worked(kind)  # a whole watch period without a failure
            elif isinstance(item, Expired):
                log.info("Relisting after the watch expired", extra=logs.kv(kind=kind))
            elif isinstance(item, Failed):
                self._health(kind).failed(kind, item.problem)
                log.warning(
                    "Watch failed; relisting",
                    extra=logs.kv(kind=kind, err=item.problem, retryAfter=item.retry_after),
                )


def _raw(obj: Raw) -> Raw:
    return obj
