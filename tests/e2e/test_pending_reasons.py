"""Every Pending GPU pod says why, in words, with the real kube-scheduler: MIG, whole GPU, shared and dynamic MIG.

A dedicated kube-scheduler (the chart's scheduler-config.yaml) consults the extender served in
this process, whose watch also feeds the pending-reasons reporter with its real Event writer
(docs/adr-019-pending-reasons.md). kwok nodes carry the node agent's inventory (and, for
dynamic MIG, the operator's desired annotation and MIG plan); the pods in the way are created
bound. We test, per kind of pod, that:
- kube-scheduler's own FailedScheduling event says only `Insufficient <resource>` (its
  NodeResourcesFit rejected every node, so the extender was never asked), and
- the extender's FailedScheduling event names the node and the pods in the way (MIG slices used
  up, whole GPUs taken, shared slots taken), or what dynamic MIG does: a slice being made for
  this pod, a profile only a dynamic-MIG GPU can make, a profile nothing can make.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from collections.abc import Generator
from typing import Any

import pytest
import yaml

from gpupart.core.api.provenance import sign
from gpupart.core.api.spec import GpuConfig, Mode
from gpupart.core.api.wire import (
    ASSIGNMENT_ANNOTATION,
    DESIRED_ANNOTATION,
    INVENTORY_ANNOTATION,
    MIG_PLAN_ANNOTATION,
    DesiredGroup,
    Inventory,
    InventoryGpu,
    MigDevice,
    MigPlan,
    MigReservation,
    PodAssignment,
    encode_assignment,
    encode_desired,
    encode_inventory,
    encode_mig_plan,
)
from gpupart.core.mig.layout import MigInstance, Placement
from gpupart.keyfile import KeyFile
from gpupart.signing import PrivateKeys
from gpupart_extender.app import create_app
from gpupart_extender.cache import ClusterCache
from gpupart_extender.kube import ApiBinder, ApiEvents, Watcher
from gpupart_extender.metrics import Metrics
from gpupart_extender.pending import PendingPods, Reporter
from gpupart_extender.service import ExtenderService
from gpupart_extender.settings import ExtenderSettings
from gpupart_testsupport.cluster import (
    LOOPBACK,
    REPO,
    ControlPlane,
    create_nodes,
    gpu_node,
    http_ok,
    start_scheduler,
)
from gpupart_testsupport.cluster import wait_for as wait
from gpupart_testsupport.objects import write_key_file

from .test_extender import _serve

pytestmark = pytest.mark.e2e

SCHEDULER = "gpupart-scheduler"
CONFIG_FILE = REPO / "charts" / "gpupart" / "files" / "scheduler-config.yaml"
A100 = "NVIDIA A100-SXM4-80GB"
H100 = "NVIDIA H100 80GB HBM3"
KEY = b"gpupart-e2e-pending-reasons-key1"
RUN = f"pr{int(time.time()) % 100000}"
NS = f"e2e-{RUN}"


@pytest.fixture(scope="module")
def extender_url(k8s_control_plane: ControlPlane) -> Generator[str, None, None]:
    """The extender with its pending-reasons reporter, ready once its cache synced."""
    api = k8s_control_plane.api_client()
    key_file = k8s_control_plane.workdir / "pending-reasons-keys"
    write_key_file(key_file, KEY)
    keys = KeyFile.private(key_file).keys
    cache = ClusterCache(keys=keys)
    settings = ExtenderSettings(assignment_key_file=key_file)
    service = ExtenderService(
        cache,
        settings.scoring(),
        binder=ApiBinder(api),
        metrics=Metrics(),
        keys=keys,
        scheduler_names=settings.scheduler_names,
    )
    pending = PendingPods(settings.scheduler_names)
    watcher = Watcher(api, cache, period_seconds=60, pending=pending)
    watcher.start()
    reporter = Reporter(pending, service.pending_reason, ApiEvents(api))
    thread = threading.Thread(target=reporter.run, args=(watcher.stopping, 0.5), daemon=True)
    thread.start()
    server, served, port = _serve(create_app(settings, service))
    url = f"http://{LOOPBACK}:{port}"
    try:
        wait(lambda: http_ok(f"{url}/readyz"), 30, "the extender's watch cache to sync")
        yield f"{url}{settings.prefix}"
    finally:
        watcher.stop()
        server.should_exit = True
        served.join(10)
        thread.join(10)
        api.close()


@pytest.fixture(scope="module")
def gpupart_scheduler(
    k8s_control_plane: ControlPlane, extender_url: str
) -> Generator[None, None, None]:
    cp = k8s_control_plane
    config = yaml.safe_load(CONFIG_FILE.read_text())
    config["extenders"][0]["urlPrefix"] = extender_url
    proc, port = start_scheduler(cp.bin_dir, cp.kubeconfig, config, "pending-reasons", cp.workdir)
    try:
        wait(lambda: http_ok(f"https://{LOOPBACK}:{port}/healthz"), 60, "the scheduler's /healthz")
        yield
    finally:
        proc.stop()


def _node(
    name: str, gpus: list[InventoryGpu], extended: dict[str, int], **annotations: str
) -> dict[str, Any]:
    shared = [g for g in gpus if g.mode.is_shared]
    extended = {
        **extended,
        "gpupart.io/gpu-memory": sum(g.memory_mib for g in shared),
        "gpupart.io/gpu-compute": 100 * len(shared),
    }
    manifest = gpu_node(name, extended, {"gpupart.io/e2e": RUN})
    manifest["metadata"]["annotations"][INVENTORY_ANNOTATION] = encode_inventory(
        Inventory(tuple(gpus), serial_admission=False)
    )
    manifest["metadata"]["annotations"].update(annotations)
    return manifest


def _pod(name: str, limits: dict[str, str], node: str = "") -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": name}},
        "spec": {
            "schedulerName": SCHEDULER,
            **({"nodeName": node} if node else {}),
            "nodeSelector": {"gpupart.io/e2e": RUN},
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


def _nodes() -> list[dict[str, Any]]:
    slice_ = MigInstance(Placement(0, 1), "1g.10gb")
    a100 = InventoryGpu(
        0,
        f"GPU-{RUN}-a100",
        A100,
        81920,
        Mode.MIG,
        (MigDevice("MIG-a", slice_), MigDevice("MIG-b", MigInstance(Placement(1, 1), "1g.10gb"))),
    )
    whole = [InventoryGpu(i, f"GPU-{RUN}-whole-{i}", H100, 81559, Mode.NONE) for i in range(2)]
    mps = InventoryGpu(0, f"GPU-{RUN}-mps-0", H100, 81559, Mode.MPS, replicas=2)
    dynamic = InventoryGpu(0, f"GPU-{RUN}-dyn-0", H100, 81559, Mode.MIG)
    planned = MigInstance(Placement(4, 4), "3g.40gb")
    plan = MigPlan("plan-1", (), (MigReservation(f"{NS}/dyn", "", 0, planned, time.time() + 3600),))
    desired = (DesiredGroup("dyn-h100", 1, None, GpuConfig(Mode.MIG, dynamic=True)),)
    return [
        _node(f"{RUN}-mig", [a100], {"nvidia.com/mig-1g.10gb": 2}),
        _node(f"{RUN}-whole", whole, {"nvidia.com/gpu": 2}),
        _node(f"{RUN}-mps", [mps], {"nvidia.com/gpu.shared": 2}),
        _node(
            f"{RUN}-dyn",
            [dynamic],
            {},
            **{
                DESIRED_ANNOTATION: encode_desired(desired),
                MIG_PLAN_ANNOTATION: encode_mig_plan(plan),
            },
        ),
    ]


def _bound_shared(core: Any, name: str, node: str) -> None:
    """A shared-GPU pod on `node`'s GPU 0 with the assignment the extender signs."""
    core.create_namespaced_pod(
        NS, _pod(name, {"nvidia.com/gpu.shared": "1", "gpupart.io/gpu-memory": "1000"}, node)
    )
    uid = core.read_namespaced_pod(name, NS).metadata.uid
    assignment = PodAssignment(node, 0, f"GPU-{RUN}-mps-0", 1000, pod_uid=uid)
    text = encode_assignment(sign(assignment, PrivateKeys((KEY,))))
    core.patch_namespaced_pod(
        name, NS, {"metadata": {"annotations": {ASSIGNMENT_ANNOTATION: text}}}
    )


def _event(core: Any, pod: str, *, ours: bool) -> str | None:
    """The latest FailedScheduling message about `pod`: the extender's (`ours`, source
    gpupart-extender) or kube-scheduler's ("0/N nodes are available: ...")."""
    found = []
    for e in core.list_namespaced_event(NS).items:
        if e.involved_object.name != pod or e.reason != "FailedScheduling":
            continue
        mine = e.source is not None and e.source.component == "gpupart-extender"
        if mine == ours and (ours or "nodes are available" in str(e.message)):
            found.append(e)
    found.sort(key=lambda e: int(e.metadata.resource_version))
    return str(found[-1].message) if found else None


def _diagnose_command() -> str:
    """docs/extender.md's diagnose pipeline (kubectl get pod ... | curl ...), as written."""
    for line in (REPO / "docs" / "extender.md").read_text().splitlines():
        if line.startswith("$ kubectl") and "| curl" in line and "/diagnose" in line:
            return line.removeprefix("$ ")
    raise AssertionError("docs/extender.md shows no diagnose command")


@pytest.mark.usefixtures("gpupart_scheduler")
def test_every_kind_of_pending_gpu_pod_gets_the_extenders_words(
    k8s_api: Any, k8s_control_plane: ControlPlane, extender_url: str
) -> None:
    from kubernetes import client

    core = client.CoreV1Api(k8s_api)
    core.create_namespace({"metadata": {"name": NS}})
    nodes = _nodes()
    create_nodes(k8s_api, nodes)
    mig, whole, mps, dyn = (n["metadata"]["name"] for n in nodes)
    try:
        for name in ("a", "b"):
            core.create_namespaced_pod(NS, _pod(name, {"nvidia.com/mig-1g.10gb": "1"}, mig))
        core.create_namespaced_pod(NS, _pod("w", {"nvidia.com/gpu": "2"}, whole))
        for name in ("s1", "s2"):
            _bound_shared(core, name, mps)
        wanted = {
            "mig-full": (
                {"nvidia.com/mig-1g.10gb": "1"},
                "Insufficient nvidia.com/mig-1g.10gb",
                f"{mig}: 1 GPU, no free 1g.10gb slice (all 2 in use by {NS}/a, {NS}/b)",
            ),
            "mig-nowhere": (
                {"nvidia.com/mig-1g.5gb": "1"},
                "Insufficient nvidia.com/mig-1g.5gb",
                "no node offers 1g.5gb and no GpuPartition with dynamic MIG selects a node that "
                "could make one",
            ),
            "mig-could": (
                {"nvidia.com/mig-4g.40gb": "1"},
                "Insufficient nvidia.com/mig-4g.40gb",
                f"no node offers 4g.40gb yet; dynamic MIG (GpuPartition dyn-h100) can make one on "
                f"{dyn} GPU 0",
            ),
            "dyn": (
                {"nvidia.com/mig-3g.40gb": "1"},
                "Insufficient nvidia.com/mig-3g.40gb",
                f"dynamic MIG is creating a 3g.40gb slice for this pod on {dyn} (GPU 0, slots 4-7)",
            ),
            "whole-1": (
                {"nvidia.com/gpu": "1"},
                "Insufficient nvidia.com/gpu",
                f"{whole}: 2 GPUs, needs 1 whole GPU, 0 free (in use by {NS}/w)",
            ),
            "shared-1": (
                {"nvidia.com/gpu.shared": "1", "gpupart.io/gpu-memory": "1000"},
                "Insufficient nvidia.com/gpu.shared",
                f"{mps}: 1 GPU, no shared GPU with 1000 MiB free and 1 client slot",
            ),
        }
        for name, (limits, _, _) in wanted.items():
            core.create_namespaced_pod(NS, _pod(name, limits))
        for name, (_, theirs, ours) in wanted.items():
            scheduler = wait(
                lambda name=name: _event(core, name, ours=False),
                60,
                f"{name}: the scheduler's event",
            )
            assert theirs in scheduler, (name, scheduler)
            words = wait(
                lambda name=name: _event(core, name, ours=True),
                60,
                f"{name}: the extender's event",
            )
            assert ours in words, (name, words)
        for name in wanted:
            assert not core.read_namespaced_pod(name, NS).spec.node_name, name

        # The documented diagnose command, real kubectl into real curl (no Content-Type
        # header: curl's form default), only the namespace, pod and address put in.
        command = _diagnose_command()
        assert "-n team-a get pod train-7 -o json" in command, command
        assert "localhost:8888/gpupart/diagnose" in command, command
        command = command.replace("-n team-a get pod train-7", f"-n {NS} get pod mig-full")
        command = command.replace("localhost:8888/gpupart", extender_url)
        cp = k8s_control_plane
        env = {**os.environ, "PATH": f"{cp.bin_dir}:{os.environ['PATH']}"}
        env["KUBECONFIG"] = str(cp.kubeconfig)
        out = subprocess.run(
            ["bash", "-o", "pipefail", "-c", command],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
            check=True,
        )
        diagnosis = json.loads(out.stdout)
        assert diagnosis["Pod"] == f"{NS}/mig-full", diagnosis
        assert diagnosis["FailedNodes"][mig] == wanted["mig-full"][2], diagnosis
    finally:
        core.delete_collection_namespaced_pod(NS, grace_period_seconds=0)
        wait(lambda: not core.list_namespaced_pod(NS).items, 60, "pods deleted", interval=1)
        for n in (mig, whole, mps, dyn):
            core.delete_node(n)
