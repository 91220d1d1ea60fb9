"""kopf wiring: watch GpuPartitions, Nodes and MIG pods, wake the debounced loops, hold deletion until nodes let go.

Handlers never compute or write desired state themselves; they only wake `ReconcileLoop`,
whose single worker runs `Reconciler.reconcile_all` in a thread, and `DemandLoop`, which runs
`DemandRounds.run_round` the same way. kopf keeps its own
bookkeeping in annotations under gpupart.io/, never in the user-visible status, and
handlers return None so no handler result lands there either.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from typing import Any

import kopf
from kubernetes import client

from gpupart import logs
from gpupart.core.api.records import find_time
from gpupart.core.api.wire import (
    DESIRED_ANNOTATION,
    INVENTORY_ANNOTATION,
    MIG_PLAN_ANNOTATION,
    STATE_ANNOTATION,
)
from gpupart.core.cluster.partitioning import Release
from gpupart_operator.demand import requests_mig
from gpupart_operator.loops import DemandLoop, ReconcileLoop, Reconciles
from gpupart_operator.model import (
    FINALIZER,
    GROUP,
    PLURAL,
    VERSION,
    InventoryCache,
    node_ready,
)
from gpupart_operator.reconciler import PassResult
from gpupart_operator.rounds import DemandRounds
from gpupart_operator.settings import OperatorSettings
from gpupart_operator.writer import Writer

log = logging.getLogger("gpupart.operator")

KOPF_PREFIX = "gpupart.io"
"""kopf's progress and diff-base annotations are gpupart.io/<handler-id> and
gpupart.io/last-handled-configuration on each GpuPartition."""


def demand_fingerprint(body: Mapping[str, Any]) -> tuple[Any, ...]:
    """What of a Node a dynamic MIG round reads: labels, agent report, inventory, plan."""
    meta = body.get("metadata") or {}
    annotations = meta.get("annotations") or {}
    return (
        tuple(sorted((meta.get("labels") or {}).items())),
        annotations.get(STATE_ANNOTATION),
        annotations.get(INVENTORY_ANNOTATION),
        annotations.get(MIG_PLAN_ANNOTATION),
    )


def configure_kopf(settings: kopf.OperatorSettings) -> None:
    """kopf's own state lives in annotations; nothing of kopf's goes under .status."""
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=KOPF_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=KOPF_PREFIX, key="last-handled-configuration"
    )
    # kopf turns handler log lines into Events; only warnings and errors are worth one.
    settings.posting.level = logging.WARNING


def connection_info(configuration: client.Configuration) -> kopf.ConnectionInfo:
    """kopf's credentials from the same client configuration the reconciler uses."""
    header = configuration.get_api_key_with_prefix(
        "BearerToken"
    ) or configuration.get_api_key_with_prefix("authorization")
    parts = header.split(" ", 1) if header else []
    scheme, token = (None, None)
    if len(parts) == 1:
        token = parts[0]
    elif len(parts) == 2:
        scheme, token = parts[0], parts[1]
    return kopf.ConnectionInfo(
        server=configuration.host,
        ca_path=configuration.ssl_ca_cert,
        insecure=not configuration.verify_ssl,
        username=configuration.username or None,
        password=configuration.password or None,
        scheme=scheme,
        token=token,
        certificate_path=configuration.cert_file,
        private_key_path=configuration.key_file,
    )


def node_fingerprint(
    body: Mapping[str, Any], inventories: InventoryCache | None = None
) -> tuple[Any, ...]:
    """What of a Node the operator reads; other changes (heartbeats, capacity) wake nothing.

    Of the agent's inventory only which GPUs it lists and the interface serving each (its
    `used` flags change with every pod)."""
    meta = body.get("metadata") or {}
    annotations = meta.get("annotations") or {}
    name = str(meta.get("name", ""))
    return (
        tuple(sorted((meta.get("labels") or {}).items())),
        annotations.get(STATE_ANNOTATION),
        annotations.get(DESIRED_ANNOTATION),
        node_ready(body),
        (inventories or InventoryCache()).listed(name, annotations)[0],
    )


def build_registry(
    reconciler: Reconciles,
    writer: Writer,
    settings: OperatorSettings,
    rounds: DemandRounds | None = None,
) -> kopf.OperatorRegistry:
    """A fresh registry with every handler of the operator (no module-level state).

    With `rounds`, dynamic MIG rounds run too, woken by pods that ask for MIG slices.
    """
    registry = kopf.OperatorRegistry()
    ours = settings  # kopf passes its own `settings` to startup handlers
    configuration = writer.configuration
    state: dict[str, Any] = {}
    seen_nodes: dict[str, tuple[Any, ...]] = {}
    seen_demand: dict[str, tuple[Any, ...]] = {}
    inventories = InventoryCache()

    def demand() -> DemandLoop | None:
        current: DemandLoop | None = state.get("demand")
        return current

    def loop() -> ReconcileLoop:
        current: ReconcileLoop = state["loop"]
        return current

    @kopf.on.startup(registry=registry)
    async def start(settings: kopf.OperatorSettings, **_: Any) -> None:
        configure_kopf(settings)
        seen_nodes.clear()
        state["loop"] = ReconcileLoop(
            reconciler,
            debounce=ours.debounce_seconds,
            retry_seconds=ours.release_retry_seconds,
        )
        state["task"] = asyncio.create_task(loop().run(), name="gpupart reconcile loop")
        # No pass here: a paused peer must not act. The first watch listing wakes the loop.
        if rounds is not None:
            seen_demand.clear()
            state["demand"] = DemandLoop(
                rounds.run_round,
                idle=ours.demand_idle_seconds,
                most=ours.demand_max_seconds,
                every=ours.plan_retry_seconds,
            )
            state["demand_task"] = asyncio.create_task(
                state["demand"].run(), name="gpupart dynamic MIG rounds"
            )

    @kopf.on.cleanup(registry=registry)
    async def stop(**_: Any) -> None:
        for key in ("task", "demand_task"):
            task: asyncio.Task[None] | None = state.pop(key, None)
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        return connection_info(configuration)

    @kopf.on.probe(registry=registry, id="secondsSinceReconcile")
    async def probe(**_: Any) -> float | None:
        last = loop().last_success if "loop" in state else None
        return None if last is None else round(time.monotonic() - last, 1)

    # -- GpuPartitions --

    @kopf.on.create(GROUP, VERSION, PLURAL, registry=registry, id="create")
    @kopf.on.update(GROUP, VERSION, PLURAL, registry=registry, id="update")
    @kopf.on.resume(GROUP, VERSION, PLURAL, registry=registry, id="resume")
    async def changed(**_: Any) -> None:
        loop().wake()

    @kopf.timer(
        GROUP, VERSION, PLURAL, registry=registry, id="drift", interval=settings.drift_timer_seconds
    )
    async def drift(**_: Any) -> None:
        # A full pass re-reads every node: annotations edited by hand are put back.
        loop().wake()

    @kopf.on.event(GROUP, VERSION, PLURAL, registry=registry, id="gone")
    async def gone(event: Mapping[str, Any], **_: Any) -> None:
        meta = (event.get("object") or {}).get("metadata") or {}
        # kopf runs no update handler on an object being deleted: a change to it (its
        # restoreOnDelete turned off while the deletion waits) still needs a pass.
        if event.get("type") == "DELETED" or meta.get("deletionTimestamp"):
            loop().wake()

    @kopf.on.delete(GROUP, VERSION, PLURAL, registry=registry, id="release")
    async def release(
        name: str,
        meta: Mapping[str, Any],
        **_: Any,
    ) -> None:
        # The pass sees the deletionTimestamp and removes this partition's desired groups
        # (with restoreOnDelete, it keeps its nodes' annotations: their GPUs go whole).
        result = await loop().settle()
        seen = loop().passes
        waiting = result.resolution.releases.get(name, Release())
        listed = {node.name: node for node in result.nodes}
        holding = [*waiting.unanswered, *waiting.restoring]
        unreachable = sorted({n for n in holding if n in listed and not listed[n].reachable})
        if unreachable:
            # Said in an Event (users look there) and logged once, not posted again by kopf.
            nodes = ", ".join(unreachable)
            log.warning(
                "Not waiting for unreachable nodes", extra=logs.kv(gpupartition=name, nodes=nodes)
            )
            await asyncio.to_thread(
                writer.warn,
                name,
                str(meta.get("uid", "")),
                "NodesUnreachable",
                f"Not waiting for unreachable node(s) {nodes}: their agents will drop the "
                "partition when they come back"
                + (
                    ", leaving their GPUs as they are then (not restored to whole GPUs)"
                    if waiting.restoring or _restores(result, name)
                    else ""
                ),
            )
        restoring = _restoring(result, name)
        if restoring:
            # The agents answer: their GPUs are in use, waiting for a reset, or failed. Pods
            # decide how long that takes, so no timeout. Each pass (a node's report changing
            # wakes one) is checked here, so the deletion ends with the last pass that finds
            # the GPUs whole; back to kopf (its retry, logged and posted as an Event) only
            # every drift-timer period (--resync-seconds) meanwhile.
            until = time.monotonic() + settings.drift_timer_seconds
            while restoring and (left := until - time.monotonic()) > 0:
                later = await loop().next_pass(seen, left)
                if later is None:
                    break
                seen, result = loop().passes, later
                restoring = _restoring(result, name)
            if restoring:
                raise kopf.TemporaryError(
                    f"waiting for whole GPUs on {', '.join(restoring)} (restoreOnDelete): "
                    f"{_why(result, name, restoring)}",
                    delay=settings.release_retry_seconds,
                )
            waiting = result.resolution.releases.get(name, Release())
            listed = {node.name: node for node in result.nodes}
        reachable = sorted(n for n in waiting.unanswered if n in listed and listed[n].reachable)
        if not reachable:
            return
        waited = _seconds_since(meta.get("deletionTimestamp"))
        if waited < settings.release_timeout_seconds:
            goal = (
                "'s node agent to act on the deletion (restoreOnDelete: whole GPUs)"
                if _restores(result, name)
                else " to return to the partition-free configuration"
            )
            raise kopf.TemporaryError(
                f"waiting for {', '.join(reachable)}{goal} "
                f"({waited:.0f}s of {settings.release_timeout_seconds:g}s)",
                delay=settings.release_retry_seconds,
            )
        # A Ready node whose agent is gone would hold the deletion forever.
        message = (
            f"Deleted without confirmation from node(s) {', '.join(reachable)}: their agents "
            f"did not report dropping the partition within {settings.release_timeout_seconds:g}s "
            "(is the node agent running there?); they drop it when they next reconcile"
        )
        log.warning(
            "Deleted without confirmation from nodes",
            extra=logs.kv(gpupartition=name, nodes=", ".join(reachable)),
        )
        await asyncio.to_thread(
            writer.warn, name, str(meta.get("uid", "")), "ReleaseTimedOut", message
        )

    # -- Nodes --

    @kopf.on.event("", "v1", "nodes", registry=registry, id="node")
    async def node_event(event: Mapping[str, Any], name: str, **_: Any) -> None:
        rounds = demand()
        if event.get("type") == "DELETED":
            seen_nodes.pop(name, None)
            seen_demand.pop(name, None)
            inventories.listed(name, {})  # forgets it
            loop().wake()
            if rounds is not None:
                rounds.wake()
            return
        body = event.get("object") or {}
        fingerprint = node_fingerprint(body, inventories)
        if seen_nodes.get(name) != fingerprint:
            seen_nodes[name] = fingerprint
            loop().wake()
        if rounds is not None:
            seen = demand_fingerprint(body)
            if seen_demand.get(name) != seen:
                seen_demand[name] = seen
                rounds.wake()

    if rounds is not None:

        @kopf.on.event(
            "",
            "v1",
            "pods",
            registry=registry,
            id="mig-pod",
            when=lambda body, **_: requests_mig(body),
        )
        async def pod_event(**_: Any) -> None:
            # Any change of a MIG pod (created, unschedulable, bound, gone) may change a plan.
            rounds = demand()
            if rounds is not None:
                rounds.wake()

    return registry


def _restoring(result: PassResult, name: str) -> list[str]:
    """Reachable nodes whose agent answered the deletion of `name` but whose GPUs are not whole."""
    listed = {node.name: node for node in result.nodes}
    release = result.resolution.releases.get(name, Release())
    return [n for n in release.restoring if n in listed and listed[n].reachable]


def _restores(result: PassResult, name: str) -> bool:
    """Whether the deleting partition `name` asks for whole GPUs back (restoreOnDelete)."""
    return any(
        p.name == name and p.partition is not None and p.partition.spec.restore_on_delete
        for p in result.partitions
    )


def _why(result: PassResult, name: str, nodes: list[str]) -> str:
    """Each of `nodes`' restore state, from the partition's status in this pass."""
    status = result.resolution.statuses.get(name)
    states = dict(status.nodes) if status is not None else {}
    return "; ".join(f"{n}: {states[n].message}" for n in nodes if n in states)[:1000]


def _seconds_since(timestamp: object) -> float:
    """Seconds since an RFC 3339 timestamp from the API server; 0 when it cannot be read."""
    since = find_time(timestamp)
    return 0.0 if since is None else max(0.0, time.time() - since)
