"""Pending GPU pods kube-scheduler left Unschedulable, and the reporter posting gpupart's reason on each as an Event.

kube-scheduler asks the extender only about the nodes its own resource counts passed: a MIG or
whole-GPU pod that fits nowhere never reaches filter, and its event says only `Insufficient
nvidia.com/mig-1g.10gb` (docs/adr-019-pending-reasons.md). The Pod watch feeds `PendingPods`
(the cache keeps bound and nominated pods only); `Reporter.round` asks the service for each
such pod's reason over every node and posts it when it changed.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

from gpupart import logs
from gpupart.core.api.pods import parse_pod_request

from .objects import meta_of, uid_of

log = logging.getLogger(__name__)

REASON = "FailedScheduling"
"""The Event reason: the one users and tools look for on a pod that is not scheduled."""


class EventSink(Protocol):
    """Posts a Warning Event on a pod (`kube.ApiEvents`; tests read what was posted)."""

    def warn(self, pod: Mapping[str, Any], reason: str, message: str) -> None: ...


def unschedulable(pod: Mapping[str, Any], scheduler_names: Sequence[str]) -> bool:
    """Whether `pod` is one of ours that kube-scheduler tried and could not place: its
    scheduler is one of `scheduler_names`, it is unbound, live, asks for a resource gpupart
    serves (or for one it cannot read) or has ResourceClaims, and its PodScheduled condition
    is False/Unschedulable."""
    spec = pod.get("spec")
    status = pod.get("status")
    if not isinstance(spec, Mapping) or not isinstance(status, Mapping):
        return False
    if (spec.get("schedulerName") or "default-scheduler") not in scheduler_names:
        return False
    if spec.get("nodeName") or meta_of(pod).get("deletionTimestamp") is not None:
        return False
    if status.get("phase") not in (None, "", "Pending"):
        return False
    conditions = status.get("conditions")
    if not isinstance(conditions, list) or not any(
        isinstance(c, Mapping)
        and c.get("type") == "PodScheduled"
        and c.get("status") == "False"
        and c.get("reason") == "Unschedulable"
        for c in conditions
    ):
        return False
    if spec.get("resourceClaims"):
        return True  # waits on DRA claims (docs/dra.md, "Reasons")
    try:
        return not parse_pod_request(pod).empty
    except Exception:  # noqa: BLE001 - a request it cannot read: the reason will say so
        return True


class PendingPods:
    """The pods `unschedulable` keeps, by uid; written by the Pod watch thread, read by the
    reporter (one lock, held only to swap entries)."""

    def __init__(self, scheduler_names: Sequence[str]) -> None:
        self.scheduler_names = tuple(scheduler_names)
        self._pods: dict[str, Mapping[str, Any]] = {}
        self._lock = threading.Lock()

    def apply(self, event: str, obj: Mapping[str, Any]) -> None:
        if event not in ("ADDED", "MODIFIED", "DELETED"):
            return
        uid = uid_of(obj)
        keep = event != "DELETED" and unschedulable(obj, self.scheduler_names)
        with self._lock:
            if keep:
                self._pods[uid] = obj
            else:
                self._pods.pop(uid, None)

    def replace(self, objects: Iterable[Mapping[str, Any]]) -> None:
        fresh = {uid_of(o): o for o in objects if unschedulable(o, self.scheduler_names)}
        with self._lock:
            self._pods = fresh

    def pods(self) -> dict[str, Mapping[str, Any]]:
        with self._lock:
            return dict(self._pods)


class Reporter:
    """Posts each pending pod's reason (`explain`) as a `FailedScheduling` Warning, once per
    distinct text while the pod stays pending."""

    def __init__(
        self,
        pending: PendingPods,
        explain: Callable[[Mapping[str, Any]], str],
        sink: EventSink,
    ) -> None:
        self.pending = pending
        self.explain = explain
        self.sink = sink
        self._told: dict[str, str] = {}
        """Per pod uid, the text last posted."""

    def round(self) -> int:
        """One pass over the pending pods; returns how many Events were posted."""
        pods = self.pending.pods()
        for uid in [u for u in self._told if u not in pods]:
            del self._told[uid]  # placed or gone: a new attempt starts afresh
        posted = 0
        for uid, pod in pods.items():
            try:
                text = self.explain(pod)
                if self._told.get(uid) == text:
                    continue
                self.sink.warn(pod, REASON, text)
            except Exception:  # noqa: BLE001 - one pod's problem (a bug): the others go on
                log.exception("Failed to explain a pending pod", extra=logs.kv(uid=uid))
                continue
            self._told[uid] = text
            posted += 1
        return posted

    def run(self, stopping: threading.Event, every: float) -> None:
        """Rounds every `every` seconds until `stopping` is set (the extender's thread)."""
        while not stopping.wait(every):
            self.round()
