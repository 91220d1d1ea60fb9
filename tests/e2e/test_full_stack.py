"""Full stack on a real control plane: GpuPartition -> node agents -> plugins -> gpupart-scheduler -> running pods.

Real etcd, kube-apiserver, kube-scheduler (the chart's gpupart-scheduler configuration), and
nodes served by real kubelets with the fake CRI runtime (tests/support/kubelet.py); `gpupart
operator`, `gpupart node --simulate` (one per node) and `gpupart extender` as processes. What a
container got is what the kubelet handed the runtime. Every wait has a deadline.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
from kubernetes import client

from gpupart.core.api.spec import Mode
from gpupart.core.api.wire import (
    ASSIGNMENT_ANNOTATION,
    INVENTORY_ANNOTATION,
    STATE_ANNOTATION,
    allocation_record,
    decode_allocation,
    decode_assignment,
    decode_inventory,
    decode_report,
)
from gpupart_testsupport.kubelet import EXIT_ENV
from gpupart_testsupport.polling import wait_for
from gpupart_testsupport.stack import Stack

pytestmark = pytest.mark.e2e

LABEL = "gpupart.io/e2e-stack"
A100 = "NVIDIA-A100-SXM4-80GB"
MIG_1G = "nvidia.com/mig-1g.10gb"
MIG_3G = "nvidia.com/mig-3g.40gb"
GROUP, VERSION, PLURAL = "gpupart.io", "v1alpha1", "gpupartitions"
SCHEDULER = "gpupart-scheduler"


def nodes_for(
    stack: Stack, scenario: str, product: str, gpus: str, count: int, *, auto_reset: bool = False
) -> list[str]:
    """Nodes served by real kubelets (tests/support/kubelet.py), each with its node agent."""
    names = [f"stack-{scenario}-{i}" for i in range(count)]
    labels = {LABEL: scenario, "nvidia.com/gpu.product": product, "nvidia.com/gpu.count": "1"}
    for name in names:
        stack.start_real_node(name, gpus, labels, auto_reset=auto_reset)
    return names


def partition(name: str, scenario: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "GpuPartition",
        "metadata": {"name": name},
        "spec": {"nodeSelector": {"matchLabels": {LABEL: scenario}}, "priority": 100, **spec},
    }


def pod(name: str, scenario: str, limits: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": name}},
        "spec": {
            "schedulerName": SCHEDULER,
            "nodeSelector": {LABEL: scenario},
            "terminationGracePeriodSeconds": 0,
            "containers": [
                {
                    "name": "main",
                    "image": "gpupart/cuda:0",
                    "resources": {"limits": limits},
                }
            ],
        },
    }


def remove(stack: Stack, name: str, nodes: list[str]) -> None:
    """Delete the partition while the agents still run (they release its finalizer), then the nodes.

    A partition left behind with its finalizer would keep a later test's operator busy.
    """
    c = Cluster(stack)
    with contextlib.suppress(client.ApiException):
        c.custom.delete_cluster_custom_object(GROUP, VERSION, PLURAL, name)

    def gone() -> bool:
        try:
            c.custom.get_cluster_custom_object(GROUP, VERSION, PLURAL, name)
        except client.ApiException as error:
            return error.status == 404
        return False

    try:
        c.until(gone, 60, f"GpuPartition {name} deleted (finalizer released)")
    finally:
        with contextlib.suppress(client.ApiException):
            patch = {"metadata": {"finalizers": None}}
            c.custom.patch_cluster_custom_object(GROUP, VERSION, PLURAL, name, patch)
        for node in nodes:
            stack.stop_real_node(node)
            with contextlib.suppress(client.ApiException):
                c.core.delete_node(node)


class Cluster:
    """Reads the test needs, against the stack's API client."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.core = client.CoreV1Api(stack.api_client)
        self.custom = client.CustomObjectsApi(stack.api_client)

    def capacity(self, node: str, resource: str) -> int:
        return int((self.core.read_node(node).status.allocatable or {}).get(resource, "0"))

    def node_states(self, name: str) -> dict[str, dict[str, Any]]:
        obj = self.custom.get_cluster_custom_object(GROUP, VERSION, PLURAL, name)
        return (obj.get("status") or {}).get("nodes") or {}

    def gpu_report(self, node: str) -> Any:
        text = (self.core.read_node(node).metadata.annotations or {}).get(STATE_ANNOTATION)
        return decode_report(text) if text else None

    def inventory(self, node: str) -> Any:
        text = (self.core.read_node(node).metadata.annotations or {}).get(INVENTORY_ANNOTATION)
        return decode_inventory(text).gpus if text else ()

    def pods(self, namespace: str) -> dict[str, Any]:
        return {p.metadata.name: p for p in self.core.list_namespaced_pod(namespace).items}

    def running(self, namespace: str) -> set[str]:
        return {n for n, p in self.pods(namespace).items() if p.status.phase == "Running"}

    def allocated(self, namespace: str, name: str) -> dict[str, dict[str, str]] | None:
        """Each container's environment as the kubelet created it; None before any was created."""
        for real in self.stack.real_nodes.values():
            found = real.environments(namespace, name)
            if found:
                return found
        return None

    def env(self, namespace: str, name: str, container: str = "main") -> dict[str, str]:
        found = self.allocated(namespace, name) or {}
        assert container in found, f"{namespace}/{name} container {container} was never created"
        return found[container]

    def rejected(self, namespace: str) -> dict[str, str]:
        """Pods the kubelet refused at admission, with its message."""
        return {
            n: p.status.message or ""
            for n, p in self.pods(namespace).items()
            if p.status.phase == "Failed" and p.status.reason == "UnexpectedAdmissionError"
        }

    def events(self, namespace: str, name: str) -> list[str]:
        items = self.core.list_namespaced_event(
            namespace, field_selector=f"involvedObject.name={name}"
        ).items
        return [f"{e.reason}: {e.message}" for e in items]

    def until(self, check: Any, timeout: float, what: str) -> Any:
        try:
            return wait_for(check, timeout, what, interval=0.3)
        except TimeoutError as error:
            raise AssertionError(f"{error}\n{self.stack.tails()}") from None


def test_mig_partition_to_running_pods_relayout_blocked_then_converges(
    stack: Stack, namespace: str
) -> None:
    c = Cluster(stack)
    nodes = nodes_for(stack, "mig", A100, "A100-SXM4-80GB", 2)
    c.custom.create_cluster_custom_object(
        GROUP,
        VERSION,
        PLURAL,
        partition("stack-mig", "mig", {"mode": "MIG", "mig": {"devices": {"1g.10gb": 7}}}),
    )
    try:
        # Nodes report Applied and advertise 7 slices each.
        c.until(
            lambda: all(
                c.node_states("stack-mig").get(n, {}).get("state") == "Applied" for n in nodes
            ),
            90,
            "both nodes Applied",
        )
        c.until(lambda: all(c.capacity(n, MIG_1G) == 7 for n in nodes), 30, "7 slices per node")

        # 14 pods run, each with one slice from Allocate; the 15th stays Pending and says why.
        for i in range(14):
            c.core.create_namespaced_pod(namespace, pod(f"slice-{i:02}", "mig", {MIG_1G: "1"}))
        c.until(lambda: len(c.running(namespace)) == 14, 90, "14 pods Running")
        c.until(
            lambda: all(c.allocated(namespace, f"slice-{i:02}") for i in range(14)),
            30,
            "14 Allocates",
        )
        devices = {c.env(namespace, f"slice-{i:02}")["NVIDIA_VISIBLE_DEVICES"] for i in range(14)}
        assert len(devices) == 14 and all(d.startswith("MIG-") for d in devices)
        env = c.env(namespace, "slice-00")
        assert env["NVIDIA_VISIBLE_DEVICES"] in devices
        c.core.create_namespaced_pod(namespace, pod("slice-14", "mig", {MIG_1G: "1"}))
        events = c.until(
            lambda: [
                e for e in c.events(namespace, "slice-14") if e.startswith("FailedScheduling")
            ],
            60,
            "FailedScheduling event for the 15th pod",
        )
        assert any("1g.10gb" in e for e in events), events
        assert c.pods(namespace)["slice-14"].spec.node_name is None

        # One pod goes, the Pending one takes its slice. The deadline covers kube-scheduler's
        # periodic flush of unschedulable pods (5 min) in case no event requeues it sooner.
        c.core.delete_namespaced_pod("slice-00", namespace, grace_period_seconds=0)
        c.until(lambda: "slice-14" in c.running(namespace), 330, "the 15th pod Running")
        c.until(lambda: c.allocated(namespace, "slice-14"), 30, "Allocate for the 15th pod")

        # Repartition while pods run: Blocked, naming the pods; nothing destroyed.
        c.custom.patch_cluster_custom_object(
            GROUP,
            VERSION,
            PLURAL,
            "stack-mig",
            {"spec": {"mig": {"devices": {"1g.10gb": None, "3g.40gb": 2}}}},
        )
        c.until(
            lambda: all(
                c.node_states("stack-mig").get(n, {}).get("state") == "Blocked" for n in nodes
            ),
            60,
            "both nodes Blocked",
        )
        states = c.node_states("stack-mig")
        for node in nodes:
            on_node = [n for n, p in c.pods(namespace).items() if p.spec.node_name == node]
            assert any(f"{namespace}/{n}" in states[node]["message"] for n in on_node), states[node]
            report = c.gpu_report(node)
            assert report.gpus[0].blocking_pods, report
            assert c.capacity(node, MIG_1G) == 7 and c.capacity(node, MIG_3G) == 0
        assert len(c.running(namespace)) == 14

        # Pods gone: the nodes converge on the new layout.
        c.core.delete_collection_namespaced_pod(namespace, grace_period_seconds=0)
        c.until(lambda: not c.pods(namespace), 60, "pods deleted")
        c.until(
            lambda: all(
                c.node_states("stack-mig").get(n, {}).get("state") == "Applied" for n in nodes
            ),
            90,
            "both nodes Applied with 3g.40gb x2",
        )
        c.until(
            lambda: all(c.capacity(n, MIG_3G) == 2 and c.capacity(n, MIG_1G) == 0 for n in nodes),
            30,
            "2 x 3g.40gb advertised per node",
        )
    finally:
        remove(stack, "stack-mig", nodes)


SHARED = "nvidia.com/gpu.shared"
MEMORY = "gpupart.io/gpu-memory"
COMPUTE = "gpupart.io/gpu-compute"


def test_mps_partition_memory_requests_get_the_mps_env_then_repartition(
    stack: Stack, namespace: str
) -> None:
    c = Cluster(stack)
    # Simulated GPUs that start without MIG; the simulated admin reset lets MPS -> MIG converge.
    nodes = nodes_for(stack, "mps", A100, "A100-SXM4-80GB:mig-off", 2, auto_reset=True)
    # Ceilings per client (what the MPS daemon enforces): 20 GiB and 25 % (100 / maxClients).
    spec = {"mode": "MPS", "mps": {"maxClients": 4, "defaultMemory": "20Gi"}}
    c.custom.create_cluster_custom_object(
        GROUP, VERSION, PLURAL, partition("stack-mps", "mps", spec)
    )
    try:
        c.until(
            lambda: all(
                c.node_states("stack-mps").get(n, {}).get("state") == "Applied" for n in nodes
            ),
            90,
            "both nodes Applied",
        )
        c.until(
            lambda: all(c.capacity(n, SHARED) == 4 for n in nodes), 30, "4 client slots per node"
        )
        gpu_uuids = {n: c.inventory(n)[0].uuid for n in nodes}
        assert all(c.gpu_report(n).gpus[0].mode is Mode.MPS for n in nodes)
        assert all(c.inventory(n)[0].client_memory_mib == 20480 for n in nodes)

        # A pod asking more than one MPS client may hold would get only the ceiling from the
        # GPU: it is refused, in words, on every node (kube-scheduler's own count would pass it).
        c.core.create_namespaced_pod(
            namespace, pod("mps-big", "mps", {SHARED: "1", MEMORY: "30000"})
        )
        events = c.until(
            lambda: [e for e in c.events(namespace, "mps-big") if e.startswith("FailedScheduling")],
            60,
            "FailedScheduling event for the pod above the ceiling",
        )
        assert any("MPS lets one container hold at most 20480 MiB" in e for e in events), events
        c.core.delete_namespaced_pod("mps-big", namespace, grace_period_seconds=0)

        # 8 pods of about 15000 MiB fill the 4 client slots of each GPU. One at a time, so each
        # Allocate has exactly one pod waiting for it (the kubelet's Allocate names no pod).
        computes = ["20", "25", None, "20", "25", None, "10", None]
        names = [f"mps-{i}" for i in range(8)]
        for i, name in enumerate(names):
            limits = {SHARED: "1", MEMORY: str(15000 + i)}
            if computes[i]:
                limits[COMPUTE] = computes[i]
            c.core.create_namespaced_pod(namespace, pod(name, "mps", limits))
            c.until(lambda n=name: c.allocated(namespace, n), 60, f"Allocate for {name}")
        for i, name in enumerate(names):
            placed = c.pods(namespace)[name]
            assignment = decode_assignment(placed.metadata.annotations[ASSIGNMENT_ANNOTATION])
            assert assignment.node == placed.spec.node_name
            assert assignment.gpu_uuid == gpu_uuids[placed.spec.node_name]
            env = c.env(namespace, name)
            assert env["NVIDIA_VISIBLE_DEVICES"] == assignment.gpu_uuid, env
            assert env["CUDA_MPS_PIPE_DIRECTORY"] == "/var/run/gpupart/mps", env
            limit = f"{assignment.gpu_uuid}={15000 + i}M"
            assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == limit, env
            # Without a compute request: the partition's even share, 100 / maxClients.
            assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == (computes[i] or "25"), env
        on_node = {
            n: [p for p, o in c.pods(namespace).items() if o.spec.node_name == n] for n in nodes
        }
        assert sorted(len(v) for v in on_node.values()) == [4, 4], on_node

        # A 9th pod waits: every client slot is taken.
        c.core.create_namespaced_pod(namespace, pod("mps-8", "mps", {SHARED: "1", MEMORY: "10000"}))
        events = c.until(
            lambda: [e for e in c.events(namespace, "mps-8") if e.startswith("FailedScheduling")],
            60,
            "FailedScheduling event for the 9th pod",
        )
        assert any("2 Insufficient nvidia.com/gpu.shared" in e for e in events), events
        assert c.pods(namespace)["mps-8"].spec.node_name is None

        # One pod goes: the 9th takes its slot, on that pod's GPU.
        freed = c.pods(namespace)["mps-0"].spec.node_name
        c.core.delete_namespaced_pod("mps-0", namespace, grace_period_seconds=0)
        c.until(lambda: c.allocated(namespace, "mps-8"), 330, "Allocate for the 9th pod")
        env = c.env(namespace, "mps-8")
        assert c.pods(namespace)["mps-8"].spec.node_name == freed
        assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"{gpu_uuids[freed]}=10000M", env

        # MPS -> MIG while clients run: Blocked, naming them; nothing changed.
        c.custom.patch_cluster_custom_object(
            GROUP,
            VERSION,
            PLURAL,
            "stack-mps",
            {"spec": {"mode": "MIG", "mps": None, "mig": {"devices": {"3g.40gb": 2}}}},
        )
        c.until(
            lambda: all(
                c.node_states("stack-mps").get(n, {}).get("state") == "Blocked" for n in nodes
            ),
            60,
            "both nodes Blocked",
        )
        for node in nodes:
            blocking = c.gpu_report(node).gpus[0].blocking_pods
            assert blocking and all(b.startswith(f"{namespace}/mps-") for b in blocking), blocking
            assert c.capacity(node, SHARED) == 4 and c.capacity(node, MIG_3G) == 0

        # Pods gone: MIG is enabled (Pending until the simulated reset), then the layout applied.
        c.core.delete_collection_namespaced_pod(namespace, grace_period_seconds=0)
        c.until(lambda: not c.pods(namespace), 60, "pods deleted")
        c.until(
            lambda: all(
                c.node_states("stack-mps").get(n, {}).get("state") == "Applied" for n in nodes
            ),
            90,
            "both nodes Applied with 3g.40gb x2",
        )
        c.until(
            lambda: all(c.capacity(n, MIG_3G) == 2 and c.capacity(n, SHARED) == 0 for n in nodes),
            30,
            "2 x 3g.40gb advertised per node",
        )
        agents = [p for p in stack.processes if p.name in {f"node-{n}" for n in nodes}]
        assert all("Reset simulated GPU" in p.log.read_text() for p in agents)
    finally:
        remove(stack, "stack-mps", nodes)


def burst_pod(
    name: str, scenario: str, shape: int, n: int
) -> tuple[dict[str, Any], dict[str, int]]:
    """A shared-GPU pod of one of three shapes, with limits no other pod of the burst has.

    shape 0: one container; 1: two app containers; 2: an init container and an app container.
    Returns the pod and each container's memory limit (MiB).
    """
    names = [["main"], ["serve", "proxy"], ["fetch", "serve"]][shape]
    memory = {c: 3000 + 100 * n + 7 * i for i, c in enumerate(names)}
    containers = [
        {
            "name": c,
            "image": "gpupart/cuda:0",
            "resources": {"limits": {SHARED: "1", MEMORY: str(memory[c]), COMPUTE: str(5 + i)}},
        }
        for i, c in enumerate(names)
    ]
    manifest = pod(name, scenario, {})
    manifest["spec"]["containers"] = containers[1:] if shape == 2 else containers
    if shape == 2:
        # The fake runtime lets it finish, so the kubelet goes on to the app container.
        containers[0]["env"] = [{"name": EXIT_ENV, "value": "0"}]
        manifest["spec"]["initContainers"] = containers[:1]
    return manifest, memory


@pytest.mark.parametrize("mode", ["MPS", "TimeSlicing"])
def test_a_burst_of_shared_pods_each_container_gets_its_own_pods_gpu_and_limits(
    stack: Stack, namespace: str, mode: str
) -> None:
    c = Cluster(stack)
    scenario = f"burst-{mode.lower()}"
    (node,) = nodes_for(stack, scenario, A100, "2xA100-SXM4-80GB:mig-off", 1, auto_reset=True)
    spec: dict[str, Any] = (
        {"mode": "MPS", "mps": {"maxClients": 8}}
        if mode == "MPS"
        else {"mode": "TimeSlicing", "timeSlicing": {"replicas": 8}}
    )
    name = f"stack-{scenario}"
    c.custom.create_cluster_custom_object(GROUP, VERSION, PLURAL, partition(name, scenario, spec))
    try:
        c.until(lambda: c.capacity(node, SHARED) == 16, 90, "16 client slots")
        # The agent publishes its inventory just after the plugins list the slots.
        inventory = c.until(
            lambda: [g for g in c.inventory(node) if g.replicas == 8], 30, "the inventory"
        )
        gpu_memory = {g.uuid: g.memory_mib for g in inventory}
        # Ten pods of three shapes created at once: most share a creation second, and the
        # kubelet (here its fake) admits them in its own order.
        limits = {}
        for n in range(10):
            manifest, limits[f"b-{n}"] = burst_pod(f"b-{n}", scenario, n % 3, n)
            c.core.create_namespaced_pod(namespace, manifest)
        c.until(
            lambda: all(
                set(c.allocated(namespace, p) or ()) == set(limits[p]) or p in c.rejected(namespace)
                for p in limits
            ),
            120,
            "every container of the burst created",
        )
        assert not c.rejected(namespace), c.rejected(namespace)
        per_gpu: dict[str, int] = {}
        for p, memory in limits.items():
            placed = c.pods(namespace)[p]
            assignment = decode_assignment(placed.metadata.annotations[ASSIGNMENT_ANNOTATION])
            got = c.allocated(namespace, p) or {}
            assert set(got) == set(memory), (p, got)
            record = decode_allocation(
                str(allocation_record(c.core.api_client.sanitize_for_serialization(placed)))
            )
            assert {g.name for g in record} == set(memory)
            for container, env in got.items():
                assert env["NVIDIA_VISIBLE_DEVICES"] == assignment.gpu_uuid, (p, container)
                if mode == "MPS":
                    limit = f"{assignment.gpu_uuid}={memory[container]}M"
                    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == limit, (p, container)
                    compute = str(5 + list(memory).index(container))
                    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == compute, (p, container)
                else:
                    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in env, (p, container)
            init = {i.name for i in placed.spec.init_containers or []}
            running = sum(m for k, m in memory.items() if k not in init)
            per_gpu[assignment.gpu_uuid] = per_gpu.get(assignment.gpu_uuid, 0) + running
        # What runs at once on a GPU (app containers) never exceeds it.
        assert all(per_gpu[g] <= gpu_memory[g] for g in per_gpu), per_gpu
    finally:
        c.core.delete_collection_namespaced_pod(namespace, grace_period_seconds=0)
        c.until(lambda: not c.pods(namespace), 60, "pods deleted")
        remove(stack, name, [node])
