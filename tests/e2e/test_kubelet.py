"""The device plugin against the real kubelet: registration, Allocate at admission, restarts, PodResources.

Real etcd, kube-apiserver, kube-scheduler (gpupart-scheduler profile), `gpupart operator`,
`gpupart extender`, and per node a real kubelet v1.36 with the fake CRI runtime in its own mount
namespace (tests/support/kubelet.py) and `gpupart node --simulate` serving it. What a container
got is read where the kubelet put it: the runtime's record of each CreateContainer.

We test these aspects:
- registration: every resource of a partition in the Node's capacity and allocatable;
- Allocate at admission for MIG, whole GPUs, MPS and time-slicing: env, device nodes, mounts and
  CDI names as the runtime received them, for pods with two GPU containers and with an init
  container and an app container (the kubelet allocates both, the app reusing the init's);
- GetPreferredAllocation honoured: shared slots come from the GPU the extender assigned;
- an over-request refused by the kubelet itself;
- a kubelet restart: running pods keep their devices, no second Allocate, resources back;
- PodResources from the real kubelet blocks a repartition while a pod holds a MIG device, and the
  change goes ahead soon after the pod is deleted (the agent's pod watch, not its 60 s resync);
- a MIG plan written on the Node of a dynamic partition: its instance is created and registered
  at run time, a pod runs on it, the inventory marks it used, and free again once the pod left;
- with a kubelet whose node-status sync is 60 s, the new instance is in the Node's allocatable
  well before that sync, written by the node agent once the kubelet holds it, and a pod on it is
  admitted by the kubelet.
"""

from __future__ import annotations

import contextlib
import time
import urllib.request
from typing import Any

import pytest
from kubernetes import client

from gpupart.core.api.wire import (
    ASSIGNMENT_ANNOTATION,
    DESIRED_ANNOTATION,
    MIG_PLAN_ANNOTATION,
    STATE_ANNOTATION,
    GpuState,
    MigPlan,
    PlannedGpu,
    PlanReport,
    allocation_record,
    decode_allocation,
    decode_assignment,
    decode_inventory,
    decode_report,
    encode_mig_plan,
)
from gpupart.core.mig.layout import MigInstance, Placement
from gpupart_testsupport.kubelet import EXIT_ENV, KubeletNode
from gpupart_testsupport.polling import wait_for
from gpupart_testsupport.stack import Stack

pytestmark = pytest.mark.e2e

GROUP, VERSION, PLURAL = "gpupart.io", "v1alpha1", "gpupartitions"
LABEL = "gpupart.io/e2e-kubelet"
A100 = "NVIDIA-A100-SXM4-80GB"
SHARED, MEMORY, COMPUTE = "nvidia.com/gpu.shared", "gpupart.io/gpu-memory", "gpupart.io/gpu-compute"
MIG_1G, MIG_2G, MIG_3G = (f"nvidia.com/mig-{p}" for p in ("1g.10gb", "2g.20gb", "3g.40gb"))
CONTROL = {"/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"}


class Node:
    """One real-kubelet node with a partition, and the reads the tests make."""

    def __init__(
        self,
        stack: Stack,
        scenario: str,
        gpus: str,
        spec: dict[str, Any],
        *,
        node_status_s: int = 2,
    ) -> None:
        self.stack = stack
        self.name = f"real-{scenario}"
        self.scenario = scenario
        self.core = client.CoreV1Api(stack.api_client)
        self.custom = client.CustomObjectsApi(stack.api_client)
        labels = {LABEL: scenario, "nvidia.com/gpu.product": A100}
        self.real: KubeletNode = stack.start_real_node(
            self.name, gpus, labels, auto_reset=True, node_status_s=node_status_s
        )
        self.partition = f"kubelet-{scenario}"
        body = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "GpuPartition",
            "metadata": {"name": self.partition},
            "spec": {"nodeSelector": {"matchLabels": {LABEL: scenario}}, **spec},
        }
        self.custom.create_cluster_custom_object(GROUP, VERSION, PLURAL, body)

    def allocatable(self, resource: str) -> int:
        try:
            node = self.core.read_node(self.name)
        except client.ApiException:
            return -1
        return int((node.status.allocatable or {}).get(resource, "0"))

    def until(self, check: Any, timeout: float, what: str) -> Any:
        try:
            return wait_for(check, timeout, what, interval=0.2)
        except TimeoutError as error:
            raise AssertionError(f"{error}\n{self.stack.tails()}") from None

    def inventory(self) -> dict[str, Any]:
        """MIG device or GPU UUID -> what it is (profile, or the GPU's index)."""
        text = (self.core.read_node(self.name).metadata.annotations or {})["gpupart.io/inventory"]
        found: dict[str, Any] = {}
        for gpu in decode_inventory(text).gpus:
            found[gpu.uuid] = gpu.index
            found.update({d.uuid: d.instance.profile for d in gpu.mig_devices})
        return found

    def pod(
        self,
        namespace: str,
        name: str,
        containers: list[dict[str, str]],
        init: list[dict[str, str]] | None = None,
    ) -> str:
        """Create a pod whose containers ask for these limits; init containers exit at once."""

        def container(n: int, limits: dict[str, str], exits: bool) -> dict[str, Any]:
            c: dict[str, Any] = {
                "name": f"{'init' if exits else 'app'}-{n}",
                "image": "gpupart/cuda:0",
                "resources": {"limits": limits},
            }
            if exits:
                c["env"] = [{"name": EXIT_ENV, "value": "0"}]
            return c

        spec: dict[str, Any] = {
            "schedulerName": "gpupart-scheduler",
            "nodeSelector": {LABEL: self.scenario},
            "terminationGracePeriodSeconds": 0,
            "containers": [container(n, c, False) for n, c in enumerate(containers)],
        }
        if init:
            spec["initContainers"] = [container(n, c, True) for n, c in enumerate(init)]
        self.core.create_namespaced_pod(
            namespace, {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}
        )
        return name

    def running(self, namespace: str, *names: str) -> None:
        def phases() -> bool:
            pods = {p.metadata.name: p for p in self.core.list_namespaced_pod(namespace).items}
            return all(n in pods and pods[n].status.phase == "Running" for n in names)

        self.until(phases, 90, f"{', '.join(names)} Running on {self.name}")

    def env(self, namespace: str, pod: str, container: str) -> dict[str, Any]:
        created = self.real.container(namespace, pod, container)
        assert created is not None, f"{pod}/{container} was never created"
        return created

    def until_dynamic(self) -> None:
        """Until the agent ran a first pass of a dynamic partition: no MIG instance yet."""

        def annotations() -> dict[str, str]:
            return self.core.read_node(self.name).metadata.annotations or {}

        self.until(
            lambda: '"dynamic":true' in annotations().get(DESIRED_ANNOTATION, ""),
            60,
            "the operator's desired annotation with dynamic: true",
        )
        self.until(lambda: STATE_ANNOTATION in annotations(), 60, "a first pass")
        assert self.allocatable(MIG_3G) <= 0, "no instance before a plan"

    def allocations_total(self) -> float:
        url = f"http://127.0.0.1:{self.real.agent_metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("gpupart_node_allocations_total{")
        )

    def remove(self) -> None:
        with contextlib.suppress(client.ApiException):
            self.custom.delete_cluster_custom_object(GROUP, VERSION, PLURAL, self.partition)

        def gone() -> bool:
            try:
                self.custom.get_cluster_custom_object(GROUP, VERSION, PLURAL, self.partition)
            except client.ApiException as error:
                return error.status == 404
            return False

        with contextlib.suppress(AssertionError):
            self.until(gone, 60, f"GpuPartition {self.partition} deleted")
        with contextlib.suppress(client.ApiException):
            patch = {"metadata": {"finalizers": None}}
            self.custom.patch_cluster_custom_object(GROUP, VERSION, PLURAL, self.partition, patch)


MIG_SPEC = {"mode": "MIG", "mig": {"devices": {"1g.10gb": 2, "2g.20gb": 1, "3g.40gb": 1}}}


def test_mig_registration_and_allocate_for_two_containers_and_init_plus_app(
    stack: Stack, namespace: str
) -> None:
    node = Node(stack, "mig", "A100-SXM4-80GB", MIG_SPEC)
    try:
        node.until(
            lambda: [node.allocatable(r) for r in (MIG_1G, MIG_2G, MIG_3G)] == [2, 1, 1],
            90,
            "2 x 1g.10gb, 2g.20gb and 3g.40gb in the Node's allocatable",
        )
        node.pod(namespace, "two", [{MIG_1G: "1"}, {MIG_2G: "1"}])
        node.pod(namespace, "staged", [{MIG_3G: "1"}], init=[{MIG_3G: "1"}])
        node.running(namespace, "two", "staged")
        inventory = node.inventory()
        for container, profile in (("app-0", "1g.10gb"), ("app-1", "2g.20gb")):
            got = node.env(namespace, "two", container)
            uuid_ = got["env"]["NVIDIA_VISIBLE_DEVICES"]
            assert inventory.get(uuid_) == profile, (container, got)
            assert set(got["devices"]) >= CONTROL and "/dev/nvidia0" in got["devices"], got
            assert any(d.startswith("/dev/nvidia-caps/nvidia-cap") for d in got["devices"]), got
            assert got["cdiDevices"] == [f"nvidia.com/gpu={uuid_}"], got
        init, app = (node.env(namespace, "staged", c)["env"] for c in ("init-0", "app-0"))
        assert inventory.get(app["NVIDIA_VISIBLE_DEVICES"]) == "3g.40gb"
        assert init["NVIDIA_VISIBLE_DEVICES"] == app["NVIDIA_VISIBLE_DEVICES"]  # reused

        # Asked past what is left: the kubelet refuses it at admission (no scheduler involved).
        node.core.create_namespaced_pod(
            namespace,
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "greedy"},
                "spec": {
                    "nodeName": node.name,
                    "containers": [
                        {"name": "main", "image": "x", "resources": {"limits": {MIG_1G: "2"}}}
                    ],
                },
            },
        )
        failed = node.until(
            lambda: (
                (p := node.core.read_namespaced_pod("greedy", namespace)).status.phase == "Failed"
                and p
            ),
            60,
            "the over-request Failed",
        )
        assert failed.status.reason in (f"OutOf{MIG_1G}", "UnexpectedAdmissionError"), failed.status
        assert node.real.container(namespace, "greedy", "main") is None
    finally:
        node.remove()


@pytest.mark.parametrize("mode", ["MPS", "TimeSlicing"])
def test_shared_pods_get_their_own_gpu_and_limits_through_the_real_kubelet(
    stack: Stack, namespace: str, mode: str
) -> None:
    spec: dict[str, Any] = (
        {"mode": "MPS", "mps": {"maxClients": 8}}
        if mode == "MPS"
        else {"mode": "TimeSlicing", "timeSlicing": {"replicas": 8}}
    )
    node = Node(stack, f"shared-{mode.lower()}", "2xA100-SXM4-80GB:mig-off", spec)
    try:
        node.until(lambda: node.allocatable(SHARED) == 16, 90, "16 client slots")
        # Nine pods at once, three shapes, every container with limits of its own.
        wanted: dict[str, dict[str, tuple[int, int]]] = {}
        for n in range(9):
            first, second = (
                {SHARED: "1", MEMORY: str(3000 + 100 * n + i), COMPUTE: str(5 + i)}
                for i in range(2)
            )
            name, shape = f"s-{n}", n % 3
            if shape == 0:
                node.pod(namespace, name, [first])
                given = {"app-0": first}
            elif shape == 1:
                node.pod(namespace, name, [first, second])
                given = {"app-0": first, "app-1": second}
            else:
                node.pod(namespace, name, [second], init=[first])
                given = {"init-0": first, "app-0": second}
            wanted[name] = {k: (int(v[MEMORY]), int(v[COMPUTE])) for k, v in given.items()}
        node.running(namespace, *wanted)
        for name, containers in wanted.items():
            pod = node.core.read_namespaced_pod(name, namespace)
            gpu = decode_assignment(pod.metadata.annotations[ASSIGNMENT_ANNOTATION]).gpu_uuid
            record = {
                g.name: g
                for g in decode_allocation(
                    str(allocation_record(node.core.api_client.sanitize_for_serialization(pod)))
                )
            }
            assert set(record) == set(containers), (name, record)
            for container, (memory, compute) in containers.items():
                got = node.env(namespace, name, container)
                env = got["env"]
                assert env["NVIDIA_VISIBLE_DEVICES"] == gpu, (name, container, env)
                assert got["cdiDevices"] == [f"nvidia.com/gpu={gpu}"]
                # GetPreferredAllocation honoured: the kubelet took slots of the assigned GPU.
                assert all(d.startswith(f"{gpu}::") for d in record[container].devices)
                if mode == "MPS":
                    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"{gpu}={memory}M"
                    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == str(compute)
                    mounts = {m["containerPath"]: m["hostPath"] for m in got["mounts"]}
                    assert mounts["/var/run/gpupart/mps"].endswith(f"{gpu}/pipe"), mounts
                else:
                    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in env
    finally:
        node.core.delete_collection_namespaced_pod(namespace, grace_period_seconds=0)
        node.remove()


def test_whole_gpus_for_two_containers_and_init_plus_app(stack: Stack, namespace: str) -> None:
    node = Node(stack, "whole", "2xA100-SXM4-80GB:mig-off", {"mode": "None"})
    try:
        node.until(lambda: node.allocatable("nvidia.com/gpu") == 2, 90, "2 whole GPUs")
        node.pod(namespace, "pair", [{"nvidia.com/gpu": "1"}, {"nvidia.com/gpu": "1"}])
        node.running(namespace, "pair")
        gpus = {
            node.env(namespace, "pair", c)["env"]["NVIDIA_VISIBLE_DEVICES"]
            for c in ("app-0", "app-1")
        }
        assert len(gpus) == 2 and all(isinstance(node.inventory()[g], int) for g in gpus)
        node.core.delete_namespaced_pod("pair", namespace, grace_period_seconds=0)
        node.until(lambda: not node.core.list_namespaced_pod(namespace).items, 60, "pair gone")
        node.pod(namespace, "staged", [{"nvidia.com/gpu": "2"}], init=[{"nvidia.com/gpu": "1"}])
        node.running(namespace, "staged")
        init = node.env(namespace, "staged", "init-0")["env"]["NVIDIA_VISIBLE_DEVICES"]
        app = node.env(namespace, "staged", "app-0")["env"]["NVIDIA_VISIBLE_DEVICES"].split(",")
        assert len(app) == 2 and init in app  # the app container reuses the init's GPU
    finally:
        node.core.delete_collection_namespaced_pod(namespace, grace_period_seconds=0)
        node.remove()


def test_kubelet_restart_keeps_devices_and_registers_again(stack: Stack, namespace: str) -> None:
    node = Node(stack, "restart", "A100-SXM4-80GB", MIG_SPEC)
    try:
        node.until(lambda: node.allocatable(MIG_3G) == 1, 90, "3g.40gb advertised")
        node.pod(namespace, "keeps", [{MIG_3G: "1"}])
        node.running(namespace, "keeps")
        before = node.env(namespace, "keeps", "app-0")["env"]["NVIDIA_VISIBLE_DEVICES"]
        created, allocations = len(node.real.created()), node.allocations_total()
        node.real.stop_kubelet()
        started = time.monotonic()
        node.real.start_kubelet()
        resources = {MIG_1G, MIG_2G, MIG_3G}
        node.until(lambda: node.real.registered() >= resources, 30, "plugins registered again")
        print(f"plugins registered {time.monotonic() - started:.2f} s after the kubelet started")
        node.until(
            lambda: [node.allocatable(r) for r in (MIG_1G, MIG_2G, MIG_3G)] == [2, 1, 1],
            60,
            "every resource in allocatable after the kubelet restart",
        )
        time.sleep(3)  # a kubelet that wanted to re-admit or re-create would have by now
        pod = node.core.read_namespaced_pod("keeps", namespace)
        assert pod.status.phase == "Running"
        assert len(node.real.created()) == created  # no container created again
        assert node.allocations_total() == allocations  # no second Allocate
        assert node.env(namespace, "keeps", "app-0")["env"]["NVIDIA_VISIBLE_DEVICES"] == before
    finally:
        node.core.delete_collection_namespaced_pod(namespace, grace_period_seconds=0)
        node.remove()


def test_pod_resources_block_a_repartition_until_the_pod_leaves(
    stack: Stack, namespace: str
) -> None:
    node = Node(
        stack, "blocked", "A100-SXM4-80GB", {"mode": "MIG", "mig": {"devices": {"3g.40gb": 2}}}
    )
    try:
        node.until(lambda: node.allocatable(MIG_3G) == 2, 90, "2 x 3g.40gb")
        node.pod(namespace, "holder", [{MIG_3G: "1"}])
        node.running(namespace, "holder")
        patch = {"spec": {"mig": {"devices": {"1g.10gb": 7, "3g.40gb": None}}}}  # merge patch
        node.custom.patch_cluster_custom_object(GROUP, VERSION, PLURAL, node.partition, patch)

        def report() -> Any:
            text = (node.core.read_node(node.name).metadata.annotations or {}).get(
                "gpupart.io/state"
            )
            return decode_report(text) if text else None

        blocked = node.until(
            lambda: (r := report()) is not None and r.gpus[0].state.value == "Blocked" and r,
            60,
            "the repartition Blocked by the pod holding a MIG device",
        )
        assert blocked.gpus[0].blocking_pods == (f"{namespace}/holder",), blocked
        node.core.delete_namespaced_pod("holder", namespace, grace_period_seconds=0)
        deleted = time.monotonic()
        # The agent's resync is 60 s here: converging well before it is the pod watch's work.
        node.until(lambda: node.allocatable(MIG_1G) == 7, 20, "7 x 1g.10gb after the pod left")
        print(f"converged {time.monotonic() - deleted:.2f} s after the blocking pod's deletion")
    finally:
        node.core.delete_collection_namespaced_pod(namespace, grace_period_seconds=0)
        node.remove()


def test_a_pod_waiting_for_shared_memory_runs_once_a_node_offers_it(
    stack: Stack, namespace: str
) -> None:
    """kube-scheduler requeues it on the Node's change (not after its 5-minute flush): the node
    agent advertises the extender-managed memory and compute in the Node's allocatable."""
    core = client.CoreV1Api(stack.api_client)
    limits = {SHARED: "1", MEMORY: "20000", COMPUTE: "25"}
    core.create_namespaced_pod(
        namespace,
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "early"},
            "spec": {
                "schedulerName": "gpupart-scheduler",
                "nodeSelector": {LABEL: "late"},
                "terminationGracePeriodSeconds": 0,
                "containers": [{"name": "main", "image": "x", "resources": {"limits": limits}}],
            },
        },
    )
    wait_for(
        lambda: any(
            c.type == "PodScheduled" and c.status == "False"
            for c in core.read_namespaced_pod("early", namespace).status.conditions or []
        ),
        60,
        "the pod found unschedulable",
    )
    node = Node(
        stack, "late", "2xA100-SXM4-80GB:mig-off", {"mode": "MPS", "mps": {"maxClients": 4}}
    )
    try:
        node.until(lambda: node.allocatable(MEMORY) == 2 * 81920, 90, "2 x 81920 MiB offered")
        assert node.allocatable("gpupart.io/gpu-compute") == 200
        node.running(namespace, "early")
        env = node.env(namespace, "early", "main")["env"]
        assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"].endswith("=20000M")
    finally:
        node.core.delete_collection_namespaced_pod(namespace, grace_period_seconds=0)
        node.remove()


def test_a_mig_plan_on_the_node_creates_its_instance_for_a_pod_through_the_real_kubelet(
    stack: Stack, namespace: str
) -> None:
    spec = {"mode": "MIG", "mig": {"dynamic": {"profiles": ["3g.40gb", "1g.10gb"]}}}
    node = Node(stack, "plan", "A100-SXM4-80GB", spec)

    def annotations() -> dict[str, str]:
        return node.core.read_node(node.name).metadata.annotations or {}

    def used() -> list[bool]:
        (gpu,) = decode_inventory(annotations()["gpupart.io/inventory"]).gpus
        return [d.used for d in gpu.mig_devices]

    def answered(plan_id: str) -> bool:
        text = annotations().get(STATE_ANNOTATION)
        return text is not None and decode_report(text).plan == PlanReport(
            plan_id, GpuState.APPLIED
        )

    try:
        node.until_dynamic()
        layout = (MigInstance(Placement(4, 4), "3g.40gb"),)

        def write(plan_id: str) -> None:
            plan = encode_mig_plan(MigPlan(plan_id, (PlannedGpu(0, layout),)))
            node.core.patch_node(
                node.name, {"metadata": {"annotations": {MIG_PLAN_ANNOTATION: plan}}}
            )

        write("e2e-1")
        node.until(lambda: answered("e2e-1"), 30, "plan e2e-1 Applied")
        node.until(lambda: node.allocatable(MIG_3G) == 1, 30, "3g.40gb registered at run time")
        assert used() == [False]
        node.pod(namespace, "planned", [{MIG_3G: "1"}])
        node.running(namespace, "planned")
        assert (
            node.inventory().get(
                node.env(namespace, "planned", "app-0")["env"]["NVIDIA_VISIBLE_DEVICES"]
            )
            == "3g.40gb"
        )
        write("e2e-2")  # as the operator does once the pod is bound: its reservation dropped
        node.until(lambda: answered("e2e-2") and used() == [True], 30, "the instance used")
        node.core.delete_namespaced_pod("planned", namespace, grace_period_seconds=0)
        # The agent's resync is 60 s here: the pod watch and its retry free it sooner.
        node.until(lambda: used() == [False], 20, "the instance free after the pod left")
    finally:
        node.core.delete_collection_namespaced_pod(namespace, grace_period_seconds=0)
        node.remove()


def test_a_planned_instance_is_allocatable_before_the_kubelets_node_status_sync(
    stack: Stack, namespace: str
) -> None:
    spec = {"mode": "MIG", "mig": {"dynamic": {"profiles": ["3g.40gb", "1g.10gb"]}}}
    node = Node(stack, "early", "A100-SXM4-80GB", spec, node_status_s=60)

    def owners(resource: str) -> set[str]:
        """Who last changed the resource's allocatable amount (the Node's managed fields)."""
        managed = node.core.read_node(node.name).metadata.managed_fields or []
        return {
            entry.manager
            for entry in managed
            if f"f:{resource}"
            in ((entry.fields_v1 or {}).get("f:status") or {}).get("f:allocatable", {})
        }

    try:
        node.until_dynamic()
        plan = encode_mig_plan(
            MigPlan("early-1", (PlannedGpu(0, (MigInstance(Placement(4, 4), "3g.40gb"),)),))
        )
        node.core.patch_node(node.name, {"metadata": {"annotations": {MIG_PLAN_ANNOTATION: plan}}})
        written = time.monotonic()
        # The kubelet writes device-plugin capacity only every 60 s here.
        node.until(lambda: node.allocatable(MIG_3G) == 1, 20, "3g.40gb allocatable")
        print(f"allocatable {time.monotonic() - written:.2f} s after the plan was written")
        # The agent changed it, not the kubelet (whose same value later changes nothing).
        assert "kubelet" not in owners(MIG_3G), owners(MIG_3G)
        assert owners(MIG_3G), "someone wrote it"
        node.pod(namespace, "early", [{MIG_3G: "1"}])
        node.running(namespace, "early")  # the kubelet admitted it on the device it holds
        pod = node.core.read_namespaced_pod("early", namespace)
        assert pod.status.reason != "UnexpectedAdmissionError", pod.status
        uuid_ = node.env(namespace, "early", "app-0")["env"]["NVIDIA_VISIBLE_DEVICES"]
        assert node.inventory().get(uuid_) == "3g.40gb"
    finally:
        node.core.delete_collection_namespaced_pod(namespace, grace_period_seconds=0)
        node.remove()
