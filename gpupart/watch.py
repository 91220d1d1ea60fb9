"""The one list+watch of gpupart: list, watch from the list's resourceVersion, relist on 410 Gone, back off on failure.

The extender's watch cache and the node agent's Node and Pod watches consume it; the operator
uses kopf's own watches. Objects stay raw JSON mappings unless the caller decodes them (at
thousands of pods the client's model deserialisation costs more than everything else).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from kubernetes.client.exceptions import ApiException
from kubernetes.watch.watch import iter_resp_lines

from gpupart.core.api.jsontext import loads
from gpupart.kubeconfig import describe_api_error

T = TypeVar("T")

Raw = Mapping[str, Any]


class Backoff:
    """Waits between failed attempts: `first`, doubling up to `longest`; `reset` once one works."""

    def __init__(self, first: float = 1.0, longest: float = 30.0) -> None:
        if not 0 < first <= longest:
            raise ValueError(f"backoff needs 0 < first <= longest, got {first}, {longest}")
        self.first = first
        self.longest = longest
        self._next = first

    def next(self) -> float:
        """The wait before the next attempt; the one after it is twice as long (capped)."""
        delay = self._next
        self._next = min(delay * 2, self.longest)
        return delay

    def reset(self) -> None:
        self._next = self.first


@dataclass(frozen=True, slots=True)
class Listed:
    """A full list (the start, or a relist): what is absent from `items` is gone."""

    items: tuple[Raw, ...]
    version: str


@dataclass(frozen=True, slots=True)
class Event(Generic[T]):
    """One ADDED, MODIFIED or DELETED event (bookmarks only move the resourceVersion on)."""

    type: str
    object: T


@dataclass(frozen=True, slots=True)
class Resumed:
    """A watch period ended cleanly (its server-side timeout); the next resumes at `version`."""

    version: str


@dataclass(frozen=True, slots=True)
class Expired:
    """410 Gone: the resourceVersion is too old; a relist follows at once."""


@dataclass(frozen=True, slots=True)
class Failed:
    """The list or watch failed; the next attempt comes after `retry_after` seconds."""

    problem: str
    retry_after: float


Item = Listed | Event[T] | Resumed | Expired | Failed


class _Gone(Exception):
    pass


def list_watch(
    lister: Callable[..., Any],
    stop: threading.Event,
    *,
    decode: Callable[[Raw], T],
    timeout_s: float,
    request_timeout_s: float | None = None,
    field_selector: str | None = None,
    backoff: Backoff | None = None,
    sleep: Callable[[float], object] | None = None,
) -> Iterator[Item[T]]:
    """Everything the watch sees, in order, until `stop` is set.

    `lister` is a generated list method (`CoreV1Api.list_node`, ...), `timeout_s` the
    server-side length of one watch period, `decode` turns a raw object into the caller's
    form. Any failure (refused, dropped, malformed) is yielded as `Failed`, then waited out
    with `sleep` (default: `stop.wait`) before a relist; nothing escapes the loop.
    """
    backoff = backoff or Backoff()
    wait = sleep or stop.wait
    selector = {"field_selector": field_selector} if field_selector else {}
    timeouts = {"_request_timeout": request_timeout_s} if request_timeout_s else {}
    while not stop.is_set():
        try:
            response = lister(_preload_content=False, **selector, **timeouts)
            data = loads(response.data, "the list")
            items = tuple(i for i in data.get("items") or () if isinstance(i, Mapping))
            version = str((data.get("metadata") or {}).get("resourceVersion") or "")
            backoff.reset()
            yield Listed(items, version)
            while not stop.is_set():
                response = lister(
                    watch=True,
                    resource_version=version,
                    allow_watch_bookmarks=True,
                    timeout_seconds=max(1, int(timeout_s)),
                    _preload_content=False,
                    **selector,
                    **timeouts,
                )
                try:
                    for line in iter_resp_lines(response):
                        if stop.is_set():
                            return
                        event = loads(line, "a watch event")
                        kind, obj = event.get("type"), event.get("object") or {}
                        if kind == "ERROR":
                            if obj.get("code") == 410:
                                raise _Gone
                            raise ApiException(status=obj.get("code"), reason=obj.get("message"))
                        version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
                        if kind != "BOOKMARK":
                            backoff.reset()  # the API server answers again
                            yield Event(str(kind), decode(obj))
                finally:
                    response.release_conn()
                yield Resumed(version)
        except Exception as error:  # noqa: BLE001 - any failure of one attempt is retried
            if isinstance(error, _Gone) or (
                isinstance(error, ApiException) and error.status == 410
            ):
                yield Expired()
                continue
            delay = backoff.next()
            yield Failed(describe_api_error(error), delay)
            wait(delay)
