"""The HTTP edge: `create_app` serves the verbs, health and metrics; `create_health_app` health and metrics only.

Handlers parse the wire models, call the service with plain values, and write the answer in
the exact shape kube-scheduler decodes. Filter and prioritize answer with pre-encoded JSON: at
5,000 nodes pydantic serialisation of the reply would cost more than the decision itself.
Every request passes `limits.RequestLimits` first (size, count and bodies in flight), and a
request naming more than `max_request_nodes` nodes is refused (413) before any is looked at.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

from fastapi import FastAPI, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
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
from .service import ExtenderService, FilterOutcome
from .settings import ExtenderSettings
from .texts import explain

log = logging.getLogger(__name__)
_JSON = "application/json"
_POD_BODY: TypeAdapter[dict[str, Any]] = TypeAdapter(dict[str, Any])
"""diagnose's body: a Pod, read as a JSON object (pydantic's parser: bounded depth)."""
HEALTH_BODY_BYTES = 4096
"""The largest body the health port reads (its three routes read none)."""


class TooManyNodes(Exception):
    """A request naming more nodes than `max_request_nodes` (answered 413)."""


def filter_reply(passed: str, failed: str, unresolvable: str) -> str:
    """An ExtenderFilterResult (nodeCacheCapable) from the JSON text of its three parts."""
    return (
        f'{{"NodeNames":{passed},"FailedNodes":{failed},'
        f'"FailedAndUnresolvableNodes":{unresolvable},"Error":""}}'
    )


def create_app(settings: ExtenderSettings, service: ExtenderService) -> FastAPI:
    """One app per service; nothing module-level, so tests build as many as they like."""
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
    async def _too_many(_: Request, error: TooManyNodes) -> JSONResponse:
        metrics.refused.labels("too_large").inc()
        return JSONResponse({"Error": str(error)}, status_code=413)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, error: Exception) -> JSONResponse:
        # A bug met by one request: answered with words and logged; the server goes on.
        log.error(
            "Failed to answer a request",
            exc_info=error,
            extra=logs.kv(path=request.url.path),
        )
        return JSONResponse({"Error": explain(error)}, status_code=500)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, error: RequestValidationError) -> JSONResponse:
        # A 4xx with a short message; kube-scheduler logs it and treats the call as failed.
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', ())) or 'body'}: {e.get('msg', '')}"
            for e in error.errors()[:5]
        )
        return JSONResponse({"Error": f"malformed request: {problems}"}, status_code=400)

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
        if outcome.error:
            body: dict[str, Any] = {
                "NodeNames": None if args.NodeNames is None and args.Nodes is not None else [],
                "FailedNodes": {},
                "FailedAndUnresolvableNodes": {},
                "Error": outcome.error,
            }
            text = json.dumps(body)
        elif args.NodeNames is None and args.Nodes is not None:
            # nodeCacheCapable false: the survivors go back as a NodeList.
            keep = set(outcome.passed)
            nodes = args.Nodes.model_dump(exclude_none=True)
            nodes["items"] = [
                n for n in nodes.get("items") or [] if (n.get("metadata") or {}).get("name") in keep
            ]
            text = json.dumps(
                {
                    "Nodes": nodes,
                    "NodeNames": None,
                    "FailedNodes": outcome.failed,
                    "FailedAndUnresolvableNodes": outcome.unresolvable,
                    "Error": "",
                }
            )
        else:
            assert outcome.encoded is not None  # every outcome without an error carries it
            text = filter_reply(*outcome.encoded)
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
            return JSONResponse({"Error": explain(error)}, status_code=400)
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
            return JSONResponse({"Error": explain(error)}, status_code=400)
        text = json.dumps(
            {
                "NodeNameToMetaVictims": {
                    node: {
                        "Pods": [{"UID": uid} for uid in victims.uids],
                        "NumPDBViolations": victims.violations,
                    }
                    for node, victims in kept.items()
                }
            }
        )
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
        return ExtenderBindingResult(Error=error)

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
            return JSONResponse({"Error": explain(error)}, status_code=400)
        result = DiagnosisResult(
            Pod=found.pod,
            Scores=found.scores,
            FailedNodes=found.failed,
            FailedAndUnresolvableNodes=found.unresolvable,
            Unreadable=found.unreadable,
        )
        return Response(result.model_dump_json(), media_type=_JSON)

    _health_routes(app, service)
    return app


def create_health_app(service: ExtenderService) -> FastAPI:
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
    _health_routes(app, service)
    return app


def _health_routes(app: FastAPI, service: ExtenderService) -> None:
    metrics = service.metrics

    @app.get("/healthz", response_class=PlainTextResponse)
    async def healthz() -> str:
        return "ok"

    @app.get("/readyz", response_class=PlainTextResponse)
    async def readyz() -> Response:
        cache = service.cache
        if cache.ready:
            return PlainTextResponse("ok")
        waiting = ", ".join(k for k, done in cache.synced.items() if not done)
        failing = "; ".join(
            f"watch of {kind} failed {count} times in a row: {error}"
            for kind, (count, error) in cache.failing().items()
        )
        text = "; ".join(
            part for part in (waiting and f"watch cache not synced: {waiting}", failing) if part
        )
        return PlainTextResponse(text, status_code=503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        service.cache.expire_slices(wait=False)
        snap = service.cache.snapshot
        metrics.slice_reservations.set(snap.slice_reservations())
        for kind, count in snap.counts().items():
            metrics.cache.labels(kind).set(count)
        for kind, count in snap.unreadable_counts().items():
            metrics.unreadable.labels(kind).set(count)
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
