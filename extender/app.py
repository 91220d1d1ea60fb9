"""The HTTP edge: `create_app` serves the verbs, health and metrics; `create_health_app` health and metrics only.

Handlers parse the wire models, call the service with plain values, and send back what
`replies` writes for each verb (the exact bytes kube-scheduler decodes). /readyz follows the
watcher's readiness rule (`watchhealth`); /metrics only reads.
Every request passes `limits.RequestLimits` first (size, count and bodies in flight), and a
request naming more than `max_request_nodes` nodes is refused (413) before any is looked at.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

from fastapi import FastAPI, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, TypeAdapter, ValidationError

from gpupart import logs
from gpupart.core.errors import GpupartError

from .limits import RequestLimits
from .models import (
    POD_SCHEMA,
    DiagnosisResult,
    ExtenderArgs,
    ExtenderBindingArgs,
    ExtenderBindingResult,
    ExtenderFilterResult,
    ExtenderPreemptionArgs,
    ExtenderPreemptionResult,
    HostPriority,
)
from .preemption import NodeVictims
from .replies import bind_result, diagnose_text, error_text, filter_text, preempt_text
from .service import ExtenderService, FilterOutcome
from .settings import ExtenderSettings
from .texts import explain
from .watchhealth import WatchHealth, unready_reason

log = logging.getLogger(__name__)
_JSON = "application/json"
_POD_BODY: TypeAdapter[dict[str, Any]] = TypeAdapter(dict[str, Any])
"""diagnose's body: a Pod, read as a JSON object (pydantic's parser: bounded depth)."""
HEALTH_BODY_BYTES = 4096
"""The largest body the health port reads (its three routes read none)."""


class TooManyNodes(Exception):
    """A request naming more nodes than `max_request_nodes` (answered 413)."""


def create_app(
    settings: ExtenderSettings, service: ExtenderService, health: WatchHealth | None = None
) -> FastAPI:
    """One app per service; nothing module-level, so tests build as many as they like.
    `health`: the watcher's, for /readyz (None: no watcher, ready once the cache is listed)."""
    prefix = settings.prefix
    app = FastAPI(
        title="gpupart scheduler extender",
        version="v1",
        description="kube-scheduler extender (k8s.io/kube-scheduler/extender/v1) for GPU pods.",
    )
    app.state.service = service
    metrics = service.metrics
    most = settings.max_request_nodes
    app.add_middleware(
        RequestLimits,
        max_body=settings.max_request_bytes,
        max_concurrent=settings.max_concurrent_requests,
        metrics=metrics,
    )

    @app.exception_handler(TooManyNodes)
    async def _too_many(_: Request, error: TooManyNodes) -> Response:
        metrics.refused.labels("too_large").inc()
        return _error(str(error), 413)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, error: Exception) -> Response:
        # A bug met by one request: answered with words and logged; the server goes on.
        log.error(
            "Failed to answer a request",
            exc_info=error,
            extra=logs.kv(path=request.url.path),
        )
        return _error(explain(error), 500)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, error: RequestValidationError) -> Response:
        # A 4xx with a short message; kube-scheduler logs it and treats the call as failed.
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', ())) or 'body'}: {e.get('msg', '')}"
            for e in error.errors()[:5]
        )
        return _error(f"malformed request: {problems}", 400)

    @app.post(
        f"{prefix}/filter",
        response_model=ExtenderFilterResult,
        response_model_by_alias=True,
        summary="Filter nodes for a pod",
        openapi_extra=_json_body(ExtenderArgs),
    )
    async def filter_nodes(request: Request) -> Response:
        started = time.perf_counter()
        args = await _parse(request, ExtenderArgs)
        names, items = _names(args, most)
        try:
            # nodeCacheCapable: the reply is joined from pre-encoded pieces, no lists needed.
            outcome = service.filter(args.Pod, names, items, lists=args.NodeNames is None)
        except Exception as error:  # noqa: BLE001 - the scheduler gets words, never a 500
            log.exception("Failed to filter", extra=logs.kv(nodes=len(names)))
            outcome = FilterOutcome([], {}, {}, explain(error))
        nodes = None
        if args.NodeNames is None and args.Nodes is not None:
            nodes = args.Nodes.model_dump(exclude_none=True)
        text = filter_text(outcome, nodes)
        metrics.latency.labels("filter").observe(time.perf_counter() - started)
        return Response(text, media_type=_JSON)

    @app.post(
        f"{prefix}/prioritize",
        response_model=list[HostPriority],
        summary="Score nodes 0-10 for a pod",
        openapi_extra=_json_body(ExtenderArgs),
    )
    async def prioritize(request: Request) -> Response:
        started = time.perf_counter()
        args = await _parse(request, ExtenderArgs)
        names, items = _names(args, most)
        try:
            text = service.prioritize_json(args.Pod, names, items)
        except Exception as error:  # noqa: BLE001 - the scheduler gets words, never a 500
            # The protocol has no Error field here; a 400 makes the scheduler ignore our scores.
            if not isinstance(error, GpupartError):
                log.exception("Failed to prioritize", extra=logs.kv(nodes=len(names)))
            metrics.decisions.labels("prioritize", "error").inc()
            return _error(explain(error), 400)
        metrics.latency.labels("prioritize").observe(time.perf_counter() - started)
        return Response(text, media_type=_JSON)

    @app.post(
        f"{prefix}/preempt",
        response_model=ExtenderPreemptionResult,
        summary="Victims on one GPU per candidate node; nodes where none help are left out",
        responses={400: {"description": "not a pod we can read"}},
        openapi_extra=_json_body(ExtenderPreemptionArgs),
    )
    async def preempt(request: Request) -> Response:
        started = time.perf_counter()
        args = await _parse(request, ExtenderPreemptionArgs)
        try:
            # On the thread pool: preempt writes its proposals under the writer lock, which a
            # relist may hold for a while; the event loop never waits for it.
            candidates = _candidates(args, most)
            kept = await run_in_threadpool(service.preempt, args.Pod, candidates)
        except TooManyNodes:
            raise
        except Exception as error:  # noqa: BLE001 - the scheduler gets words, never a 500
            # No Error field in the result: a 400 fails this preemption attempt, and
            # kube-scheduler tries again on the pod's next cycle.
            if not isinstance(error, GpupartError):
                log.exception("Failed to preempt")
            metrics.decisions.labels("preempt", "error").inc()
            return _error(explain(error), 400)
        text = preempt_text(kept)
        metrics.latency.labels("preempt").observe(time.perf_counter() - started)
        return Response(text, media_type=_JSON)

    @app.post(
        f"{prefix}/bind",
        response_model=ExtenderBindingResult,
        summary="Write the GPU assignment and bind the pod",
    )
    def bind(args: ExtenderBindingArgs) -> ExtenderBindingResult:
        # A plain `def`: bind does blocking API calls, so it runs on the thread pool.
        started = time.perf_counter()
        error = service.bind(args.PodNamespace, args.PodName, args.PodUID, args.Node)
        metrics.latency.labels("bind").observe(time.perf_counter() - started)
        return bind_result(error)

    @app.post(
        f"{prefix}/diagnose",
        response_model=DiagnosisResult,
        summary="Why a pod fits or not on each node, every reason in full",
        responses={400: {"description": "not a pod we can read"}},
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {
                    _JSON: {
                        "schema": {
                            **POD_SCHEMA,
                            "description": "the Pod, as `kubectl get pod -o json`",
                        }
                    }
                },
            }
        },
    )
    async def diagnose(
        request: Request,
        node: Annotated[
            list[str] | None, Query(description="only these nodes (default: all)")
        ] = None,
    ) -> Response:
        _bounded(len(node or ()), most, "node")
        # Read whatever the Content-Type says: `curl --data-binary @-` sends
        # application/x-www-form-urlencoded, and the body is the Pod all the same.
        pod = await _parse_pod(request)
        try:
            # On the thread pool: evaluating every node must not hold up filter calls.
            found = await run_in_threadpool(service.diagnose, pod, node or ())
        except GpupartError as error:
            return _error(explain(error), 400)
        return Response(diagnose_text(found), media_type=_JSON)

    _health_routes(app, service, health)
    return app


def create_health_app(service: ExtenderService, health: WatchHealth | None = None) -> FastAPI:
    """The plain-HTTP health port: /healthz, /readyz and /metrics and nothing else (no
    documentation routes either), for probes and scrapers that hold no client certificate.
    Nothing here names a pod or a namespace: the metrics are aggregate counters."""
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
    app.add_middleware(
        RequestLimits,
        max_body=HEALTH_BODY_BYTES,
        max_concurrent=16,
        metrics=service.metrics,
    )
    _health_routes(app, service, health)
    return app


def _error(message: str, status: int) -> Response:
    return Response(error_text(message), status_code=status, media_type=_JSON)


def _health_routes(app: FastAPI, service: ExtenderService, health: WatchHealth | None) -> None:
    metrics = service.metrics

    @app.get("/healthz", response_class=PlainTextResponse)
    async def healthz() -> str:
        return "ok"

    @app.get("/readyz", response_class=PlainTextResponse)
    async def readyz() -> Response:
        reason = unready_reason(service.cache.synced, health)
        if not reason:
            return PlainTextResponse("ok")
        return PlainTextResponse(reason, status_code=503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        # Read-only: the gauges read the current snapshot as they are collected.
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)


_Model = TypeVar("_Model", bound=BaseModel)
_Parsed = TypeVar("_Parsed")


async def _parse(request: Request, model: type[_Model]) -> _Model:
    """The body in one pass of pydantic's JSON parser: at 5,000 node names, half the cost of
    FastAPI's json.loads and then validation. Errors answer like FastAPI's own (400). The
    body's size was bounded before it was read (`RequestLimits`)."""
    return _validated(await request.body(), model.model_validate_json)


async def _parse_pod(request: Request) -> dict[str, Any]:
    """The body as a JSON object (a Pod), whatever its Content-Type; errors as `_parse`'s."""
    return _validated(await request.body(), _POD_BODY.validate_json)


def _validated(body: bytes, validate: Callable[[bytes], _Parsed]) -> _Parsed:
    try:
        return validate(body)
    except ValidationError as error:
        raise RequestValidationError(error.errors()) from None
    except RecursionError:  # JSON nested past what the parser walks
        raise RequestValidationError([{"loc": ("body",), "msg": "nested too deeply"}]) from None


def _bounded(count: int, most: int, what: str) -> None:
    if count > most:
        raise TooManyNodes(
            f"the request names {count} {what}s; at most {most} (setting max_request_nodes)"
        )


def _json_body(model: type[BaseModel]) -> dict[str, Any]:
    """OpenAPI for a body the handler parses itself; nested models inlined (no components)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                return inline(defs[ref.removeprefix("#/$defs/")])
            return {k: inline(v) for k, v in node.items()}
        if isinstance(node, list):
            return [inline(v) for v in node]
        return node

    content = {"application/json": {"schema": inline(schema)}}
    return {"requestBody": {"required": True, "content": content}}


def _candidates(args: ExtenderPreemptionArgs, most: int) -> dict[str, NodeVictims]:
    """Victims per node from NodeNameToMetaVictims (nodeCacheCapable) or NodeNameToVictims."""
    _bounded(len(args.NodeNameToMetaVictims or {}), most, "candidate node")
    _bounded(len(args.NodeNameToVictims or {}), most, "candidate node")
    if args.NodeNameToMetaVictims is not None:
        return {
            node: NodeVictims(
                tuple(p.UID for p in v.Pods or ()) if v else (), v.NumPDBViolations if v else 0
            )
            for node, v in args.NodeNameToMetaVictims.items()
        }
    found = {}
    for node, victims in (args.NodeNameToVictims or {}).items():
        uids = []
        for pod in (victims.Pods if victims else None) or ():
            meta = pod.get("metadata") if isinstance(pod, dict) else None
            uid = meta.get("uid") if isinstance(meta, dict) else None
            if isinstance(uid, str) and uid:
                uids.append(uid)
        found[node] = NodeVictims(tuple(uids), victims.NumPDBViolations if victims else 0)
    return found


def _names(args: ExtenderArgs, most: int) -> tuple[list[str], list[dict[str, Any]]]:
    """Node names from NodeNames (nodeCacheCapable) or from the full NodeList."""
    if args.NodeNames is not None:
        _bounded(len(args.NodeNames), most, "node")
        return args.NodeNames, []
    items = (args.Nodes.items if args.Nodes is not None else None) or []
    _bounded(len(items), most, "node")
    names = [str((n.get("metadata") or {}).get("name") or "") for n in items]
    return [n for n in names if n], items
