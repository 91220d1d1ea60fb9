"""The node's DRA pool in the API: its ResourceSlices read and written, its slices and our claims watched.

The one door of the node agent to `resource.k8s.io`: every list and watch of slices is scoped
to this node and our driver (`spec.nodeName`, `spec.driver`); claims are listed cluster-wide
(the API has no selector for an allocation's pool) and kept only when allocated from our
driver (`gpupart.core.dra.read`). Objects stay raw JSON (the client's models lag the API's
fields). Failures raise KubeUnavailable; the sink logs them and retries.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from gpupart.core.api.jsontext import loads
from gpupart.core.dra import names
from gpupart.core.dra.pool import PublishPlan
from gpupart.core.dra.read import SliceView
from gpupart.core.errors import InvalidInput
from gpupart.kubeconfig import describe_api_error
from gpupart.watch import Backoff, Event, Failed, Listed, list_watch
from gpupart_plugin.kube import CONNECTION_ERRORS, KubeUnavailable, watch_failed

Raw = Mapping[str, Any]

NOT_FOUND = 404
"""A slice already gone; on a list: the API server serves no `resource.k8s.io/v1` (DRA off)."""


class DraNotServed(KubeUnavailable):
    """The API server does not serve `resource.k8s.io/v1`: no slice or claim can exist."""


class PoolClient:
    """This node's pool: list, write and watch its slices; list and watch the claims."""

    def __init__(
        self,
        api: client.ApiClient,
        node: str,
        *,
        writer: client.ApiClient | None = None,
        timeout_s: float = 10.0,
        backoff_s: tuple[float, float] = (1.0, 30.0),
    ) -> None:
        self.resource = client.ResourceV1Api(api)
        self.writes = client.ResourceV1Api(writer or api)
        """Slice writes: as the node itself where the agent acts as its node (ADR 034)."""
        self.core = client.CoreV1Api(api)
        self.node = node
        self.timeout_s = timeout_s
        self.backoff_s = backoff_s
        self._node_uid = ""

    @property
    def slice_selector(self) -> str:
        return f"spec.nodeName={self.node},spec.driver={names.DRIVER}"

    def node_uid(self) -> str:
        """The Node's uid, for the slices' ownerReference (read once)."""
        if not self._node_uid:
            try:
                node = self.core.read_node(self.node, _request_timeout=self.timeout_s)
            except CONNECTION_ERRORS as error:
                raise KubeUnavailable(
                    f"read node {self.node}: {describe_api_error(error)}"
                ) from error
            uid = node.metadata.uid if node.metadata is not None else None
            if not uid:
                raise KubeUnavailable(f"read node {self.node}: it has no uid")
            self._node_uid = str(uid)
        return self._node_uid

    def list_slices(self) -> list[Raw]:
        return self._list(
            "list the ResourceSlices of node " + self.node,
            self.resource.list_resource_slice,
            field_selector=self.slice_selector,
        )

    def list_claims(self) -> list[Raw]:
        return self._list(
            "list ResourceClaims", self.resource.list_resource_claim_for_all_namespaces
        )

    def _list(self, what: str, lister: Callable[..., Any], **selector: str) -> list[Raw]:
        try:
            response = lister(_preload_content=False, _request_timeout=self.timeout_s, **selector)
            items = loads(response.data, what).get("items") or []
        except ApiException as error:
            if error.status == NOT_FOUND:
                raise DraNotServed(f"{what}: {describe_api_error(error)}") from error
            raise KubeUnavailable(f"{what}: {describe_api_error(error)}") from error
        except (*CONNECTION_ERRORS, ValueError, InvalidInput) as error:
            raise KubeUnavailable(f"{what}: {describe_api_error(error)}") from error
        return [i for i in items if isinstance(i, Mapping)]

    def write(self, plan: PublishPlan, existing: Sequence[SliceView]) -> int:
        """The plan's writes in order (creates and updates, then deletes); how many were made.

        An update carries the resourceVersion read, so a slice changed meanwhile is refused
        (409) rather than overwritten; the next publish reads it again.
        """
        versions = {s.name: s.resource_version for s in existing}
        done = 0
        for doc in plan.creates:
            self._write("create", doc)
            done += 1
        for doc in plan.updates:
            name = doc["metadata"]["name"]
            self._write(
                "update",
                {**doc, "metadata": {**doc["metadata"], "resourceVersion": versions[name]}},
            )
            done += 1
        for name in plan.deletes:
            self.delete(name)
            done += 1
        return done

    def delete(self, name: str) -> None:
        """Delete one slice of this pool; one already gone is no error."""
        try:
            self.writes.delete_resource_slice(
                name, _request_timeout=self.timeout_s, _preload_content=False
            )
        except ApiException as error:
            if error.status != NOT_FOUND:
                raise KubeUnavailable(
                    f"delete ResourceSlice {name}: {describe_api_error(error)}"
                ) from error
        except CONNECTION_ERRORS as error:
            raise KubeUnavailable(
                f"delete ResourceSlice {name}: {describe_api_error(error)}"
            ) from error

    def _write(self, verb: str, doc: Raw) -> None:
        name = doc["metadata"]["name"]
        try:
            # The model only carries the document (it keeps every field; a test reads it back).
            body = client.V1ResourceSlice.model_validate(doc)
            if verb == "create":
                self.writes.create_resource_slice(
                    body, _preload_content=False, _request_timeout=self.timeout_s
                )
            else:
                self.writes.replace_resource_slice(
                    name, body, _preload_content=False, _request_timeout=self.timeout_s
                )
        except (*CONNECTION_ERRORS, ValueError) as error:
            raise KubeUnavailable(
                f"{verb} ResourceSlice {name}: {describe_api_error(error)}"
            ) from error

    def watch_slices(self, stop: threading.Event, *, relist_s: float) -> Iterator[Raw | None]:
        """None at each (re)list, then each slice of this pool that is deleted."""
        for item in self._watch(
            stop, "resourceslices", self.resource.list_resource_slice, relist_s,
            field_selector=self.slice_selector,
        ):  # fmt: skip
            if isinstance(item, Listed):
                yield None
            elif item.type == "DELETED":
                yield item.object

    def watch_claims(
        self, stop: threading.Event, *, relist_s: float
    ) -> Iterator[Listed | Event[Raw]]:
        """Every claim at each (re)list, then each change."""
        yield from self._watch(
            stop, "resourceclaims", self.resource.list_resource_claim_for_all_namespaces,
            relist_s,
        )  # fmt: skip

    def _watch(
        self,
        stop: threading.Event,
        what: str,
        lister: Callable[..., Any],
        relist_s: float,
        *,
        field_selector: str | None = None,
    ) -> Iterator[Listed | Event[Raw]]:
        backoff = Backoff(*self.backoff_s)
        for item in list_watch(
            lister,
            stop,
            decode=lambda o: o,
            timeout_s=relist_s,
            request_timeout_s=relist_s + self.timeout_s,
            field_selector=field_selector,
            backoff=backoff,
        ):
            if isinstance(item, Listed | Event):
                yield item
            elif isinstance(item, Failed):
                watch_failed(what, self.node, item.problem, item.retry_after)
