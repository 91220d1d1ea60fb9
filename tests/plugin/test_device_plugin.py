"""Device plugin over real gRPC with a fake kubelet: Register, ListAndWatch, Allocate, preferences, health, restarts."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import grpc
import pytest
from plugin_fakes import FakeKubelet

from gpupart.core.api.pods import SharedContainer
from gpupart.core.api.spec import GpuConfig, Mode, MpsSettings
from gpupart.core.api.wire import (
    DesiredGroup,
    GivenContainer,
    GpuState,
    MigPlan,
    PlannedGpu,
    PlanReport,
    PodAssignment,
    decode_inventory,
    decode_report,
    encode_desired,
    encode_mig_plan,
)
from gpupart.core.mig.layout import MigInstance, Placement
from gpupart.core.node.admission import SharedPod
from gpupart_plugin.actuator import Actuator
from gpupart_plugin.agent import NodeAgent
from gpupart_plugin.annotations import NodeAnnotations
from gpupart_plugin.checkpoint import Checkpoint
from gpupart_plugin.deviceplugin.allocator import Allocator
from gpupart_plugin.deviceplugin.api import deviceplugin_pb2 as api
from gpupart_plugin.deviceplugin.hub import DeviceHub
from gpupart_plugin.deviceplugin.registration import DevicePlugins, socket_name
from gpupart_plugin.deviceplugin.sink import DevicePluginSink
from gpupart_plugin.health import HealthMonitor
from gpupart_plugin.kube import KubeUnavailable
from gpupart_plugin.metrics import NodeMetrics, serve_http
from gpupart_plugin.mps import MpsDaemons
from gpupart_plugin.simgpu import SimulatedGpus

H200 = "H200-141GB"
MIG_1G = "nvidia.com/mig-1g.18gb"
MIG_3G = "nvidia.com/mig-3g.71gb"


@dataclass
class Node:
    sim: SimulatedGpus
    hub: DeviceHub
    plugins: DevicePlugins
    agent: NodeAgent
    kubelet: FakeKubelet
    pods: list[SharedPod]
    recorded: dict[str, tuple[GivenContainer, ...]]
    """The allocation records written, by pod uid."""
    published: list[tuple[str, str]]

    def apply(self, *groups: DesiredGroup) -> None:
        self.agent.reconcile(encode_desired(groups))


@pytest.fixture
def node(kubelet: FakeKubelet, tmp_path: Path, mps_command: list[str]) -> Iterator[Node]:
    sim = SimulatedGpus([H200, H200], mode_change_needs_reset=False)
    hub, metrics, pods = DeviceHub(), NodeMetrics(), []

    recorded: dict[str, tuple[GivenContainer, ...]] = {}

    def record(pod: SharedPod, given: tuple[GivenContainer, ...]) -> None:
        recorded[pod.uid] = given

    allocator = Allocator(
        hub, "node-a", lambda: tuple(pods), record, Checkpoint(tmp_path / "state", "node-a")
    )
    plugins = DevicePlugins(
        hub,
        allocator,
        metrics,
        plugin_dir=kubelet.directory,
        kubelet_socket=kubelet.socket,
        poll_s=0.05,
    )
    published: list[tuple[str, str]] = []
    actuator = Actuator(sim, lambda: (), MpsDaemons(tmp_path / "mps", mps_command))
    publish = NodeAnnotations(lambda s, i, _c: published.append((s, i)))
    agent = NodeAgent(actuator, (DevicePluginSink(hub, plugins, metrics), publish), metrics)
    yield Node(sim, hub, plugins, agent, kubelet, pods, recorded, published)
    plugins.stop()


def mig(counts: dict[str, int], gpus: tuple[int, ...] | None = None) -> DesiredGroup:
    return DesiredGroup("p", 1, gpus, GpuConfig(Mode.MIG, tuple(counts.items())))


def test_registers_each_resource_and_lists_its_devices(node: Node) -> None:
    node.apply(mig({"1g.18gb": 4, "3g.71gb": 1}))
    assert node.kubelet.registered() == {MIG_1G, MIG_3G}
    listed = node.kubelet.latest(MIG_1G)
    assert len(listed) == 8 and all(h == "Healthy" for _, h in listed)
    assert node.kubelet.options[MIG_1G].get_preferred_allocation_available
    state = decode_report(node.published[-1][0])
    assert [g.state.value for g in state.gpus] == ["Applied", "Applied"]
    inventory = decode_inventory(node.published[-1][1])
    assert sum(len(g.mig_devices) for g in inventory.gpus) == 10
    assert inventory.serial_admission  # its shared Allocates are paired one pod at a time


def test_allocate_mig_returns_uuid_device_nodes_and_cdi(node: Node) -> None:
    node.apply(mig({"3g.71gb": 2}))
    node.kubelet.registered()
    listed = node.kubelet.latest(MIG_3G)
    device = listed[0][0]
    stub = node.kubelet.stubs[MIG_3G]
    request = api.AllocateRequest(
        container_requests=[api.ContainerAllocateRequest(devices_ids=[device])]
    )
    response = stub.Allocate(request, timeout=5).container_responses[0]
    assert response.envs["NVIDIA_VISIBLE_DEVICES"] == device
    paths = {d.container_path for d in response.devices}
    assert "/dev/nvidiactl" in paths and "/dev/nvidia0" in paths
    assert any(p.startswith("/dev/nvidia-caps/nvidia-cap") for p in paths)
    assert [c.name for c in response.cdi_devices] == [f"nvidia.com/gpu={device}"]


def test_allocate_refuses_unknown_devices_with_a_message(node: Node) -> None:
    node.apply(mig({"3g.71gb": 2}))
    node.kubelet.registered()
    node.kubelet.latest(MIG_3G)
    stub = node.kubelet.stubs[MIG_3G]
    request = api.AllocateRequest(
        container_requests=[api.ContainerAllocateRequest(devices_ids=["MIG-nope"])]
    )
    with pytest.raises(grpc.RpcError) as error:
        stub.Allocate(request, timeout=5)
    assert error.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "MIG-nope" in (error.value.details() or "")


def test_preferred_allocation_keeps_a_container_on_one_gpu(node: Node) -> None:
    node.apply(DesiredGroup("t", 1, None, GpuConfig(Mode.TIME_SLICING, replicas=4)))
    node.kubelet.registered()
    ids = [i for i, _ in node.kubelet.latest("nvidia.com/gpu.shared")]
    assert len(ids) == 8
    second_gpu = [i for i in ids if i.startswith(node.sim.gpus()[1].uuid)]
    request = api.PreferredAllocationRequest(
        container_requests=[
            api.ContainerPreferredAllocationRequest(
                available_deviceIDs=ids, must_include_deviceIDs=second_gpu[:1], allocation_size=3
            )
        ]
    )
    stub = node.kubelet.stubs["nvidia.com/gpu.shared"]
    chosen = stub.GetPreferredAllocation(request, timeout=5).container_responses[0].deviceIDs
    assert len(chosen) == 3 and set(chosen) <= set(second_gpu)


def test_relayout_registers_new_profiles_and_withdraws_old(node: Node) -> None:
    node.apply(mig({"1g.18gb": 7}))
    assert node.kubelet.registered() == {MIG_1G}
    node.kubelet.latest(MIG_1G)
    node.apply(mig({"3g.71gb": 2}))
    assert node.kubelet.registered() == {MIG_3G}
    assert node.kubelet.wait_for(MIG_1G, lambda listed: listed == []) == []
    assert len(node.kubelet.latest(MIG_3G)) == 4


def test_a_plan_creating_a_new_profile_registers_it_and_keeps_the_other_servers(
    node: Node,
) -> None:
    dynamic = DesiredGroup("d", 1, (1,), GpuConfig(Mode.MIG, (), dynamic=True))
    desired = encode_desired((mig({"1g.18gb": 7}, (0,)), dynamic))
    node.agent.reconcile(desired)
    assert node.kubelet.registered() == {MIG_1G}
    assert len(node.kubelet.latest(MIG_1G)) == 7
    socket = node.kubelet.directory / socket_name(MIG_1G)
    served = socket.stat().st_ino
    layout = (MigInstance(Placement(0, 4), "3g.71gb"), MigInstance(Placement(6, 1), "1g.18gb"))
    node.agent.reconcile(desired, encode_mig_plan(MigPlan("p1", (PlannedGpu(1, layout),))))
    assert decode_report(node.published[-1][0]).plan == PlanReport("p1", GpuState.APPLIED)
    assert node.kubelet.registered() == {MIG_3G}, "only the new resource registers"
    assert len(node.kubelet.wait_for(MIG_1G, lambda listed: len(listed) == 8)) == 8
    assert len(node.kubelet.latest(MIG_3G)) == 1
    assert socket.stat().st_ino == served, "the 1g.18gb server kept its socket"


def test_kubelet_restart_makes_the_plugin_register_again(node: Node) -> None:
    node.apply(mig({"1g.18gb": 7}))
    assert node.kubelet.registered() == {MIG_1G}
    node.kubelet.restart()
    assert node.plugins.check_kubelet()
    assert node.kubelet.registered() == {MIG_1G}
    assert (node.kubelet.directory / "gpupart-nvidia.com_mig-1g.18gb.sock").exists()
    assert len(node.kubelet.latest(MIG_1G)) == 14


def test_xid_marks_only_its_instance_unhealthy_and_recovery_brings_it_back(node: Node) -> None:
    node.apply(mig({"1g.18gb": 7}, (0,)), mig({"3g.71gb": 2}, (1,)))
    node.kubelet.registered()
    listed = node.kubelet.latest(MIG_1G)
    now = [0.0]
    monitor = HealthMonitor(node.sim, node.hub, quiet_s=10, clock=lambda: now[0])
    victim = next(d for d in node.hub.all_devices() if d.mig and d.gpu.index == 0)
    assert victim.mig is not None
    node.sim.inject_xid(0, 13, victim.mig.gpu_instance_id)  # application error: ignored
    assert not monitor.step(0.2)
    node.sim.inject_xid(0, 79, victim.mig.gpu_instance_id)
    assert monitor.step(0.2)
    sick = node.kubelet.wait_for(MIG_1G, lambda listed: any(h == "Unhealthy" for _, h in listed))
    assert [i for i, h in sick if h == "Unhealthy"] == [victim.id]
    assert all(h == "Healthy" for _, h in node.kubelet.latest(MIG_3G))
    now[0] = 5
    assert not monitor.step(0.01)  # quiet period not over
    now[0] = 11
    assert monitor.step(0.01)
    back = node.kubelet.wait_for(MIG_1G, lambda listed: all(h == "Healthy" for _, h in listed))
    assert len(back) == len(listed)


def test_lost_gpu_goes_unhealthy_until_it_answers_again(node: Node) -> None:
    node.apply(mig({"3g.71gb": 2}))
    node.kubelet.registered()
    monitor = HealthMonitor(node.sim, node.hub, quiet_s=0)
    node.sim.set_lost(1, True)
    assert monitor.step(0.01)
    gpu1 = node.sim.gpus()[1].uuid
    bad = {d.id for d in node.hub.all_devices() if d.gpu.uuid == gpu1}
    assert node.hub.unhealthy == bad
    node.sim.set_lost(1, False)
    assert monitor.step(0.01)
    assert node.hub.unhealthy == frozenset()


def _assigned(uid: str, gpu_uuid: str, memory: int, compute: int) -> SharedPod:
    return SharedPod(
        uid,
        "ml",
        f"pod-{uid}",
        "node-a",
        PodAssignment("node-a", 0, gpu_uuid, memory, compute, pod_uid=uid),
        (SharedContainer("main", 1, memory, compute),),
    )


def test_shared_allocate_uses_the_assigned_gpu_and_its_mps_limits(node: Node) -> None:
    node.apply(DesiredGroup("s", 1, None, GpuConfig(Mode.MPS, mps=MpsSettings(), replicas=4)))
    node.kubelet.registered()
    stub = node.kubelet.stubs["nvidia.com/gpu.shared"]
    gpu0, gpu1 = (g.uuid for g in node.sim.gpus())
    ids = [i for i, _ in node.kubelet.latest("nvidia.com/gpu.shared") if i.startswith(gpu1)]
    request = api.AllocateRequest(
        container_requests=[api.ContainerAllocateRequest(devices_ids=ids[:1])]
    )
    with pytest.raises(grpc.RpcError) as refused:
        stub.Allocate(request, timeout=5)
    assert "awaits" in (refused.value.details() or "")
    node.pods.append(_assigned("1", gpu1, 10240, 20))
    elsewhere = api.AllocateRequest(
        container_requests=[api.ContainerAllocateRequest(devices_ids=[f"{gpu0}::0"])]
    )
    with pytest.raises(grpc.RpcError) as wrong:  # slots of another GPU than the assigned one
        stub.Allocate(elsewhere, timeout=5)
    assert f"assigned GPU {gpu1}, the kubelet allocated slots of GPU {gpu0}" in (
        wrong.value.details() or ""
    )
    response = stub.Allocate(request, timeout=5).container_responses[0]
    assert response.envs["NVIDIA_VISIBLE_DEVICES"] == gpu1
    assert response.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"{gpu1}=10240M"
    assert response.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "20"
    assert response.envs["CUDA_MPS_PIPE_DIRECTORY"] == "/var/run/gpupart/mps"
    mounts = {m.container_path: m.host_path for m in response.mounts}
    assert mounts["/var/run/gpupart/mps"].endswith(f"{gpu1}/pipe")
    assert "/dev/shm" in mounts
    # What it gave is recorded on the pod; the same devices again get the same answer.
    assert node.recorded["1"] == (GivenContainer("main", tuple(ids[:1]), gpu1, 10240, 20),)
    again = stub.Allocate(request, timeout=5).container_responses[0]
    assert again.envs == response.envs
    other = api.AllocateRequest(
        container_requests=[api.ContainerAllocateRequest(devices_ids=ids[1:2])]
    )
    with pytest.raises(grpc.RpcError) as served:  # the only assigned pod was served already
        stub.Allocate(other, timeout=5)
    assert "awaits" in (served.value.details() or "")


def test_shared_allocate_serves_running_pods_across_a_plugin_restart(node: Node) -> None:
    node.apply(DesiredGroup("s", 1, None, GpuConfig(Mode.MPS, mps=MpsSettings(), replicas=4)))
    gpu0, gpu1 = (g.uuid for g in node.sim.gpus())
    # Reported Running before its Allocate (kwok does so at once).
    node.pods.append(replace(_assigned("1", gpu0, 8192, 20), phase="Running"))
    first = node.plugins.allocator.allocate("nvidia.com/gpu.shared", [f"{gpu0}::0"])
    assert dict(first.envs)["NVIDIA_VISIBLE_DEVICES"] == gpu0
    node.pods.append(_assigned("2", gpu1, 4096, 10))

    # A new plugin process reads its checkpoint back: pod-1 was served.
    restarted = Allocator(
        node.hub,
        "node-a",
        lambda: tuple(node.pods),
        node.plugins.allocator.record,
        Checkpoint(node.plugins.allocator.checkpoint.path.parent, "node-a"),
    )
    assert restarted.preferred("nvidia.com/gpu.shared", [f"{gpu0}::1", f"{gpu1}::1"], [], 1) == (
        f"{gpu1}::1",  # pod-2 awaits: its assigned GPU first
    )
    second = restarted.allocate("nvidia.com/gpu.shared", [f"{gpu1}::1"])
    assert dict(second.envs)["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"{gpu1}=4096M"


def test_shared_allocate_fails_when_the_record_cannot_be_written(node: Node) -> None:
    node.apply(DesiredGroup("s", 1, None, GpuConfig(Mode.MPS, mps=MpsSettings(), replicas=4)))
    gpu0 = node.sim.gpus()[0].uuid
    node.pods.append(_assigned("1", gpu0, 8192, 20))

    def down(_pod: SharedPod, _given: tuple[GivenContainer, ...]) -> None:
        raise KubeUnavailable("record the allocation of pod ml/pod-1: 503 Service Unavailable")

    checkpoint = node.plugins.allocator.checkpoint
    blind = Allocator(node.hub, "node-a", lambda: tuple(node.pods), down, checkpoint)
    with pytest.raises(KubeUnavailable, match="503"):
        blind.allocate("nvidia.com/gpu.shared", [f"{gpu0}::0"])
    # Nothing given, nothing kept: the pod still awaits, in this process and the next.
    assert "1" not in node.recorded and Checkpoint(checkpoint.path.parent, "node-a").records == {}


def test_metrics_and_healthz(node: Node) -> None:
    node.apply(mig({"1g.18gb": 7}))
    server = serve_http(node.agent.metrics, lambda: True, host="127.0.0.1", port=0)
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        text = urllib.request.urlopen(f"{base}/metrics", timeout=5).read().decode()
        assert (
            'gpupart_node_devices{health="Healthy",resource="nvidia.com/mig-1g.18gb"} 14.0' in text
        )
        assert "gpupart_node_apply_seconds_count 1.0" in text
        assert urllib.request.urlopen(f"{base}/healthz", timeout=5).read() == b"ok"
    finally:
        server.shutdown()
