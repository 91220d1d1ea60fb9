"""Kubernetes API adapter of the node agent: its own Node, the pods bound to it (one watch), its pending shared pods."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

from gpupart import logs
from gpupart.core.api.provenance import AssignmentKeys
from gpupart.core.api.wire import (
    DESIRED_ANNOTATION,
    INVENTORY_ANNOTATION,
    MIG_PLAN_ANNOTATION,
    STATE_ANNOTATION,
    GivenContainer,
    allocation_condition,
)
from gpupart.core.errors import GpupartError
from gpupart.core.node.admission import SharedPod, read_shared_pod
from gpupart.keyfile import PublicKeySource
from gpupart.kubeconfig import describe_api_error
from gpupart.podevents import warn_pod
from gpupart.watch import Backoff, Event, Failed, Listed, Resumed, list_watch

log = logging.getLogger(__name__)
T = TypeVar("T")

CONNECTION_ERRORS = (ApiException, HTTPError, OSError)
"""What the client raises when the API server refuses, drops or never answers a request.

urllib3's MaxRetryError (connection refused after its retries) and ProtocolError (connection
dropped mid-watch) derive from urllib3's HTTPError, not from OSError.
"""


ALLOCATE_REFUSED = "SharedGpuAllocateRefused"
"""The reason of the Event on a pod whose shared-GPU Allocate the node agent refused."""


class KubeUnavailable(GpupartError):
    """The API server did not answer a request of the node agent (it retries on the next pass)."""


@dataclass(frozen=True, slots=True)
class PassInput:
    """What a pass acts on: the operator's desired and MIG plan annotations on this Node, as
    text (None: not there); parsed by the agent, each on its own."""

    desired: str | None = None
    plan: str | None = None

    @classmethod
    def of(cls, obj: Any) -> PassInput:
        annotations = _annotations(obj)
        return cls(annotations.get(DESIRED_ANNOTATION), annotations.get(MIG_PLAN_ANNOTATION))


def watch_failed(resource: str, node: str, problem: str, retry_after: float) -> None:
    """The node agent's one warning for a list or watch that failed and is tried again."""
    log.warning(
        "Failed to watch",
        extra=logs.kv(resource=resource, node=node, retryAfter=f"{retry_after:g}s", err=problem),
    )


PodKey = tuple[str, str, str]
"""(uid, namespace, name) of a pod."""


class NodePods:
    """The agent's one watch of the pods bound to its node (`spec.nodeName=<node>`, raw JSON):
    which pods are here, and each pod that leaves (`left`: it finished or was deleted, so what
    it held may be free soon and a pass should look).

    The DRA prepare's pod check asks `holds` first (a LIST per claim costs a round trip). It only
    ever says yes: a pod of that uid and name was bound to this node by the scheduler (neither
    changes once set); a pod not seen yet, the watch behind or down, is asked of the API.
    Objects are never decoded into the client's models: a pod's events come in bursts exactly
    while the kubelet waits for its NodePrepareResources, in the same process.
    """

    def __init__(
        self,
        api: client.ApiClient,
        node: str,
        *,
        relist_s: float = 300.0,
        left: Callable[[str], None] | None = None,
        timeout_s: float = 10.0,
        backoff_s: tuple[float, float] = (1.0, 30.0),
    ) -> None:
        self.core = client.CoreV1Api(api)
        self.node = node
        self.relist_s = relist_s
        self.left = left
        self.timeout_s = timeout_s
        self.backoff_s = backoff_s
        """Told `namespace/name` of each pod that finishes or is deleted, as the watch sees it."""
        self._lock = threading.Lock()
        self._pods: frozenset[PodKey] = frozenset()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def holds(self, uid: str, namespace: str, name: str) -> bool:
        with self._lock:
            return (uid, namespace, name) in self._pods

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="pod-watch", daemon=True)
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
            request_timeout_s=self.relist_s + self.timeout_s,
            field_selector=f"spec.nodeName={self.node}",
            backoff=Backoff(*self.backoff_s),
        ):
            if isinstance(item, Listed):
                found = frozenset(k for k in map(self._key, item.items) if k is not None)
                with self._lock:
                    self._pods = found
            elif isinstance(item, Event):
                self._seen(item.type, item.object)
            elif isinstance(item, Failed):
                watch_failed("pods", self.node, item.problem, item.retry_after)

    def _seen(self, kind: str, pod: Mapping[str, Any]) -> None:
        key = self._key(pod)
        if key is None:
            return
        with self._lock:
            self._pods = self._pods - {key} if kind == "DELETED" else self._pods | {key}
        status = pod.get("status")
        phase = status.get("phase") if isinstance(status, Mapping) else None
        if self.left is not None and (
            kind == "DELETED" or (kind == "MODIFIED" and phase in ("Succeeded", "Failed"))
        ):
            self.left(f"{key[1]}/{key[2]}")


class NodeClient:
    """The agent's only door to the API server; every list and watch is scoped to this node."""

    def __init__(
        self,
        api: client.ApiClient,
        node: str,
        keys: PublicKeySource,
        *,
        writer: client.ApiClient | None = None,
        timeout_s: float = 10.0,
        backoff_s: tuple[float, float] = (1.0, 30.0),
    ) -> None:
        self.core = client.CoreV1Api(api)
        self.writes = client.CoreV1Api(writer or api)
        """Every write (the Node, its status, pods' status, Events): as the node itself where
        the agent acts as its node (`node_writer`), so the API server's Node authorizer and
        NodeRestriction confine it to this node's objects."""
        self.node = node
        self.keys = keys
        """The extender's assignment keys: only assignments that verify are served."""
        self.timeout_s = timeout_s
        self.backoff_s = backoff_s
        """First and longest wait between failed watch attempts (doubling in between)."""
        self._capacity: dict[str, int] | None = None
        """The extender-managed capacity last written (None: not yet, write it once)."""

    def read_input(self) -> PassInput:
        return PassInput.of(self.core.read_node(self.node, _request_timeout=self.timeout_s))

    def last_inventory(self) -> str | None:
        """The inventory annotation on this Node: what the agent published before it restarted.

        None when there is none (a new node); KubeUnavailable when the API server does not answer.
        """
        try:
            node = self.core.read_node(self.node, _request_timeout=self.timeout_s)
        except CONNECTION_ERRORS as error:
            raise KubeUnavailable(
                f"read the inventory of node {self.node}: {describe_api_error(error)}"
            ) from error
        return _annotations(node).get(INVENTORY_ANNOTATION)

    def watch_input(self, stop: threading.Event, *, relist_s: float) -> Iterator[PassInput]:
        """The desired and plan annotations now, when either changes, and at least every
        `relist_s` (drift)."""
        last: PassInput | None = None
        for start, event in self._watch(
            stop, "node", self.core.list_node, f"metadata.name={self.node}", relist_s,
            start=self.read_input,
        ):  # fmt: skip
            # Each (re)start of the watch reads the Node itself: always a pass (drift).
            value = start if event is None else PassInput.of(event["object"])
            if value is not None and (event is None or value != last):
                last = value
                yield value

    def _watch(
        self,
        stop: threading.Event,
        what: str,
        list_fn: Callable[..., Any],
        field_selector: str,
        relist_s: float,
        *,
        start: Callable[[], T] | None = None,
    ) -> Iterator[tuple[T | None, Any]]:
        """(start(), None) at each (re)start of the watch when `start` is given, then (None, event).

        The node agent's side of gpupart.watch: events are `{"type", "object"}` with the
        client's model objects. Failures (the API server unreachable at start, or dropping the
        stream) are logged and retried after the first backoff, doubling up to the longest,
        back to the first once the API server answers again.
        """
        backoff = Backoff(*self.backoff_s)
        return_type = watch.Watch().get_return_type(list_fn)  # V1NodeList -> V1Node

        def decode(obj: Mapping[str, Any]) -> Any:
            return self.core.api_client.deserialize(
                json.dumps(obj), return_type, "application/json"
            )

        while not stop.is_set():
            for item in list_watch(
                list_fn,
                stop,
                decode=decode,
                timeout_s=relist_s,
                request_timeout_s=relist_s + self.timeout_s,
                field_selector=field_selector,
                backoff=backoff,
            ):
                if isinstance(item, Event):
                    yield None, {"type": item.type, "object": item.object}
                elif isinstance(item, Failed):
                    watch_failed(what, self.node, item.problem, item.retry_after)
                elif isinstance(item, Listed | Resumed) and start is not None:
                    try:
                        value = start()
                    except CONNECTION_ERRORS as error:
                        delay = backoff.next()
                        watch_failed(what, self.node, describe_api_error(error), delay)
                        stop.wait(delay)
                        break  # relist, then read again
                    yield value, None

    def publish(self, state: str, inventory: str, capacity: Mapping[str, int]) -> None:
        """The state and inventory annotations, and the extender-managed capacity when it changed.

        The capacity goes into the Node's status (capacity and allocatable), which the kubelet
        keeps: it rewrites only the resources it manages.
        """
        body = {
            "metadata": {"annotations": {STATE_ANNOTATION: state, INVENTORY_ANNOTATION: inventory}}
        }
        try:
            self.writes.patch_node(self.node, body, _request_timeout=self.timeout_s)
        except CONNECTION_ERRORS as error:
            raise KubeUnavailable(
                f"publish state of node {self.node}: {describe_api_error(error)}"
            ) from error
        if capacity != self._capacity:
            self.write_status(capacity, capacity)
            self._capacity = dict(capacity)

    def write_status(self, capacity: Mapping[str, int], allocatable: Mapping[str, int]) -> None:
        """Patch these resources' amounts into the Node's status.capacity and status.allocatable.

        A merge patch: every other resource stays as the kubelet wrote it.
        """
        status = {
            "status": {
                "capacity": {name: str(value) for name, value in capacity.items()},
                "allocatable": {name: str(value) for name, value in allocatable.items()},
            }
        }
        try:
            self.writes.patch_node_status(self.node, status, _request_timeout=self.timeout_s)
        except CONNECTION_ERRORS as error:
            raise KubeUnavailable(
                f"write the status of node {self.node}: {describe_api_error(error)}"
            ) from error

    def shared_pods(self) -> tuple[SharedPod, ...]:
        """Pods bound here, in any phase but a finished one, that ask for shared-GPU slots.

        Not only Pending ones: kwok reports a pod Running before the kubelet calls Allocate for
        it. Each assignment is checked against the extender's key here (`read_shared_pod`); a
        pod without one that verifies stays listed with its problem: it may be the pod being
        admitted, so the allocator refuses rather than pair, and can name it. Unreadable pods
        are skipped: the plugin never serves them.
        """
        try:
            pods = self.core.list_pod_for_all_namespaces(
                field_selector=(
                    f"spec.nodeName={self.node},status.phase!=Succeeded,status.phase!=Failed"
                ),
                _request_timeout=self.timeout_s,
            )
        except CONNECTION_ERRORS as error:
            raise KubeUnavailable(
                f"list pods on node {self.node}: {describe_api_error(error)}"
            ) from error
        keys: AssignmentKeys | str
        try:
            keys = self.keys.keys()
        except GpupartError as error:
            keys = str(error)
        found = []
        for pod in pods.items:
            # Parse at the edge: the plain dict form, where every field is what the API sent.
            raw: Mapping[str, Any] = self.core.api_client.sanitize_for_serialization(pod)
            try:
                assigned = read_shared_pod(raw, keys)
            except Exception as error:  # noqa: BLE001 - one unreadable pod never hides the others
                meta = raw.get("metadata") or {}
                log.warning(
                    "Skipped unreadable pod",
                    extra=logs.kv(pod=f"{meta.get('namespace')}/{meta.get('name')}", err=error),
                )
                continue
            if assigned is None:
                continue
            found.append(assigned)
        return tuple(found)

    def warn(self, pod: SharedPod, message: str) -> None:
        """A Warning Event on `pod` saying why its shared-GPU Allocate was refused; never raises."""
        warn_pod(
            self.writes,
            name=pod.name,
            namespace=pod.namespace,
            uid=pod.uid,
            reason=ALLOCATE_REFUSED,
            message=message,
            component="node",
            instance=self.node,
            timeout_s=self.timeout_s,
        )

    def record_allocation(self, pod: SharedPod, given: tuple[GivenContainer, ...]) -> None:
        """Write what the plugin gave the pod's containers on the pod: the message of its
        `gpupart.io/SharedGpuAllocated` status condition (the extender's gate, ADR 001).

        Through pods/status, which tenants cannot write and which the Node authorizer lets a
        node write only on its own pods (ADR 034). A strategic merge patch: conditions merge
        by type, so the kubelet's own stay as they are.
        """
        condition = allocation_condition(given, datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
        try:
            self.writes.patch_namespaced_pod_status(
                pod.name,
                pod.namespace,
                {"status": {"conditions": [condition]}},
                _content_type="application/strategic-merge-patch+json",
                _request_timeout=self.timeout_s,
            )
        except CONNECTION_ERRORS as error:
            raise KubeUnavailable(
                f"record the allocation of pod {pod.key}: {describe_api_error(error)}"
            ) from error


def node_writer(configuration: client.Configuration, node: str) -> client.ApiClient:
    """An API client that acts as node `node` (constrained impersonation of the node the
    agent's pod runs on: `system:node:<node>`, ADR 034)."""
    api = client.ApiClient(configuration)
    api.set_default_header("Impersonate-User", f"system:node:{node}")
    return api


def _annotations(obj: Any) -> Mapping[str, str]:
    meta = obj.metadata
    return (meta.annotations if meta is not None else None) or {}
