"""The extender with the real kube-scheduler: pods land where the extender says, or stay Pending with its reason.

A dedicated kube-scheduler ("gpupart-scheduler", the chart's scheduler-config.yaml pointed at
an extender served by uvicorn in this process) runs beside the session's default scheduler;
kwok nodes carry the node agent's inventory annotation.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import Generator
from typing import Any

import pytest
import uvicorn
import yaml

from gpupart.core.mig import MigInstance, Placement
from gpupart.core.spec import Mode
from gpupart.core.wire import (
    ASSIGNMENT_ANNOTATION,
    INVENTORY_ANNOTATION,
    Inventory,
    InventoryGpu,
    MigDevice,
    decode_assignment,
    encode_inventory,
)
from gpupart_extender.app import create_app
from gpupart_extender.cache import ClusterCache
from gpupart_extender.kube import ApiBinder, Watcher
from gpupart_extender.main import listen
from gpupart_extender.metrics import Metrics
from gpupart_extender.service import ExtenderService
from gpupart_extender.settings import ExtenderSettings

from .cluster import (
    LOOPBACK,
    REPO,
    ControlPlane,
    create_nodes,
    gpu_node,
    http_ok,
    start_scheduler,
    wait_for,
)

pytestmark = pytest.mark.e2e

SCHEDULER = "gpupart-scheduler"
CONFIG_FILE = REPO / "charts" / "gpupart" / "files" / "scheduler-config.yaml"
H100 = "NVIDIA H100 80GB HBM3"


def _serve(app: Any) -> tuple[uvicorn.Server, threading.Thread, int]:
    sock = listen(LOOPBACK, 0)
    port = int(sock.getsockname()[1])
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    return server, thread, port


@pytest.fixture(scope="module")
def extender_url(k8s_control_plane: ControlPlane) -> Generator[str, None, None]:
    """The real extender (watch cache, API binder) on 127.0.0.1, ready once its cache synced."""
    api = k8s_control_plane.api_client()
    cache = ClusterCache()
    settings = ExtenderSettings(fragmentation_refresh_seconds=1)
    service = ExtenderService(
        cache, settings.scoring(), binder=ApiBinder(api), metrics=Metrics(), ttl_seconds=30
    )
    watcher = Watcher(api, cache, timeout_seconds=60)
    watcher.start()
    server, thread, port = _serve(create_app(settings, service))
    url = f"http://{LOOPBACK}:{port}"

    try:
        wait_for(lambda: http_ok(f"{url}/readyz"), 30, "the extender's watch cache to sync")
        yield f"{url}{settings.prefix}"
    finally:
        watcher.stop()
        server.should_exit = True
        thread.join(10)
        api.close()


@pytest.fixture(scope="module")
def gpupart_scheduler(
    k8s_control_plane: ControlPlane, extender_url: str
) -> Generator[None, None, None]:
    """A second kube-scheduler process with the chart's configuration, pointed at our extender."""
    cp = k8s_control_plane
    config = yaml.safe_load(CONFIG_FILE.read_text())
    config["extenders"][0]["urlPrefix"] = extender_url
    proc, port = start_scheduler(cp.bin_dir, cp.kubeconfig, config, "gpupart-scheduler", cp.workdir)
    try:
        wait_for(
            lambda: http_ok(f"https://{LOOPBACK}:{port}/healthz"),
            60,
            "gpupart-scheduler to serve /healthz",
        )
        yield
    finally:
        proc.stop()
        if proc.popen.returncode not in (0, -signal.SIGTERM):
            print(proc.log.read_text()[-4000:])


def _node(name: str, gpus: list[InventoryGpu], extended: dict[str, int]) -> dict[str, Any]:
    manifest = gpu_node(name, extended, {"gpupart.io/e2e": "extender"})
    manifest["metadata"]["annotations"][INVENTORY_ANNOTATION] = encode_inventory(
        Inventory(tuple(gpus))
    )
    return manifest


def _pod(name: str, limits: dict[str, str], app: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": app}},
        "spec": {
            "schedulerName": SCHEDULER,
            "terminationGracePeriodSeconds": 0,
            "containers": [
                {
                    "name": "main",
                    "image": "gpupart/sleep:0",
                    "resources": {"limits": limits, "requests": limits},
                }
            ],
        },
    }


@pytest.mark.usefixtures("gpupart_scheduler")
def test_pods_land_where_the_extender_says_and_a_misfit_says_why(k8s_api: Any) -> None:
    from kubernetes import client

    core = client.CoreV1Api(k8s_api)
    run = f"ext{int(time.time()) % 100000}"
    ns = f"e2e-{run}"
    core.create_namespace({"metadata": {"name": ns}})
    mps = [f"{run}-mps-{i}" for i in range(2)]
    small = [f"{run}-small-{i}" for i in range(4)]  # 20000 MiB GPUs: too small for 30000
    mig = f"{run}-mig"
    create_nodes(
        k8s_api,
        [
            _node(
                n,
                [InventoryGpu(0, f"GPU-{n}", H100, 40000, Mode.MPS, (), 16)],
                {"nvidia.com/gpu.shared": 16},
            )
            for n in mps
        ]
        + [
            _node(
                n,
                [InventoryGpu(0, f"GPU-{n}", H100, 20000, Mode.MPS, (), 16)],
                {"nvidia.com/gpu.shared": 16},
            )
            for n in small
        ]
        + [
            _node(
                mig,
                [
                    InventoryGpu(
                        0,
                        "GPU-m0",
                        H100,
                        81559,
                        Mode.MIG,
                        (
                            MigDevice("MIG-a", MigInstance(Placement(0, 4), "3g.40gb")),
                            MigDevice("MIG-b", MigInstance(Placement(4, 4), "3g.40gb")),
                        ),
                    ),
                ],
                # The device plugin says 3 (stale); the inventory has 2: the extender decides.
                {"nvidia.com/mig-3g.40gb": 3},
            )
        ],
    )
    try:
        shared = {"nvidia.com/gpu.shared": "1", "gpupart.io/gpu-memory": "30000"}
        for i in range(3):
            core.create_namespaced_pod(ns, _pod(f"infer-{i}", shared, "infer"))
        for i in range(3):
            core.create_namespaced_pod(
                ns, _pod(f"train-{i}", {"nvidia.com/mig-3g.40gb": "1"}, "train")
            )

        def two_bound_each() -> list[Any] | None:
            pods = core.list_namespaced_pod(ns).items
            bound = [p for p in pods if p.spec.node_name]
            return bound if len(bound) == 4 else None

        bound = wait_for(two_bound_each, 90, "4 pods bound by gpupart-scheduler", interval=0.5)
        infer = [p for p in bound if p.metadata.name.startswith("infer")]
        train = [p for p in bound if p.metadata.name.startswith("train")]
        # 30000 MiB each on 40000 MiB GPUs: one per node, each with its GPU written on the pod.
        assert sorted(p.spec.node_name for p in infer) == sorted(mps)
        for p in infer:
            assignment = decode_assignment(p.metadata.annotations[ASSIGNMENT_ANNOTATION])
            assert assignment.node == p.spec.node_name and assignment.memory_mib == 30000
        assert [p.spec.node_name for p in train] == [mig, mig]

        pending = {
            p.metadata.name for p in core.list_namespaced_pod(ns).items if not p.spec.node_name
        }
        assert len(pending) == 2

        def reasons() -> dict[str, str] | None:
            events = core.list_namespaced_event(ns).items
            found = {
                e.involved_object.name: e.message
                for e in events
                if e.reason == "FailedScheduling"
                and e.involved_object.name in pending
                # Not a bind refused because another pod took the node since filter.
                and "nodes are available" in e.message
            }
            return found if set(found) == pending else None

        messages = wait_for(reasons, 60, "FailedScheduling events for the misfits", interval=1)
        infer_msg = next(m for n, m in messages.items() if n.startswith("infer"))
        train_msg = next(m for n, m in messages.items() if n.startswith("train"))
        assert "no shared GPU with 30000 MiB free and 1 client slot" in infer_msg, infer_msg
        assert "GPU 0: 10000 of 40000 MiB free (used by" in infer_msg, infer_msg
        # Both in-use nodes and the first small one in full; kube-scheduler counts the rest
        # under their shared summary instead of a line per node.
        assert f"{small[0]}: 1 GPU, no shared GPU with 30000 MiB" in infer_msg, infer_msg
        assert (
            "3 node(s) had no shared GPU with 30000 MiB free and 1 client slot (too small)"
            in infer_msg
        ), infer_msg
        assert f"{mig}: 1 GPU, no free 3g.40gb slice (all 2 in use by {ns}/train-" in train_msg, (
            train_msg
        )
    finally:
        core.delete_collection_namespaced_pod(ns, grace_period_seconds=0)
        wait_for(lambda: not core.list_namespaced_pod(ns).items, 60, "pods deleted", interval=1)
        for n in [*mps, *small, mig]:
            core.delete_node(n)


def test_the_binder_writes_node_and_annotations_in_one_binding_and_reports_refusals(
    k8s_api: Any,
) -> None:
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    core = client.CoreV1Api(k8s_api)
    ns = "binder"
    core.create_namespace({"metadata": {"name": ns}})
    try:
        pod = core.create_namespaced_pod(
            ns,
            {
                "metadata": {"name": "p"},
                # No scheduler serves this name: only our Binding places the pod.
                "spec": {"schedulerName": "nobody", "containers": [{"name": "c", "image": "x"}]},
            },
        )
        binder = ApiBinder(k8s_api)
        with pytest.raises(ApiException) as refused:
            binder.bind(ns, "p", "not-the-uid", "node-a", {})
        assert refused.value.status == 409, refused.value
        assert "not-the-uid" in str(refused.value.body), refused.value.body
        binder.bind(ns, "p", pod.metadata.uid, "node-a", {ASSIGNMENT_ANNOTATION: "x"})
        bound = core.read_namespaced_pod("p", ns)
        assert bound.spec.node_name == "node-a"
        assert bound.metadata.annotations[ASSIGNMENT_ANNOTATION] == "x"
    finally:
        core.delete_namespace(ns)
