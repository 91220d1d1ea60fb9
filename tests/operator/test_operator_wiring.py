"""The kopf wiring without a server: where kopf keeps its state, the reconcile loop, flags.

Aspects: kopf's progress, diff-base and touch annotations go under gpupart.io/ in metadata and
never into .status (the leak test); the finalizer name; node events wake the loop only for what
the operator reads; bursts of wakes coalesce into one pass; a failed pass answers deletion with
a TemporaryError and is retried; a deletion waiting for whole GPUs sees the next pass without
asking for one, and a failed or absent one as None; flags become frozen settings; the registry is never kopf's
global one.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import threading

import kopf
import pytest

from gpupart.core.api.spec import Mode
from gpupart.core.api.wire import (
    INVENTORY_ANNOTATION,
    Inventory,
    InventoryGpu,
    MigDevice,
    encode_inventory,
)
from gpupart.core.errors import InvalidInput
from gpupart.core.mig.layout import MigInstance, Placement
from gpupart_operator.handlers import configure_kopf, node_fingerprint
from gpupart_operator.loops import ReconcileLoop
from gpupart_operator.reconciler import PassResult
from gpupart_operator.settings import OperatorSettings, add_arguments, from_args


def gpupartition_body() -> kopf.Body:
    return kopf.Body(
        {
            "apiVersion": "gpupart.io/v1alpha1",
            "kind": "GpuPartition",
            "metadata": {"name": "a", "uid": "u", "annotations": {}},
            "spec": {"mode": "None"},
            "status": {"observedGeneration": 1},
        }
    )


def test_kopf_progress_and_diff_base_never_touch_status():
    settings = kopf.OperatorSettings()
    configure_kopf(settings)
    assert settings.persistence.finalizer == "gpupart.io/finalizer"
    body = gpupartition_body()
    patch = kopf.Patch()
    record = {
        "started": dt.datetime(2026, 1, 1).isoformat(),
        "retries": 3,
        "delayed": dt.datetime(2026, 1, 1).isoformat(),
        "message": "waiting for n1",
        "success": False,
        "failure": False,
    }
    settings.persistence.progress_storage.store(
        key=kopf.HandlerId("release"), record=record, body=body, patch=patch
    )
    settings.persistence.progress_storage.touch(body=body, patch=patch, value="x")
    settings.persistence.diffbase_storage.store(
        body=body, patch=patch, essence=kopf.BodyEssence(spec={"mode": "None"})
    )
    assert not patch.status, patch
    assert "status" not in dict(patch)
    annotations = patch["metadata"]["annotations"]
    assert "gpupart.io/release" in annotations
    assert "gpupart.io/last-handled-configuration" in annotations
    assert all(key.startswith("gpupart.io/") for key in annotations), annotations


def test_kopf_does_not_turn_info_logs_into_events():
    settings = kopf.OperatorSettings()
    configure_kopf(settings)
    assert settings.posting.level >= 30  # WARNING and above only


def node(labels=None, annotations=None, ready="True", heartbeat="t0"):
    return {
        "metadata": {"name": "n1", "labels": labels or {}, "annotations": annotations or {}},
        "status": {
            "conditions": [{"type": "Ready", "status": ready, "lastHeartbeatTime": heartbeat}],
            "capacity": {"cpu": "64"},
        },
    }


def test_node_fingerprint_ignores_heartbeats_and_sees_what_the_operator_reads():
    base = node({"pool": "mig"})
    assert node_fingerprint(base) == node_fingerprint(node({"pool": "mig"}, heartbeat="t1"))
    assert node_fingerprint(base) != node_fingerprint(node({"pool": "cpu"}))
    assert node_fingerprint(base) != node_fingerprint(
        node({"pool": "mig"}, {"gpupart.io/state": "{}"})
    )
    assert node_fingerprint(base) != node_fingerprint(
        node({"pool": "mig"}, {"gpupart.io/desired": "{}"})
    )
    assert node_fingerprint(base) != node_fingerprint(node({"pool": "mig"}, ready="Unknown"))
    assert node_fingerprint(base) == node_fingerprint(
        node({"pool": "mig"}, {"unrelated": "changed"})
    )

    # The inventory's GPUs count (a node's GPUs), its per-pod `used` flags do not.
    def inventory(*gpus: tuple[int, bool]) -> dict[str, str]:
        listed = tuple(
            InventoryGpu(
                i, f"GPU-{i}", "NVIDIA H100 80GB HBM3", 81559, Mode.MIG,
                (MigDevice(f"MIG-{i}", MigInstance(Placement(0, 1), "1g.10gb"), used),),
            )
            for i, used in gpus
        )  # fmt: skip
        return {INVENTORY_ANNOTATION: encode_inventory(Inventory(listed))}

    one = node_fingerprint(node({"pool": "mig"}, inventory((0, False))))
    assert one == node_fingerprint(node({"pool": "mig"}, inventory((0, True))))
    assert one != node_fingerprint(node({"pool": "mig"}, inventory((0, False), (1, False))))
    assert one != node_fingerprint(base)
    # So does the interface serving each GPU: status.interface counts it.
    moved = json.loads(inventory((0, False))[INVENTORY_ANNOTATION])
    moved["gpus"][0]["interface"] = "dra"
    assert one != node_fingerprint(node({"pool": "mig"}, {INVENTORY_ANNOTATION: json.dumps(moved)}))


class CountingReconciler:
    """Stands in for the API-backed Reconciler: counts passes, can be told to fail."""

    def __init__(self) -> None:
        self.passes = 0
        self.fail = False
        self.lock = threading.Lock()

    def reconcile_all(self) -> PassResult:
        with self.lock:
            self.passes += 1
            if self.fail:
                raise ConnectionError("API server unreachable")
            return PassResult((), (), 0, 0.0)


def test_a_burst_of_wakes_is_one_pass_and_settle_waits_for_a_fresh_one():
    async def scenario():
        reconciler = CountingReconciler()
        loop = ReconcileLoop(reconciler, debounce=0.05, retry_seconds=0.05)
        task = asyncio.create_task(loop.run())
        for _ in range(100):
            loop.wake()
        await asyncio.sleep(0.3)
        burst = reconciler.passes
        result = await loop.settle()
        task.cancel()
        return burst, reconciler.passes, result

    burst, total, result = asyncio.run(scenario())
    assert burst == 1
    assert total == 2
    assert result.writes == 0


def test_a_failed_pass_is_a_temporary_error_for_deletion_and_is_retried():
    async def scenario():
        reconciler = CountingReconciler()
        reconciler.fail = True
        loop = ReconcileLoop(reconciler, debounce=0.01, retry_seconds=0.05)
        task = asyncio.create_task(loop.run())
        with pytest.raises(kopf.TemporaryError, match="API server unreachable"):
            await loop.settle()
        reconciler.fail = False
        await asyncio.sleep(0.3)  # the retry timer wakes the loop on its own
        task.cancel()
        return reconciler.passes, loop.last_success

    passes, last_success = asyncio.run(scenario())
    assert passes >= 2 and last_success is not None


def test_next_pass_waits_for_a_pass_it_does_not_ask_for():
    async def scenario():
        reconciler = CountingReconciler()
        loop = ReconcileLoop(reconciler, debounce=0.01, retry_seconds=0.05)
        task = asyncio.create_task(loop.run())
        await loop.settle()
        seen = loop.passes
        nothing = await loop.next_pass(seen, 0.2)  # nobody wakes the loop: no pass comes
        waiting = asyncio.create_task(loop.next_pass(seen, 5))
        loop.wake()  # a node event, say
        later = await waiting
        reconciler.fail = True
        loop.wake()
        failed = await loop.next_pass(loop.passes, 5)
        task.cancel()
        return nothing, later, failed, reconciler.passes

    nothing, later, failed, passes = asyncio.run(scenario())
    assert nothing is None and later is not None and failed is None
    assert passes == 3  # next_pass itself asked for none


def parse(*argv: str) -> OperatorSettings:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return from_args(parser.parse_args(list(argv)))


def test_flags_become_frozen_settings():
    settings = parse("--peering", "gpupart", "--priority", "7", "--liveness", "8080")
    assert settings.peering == "gpupart" and not settings.standalone
    assert settings.priority == 7
    assert settings.liveness_endpoint == "http://127.0.0.1:8080/healthz"
    with pytest.raises(AttributeError):
        settings.priority = 1  # type: ignore[misc]
    assert parse().standalone and parse("--standalone").standalone


def test_auto_priority_makes_equal_replicas_differ():
    priorities = {parse("--peering", "p").priority for _ in range(20)}
    assert len(priorities) > 1 and all(p > 0 for p in priorities)


def test_bad_settings_are_refused_at_start():
    with pytest.raises(InvalidInput, match="--priority: expected an integer or 'auto'"):
        parse("--priority", "high")
    with pytest.raises(InvalidInput, match="--resync-seconds must be > 0"):
        parse("--resync-seconds", "0")
    with pytest.raises(ValueError, match="TCP port"):
        OperatorSettings(metrics_port=70000)


def test_the_registry_is_built_fresh_and_kopfs_global_one_stays_empty():
    from kubernetes import client

    from gpupart_operator.handlers import build_registry
    from gpupart_operator.metrics import Metrics
    from gpupart_operator.model import Resolutions
    from gpupart_operator.reconciler import Reconciler
    from gpupart_operator.writer import Writer

    before = len(list(kopf.get_default_registry()._changing.get_all_handlers()))
    api = client.ApiClient(client.Configuration(host="https://127.0.0.1:9"))
    metrics = Metrics()
    writer = Writer(api, OperatorSettings(), metrics)
    reconciler = Reconciler(writer, metrics, Resolutions())
    try:
        registry = build_registry(reconciler, writer, OperatorSettings())
        changing = {h.id for h in registry._changing.get_all_handlers()}
        assert {"create", "update", "resume", "release"} <= changing
        assert {h.id for h in registry._spawning.get_all_handlers()} == {"drift"}
        assert {h.id for h in registry._watching.get_all_handlers()} == {"gone", "node"}
        assert build_registry(reconciler, writer, OperatorSettings()) is not registry
    finally:
        writer.close()
        api.close()
    assert len(list(kopf.get_default_registry()._changing.get_all_handlers())) == before
