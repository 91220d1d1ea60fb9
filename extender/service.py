"""Filter, prioritize and bind on domain types: the cache, the core's terms, holds and binding.

HTTP-free: `app.py` parses the wire models and calls these methods. Every core error is turned
into extender words here, in `explain`, and nowhere else.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from gpupart.core.errors import GpupartError, InvalidInput
from gpupart.core.scheduling import (
    Demand,
    FailureKind,
    Fit,
    NodeView,
    NoFit,
    PlacedPod,
    ScoringConfig,
    Verdict,
    assemble_node,
    evaluate,
    fragmentation_model,
    parse_demand,
    tenant_of,
)
from gpupart.core.scoring import FragmentationModel
from gpupart.core.wire import ASSIGNMENT_ANNOTATION, PodAssignment, encode_assignment

from .cache import ClusterCache, PodEntry, read_node
from .metrics import Metrics

log = logging.getLogger(__name__)


class Binder(Protocol):
    """The two API writes of a bind; `kube.ApiBinder` does them for real, tests pass a fake."""

    def annotate(
        self, namespace: str, name: str, uid: str, annotations: Mapping[str, str]
    ) -> None: ...
    def bind(self, namespace: str, name: str, uid: str, node: str) -> None: ...


def explain(error: BaseException) -> str:
    """The one place an error becomes the text of an `Error` field."""
    if isinstance(error, InvalidInput):
        return f"invalid pod: {error}"
    if isinstance(error, GpupartError):
        return str(error)
    return f"internal error: {type(error).__name__}: {error}"


@dataclass(frozen=True, slots=True)
class FilterOutcome:
    passed: list[str]
    failed: dict[str, str]
    unresolvable: dict[str, str]
    error: str = ""


@dataclass(frozen=True, slots=True)
class Hold:
    """A filter decision kept until bind: the pod as the scheduler sent it and its demand."""

    pod: Mapping[str, Any]
    demand: Demand
    expires: float


class ExtenderService:
    def __init__(
        self,
        cache: ClusterCache,
        scoring: ScoringConfig,
        *,
        binder: Binder,
        metrics: Metrics,
        ttl_seconds: float = 30.0,
        refresh_seconds: float = 60.0,
        memo_size: int = 200_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cache = cache
        self.scoring = scoring
        self.binder = binder
        self.metrics = metrics
        self.ttl = ttl_seconds
        self.refresh = refresh_seconds
        self.memo_size = memo_size
        self.clock = clock
        self._memo: dict[tuple[str, int, Demand], Verdict] = {}
        self._holds: dict[str, Hold] = {}
        self._holds_lock = threading.Lock()
        self._model: FragmentationModel = fragmentation_model(())
        self._model_at = -math.inf
        self._last_purge = -math.inf

    # -- shared machinery --

    def model(self, now: float) -> FragmentationModel:
        """The fragmentation model over the observed mix, rebuilt every `refresh` seconds."""
        if now - self._model_at >= self.refresh:
            shapes = self.cache.observed_shapes()
            self._model = fragmentation_model(shapes)
            self._model_at = now
            self._memo.clear()  # verdicts depend on the model
        return self._model

    def _housekeeping(self, now: float) -> None:
        if now - self._last_purge < 1.0:
            return
        self._last_purge = now
        self.cache.expire(now)
        with self._holds_lock:
            for uid in [u for u, h in self._holds.items() if h.expires <= now]:
                del self._holds[uid]
        if len(self._memo) > self.memo_size:
            self._memo.clear()

    def _verdicts(
        self, names: Sequence[str], demand: Demand, given: Mapping[str, NodeView], now: float
    ) -> list[tuple[str, Verdict | None]]:
        """Verdict per node name, memoised per (node, version, pod shape); None: unknown node."""
        model = self.model(now)
        shape = dataclasses.replace(demand, pod="")
        memo = self._memo
        out: list[tuple[str, Verdict | None]] = []
        with self.cache.lock():
            view_of = self.cache.view
            for name in names:
                view = view_of(name) or given.get(name)
                if view is None:
                    out.append((name, None))
                    continue
                key = (name, view.version, shape)
                verdict = memo.get(key)
                if verdict is None:
                    verdict = evaluate(view, demand, config=self.scoring, model=model)
                    if view.version:
                        memo[key] = verdict
                out.append((name, verdict))
        return out

    def _demand(self, pod: Mapping[str, Any]) -> Demand:
        return parse_demand(pod, group_label=self.scoring.group_label)

    # -- verbs --

    def filter(
        self, pod: Mapping[str, Any], names: Sequence[str], nodes: Iterable[Mapping[str, Any]] = ()
    ) -> FilterOutcome:
        now = self.clock()
        self._housekeeping(now)
        try:
            demand = self._demand(pod)
        except GpupartError as error:
            self.metrics.decisions.labels("filter", "error").inc()
            return FilterOutcome([], {}, {}, explain(error))
        given = _views_from_objects(nodes)
        passed: list[str] = []
        failed: dict[str, str] = {}
        unresolvable: dict[str, str] = {}
        reasons: Counter[str] = Counter()
        for name, verdict in self._verdicts(names, demand, given, now):
            if isinstance(verdict, Fit):
                passed.append(name)
            elif verdict is None:
                failed[name] = (
                    f"{name}: not known to the gpupart extender (no such Node watched yet)"
                )
                reasons[FailureKind.UNKNOWN_NODE] += 1
            else:
                (unresolvable if verdict.unresolvable else failed)[name] = verdict.reason
                reasons[verdict.kind] += 1
        for reason, count in reasons.items():
            self.metrics.filtered.labels(reason).inc(count)
        uid = _uid(pod)
        with self._holds_lock:
            self._holds[uid] = Hold(pod, demand, now + self.ttl)
        self.metrics.decisions.labels("filter", "ok" if passed else "unschedulable").inc()
        if not passed:
            log.info(
                "Filtered out every node",
                extra={"kv": {"pod": demand.pod, "nodes": len(names)}},
            )
        return FilterOutcome(passed, failed, unresolvable)

    def prioritize(
        self, pod: Mapping[str, Any], names: Sequence[str], nodes: Iterable[Mapping[str, Any]] = ()
    ) -> list[tuple[str, int]]:
        now = self.clock()
        demand = self._demand(pod)  # InvalidInput goes to the caller: prioritize has no Error field
        given = _views_from_objects(nodes)
        scores = [
            (name, verdict.score if isinstance(verdict, Fit) else 0)
            for name, verdict in self._verdicts(names, demand, given, now)
        ]
        self.metrics.decisions.labels("prioritize", "ok").inc()
        return scores

    def bind(self, namespace: str, name: str, uid: str, node: str) -> str:
        """Choose the GPU again on fresh state, reserve it, write the assignment, bind; "" = done."""
        now = self.clock()
        self._housekeeping(now)
        key = uid or f"{namespace}/{name}"
        with self._holds_lock:
            hold = self._holds.get(key)
        if hold is None or hold.demand.pod != f"{namespace}/{name}":
            self.metrics.decisions.labels("bind", "error").inc()
            return (
                f"no filter decision for pod {namespace}/{name} (uid {uid!r}) in the last "
                f"{self.ttl:g}s; the scheduler will retry"
            )
        demand = hold.demand
        with self.cache.lock():
            view = self.cache.view(node)
            if view is None:
                self.metrics.decisions.labels("bind", "error").inc()
                return f"node {node} is not known to the gpupart extender"
            verdict = evaluate(view, demand, config=self.scoring, model=self.model(now))
            if isinstance(verdict, NoFit):
                self.metrics.decisions.labels("bind", "error").inc()
                return f"node changed since filter: {verdict.reason}"
            assignment = None
            if verdict.gpu is not None:
                gpu = next(g for g in view.gpus if g.index == verdict.gpu)
                assignment = PodAssignment(
                    node,
                    gpu.index,
                    gpu.uuid,
                    demand.request.memory_mib,
                    demand.request.compute_percent,
                )
            entry = PodEntry(
                key,
                demand.pod,
                node,
                PlacedPod(tenant_of(hold.pod, demand.request), demand.request, assignment),
            )
            # Reserved before the API calls, so a concurrent bind already sees this capacity gone.
            self.cache.assume(entry, expires=now + self.ttl)
        try:
            if assignment is not None:
                self.binder.annotate(
                    namespace, name, uid, {ASSIGNMENT_ANNOTATION: encode_assignment(assignment)}
                )
            self.binder.bind(namespace, name, uid, node)
        except Exception as error:  # noqa: BLE001 - any API failure is reported, never raised
            self.cache.forget(key)
            self.metrics.decisions.labels("bind", "error").inc()
            log.warning(
                "Failed to bind pod",
                extra={"kv": {"pod": demand.pod, "node": node, "err": explain(error)}},
            )
            return f"binding {demand.pod} to {node} failed: {explain(error)}"
        with self._holds_lock:
            self._holds.pop(key, None)
        self.metrics.decisions.labels("bind", "ok").inc()
        log.info(
            "Bound pod",
            extra={
                "kv": {
                    "pod": demand.pod,
                    "node": node,
                    "gpu": "" if assignment is None else assignment.gpu,
                    "score": verdict.score,
                }
            },
        )
        return ""


def _uid(pod: Mapping[str, Any]) -> str:
    meta = pod.get("metadata") or {}
    uid = meta.get("uid")
    if uid:
        return str(uid)
    return f"{meta.get('namespace') or 'default'}/{meta.get('name') or '?'}"


def _views_from_objects(nodes: Iterable[Mapping[str, Any]]) -> dict[str, NodeView]:
    """Views of nodes the scheduler sent in full (nodeCacheCapable false) that the cache lacks.

    No pods are known for them, so they are trusted only as far as their inventory goes.
    """
    views = {}
    for node in nodes:
        name = str((node.get("metadata") or {}).get("name") or "")
        if name:
            entry = read_node(node)
            views[name] = assemble_node(name, entry.inventory, (), problem=entry.problem)
    return views
