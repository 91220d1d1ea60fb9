"""The extender with the real kube-scheduler: pods land where the extender says, or stay Pending with its reason.

A dedicated kube-scheduler ("gpupart-scheduler", the chart's scheduler-config.yaml pointed at
an extender served by uvicorn in this process) runs beside the session's default scheduler;
kwok nodes carry the node agent's inventory annotation.
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
import urllib.request
from collections.abc import Generator
from typing import Any

import pytest
import uvicorn
import yaml

from gpupart.core.api.provenance import sign
from gpupart.core.api.spec import Mode
from gpupart.core.api.wire import (
    ASSIGNMENT_ANNOTATION,
    INVENTORY_ANNOTATION,
    MIG_PLAN_ANNOTATION,
    Inventory,
    InventoryGpu,
    MigDevice,
    MigPlan,
    MigReservation,
    PodAssignment,
    decode_assignment,
    encode_assignment,
    encode_inventory,
    encode_mig_plan,
)
from gpupart.core.mig.layout import MigInstance, Placement
from gpupart.keyfile import KeyFile
from gpupart.signing import PrivateKeys
from gpupart_extender.app import create_app
from gpupart_extender.cache import ClusterCache
from gpupart_extender.kube import ApiBinder, Watcher
from gpupart_extender.main import listen
from gpupart_extender.metrics import Metrics
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
    wait_for,
)
from gpupart_testsupport.objects import write_key_file

pytestmark = pytest.mark.e2e

SCHEDULER = "gpupart-scheduler"
CONFIG_FILE = REPO / "charts" / "gpupart" / "files" / "scheduler-config.yaml"
H100 = "NVIDIA H100 80GB HBM3"
KEY = b"gpupart-e2e-extender-key-0000001"
"""The raw Ed25519 private key the extender signs with here (and the pods "already bound" below)."""


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
    key_file = k8s_control_plane.workdir / "extender-assignment-keys"
    write_key_file(key_file, KEY)
    keys = KeyFile.private(key_file).keys
    cache = ClusterCache(keys=keys)
    settings = ExtenderSettings(fragmentation_refresh_seconds=1, assignment_key_file=key_file)
    service = ExtenderService(
        cache,
        settings.scoring(),
        binder=ApiBinder(api),
        metrics=Metrics(),
        ttl_seconds=30,
        keys=keys,
        scheduler_names=settings.scheduler_names,
    )
    watcher = Watcher(api, cache, period_seconds=60)
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
    """A kwok Node with the inventory a node agent writes and the capacity it advertises."""
    shared = [g for g in gpus if g.mode in (Mode.MPS, Mode.TIME_SLICING)]
    extended = {
        **extended,
        "gpupart.io/gpu-memory": sum(g.memory_mib for g in shared),
        "gpupart.io/gpu-compute": 100 * len(shared),
    }
    manifest = gpu_node(name, extended, {"gpupart.io/e2e": "extender"})
    manifest["metadata"]["annotations"][INVENTORY_ANNOTATION] = encode_inventory(
        Inventory(tuple(gpus))
    )
    return manifest


def _pod(
    name: str, limits: dict[str, str], app: str, selector: dict[str, str] | None = None
) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": app}},
        "spec": {
            "schedulerName": SCHEDULER,
            **({"nodeSelector": selector} if selector else {}),
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
    # kube-scheduler counts GPU memory per node (ADR 005): every node below has room for a
    # 30000 MiB pod in total, so its reason is the extender's (which GPU holds what).
    mps = [f"{run}-mps-{i}" for i in range(2)]  # 40000 + 20000 MiB: one 30000 MiB pod each
    small = [f"{run}-small-{i}" for i in range(4)]  # 2 x 20000 MiB GPUs: too small for 30000
    mig = f"{run}-mig"
    create_nodes(
        k8s_api,
        [
            _node(
                n,
                [
                    InventoryGpu(0, f"GPU-{n}", H100, 40000, Mode.MPS, (), 16),
                    InventoryGpu(1, f"GPU-{n}-1", H100, 20000, Mode.MPS, (), 16),
                ],
                {"nvidia.com/gpu.shared": 32},
            )
            for n in mps
        ]
        + [
            _node(
                n,
                [InventoryGpu(g, f"GPU-{n}-{g}", H100, 20000, Mode.MPS, (), 16) for g in (0, 1)],
                {"nvidia.com/gpu.shared": 32},
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
        assert f"{small[0]}: 2 GPUs, no shared GPU with 30000 MiB" in infer_msg, infer_msg
        assert (
            "3 node(s) had no shared GPU with 30000 MiB free and 1 client slot (too small)"
            in infer_msg
        ), infer_msg
        # The MIG node has no shared GPU memory at all: kube-scheduler's own count says so.
        assert "1 Insufficient gpupart.io/gpu-memory" in infer_msg, infer_msg
        assert f"{mig}: 1 GPU, no free 3g.40gb slice (all 2 in use by {ns}/train-" in train_msg, (
            train_msg
        )
    finally:
        core.delete_collection_namespaced_pod(ns, grace_period_seconds=0)
        wait_for(lambda: not core.list_namespaced_pod(ns).items, 60, "pods deleted", interval=1)
        for n in [*mps, *small, mig]:
            core.delete_node(n)


def _one_slice_node(name: str, group: str, reserved_for: str | None) -> dict[str, Any]:
    """A kwok node with one 3g.40gb instance; `reserved_for`: the operator's MIG plan holds it
    for that pod (namespace/name) for ten minutes."""
    instance = MigInstance(Placement(0, 4), "3g.40gb")
    gpu = InventoryGpu(0, f"GPU-{name}", H100, 81559, Mode.MIG, (MigDevice("MIG-0", instance),))
    manifest = _node(name, [gpu], {"nvidia.com/mig-3g.40gb": 1})
    manifest["metadata"]["labels"]["gpupart.io/e2e-group"] = group
    if reserved_for is not None:
        reservation = MigReservation(reserved_for, "", 0, instance, time.time() + 600)
        manifest["metadata"]["annotations"][MIG_PLAN_ANNOTATION] = encode_mig_plan(
            MigPlan("plan-1", (), (reservation,))
        )
    return manifest


@pytest.mark.usefixtures("gpupart_scheduler")
def test_a_reserved_mig_slice_goes_to_its_pod_and_no_other(k8s_api: Any) -> None:
    """Group 1: the reserved node refuses b and c (the reason names the pod it is held for), a
    lands there. Group 2: d is scored first on the node reserved for it, though another node
    with a free slice passes filter too."""
    from kubernetes import client

    core = client.CoreV1Api(k8s_api)
    run = f"res{int(time.time()) % 100000}"
    ns = f"e2e-{run}"
    core.create_namespace({"metadata": {"name": ns}})
    reserved, free = f"{run}-reserved", f"{run}-free"
    reserved_2, free_2 = f"{run}-reserved-2", f"{run}-free-2"
    create_nodes(
        k8s_api,
        [
            _one_slice_node(reserved, "1", f"{ns}/a"),
            _one_slice_node(free, "1", None),
            _one_slice_node(reserved_2, "2", f"{ns}/d"),
            _one_slice_node(free_2, "2", None),
        ],
    )
    mig = {"nvidia.com/mig-3g.40gb": "1"}

    def node_of(name: str) -> str | None:
        return str(core.read_namespaced_pod(name, ns).spec.node_name or "") or None

    try:
        core.create_namespaced_pod(ns, _pod("b", mig, "b", {"gpupart.io/e2e-group": "1"}))
        assert wait_for(lambda: node_of("b"), 60, "b bound", interval=0.5) == free
        core.create_namespaced_pod(ns, _pod("c", mig, "c", {"gpupart.io/e2e-group": "1"}))

        def reason() -> str | None:
            for e in core.list_namespaced_event(ns).items:
                if (e.involved_object.name, e.reason) == ("c", "FailedScheduling") and (
                    "nodes are available" in e.message
                ):
                    return str(e.message)
            return None

        message = wait_for(reason, 60, "c's FailedScheduling event", interval=1)
        want = f"{reserved}: 1 GPU, no free 3g.40gb slice (all 1 reserved for {ns}/a)"
        assert want in message, message
        # b's node: kube-scheduler counts its one slice in use itself, before asking us.
        assert "1 Insufficient nvidia.com/mig-3g.40gb" in message, message
        core.create_namespaced_pod(ns, _pod("a", mig, "a", {"gpupart.io/e2e-group": "1"}))
        assert wait_for(lambda: node_of("a"), 60, "a bound", interval=0.5) == reserved
        assert node_of("c") is None

        core.create_namespaced_pod(ns, _pod("d", mig, "d", {"gpupart.io/e2e-group": "2"}))
        assert wait_for(lambda: node_of("d"), 60, "d bound", interval=0.5) == reserved_2
    finally:
        core.delete_collection_namespaced_pod(ns, grace_period_seconds=0)
        wait_for(lambda: not core.list_namespaced_pod(ns).items, 60, "pods deleted", interval=1)
        for n in (reserved, free, reserved_2, free_2):
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


PRIORITIES = {"e2e-low": 0, "e2e-mid": 500, "e2e-high": 1000, "e2e-top": 2000}


def _create_bound_pod(
    core: Any, ns: str, name: str, node: str, gpu: int, memory: int, priority_class: str
) -> None:
    """A shared-GPU pod already running on `node`'s GPU `gpu`, with the assignment the extender
    would have signed for it (its UID is known once created)."""
    manifest = _pod(
        name, {"nvidia.com/gpu.shared": "1", "gpupart.io/gpu-memory": str(memory)}, name
    )
    manifest["spec"]["nodeName"] = node
    manifest["spec"]["priorityClassName"] = priority_class
    created = core.create_namespaced_pod(ns, manifest)
    assignment = PodAssignment(node, gpu, f"GPU-{node}-{gpu}", memory, pod_uid=created.metadata.uid)
    text = encode_assignment(sign(assignment, PrivateKeys((KEY,))))
    core.patch_namespaced_pod(
        name, ns, {"metadata": {"annotations": {ASSIGNMENT_ANNOTATION: text}}}
    )


def _metric(extender_url: str, name: str) -> float:
    """A counter of the extender's /metrics (served next to its verbs' prefix)."""
    base = extender_url.rsplit("/", 1)[0]
    with urllib.request.urlopen(f"{base}/metrics", timeout=5) as response:  # noqa: S310 - loopback
        text = response.read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def _events(core: Any, ns: str, reason: str) -> list[Any]:
    return [e for e in core.list_namespaced_event(ns).items if e.reason == reason]


def _priority_classes(k8s_api: Any) -> None:
    """PRIORITIES as PriorityClasses (shared by the tests of this module, made once)."""
    from kubernetes import client

    scheduling = client.SchedulingV1Api(k8s_api)
    existing = {c.metadata.name for c in scheduling.list_priority_class().items}
    for name, value in PRIORITIES.items():
        if name not in existing:
            scheduling.create_priority_class({"metadata": {"name": name}, "value": value})


def _all_running(core: Any, ns: str) -> None:
    wait_for(
        lambda: (
            all(p.status.phase == "Running" for p in core.list_namespaced_pod(ns).items) or None
        ),
        60,
        f"the pods already on the nodes of {ns} running",
        interval=0.5,
    )


@pytest.mark.usefixtures("gpupart_scheduler")
def test_a_high_priority_pod_evicts_exactly_the_pods_on_one_gpu_and_nothing_helps_a_misfit(
    k8s_api: Any, extender_url: str
) -> None:
    """Only GPU memory is short (16 client slots per GPU): kube-scheduler sees it because it
    counts gpupart.io/gpu-memory per node; the preempt verb moves its victims onto one GPU."""
    from kubernetes import client

    core = client.CoreV1Api(k8s_api)
    run = f"pre{int(time.time()) % 100000}"
    ns = f"e2e-{run}"
    core.create_namespace({"metadata": {"name": ns}})
    _priority_classes(k8s_api)
    a, b, c, m, w = (f"{run}-{x}" for x in "abcmw")
    create_nodes(
        k8s_api,
        [
            _node(
                n,
                [InventoryGpu(g, f"GPU-{n}-{g}", H100, 40000, Mode.MPS, (), 16) for g in (0, 1)],
                {"nvidia.com/gpu.shared": 32},
            )
            for n in (a, b)
        ]
        # Empty, 60000 MiB in total on two 30000 MiB GPUs: past kube-scheduler's count for
        # the pods below, so it is the extender that says why neither fits there.
        + [
            _node(
                c,
                [InventoryGpu(g, f"GPU-{c}-{g}", H100, 30000, Mode.MPS, (), 16) for g in (0, 1)],
                {"nvidia.com/gpu.shared": 32},
            ),
            _node(
                m,
                [
                    InventoryGpu(
                        0,
                        f"GPU-{m}",
                        H100,
                        81559,
                        Mode.MIG,
                        (
                            MigDevice("MIG-m0", MigInstance(Placement(0, 4), "3g.40gb")),
                            MigDevice("MIG-m1", MigInstance(Placement(4, 4), "3g.40gb")),
                        ),
                    )
                ],
                {"nvidia.com/mig-3g.40gb": 2},
            ),
            _node(
                w,
                [InventoryGpu(g, f"GPU-{w}-{g}", H100, 81559, Mode.NONE) for g in (0, 1)],
                {"nvidia.com/gpu": 2},
            ),
        ],
    )
    # a and b full with 20000 MiB pods (memory only: 2 of 16 client slots used per GPU).
    # A priority-1000 pod of 40000 MiB fits after evicting a-mid-0 and a-low-0 (a's GPU 0)
    # and nowhere else: every other GPU holds a pod of priority 1000 or more. kube-scheduler's
    # own dry run counts node totals and reprieves the highest priority first, so it keeps
    # a-mid-0 and proposes a-low-0 and a-low-1 (on two GPUs: that frees no GPU).
    running = {
        "a-mid-0": (a, 0, "e2e-mid"),
        "a-low-0": (a, 0, "e2e-low"),
        "a-high-0": (a, 1, "e2e-high"),
        "a-low-1": (a, 1, "e2e-low"),
        "b-top-0": (b, 0, "e2e-top"),
        "b-low-0": (b, 0, "e2e-low"),
        "b-high-0": (b, 1, "e2e-high"),
        "b-low-1": (b, 1, "e2e-low"),
    }
    held = {"m-low-0": (m, "nvidia.com/mig-3g.40gb"), "m-low-1": (m, "nvidia.com/mig-3g.40gb")}
    held |= {"w-low-0": (w, "nvidia.com/gpu"), "w-low-1": (w, "nvidia.com/gpu")}
    try:
        for name, (node_name, gpu, cls) in running.items():
            _create_bound_pod(core, ns, name, node_name, gpu, 20000, cls)
        for name, (node_name, resource) in held.items():
            low = _pod(name, {resource: "1"}, name)
            low["spec"].update(nodeName=node_name, priorityClassName="e2e-low")
            core.create_namespaced_pod(ns, low)
        _all_running(core, ns)

        # A budget the extender's watch picks up (the preempt verb counts its violations); it
        # covers a pod no preemption here may take.
        client.PolicyV1Api(k8s_api).create_namespaced_pod_disruption_budget(
            ns,
            {
                "metadata": {"name": "top"},
                "spec": {"maxUnavailable": 0, "selector": {"matchLabels": {"app": "b-top-0"}}},
            },
        )
        wait_for(
            lambda: (
                _metric(extender_url, 'gpupart_extender_cache_objects{kind="budgets"}') >= 1 or None
            ),
            30,
            "the extender's cache to list the PodDisruptionBudget",
            interval=0.5,
        )

        # More memory than any GPU has (50000 MiB), less than a node's total: no eviction
        # helps, so nothing is evicted, and the extender says why.
        dropped_before = _metric(extender_url, "gpupart_extender_preemption_nodes_dropped_total")
        misfit = _pod(
            "misfit", {"nvidia.com/gpu.shared": "1", "gpupart.io/gpu-memory": "50000"}, "misfit"
        )
        misfit["spec"]["priorityClassName"] = "e2e-high"
        core.create_namespaced_pod(ns, misfit)

        def misfit_reason() -> str | None:
            for e in _events(core, ns, "FailedScheduling"):
                if e.involved_object.name == "misfit" and "nodes are available" in e.message:
                    return str(e.message)
            return None

        message = wait_for(misfit_reason, 60, "the misfit's FailedScheduling event", interval=1)
        # a, b, m and w are short in total (kube-scheduler's count); c reaches the extender.
        assert "4 Insufficient gpupart.io/gpu-memory" in message, message
        assert f"{c}: 2 GPUs, no shared GPU with 50000 MiB free and 1 client slot" in message, (
            message
        )
        # kube-scheduler's dry run finds victims on a (60000 MiB in total without its lower
        # pods); the preempt verb drops it (no GPU holds 50000 MiB): nothing is evicted.
        assert "preemption: no candidate node for preemption" in message, message
        dropped = _metric(extender_url, "gpupart_extender_preemption_nodes_dropped_total")
        assert dropped - dropped_before >= 1, (dropped_before, dropped)
        condition = next(
            x for x in core.read_namespaced_pod("misfit", ns).status.conditions
            if x.type == "PodScheduled"
        )  # fmt: skip
        assert condition.status == "False" and condition.reason == "Unschedulable", condition
        assert "no shared GPU with 50000 MiB free" in condition.message, condition.message
        assert {p.metadata.name for p in core.list_namespaced_pod(ns).items} == {
            *running,
            *held,
            "misfit",
        }
        assert not _events(core, ns, "Preempted")

        infer = _pod(
            "infer", {"nvidia.com/gpu.shared": "1", "gpupart.io/gpu-memory": "40000"}, "infer"
        )
        infer["spec"]["priorityClassName"] = "e2e-high"
        core.create_namespaced_pod(ns, infer)

        def bound(name: str) -> Any:
            p = core.read_namespaced_pod(name, ns)
            return p if p.spec.node_name else None

        placed = wait_for(
            lambda: bound("infer"), 90, "the high-priority pod bound after preemption", interval=0.5
        )
        assert placed.spec.node_name == a
        assignment = decode_assignment(placed.metadata.annotations[ASSIGNMENT_ANNOTATION])
        assert (assignment.node, assignment.gpu, assignment.memory_mib) == (a, 0, 40000)
        left = {p.metadata.name for p in core.list_namespaced_pod(ns).items}
        # Exactly the two pods on the GPU it landed on went, a-mid-0 among them: kube-scheduler
        # took the extender's victims over its own (a-low-1 keeps running). The misfit is
        # still Pending.
        assert left == set(running) - {"a-mid-0", "a-low-0"} | {*held, "infer", "misfit"}
        still = core.read_namespaced_pod("misfit", ns)
        assert still.spec.node_name is None and not still.status.nominated_node_name
        preempted = {e.involved_object.name for e in _events(core, ns, "Preempted")}
        assert preempted == {"a-mid-0", "a-low-0"}, preempted

        # MIG slices and whole GPUs are counted in-tree: kube-scheduler's own victim (one of
        # the node's two pods) stands, as the extender finds that its eviction frees a 3g.40gb
        # slice or a whole GPU.
        evicted = {"a-mid-0", "a-low-0"}
        for name, resource, node_name in (
            ("train", "nvidia.com/mig-3g.40gb", m),
            ("whole", "nvidia.com/gpu", w),
        ):
            pod = _pod(name, {resource: "1"}, name)
            pod["spec"]["priorityClassName"] = "e2e-high"
            core.create_namespaced_pod(ns, pod)
            placed = wait_for(
                lambda name=name: bound(name), 90, f"{name} bound after preemption", interval=0.5
            )
            assert placed.spec.node_name == node_name
            names = {p.metadata.name for p in core.list_namespaced_pod(ns).items}
            gone = {h for h, (n, _) in held.items() if n == node_name} - names
            assert len(gone) == 1, gone
            evicted |= gone
            preempted = {e.involved_object.name for e in _events(core, ns, "Preempted")}
            assert preempted == evicted, preempted
    finally:
        core.delete_collection_namespaced_pod(ns, grace_period_seconds=0)
        wait_for(lambda: not core.list_namespaced_pod(ns).items, 60, "pods deleted", interval=1)
        for n in (a, b, c, m, w):
            core.delete_node(n)


@pytest.mark.usefixtures("gpupart_scheduler")
def test_a_node_with_room_only_in_total_gets_no_preemption(k8s_api: Any) -> None:
    """The gap ADR 005 leaves: 20000 MiB free on each of two GPUs fits a 40000 MiB pod in
    kube-scheduler's node total, so its dry run finds no victim there and nothing is evicted,
    although evicting one GPU's pod would make room."""
    from kubernetes import client

    core = client.CoreV1Api(k8s_api)
    run = f"gap{int(time.time()) % 100000}"
    ns = f"e2e-{run}"
    core.create_namespace({"metadata": {"name": ns}})
    _priority_classes(k8s_api)
    f = f"{run}-f"
    create_nodes(
        k8s_api,
        [
            _node(
                f,
                [InventoryGpu(g, f"GPU-{f}-{g}", H100, 40000, Mode.MPS, (), 16) for g in (0, 1)],
                {"nvidia.com/gpu.shared": 32},
            )
        ],
    )
    try:
        for g in (0, 1):
            _create_bound_pod(core, ns, f"low-{g}", f, g, 20000, "e2e-low")
        _all_running(core, ns)
        high = _pod("high", {"nvidia.com/gpu.shared": "1", "gpupart.io/gpu-memory": "40000"}, "h")
        high["spec"].update(
            priorityClassName="e2e-high", nodeSelector={"kubernetes.io/hostname": f}
        )
        core.create_namespaced_pod(ns, high)

        def reason() -> str | None:
            for e in _events(core, ns, "FailedScheduling"):
                if e.involved_object.name == "high" and "nodes are available" in e.message:
                    return str(e.message)
            return None

        message = wait_for(reason, 60, "the pod's FailedScheduling event", interval=1)
        assert f"{f}: 2 GPUs, no shared GPU with 40000 MiB free and 1 client slot" in message, (
            message
        )
        assert f'preemption: expected at least one victim pod on node "{f}"' in message, message
        assert {p.metadata.name for p in core.list_namespaced_pod(ns).items} == {
            "low-0",
            "low-1",
            "high",
        }
        assert not _events(core, ns, "Preempted")
        assert core.read_namespaced_pod("high", ns).spec.node_name is None
    finally:
        core.delete_collection_namespaced_pod(ns, grace_period_seconds=0)
        wait_for(
            lambda ns=ns: not core.list_namespaced_pod(ns).items, 60, "pods deleted", interval=1
        )
        core.delete_node(f)


def _diagnose(extender_url: str, pod: dict[str, Any], node: str) -> dict[str, Any]:
    request = urllib.request.Request(
        f"{extender_url}/diagnose?node={node}",
        data=json.dumps(pod).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=10) as response:  # noqa: S310 - loopback
        return json.loads(response.read())  # type: ignore[no-any-return]


@pytest.mark.usefixtures("gpupart_scheduler")
def test_a_namespace_selector_is_decided_by_the_other_namespaces_labels_as_they_change(
    k8s_api: Any, extender_url: str
) -> None:
    """A guest pod avoids `app=holder` pods in namespaces labelled gold (required
    podAntiAffinity with a namespaceSelector). The holder's namespace is not gold: the guest
    shares its GPU. Labelled gold: the next guest is refused that GPU, with the extender's
    reason. The label removed: the next one shares it again. The term's topologyKey is on no
    node, so kube-scheduler's own InterPodAffinity lets every node pass: the extender decides."""
    from kubernetes import client

    core = client.CoreV1Api(k8s_api)
    run = f"nss{int(time.time()) % 100000}"
    holders, guests = f"e2e-{run}-a", f"e2e-{run}-b"
    for ns in (holders, guests):
        core.create_namespace({"metadata": {"name": ns}})
    _priority_classes(k8s_api)
    f = f"{run}-f"
    gpu = InventoryGpu(0, f"GPU-{f}-0", H100, 40000, Mode.MPS, (), 16)
    create_nodes(k8s_api, [_node(f, [gpu], {"nvidia.com/gpu.shared": 16})])
    tier = "gpupart.io/e2e-tier"

    def guest(name: str) -> dict[str, Any]:
        manifest = _pod(name, {"nvidia.com/gpu.shared": "1", "gpupart.io/gpu-memory": "1000"}, name)
        term = {
            "labelSelector": {"matchLabels": {"app": "holder"}},
            "namespaceSelector": {"matchLabels": {tier: "gold"}},
            "topologyKey": "gpupart.io/e2e-no-such-topology",
        }
        manifest["metadata"]["namespace"] = guests
        manifest["spec"].update(
            nodeSelector={"kubernetes.io/hostname": f},
            affinity={
                "podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [term]}
            },
        )
        return manifest

    def node_of(name: str) -> str | None:
        return str(core.read_namespaced_pod(name, guests).spec.node_name or "") or None

    def relabel(value: str | None) -> None:
        core.patch_namespace(holders, {"metadata": {"labels": {tier: value}}})
        probe = guest("probe")
        wait_for(
            lambda: (f in _diagnose(extender_url, probe, f)["FailedNodes"]) == (value == "gold"),
            30,
            f"the extender to see namespace {holders} labelled {tier}={value}",
            interval=0.5,
        )

    try:
        _create_bound_pod(core, holders, "holder", f, 0, 10000, "e2e-low")
        _all_running(core, holders)
        core.create_namespaced_pod(guests, guest("guest-1"))
        assert wait_for(lambda: node_of("guest-1"), 60, "guest-1 bound", interval=0.5) == f

        relabel("gold")
        core.create_namespaced_pod(guests, guest("guest-2"))

        def reason() -> str | None:
            for e in _events(core, guests, "FailedScheduling"):
                if e.involved_object.name == "guest-2" and "nodes are available" in e.message:
                    return str(e.message)
            return None

        message = wait_for(reason, 60, "guest-2's FailedScheduling event", interval=1)
        assert f"GPU 0: required podAntiAffinity with {holders}/holder" in message, message
        assert node_of("guest-2") is None

        relabel(None)
        core.create_namespaced_pod(guests, guest("guest-3"))
        assert wait_for(lambda: node_of("guest-3"), 60, "guest-3 bound", interval=0.5) == f
    finally:
        for ns in (holders, guests):
            core.delete_collection_namespaced_pod(ns, grace_period_seconds=0)
            wait_for(
                lambda ns=ns: not core.list_namespaced_pod(ns).items, 60, "pods deleted", interval=1
            )
        core.delete_node(f)
