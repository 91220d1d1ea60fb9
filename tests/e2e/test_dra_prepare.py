"""The DRA kubelet plugin over real gRPC unix sockets, claims and pods from the real kube-apiserver, simulated GPUs.

The test writes each claim's allocation and `reservedFor` as the scheduler would (status
subresource), then calls the plugin as the kubelet does. The real-kubelet runs (the fake
runtime resolving CDI IDs) are the test bed's.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import uuid
from collections.abc import Generator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
from kubernetes import client

from gpupart.core.api.spec import GpuConfig, Interface, Mode, MpsSettings
from gpupart.core.api.wire import (
    DESIRED_ANNOTATION,
    DesiredGroup,
    encode_desired,
)
from gpupart.core.dra import names
from gpupart.core.dra.prepare import CDI_KIND
from gpupart.core.dra.prepared import ClaimRef
from gpupart.core.dra.read import Consumer
from gpupart.core.mig.catalogue import require_gpu_model
from gpupart.core.mig.layout import MigInstance, Placement
from gpupart.core.mig.planning import CreateGpuInstance
from gpupart.core.node.mps import MpsLimits
from gpupart_plugin.actuator import Actuator
from gpupart_plugin.api import podresources_pb2 as pr
from gpupart_plugin.api import podresources_pb2_grpc as pr_grpc
from gpupart_plugin.backend import NvmlFailure
from gpupart_plugin.dra.api.health import api_pb2 as health_api
from gpupart_plugin.dra.api.health import api_pb2_grpc as health_grpc
from gpupart_plugin.dra.api.registration import api_pb2 as reg_api
from gpupart_plugin.dra.api.registration import api_pb2_grpc as reg_grpc
from gpupart_plugin.dra.api.v1 import api_pb2 as v1
from gpupart_plugin.dra.api.v1 import api_pb2_grpc as v1_grpc
from gpupart_plugin.dra.api.v1beta1 import api_pb2 as v1beta1
from gpupart_plugin.dra.api.v1beta1 import api_pb2_grpc as v1beta1_grpc
from gpupart_plugin.dra.kubelet.cdi import CdiSpecs
from gpupart_plugin.dra.kubelet.claims import ClaimReader, ClaimUnavailable
from gpupart_plugin.dra.kubelet.driver import DraDriver
from gpupart_plugin.dra.kubelet.gpus import gpu_source
from gpupart_plugin.dra.kubelet.health import DraHealth
from gpupart_plugin.dra.kubelet.registration import DraPluginSockets
from gpupart_plugin.dra.kubelet.server import ResourceHealth
from gpupart_plugin.dra.kubelet.state import ClaimCheckpoint
from gpupart_plugin.health import Boards, HealthMonitor
from gpupart_plugin.kube import NodePods
from gpupart_plugin.mps import MpsDaemons
from gpupart_plugin.simgpu import Fault, SimulatedGpus
from gpupart_testsupport.polling import wait_for
from gpupart_testsupport.processes import Proc, spawn

pytestmark = pytest.mark.e2e

NODE = "dra-prepare-node"
A100 = require_gpu_model("A100-SXM4-80GB")
THREE_G = MigInstance(Placement(4, 4), "3g.40gb")
TARGETS = {
    0: GpuConfig(Mode.MIG, dynamic=True, interface=Interface.DRA),
    1: GpuConfig(Mode.NONE, interface=Interface.DRA),
    2: GpuConfig(
        Mode.MPS,
        mps=MpsSettings(default_memory_mib=20480, default_compute_percent=40),
        replicas=4,
        interface=Interface.DRA,
    ),
}


class Plugin:
    """One agent's DRA plugin over a directory: restartable as a new process would be."""

    def __init__(
        self, api: Any, gpus: SimulatedGpus, root: Path, targets: dict[int, GpuConfig] = TARGETS
    ) -> None:
        self.gpus, self.root = gpus, root
        actuator = Actuator(gpus, lambda: (), MpsDaemons(root / "mps", ["true"]))
        # The agent's pass: the MPS daemons started.
        actuator.reconcile(tuple(DesiredGroup("p", 1, (i,), c) for i, c in targets.items()))
        self.health = DraHealth()
        self.pods = NodePods(api, NODE)  # as the agent wires it: the pod check asks it first
        self.pods.start()
        self.driver = DraDriver(
            NODE,
            ClaimReader(api, NODE, pods=self.pods),
            gpu_source(gpus, actuator, lambda: targets),
            actuator.apply_instances,
            ClaimCheckpoint(root / "state", NODE),
            CdiSpecs(root / "cdi"),
            changed=self.health.update,
        )
        self.sockets = DraPluginSockets(
            self.driver,
            ResourceHealth(self.health),
            registry_dir=root / "plugins_registry",
            plugins_dir=root / "plugins",
        )
        self.sockets.start()
        self.channel = grpc.insecure_channel(f"unix://{self.sockets.plugin_socket}")
        self.stub = v1_grpc.DRAPluginStub(self.channel)

    def prepare(self, *claims: dict[str, Any]) -> Any:
        return self.stub.NodePrepareResources(
            v1.NodePrepareResourcesRequest(claims=_refs(claims)), timeout=45
        )

    def unprepare(self, *claims: dict[str, Any]) -> Any:
        return self.stub.NodeUnprepareResources(
            v1.NodeUnprepareResourcesRequest(claims=_refs(claims)), timeout=45
        )

    def stop(self) -> None:
        self.channel.close()
        self.sockets.stop()
        self.pods.stop()


def _refs(claims: tuple[dict[str, Any], ...]) -> list[Any]:
    return [
        v1.Claim(
            namespace=c["metadata"]["namespace"],
            name=c["metadata"]["name"],
            uid=c["metadata"]["uid"],
        )
        for c in claims
    ]


@pytest.fixture
def api(k8s_api: Any) -> Any:
    return k8s_api


@pytest.fixture
def pod(api: Any, namespace: str) -> Any:
    body = {
        "metadata": {"name": "consumer"},
        "spec": {"nodeName": NODE, "containers": [{"name": "c", "image": "none"}]},
    }
    return client.CoreV1Api(api).create_namespaced_pod(namespace, body)


@pytest.fixture
def plugin(api: Any, tmp_path: Path) -> Generator[Plugin, None, None]:
    gpus = SimulatedGpus(["A100-SXM4-80GB"] * 3, node=NODE, mig_enabled=[True, False, False])
    running = Plugin(api, gpus, tmp_path)
    yield running
    running.stop()


def _claim(
    api: Any,
    namespace: str,
    pod: Any,
    devices: list[tuple[str, str]],
    *,
    reserved: bool = True,
    config: list[Any] | None = None,
    consumed: dict[str, str] | None = None,
    pool: str = NODE,
) -> dict[str, Any]:
    """A claim allocated as the scheduler writes it: `devices` are (driver, device) pairs."""
    custom = client.CustomObjectsApi(api)
    requests = [
        {"name": f"r{k}", "exactly": {"deviceClassName": "gpu.gpupart.io"}}
        for k in range(len(devices))
    ]
    name = f"claim-{uuid.uuid4().hex[:6]}"
    created = custom.create_namespaced_custom_object(
        "resource.k8s.io",
        "v1",
        namespace,
        "resourceclaims",
        {"metadata": {"name": name}, "spec": {"devices": {"requests": requests}}},
    )
    allocation: dict[str, Any] = {
        "devices": {
            "results": [
                {
                    "request": f"r{k}",
                    "driver": driver,
                    "pool": pool,
                    "device": device,
                    **(
                        {"consumedCapacity": consumed, "shareID": str(uuid.uuid4())}
                        if consumed is not None
                        else {}
                    ),
                }
                for k, (driver, device) in enumerate(devices)
            ]
        }
    }
    if config is not None:
        allocation["devices"]["config"] = config
    status: dict[str, Any] = {"allocation": allocation}
    if reserved:
        status["reservedFor"] = [
            {"resource": "pods", "name": pod.metadata.name, "uid": pod.metadata.uid}
        ]
    created["status"] = status
    return custom.replace_namespaced_custom_object_status(  # type: ignore[no-any-return]
        "resource.k8s.io", "v1", namespace, "resourceclaims", name, created
    )


def _uid(claim: dict[str, Any]) -> str:
    return claim["metadata"]["uid"]  # type: ignore[no-any-return]


MIG_3G = names.mig_device_name(0, "3g.40gb", 4)


def test_a_batch_prepares_each_claim_on_its_own_and_a_retry_makes_nothing(
    api: Any, namespace: str, pod: Any, plugin: Plugin
) -> None:
    good = _claim(api, namespace, pod, [(names.DRIVER, MIG_3G), (names.DRIVER, "gpu-1")])
    foreign = _claim(api, namespace, pod, [("gpu.example.com", "gpu-0")])
    stranger = _claim(api, namespace, pod, [(names.DRIVER, "gpu-1")], reserved=False)
    bad_config = _claim(
        api,
        namespace,
        pod,
        [(names.DRIVER, "gpu-1")],
        config=[
            {
                "source": "FromClaim",
                "opaque": {
                    "driver": names.DRIVER,
                    "parameters": {"apiVersion": "v9", "kind": "GpuClaimConfig"},
                },
            }
        ],
    )
    answer = plugin.prepare(good, foreign, stranger, bad_config)
    assert "holds no device of driver gpu.gpupart.io" in answer.claims[_uid(foreign)].error
    assert "is not reserved for a pod on this node" in answer.claims[_uid(stranger)].error
    assert "parameters.apiVersion: 'v9' is not a version" in answer.claims[_uid(bad_config)].error
    prepared = answer.claims[_uid(good)]
    assert prepared.error == ""
    (made,) = plugin.gpus.instances(0)
    assert made.device.instance == THREE_G  # exactly the allocated placement
    assert [
        (list(d.request_names), d.device_name, list(d.cdi_device_ids)) for d in prepared.devices
    ] == [
        (["r0"], MIG_3G, [f"{CDI_KIND}={_uid(good)}-r0"]),
        (["r1"], "gpu-1", [f"{CDI_KIND}={_uid(good)}-r1"]),
    ]
    spec = json.loads(
        (plugin.root / "cdi" / f"k8s.gpu.gpupart.io-claim_{_uid(good)}.json").read_text()
    )
    env = {d["name"]: d["containerEdits"]["env"] for d in spec["devices"]}
    assert env[f"{_uid(good)}-r0"] == [f"NVIDIA_VISIBLE_DEVICES={made.device.uuid}"]
    assert env[f"{_uid(good)}-r1"] == [f"NVIDIA_VISIBLE_DEVICES={plugin.gpus.gpus()[1].uuid}"]
    calls = list(plugin.gpus.calls)
    again = plugin.prepare(good)
    assert again.claims[_uid(good)] == prepared
    beta = v1beta1_grpc.DRAPluginStub(plugin.channel).NodePrepareResources(
        v1beta1.NodePrepareResourcesRequest(
            claims=[
                v1beta1.Claim(namespace=namespace, name=good["metadata"]["name"], uid=_uid(good))
            ]
        ),
        timeout=45,
    )
    assert [
        (list(d.request_names), d.device_name, list(d.cdi_device_ids))
        for d in beta.claims[_uid(good)].devices
    ] == [(list(d.request_names), d.device_name, list(d.cdi_device_ids)) for d in prepared.devices]
    assert plugin.gpus.calls == calls  # nothing created twice


def test_a_restarted_plugin_unprepares_from_its_checkpoint_exactly_that_claims_instance(
    api: Any, namespace: str, pod: Any, plugin: Plugin, tmp_path: Path
) -> None:
    first = _claim(api, namespace, pod, [(names.DRIVER, MIG_3G)])
    other = _claim(api, namespace, pod, [(names.DRIVER, names.mig_device_name(0, "1g.10gb", 0))])
    answer = plugin.prepare(first, other)
    assert [answer.claims[_uid(c)].error for c in (first, other)] == ["", ""]
    assert len(plugin.gpus.instances(0)) == 2
    plugin.stop()
    restarted = Plugin(api, plugin.gpus, tmp_path)  # a new agent over the same state directory
    try:
        assert restarted.unprepare(first).claims[_uid(first)].error == ""
        left = [r.device.instance for r in plugin.gpus.instances(0)]
        assert left == [MigInstance(Placement(0, 1), "1g.10gb")]  # the other claim's stays
        assert not (tmp_path / "cdi" / f"k8s.gpu.gpupart.io-claim_{_uid(first)}.json").exists()
        assert restarted.unprepare(first).claims[_uid(first)].error == ""  # idempotent
        assert (
            restarted.prepare(other).claims[_uid(other)].error == ""
        )  # answered from the checkpoint
    finally:
        restarted.stop()
        plugin.sockets = restarted.sockets  # stopped already; the fixture's stop is a no-op


def test_a_retry_answered_from_the_checkpoint_writes_again_a_cdi_spec_a_crash_lost(
    api: Any, namespace: str, pod: Any, plugin: Plugin, tmp_path: Path
) -> None:
    """The spec is not fsynced (ADR 029): lost or cut short, the retry rewrites it from the GPUs."""
    claim = _claim(api, namespace, pod, [(names.DRIVER, MIG_3G), (names.DRIVER, "gpu-1")])
    first = plugin.prepare(claim).claims[_uid(claim)]
    assert first.error == ""
    spec = plugin.driver.cdi.path(_uid(claim))
    written = spec.read_bytes()
    made = _mig_calls(plugin)
    for crashed in (None, b"", written[: len(written) // 2]):
        if crashed is None:
            spec.unlink()
        else:
            spec.write_bytes(crashed)
        plugin.stop()
        plugin = Plugin(api, plugin.gpus, tmp_path)  # the agent restarted after the crash
        try:
            assert plugin.prepare(claim).claims[_uid(claim)] == first
            assert spec.read_bytes() == written
        finally:
            plugin.stop()
    assert _mig_calls(plugin) == made  # nothing made again
    assert [r.device.instance for r in plugin.gpus.instances(0)] == [THREE_G]


def _mig_calls(plugin: Plugin) -> list[str]:
    """The simulator's MIG instance calls so far (a restarted plugin's pass sets compute modes)."""
    return [c for c in plugin.gpus.calls if "Instance" in c]


def test_the_node_pod_watch_holds_exactly_the_pods_bound_to_this_node(
    api: Any, namespace: str, pod: Any
) -> None:
    """The agent's one pod watch: the pods bound here (the DRA pod check), and each one that
    leaves (a pass)."""
    core = client.CoreV1Api(api)
    elsewhere = core.create_namespaced_pod(
        namespace,
        {
            "metadata": {"name": "elsewhere"},
            "spec": {"nodeName": "another-node", "containers": [{"name": "c", "image": "none"}]},
        },
    )
    left: list[str] = []
    pods = NodePods(api, NODE, relist_s=5, left=left.append)
    pods.start()
    try:
        wait_for(
            lambda: pods.holds(pod.metadata.uid, namespace, "consumer"), 60, "the pod in the watch"
        )
        assert not pods.holds(elsewhere.metadata.uid, namespace, "elsewhere")
        assert not pods.holds("another-uid", namespace, "consumer")  # the uid is exact
        # Deleted first: the watch sees events in order, so it would have told of this one
        # before the consumer's had it been bound here.
        core.delete_namespaced_pod("elsewhere", namespace, grace_period_seconds=0)
        core.delete_namespaced_pod("consumer", namespace, grace_period_seconds=0)
        wait_for(
            lambda: not pods.holds(pod.metadata.uid, namespace, "consumer"),
            60,
            "the deleted pod gone from the watch",
        )
        assert f"{namespace}/consumer" in left
        assert f"{namespace}/elsewhere" not in left
    finally:
        pods.stop()


def test_the_pod_check_lists_the_pod_when_the_watch_has_not_seen_it(
    api: Any, namespace: str, pod: Any
) -> None:
    """A watch behind (here: never started) costs a LIST, never a refusal."""
    reader = ClaimReader(api, NODE, pods=NodePods(api, NODE))
    here = Consumer("pods", "consumer", pod.metadata.uid)
    assert reader.pods_here(namespace, (here,)) == frozenset({pod.metadata.uid})
    stranger = Consumer("pods", "consumer", "another-uid")
    assert reader.pods_here(namespace, (stranger,)) == frozenset()


def test_the_claim_is_read_over_kept_alive_connections_as_the_client_reads_it(
    api: Any, namespace: str, pod: Any
) -> None:
    """The lean GET path (ADR 031) answers what the client's path answers, keeps its
    connection alive, and reads again through a fresh one when a kept-alive connection died."""
    claim = _claim(api, namespace, pod, [(names.DRIVER, "gpu-0")])
    lean = ClaimReader(api, NODE)
    through_client = ClaimReader(api, NODE)
    assert lean.gets is not None
    through_client.gets = None
    name = claim["metadata"]["name"]
    for _ in range(3):
        assert lean.claim(namespace, name) == through_client.claim(namespace, name)
    assert len(lean.gets._idle) == 1  # one connection, kept alive and reused
    lean.gets._idle[0].sock.close()  # as a server closing an idle connection leaves it
    assert _uid(lean.claim(namespace, name)) == _uid(claim)
    for reader in (lean, through_client):
        with pytest.raises(ClaimUnavailable, match="get resourceclaim .*/absent: 404 Not Found"):
            reader.claim(namespace, "absent")
    elsewhere = ClaimReader(api, "another-node")
    assert elsewhere.pods_here(namespace, (Consumer("pods", "consumer", pod.metadata.uid),)) == (
        frozenset()
    )


def test_a_failed_compute_instance_create_leaves_no_instance_and_says_why(
    api: Any, namespace: str, pod: Any, plugin: Plugin
) -> None:
    claim = _claim(api, namespace, pod, [(names.DRIVER, MIG_3G)])
    plugin.gpus.inject(Fault(NvmlFailure.INSUFFICIENT_RESOURCES, operation="CreateComputeInstance"))
    error = plugin.prepare(claim).claims[_uid(claim)].error
    assert "could not create its MIG instance" in error and "CreateComputeInstance" in error
    assert plugin.gpus.instances(0) == ()  # the GPU instance was rolled back
    plugin.gpus.clear_faults()
    assert plugin.prepare(claim).claims[_uid(claim)].error == ""
    assert [r.device.instance for r in plugin.gpus.instances(0)] == [THREE_G]


def test_registration_names_the_services_and_comes_back_when_the_kubelet_removes_it(
    plugin: Plugin,
) -> None:
    socket = plugin.sockets.registry_socket
    with grpc.insecure_channel(f"unix://{socket}") as channel:
        info = reg_grpc.RegistrationStub(channel).GetInfo(reg_api.InfoRequest(), timeout=10)
    assert (info.type, info.name, info.endpoint) == (
        "DRAPlugin",
        names.DRIVER,
        str(plugin.sockets.plugin_socket),
    )
    assert list(info.supported_versions) == [
        "v1.DRAPlugin",
        "v1beta1.DRAPlugin",
        "v1alpha1.DRAResourceHealth",
    ]
    socket.unlink()
    wait_for(
        lambda: plugin.sockets.check() or socket.exists(),
        30,
        "the registration socket served again",
    )
    with grpc.insecure_channel(f"unix://{socket}") as channel:
        assert (
            reg_grpc.RegistrationStub(channel).GetInfo(reg_api.InfoRequest(), timeout=10).name
            == names.DRIVER
        )


def _spec(plugin: Plugin, claim: dict[str, Any]) -> dict[str, Any]:
    path = plugin.root / "cdi" / f"k8s.gpu.gpupart.io-claim_{_uid(claim)}.json"
    return json.loads(path.read_text())  # type: ignore[no-any-return]


def test_each_shared_claim_gets_exactly_its_consumed_capacity_as_mps_limits(
    api: Any, namespace: str, pod: Any, plugin: Plugin
) -> None:
    """Below the partition's ceilings (20 GiB and 40 % a client, which the daemon enforces);
    a claim above them is refused in words, though the API holds its allocation."""
    big = _claim(
        api,
        namespace,
        pod,
        [(names.DRIVER, "gpu-2-shared")],
        consumed={"memory": "20Gi", "compute": "40"},
    )
    small = _claim(
        api,
        namespace,
        pod,
        [(names.DRIVER, "gpu-2-shared")],
        consumed={"memory": "10Gi", "compute": "10"},
    )
    over = _claim(
        api,
        namespace,
        pod,
        [(names.DRIVER, "gpu-2-shared")],
        consumed={"memory": "21Gi", "compute": "10"},
    )
    answer = plugin.prepare(big, small, over)
    assert [answer.claims[_uid(c)].error for c in (big, small)] == ["", ""]
    assert "21504 MiB asked, MPS lets one client hold at most 20480 MiB" in (
        answer.claims[_uid(over)].error
    )
    uuid_2 = plugin.gpus.gpus()[2].uuid
    # the daemon holds every client to the partition's ceilings, whatever its environment says
    assert MpsDaemons(plugin.root / "mps", ["true"]).limits(uuid_2) == MpsLimits(4, 20480, 40)
    for claim, memory, compute in ((big, 20480, 40), (small, 10240, 10)):
        (device,) = _spec(plugin, claim)["devices"]
        env = device["containerEdits"]["env"]
        assert f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT={uuid_2}={memory}M" in env
        assert f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={compute}" in env
        mounts = {m["containerPath"]: m["hostPath"] for m in device["containerEdits"]["mounts"]}
        assert mounts["/var/run/gpupart/mps"] == str(plugin.root / "mps" / uuid_2 / "pipe")
        (given,) = answer.claims[_uid(claim)].devices
        assert given.share_id == claim["status"]["allocation"]["devices"]["results"][0]["shareID"]


class Killed(BaseException):
    """Stands in for kill -9: nothing after it runs, not even the plugin's own cleanup."""


def _crash_after_the_gpu_instance(plugin: Plugin) -> None:
    """Killed between the GPU instance and its compute instance."""

    def crash(index: int, _layout: Any) -> str:
        plugin.gpus.apply(CreateGpuInstance(index, THREE_G))
        raise Killed

    plugin.driver.apply = crash


def _crash_after_the_cdi_spec(plugin: Plugin) -> None:
    """Killed once the instance is whole and the claim's CDI spec written, before the
    checkpoint says the claim is complete."""
    write = plugin.driver.cdi.write

    def crash(claim_uid: str, spec: dict[str, Any]) -> Path:
        write(claim_uid, spec)
        raise Killed

    plugin.driver.cdi.write = crash  # type: ignore[method-assign]


@pytest.mark.parametrize("then", ["unprepare", "prepare"])
@pytest.mark.parametrize(
    ("crash", "left"),
    [(_crash_after_the_gpu_instance, [0]), (_crash_after_the_cdi_spec, [1])],
    ids=["after-gpu-instance", "after-cdi-spec"],
)
def test_an_agent_killed_mid_prepare_leaks_nothing_and_creates_nothing_twice(
    api: Any,
    namespace: str,
    pod: Any,
    plugin: Plugin,
    tmp_path: Path,
    then: str,
    crash: Any,
    left: list[int],
) -> None:
    """Each kill point leaves the GPU as it was then (`left`: compute instances of the one GPU
    instance); after a restart the kubelet's retry of either call ends with one whole instance
    or none, one CDI spec or none, and the GPU instance made once."""
    claim = _claim(api, namespace, pod, [(names.DRIVER, MIG_3G)])
    crash(plugin)
    with pytest.raises(Killed):
        plugin.driver.prepare([ClaimRef(namespace, claim["metadata"]["name"], _uid(claim))])
    assert [r.compute_instances for r in plugin.gpus.instances(0)] == left
    plugin.stop()
    restarted = Plugin(api, plugin.gpus, tmp_path)
    try:
        spec = tmp_path / "cdi" / f"k8s.gpu.gpupart.io-claim_{_uid(claim)}.json"
        if then == "unprepare":
            assert restarted.unprepare(claim).claims[_uid(claim)].error == ""
            assert restarted.gpus.instances(0) == ()
            assert not spec.exists()
        else:
            assert restarted.prepare(claim).claims[_uid(claim)].error == ""
            assert [(r.device.instance, r.compute_instances) for r in plugin.gpus.instances(0)] == [
                (THREE_G, 1)
            ]
            (record,) = plugin.gpus.instances(0)
            env = json.loads(spec.read_text())["devices"][0]["containerEdits"]["env"]
            assert env == [f"NVIDIA_VISIBLE_DEVICES={record.device.uuid}"]
        assert plugin.gpus.calls.count("CreateGpuInstance") == 1
    finally:
        restarted.stop()
        plugin.sockets = restarted.sockets


def test_an_xid_on_the_claims_instance_streams_unhealthy_and_clears_after_a_quiet_window(
    api: Any, namespace: str, pod: Any, plugin: Plugin
) -> None:
    claim = _claim(api, namespace, pod, [(names.DRIVER, MIG_3G), (names.DRIVER, "gpu-1")])
    assert plugin.prepare(claim).claims[_uid(claim)].error == ""
    now = [1000.0]
    monitor = HealthMonitor(plugin.gpus, Boards(plugin.health), quiet_s=60, clock=lambda: now[0])
    stream = health_grpc.DRAResourceHealthStub(plugin.channel).NodeWatchResources(
        health_api.NodeWatchResourcesRequest(), timeout=60
    )

    def states() -> dict[str, int]:
        message = next(stream)
        return {d.device.device_name: d.health for d in message.devices}

    assert states() == {MIG_3G: health_api.HEALTHY, "gpu-1": health_api.HEALTHY}
    (record,) = plugin.gpus.instances(0)
    plugin.gpus.inject_xid(0, 48, gpu_instance_id=record.device.gpu_instance_id)
    assert monitor.step(1.0)
    wait_for(
        lambda: states() == {MIG_3G: health_api.UNHEALTHY, "gpu-1": health_api.HEALTHY},
        30,
        "the instance Unhealthy in the stream, the other GPU not",
    )
    now[0] += 61
    assert monitor.step(0.01)
    wait_for(
        lambda: states() == {MIG_3G: health_api.HEALTHY, "gpu-1": health_api.HEALTHY},
        30,
        "the instance Healthy again after the quiet window",
    )
    stream.cancel()


# ---- the real agent process: `gpupart node --dra`, killed with SIGKILL mid-prepare ----

AGENT_NODE = "dra-agent-node"
GPUPART = Path(sys.executable).parent / "gpupart"


class _NoPods(pr_grpc.PodResourcesListerServicer):
    """The kubelet's PodResources with no pod on the node: the agent needs its answer before it
    moves a GPU to DRA (unknown use counts as held, ADR 022), and this test runs no kubelet."""

    def List(self, _request: Any, _context: Any) -> Any:  # noqa: N802 (gRPC method name)
        return pr.ListPodResourcesResponse()

    def GetAllocatableResources(self, _request: Any, _context: Any) -> Any:  # noqa: N802
        return pr.AllocatableResourcesResponse()


@pytest.fixture
def no_pods(tmp_path: Path) -> Generator[None, None, None]:
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    pr_grpc.add_PodResourcesListerServicer_to_server(_NoPods(), server)
    server.add_insecure_port(f"unix://{tmp_path / 'pod-resources.sock'}")
    server.start()
    yield
    server.stop(grace=None).wait(5)


def _start_agent(root: Path, kubeconfig: Path) -> Proc:
    (root / "keys").touch()
    return spawn(
        "agent",
        [
            str(GPUPART), "node", f"--node-name={AGENT_NODE}", "--simulate=A100-SXM4-80GB",
            f"--simulate-state={root / 'simgpu.json'}", "--simulate-create-seconds=3",
            "--dra", f"--plugins-registry-dir={root / 'plugins_registry'}",
            f"--dra-plugins-dir={root / 'plugins'}", f"--cdi-root={root / 'cdi'}",
            f"--state-dir={root / 'state'}", f"--plugin-dir={root / 'device-plugins'}",
            f"--pod-resources-socket={root / 'pod-resources.sock'}", f"--mps-root={root / 'mps'}",
            f"--assignment-key-file={root / 'keys'}", "--metrics-port=0", "--resync-seconds=2",
        ],
        root,
        env={"KUBECONFIG": str(kubeconfig)},
    )  # fmt: skip


def _instances(root: Path) -> list[tuple[int, int, int]]:
    """(start, size, compute instances) of the simulated GPU's instances, as its state file says."""
    if not (root / "simgpu.json").exists():
        return []  # never changed: no instance
    saved = json.loads((root / "simgpu.json").read_text())
    return [(i["start"], i["size"], i["compute_instances"]) for i in saved["gpus"][0]["instances"]]


def _once(root: Path, claim: dict[str, Any]) -> Any:
    """One NodePrepareResources of the claim, as the kubelet sends it; the claim's answer."""
    socket = root / "plugins" / names.DRIVER / "dra.sock"
    # Its own subchannel: a shared one to the killed agent's socket would still be backing off.
    options = [("grpc.use_local_subchannel_pool", 1)]
    with grpc.insecure_channel(f"unix://{socket}", options=options) as channel:
        got = v1_grpc.DRAPluginStub(channel).NodePrepareResources(
            v1.NodePrepareResourcesRequest(claims=_refs((claim,))), timeout=45
        )
    return got.claims[_uid(claim)]


def _ready(root: Path, probe: dict[str, Any]) -> None:
    """Waits until the agent serves DRA with its desired state read: the probe (GPU 0 whole,
    while GPU 0 is in MIG mode) is then refused for its device, not for its GPU's interface."""
    wait_for(
        lambda: "is a whole GPU" in _once(root, probe).error,
        60,
        "the agent serving DRA with its desired state read",
    )


@pytest.mark.usefixtures("no_pods")
def test_a_real_agent_killed_mid_create_leaks_nothing_and_creates_once(
    api: Any, k8s_control_plane: Any, namespace: str, tmp_path: Path
) -> None:
    core = client.CoreV1Api(api)
    group = DesiredGroup("p", 1, (0,), TARGETS[0])
    core.create_node(
        {
            "metadata": {
                "name": AGENT_NODE,
                "annotations": {DESIRED_ANNOTATION: encode_desired((group,))},
            }
        }
    )
    try:
        pod = core.create_namespaced_pod(
            namespace,
            {
                "metadata": {"name": "agent-pod"},
                "spec": {"nodeName": AGENT_NODE, "containers": [{"name": "c", "image": "none"}]},
            },
        )
        claim = _claim(api, namespace, pod, [(names.DRIVER, MIG_3G)], pool=AGENT_NODE)
        probe = _claim(api, namespace, pod, [(names.DRIVER, "gpu-0")], pool=AGENT_NODE)
        agent = _start_agent(tmp_path, k8s_control_plane.agent_kubeconfig)
        try:
            wait_for(
                lambda: (tmp_path / "plugins" / names.DRIVER / "dra.sock").exists(),
                60,
                "the DRA socket",
            )
            _ready(tmp_path, probe)
            # A prepare that the kill interrupts while NVML creates the instance (3 s).
            calls: list[BaseException | Any] = []
            call = threading.Thread(
                target=lambda: calls.append(_try(lambda: _once(tmp_path, claim))), daemon=True
            )
            call.start()
            checkpoint = tmp_path / "state" / "dra-checkpoint.json"
            wait_for(
                lambda: checkpoint.exists() and '"complete":false' in checkpoint.read_text(),
                60,
                "the write-ahead entry",
            )
            os.kill(agent.popen.pid, signal.SIGKILL)
            agent.popen.wait(30)
            call.join(60)
            assert isinstance(calls[0], grpc.RpcError), calls  # the kubelet's call failed
            assert _instances(tmp_path) == []  # killed before NVML made it: nothing half-made
        finally:
            agent.stop()
        agent = _start_agent(tmp_path, k8s_control_plane.agent_kubeconfig)
        try:
            _ready(tmp_path, probe)
            answer = _once(tmp_path, claim)
            assert answer.error == "" and [d.device_name for d in answer.devices] == [MIG_3G]
            assert _instances(tmp_path) == [(4, 4, 1)]
            assert json.loads((tmp_path / "simgpu.json").read_text())["created"] == 1  # made once
            socket = tmp_path / "plugins" / names.DRIVER / "dra.sock"
            options = [("grpc.use_local_subchannel_pool", 1)]
            with grpc.insecure_channel(f"unix://{socket}", options=options) as channel:
                done = v1_grpc.DRAPluginStub(channel).NodeUnprepareResources(
                    v1.NodeUnprepareResourcesRequest(claims=_refs((claim,))), timeout=45
                )
            assert done.claims[_uid(claim)].error == ""
            assert _instances(tmp_path) == []
        finally:
            agent.stop()
            print(agent.tail(60))
    finally:
        core.delete_node(AGENT_NODE)


def _try(call: Any) -> Any:
    try:
        return call()
    except BaseException as error:  # noqa: BLE001 - the interrupted call's failure is expected
        return error


def test_thirty_mixed_claims_at_once_each_get_exactly_their_device_and_limits(
    api: Any, namespace: str, pod: Any, tmp_path: Path
) -> None:
    targets = {0: TARGETS[0], 1: TARGETS[0], 2: TARGETS[1], 3: TARGETS[2]}
    gpus = SimulatedGpus(["A100-SXM4-80GB"] * 4, node=NODE, mig_enabled=[True, True, False, False])
    plugin = Plugin(api, gpus, tmp_path, targets)
    try:
        one_g = A100.require_profile("1g.10gb")
        wanted: list[tuple[dict[str, Any], Any]] = []
        for index in (0, 1):
            for start in one_g.starts:  # seven 1g.10gb per GPU
                device = names.mig_device_name(index, "1g.10gb", start)
                claim = _claim(api, namespace, pod, [(names.DRIVER, device)])
                wanted.append((claim, (index, MigInstance(Placement(start, 1), "1g.10gb"))))
        wanted.append((_claim(api, namespace, pod, [(names.DRIVER, "gpu-2")]), "whole"))
        for k in range(15):
            memory, compute = 1024 * (k + 1), k + 1
            consumed = {"memory": f"{memory}Mi", "compute": str(compute)}
            claim = _claim(api, namespace, pod, [(names.DRIVER, "gpu-3-shared")], consumed=consumed)
            wanted.append((claim, (memory, compute)))
        with ThreadPoolExecutor(len(wanted)) as pool:
            answers = list(pool.map(lambda w: plugin.prepare(w[0]).claims[_uid(w[0])], wanted))
        assert [a.error for a in answers] == [""] * 30
        uuids = {(i, r.device.instance): r.device.uuid for i in (0, 1) for r in gpus.instances(i)}
        assert len(uuids) == 14 and all(
            r.compute_instances == 1 for i in (0, 1) for r in gpus.instances(i)
        )
        mismatches = []
        for claim, expected in wanted:
            (device,) = _spec(plugin, claim)["devices"]
            env = device["containerEdits"]["env"]
            if expected == "whole":
                right = env == [f"NVIDIA_VISIBLE_DEVICES={gpus.gpus()[2].uuid}"]
            elif isinstance(expected[1], MigInstance):
                right = env == [f"NVIDIA_VISIBLE_DEVICES={uuids[expected]}"]
            else:
                memory, compute = expected
                right = (
                    f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT={gpus.gpus()[3].uuid}={memory}M" in env
                    and f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={compute}" in env
                )
            if not right:
                mismatches.append((claim["metadata"]["name"], expected, env))
        assert mismatches == []
    finally:
        plugin.stop()
