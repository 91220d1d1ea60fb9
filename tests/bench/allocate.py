"""Benchmark: Allocate latency through the real gRPC unix socket, and relayout time on a simulated 8-GPU node.

Run: python tests/bench/allocate.py [--floor] [--kubelet]  (last line: one JSON object)
- allocate_p50_ms / allocate_p99_ms: 10,000 Allocate calls (one MIG device each) from a client
  in another process on the plugin's unix socket, one at a time, as the kubelet makes them, after
  500 untimed ones; like the kubelet, the client holds a ListAndWatch stream open meanwhile.
- client: "go" when the client is tests/bench/kubeletclient, a Go program that dials and calls
  the plugin as the kubelet does, with the kubelet's own stubs (k8s.io/kubelet) and grpc-go
  (built once, see gpupart_testsupport.goclients); "python" when Go is missing or the build fails (said on
  stderr): a grpcio client, which adds its own latency.
- floor_p50_ms / floor_p99_ms (with --floor): the same client and server setup, but a servicer
  whose Allocate returns one precomputed response: what gRPC (grpcio, the client, the kernel)
  costs without the plugin's own work.
- relayout_s: from a new desired annotation (8 × H200, 7 × 1g.18gb -> 4 × 1g.18gb + 1 × 3g.71gb
  per GPU) to the ListAndWatch stream showing the new device list: read NVML, plan, apply 120
  simulated NVML steps, report, re-advertise.
- kubelet_admit_p50_s / kubelet_admit_p99_s (with --kubelet): what the real kubelet sees. A
  control plane and one real-kubelet node (tests/support/kubelet.py) served by `gpupart node
  --simulate 8xH200-141GB` with 7 x 1g.18gb per GPU; 50 pods of one slice each are created at
  once, bound by their nodeName; from creation (the bind) to the pod seen Running: kubelet
  admission, GetPreferredAllocation + Allocate over the plugin's socket, the fake runtime.
  Needs the binaries from scripts/build-k8s-bins.sh.
"""

from __future__ import annotations

import json
import queue
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

from gpupart.core.api.spec import GpuConfig, Mode
from gpupart.core.api.wire import DESIRED_ANNOTATION, DesiredGroup, encode_desired
from gpupart_plugin.actuator import Actuator
from gpupart_plugin.agent import NodeAgent
from gpupart_plugin.annotations import NodeAnnotations
from gpupart_plugin.checkpoint import Checkpoint
from gpupart_plugin.deviceplugin.allocator import Allocator
from gpupart_plugin.deviceplugin.api import deviceplugin_pb2 as api
from gpupart_plugin.deviceplugin.api import deviceplugin_pb2_grpc as api_grpc
from gpupart_plugin.deviceplugin.hub import DeviceHub
from gpupart_plugin.deviceplugin.registration import DevicePlugins, socket_name
from gpupart_plugin.deviceplugin.server import ResourceServicer, start_server
from gpupart_plugin.deviceplugin.sink import DevicePluginSink
from gpupart_plugin.metrics import NodeMetrics
from gpupart_plugin.mps import MpsDaemons
from gpupart_plugin.simgpu import SimulatedGpus
from gpupart_testsupport import goclients

CALLS = 10_000
WARMUP = 500
RESOURCE = "nvidia.com/mig-1g.18gb"


def desired(counts: dict[str, int]) -> str:
    return encode_desired(
        (DesiredGroup("bench", 1, None, GpuConfig(Mode.MIG, tuple(counts.items()))),)
    )


def client(socket: str, ids: list[str]) -> None:
    """The fallback client: Allocate CALLS times, one device per call; prints {"p50_ms", "p99_ms"}."""
    with grpc.insecure_channel(f"unix://{socket}") as channel:
        stub = api_grpc.DevicePluginStub(channel)
        # The kubelet keeps a ListAndWatch stream open to every registered plugin.
        stream = stub.ListAndWatch(api.Empty())
        next(stream)

        def drain() -> None:
            try:
                for _ in stream:
                    pass
            except grpc.RpcError:
                pass

        threading.Thread(target=drain, daemon=True).start()
        requests = [
            api.AllocateRequest(
                container_requests=[api.ContainerAllocateRequest(devices_ids=[ids[n % len(ids)]])]
            )
            for n in range(CALLS)
        ]
        for request in requests[:WARMUP]:  # warm-up: channel, server thread pool
            stub.Allocate(request, timeout=5)
        samples = []
        for request in requests:
            start = time.perf_counter()
            stub.Allocate(request, timeout=5)
            samples.append(time.perf_counter() - start)
        stream.cancel()
    samples.sort()
    p50, p99 = statistics.median(samples), samples[int(CALLS * 0.99) - 1]
    print(json.dumps({"p50_ms": p50 * 1000, "p99_ms": p99 * 1000}))


class ConstantServicer(ResourceServicer):
    """The floor: the same server, but every Allocate answers one precomputed response."""

    response = api.AllocateResponse()

    def Allocate(  # noqa: N802
        self, _request: api.AllocateRequest, _context: grpc.ServicerContext
    ) -> api.AllocateResponse:
        return self.response


def run_client(command: list[str], socket: str, ids: list[str]) -> tuple[float, float]:
    """Runs a client process against the socket; (p50_ms, p99_ms)."""
    done = subprocess.run(
        [*command, socket, *ids], capture_output=True, text=True, timeout=600, check=False
    )
    if done.returncode != 0:
        raise SystemExit(f"allocate bench: the client failed: {done.stderr.strip()}")
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    return figures["p50_ms"], figures["p99_ms"]


def kubelet_admission(pods: int = 50) -> dict[str, float]:
    """Creation-to-Running percentiles of `pods` one-slice MIG pods on one real-kubelet node."""
    from kubernetes import client, watch

    from gpupart_testsupport.cluster import ControlPlane, bin_dir_from_env, wait_for
    from gpupart_testsupport.stack import Stack

    workdir = Path(tempfile.mkdtemp(prefix="gpupart-bench-"))
    cp = ControlPlane(bin_dir=bin_dir_from_env(), workdir=workdir)
    stack = None
    try:
        cp.start(scheduler_config={})
        api = cp.api_client()
        core = client.CoreV1Api(api)
        (workdir / "stack").mkdir()
        stack = Stack(cp, api, workdir / "stack")
        stack.start_real_node("bench-kubelet", "8xH200-141GB", {})
        wait_for(lambda: core.list_node().items, 60, "the kubelet's Node")
        body = {"metadata": {"annotations": {DESIRED_ANNOTATION: desired({"1g.18gb": 7})}}}
        core.patch_node("bench-kubelet", body)

        def slices() -> bool:
            allocatable = core.read_node("bench-kubelet").status.allocatable or {}
            return int(allocatable.get(RESOURCE, "0")) == 56

        wait_for(slices, 120, "56 slices in the Node's allocatable")
        running: dict[str, float] = {}

        def follow() -> None:
            try:
                for event in watch.Watch().stream(
                    core.list_namespaced_pod, "default", timeout_seconds=300
                ):
                    obj = event["object"]
                    if obj.status.phase == "Running":
                        running.setdefault(obj.metadata.name, time.monotonic())
            except Exception:  # noqa: BLE001 - the API server stops under it at the end
                return

        threading.Thread(target=follow, daemon=True).start()
        time.sleep(0.5)
        created = {}
        for n in range(pods):
            name = f"slice-{n}"
            # One image, pulled once: the kubelet's image pull rate limit is not what we measure.
            container = {
                "name": "main",
                "image": "gpupart/cuda:0",
                "imagePullPolicy": "IfNotPresent",
                "resources": {"limits": {RESOURCE: "1"}},
            }
            manifest = {
                "metadata": {"name": name},
                "spec": {"nodeName": "bench-kubelet", "containers": [container]},
            }
            created[name] = time.monotonic()
            core.create_namespaced_pod("default", manifest)
        wait_for(lambda: len(running) == pods, 300, f"{pods} pods Running", interval=0.1)
        waits = sorted(running[n] - created[n] for n in created)
        return {
            "kubelet_admit_p50_s": round(statistics.median(waits), 3),
            "kubelet_admit_p99_s": round(waits[min(len(waits) - 1, int(0.99 * len(waits)))], 3),
        }
    finally:
        if stack is not None:
            stack.stop()
        cp.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def main(floor: bool, kubelet: bool) -> None:
    directory = Path(tempfile.mkdtemp(prefix="gp-bench-", dir="/tmp"))
    sim = SimulatedGpus(["H200-141GB"] * 8, node="bench")
    hub, metrics = DeviceHub(), NodeMetrics()
    allocator = Allocator(
        hub,
        "bench",
        lambda: (),
        lambda _pod, _given: None,
        Checkpoint(directory / "state", "bench"),
    )
    # No kubelet.sock: the plugins serve but skip Register; the client below dials them directly.
    plugins = DevicePlugins(
        hub,
        allocator,
        metrics,
        plugin_dir=directory,
        kubelet_socket=directory / "kubelet.sock",
        poll_s=0.05,
    )
    actuator = Actuator(sim, lambda: (), MpsDaemons(directory / "mps", ["true"]))
    publish = NodeAnnotations(lambda _s, _i, _c: None)
    agent = NodeAgent(actuator, (DevicePluginSink(hub, plugins, metrics), publish), metrics)
    agent.reconcile(desired({"1g.18gb": 7}))
    socket = str(directory / socket_name(RESOURCE))
    channel = grpc.insecure_channel(f"unix://{socket}")
    stub = api_grpc.DevicePluginStub(channel)
    constant: grpc.Server | None = None
    figures: dict[str, object] = {}
    try:
        ids = [d.id for d in hub.all_devices()]
        # The client runs in its own process, as the kubelet does: in this process it would
        # compete with the server for the GIL and measure that instead.
        binary = goclients.build("kubeletclient")
        if binary is not None:
            kind, command = "go", [str(binary), "-calls", str(CALLS), "-warmup", str(WARMUP)]
        else:
            kind, command = "python", [sys.executable, __file__, "--client"]
        p50, p99 = run_client(command, socket, ids)
        if floor:
            request = api.ContainerAllocateRequest(devices_ids=ids[:1])
            ConstantServicer.response = stub.Allocate(
                api.AllocateRequest(container_requests=[request]), timeout=5
            )
            floor_socket = str(directory / "floor.sock")
            servicer = ConstantServicer(RESOURCE, hub, allocator, metrics, poll_s=0.05)
            constant = start_server(servicer, floor_socket)
            floor_p50, floor_p99 = run_client(command, floor_socket, ids)
            figures = {"floor_p50_ms": round(floor_p50, 3), "floor_p99_ms": round(floor_p99, 3)}
        lists: queue.Queue[int] = queue.Queue()
        stream = stub.ListAndWatch(api.Empty(), timeout=60)

        def read() -> None:
            try:
                for response in stream:
                    lists.put(len(response.devices))
            except grpc.RpcError:
                pass

        threading.Thread(target=read, daemon=True).start()
        assert lists.get(timeout=5) == 56
        start = time.perf_counter()
        agent.reconcile(desired({"1g.18gb": 4, "3g.71gb": 1}))
        while lists.get(timeout=30) != 32:
            pass
        relayout = time.perf_counter() - start
        stream.cancel()
    finally:
        channel.close()
        if constant is not None:
            constant.stop(grace=0.5).wait(5)
        plugins.stop()
        shutil.rmtree(directory, ignore_errors=True)
    print(
        f"Allocate over gRPC ({CALLS} calls, {kind} client): p50 {p50:.3f} ms, p99 {p99:.3f} ms; "
        f"relayout of 8 GPUs to updated ListAndWatch: {relayout:.3f} s",
        file=sys.stderr,
    )
    if floor:
        print(
            f"Floor, constant Allocate response on the same server: "
            f"p50 {floor_p50:.3f} ms, p99 {floor_p99:.3f} ms",
            file=sys.stderr,
        )
    if kubelet:
        figures.update(kubelet_admission())
        print(
            f"Real kubelet, 50 one-slice pods: creation to Running p50 "
            f"{figures['kubelet_admit_p50_s']} s, p99 {figures['kubelet_admit_p99_s']} s",
            file=sys.stderr,
        )
    print(
        json.dumps(
            {
                "allocate_p50_ms": round(p50, 3),
                "allocate_p99_ms": round(p99, 3),
                "relayout_s": round(relayout, 3),
                "client": kind,
                **figures,
            }
        )
    )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--client"]:
        client(sys.argv[2], sys.argv[3:])
    elif set(sys.argv[1:]) <= {"--floor", "--kubelet"}:
        main(floor="--floor" in sys.argv[1:], kubelet="--kubelet" in sys.argv[1:])
    else:
        raise SystemExit("usage: python tests/bench/allocate.py [--floor] [--kubelet]")
