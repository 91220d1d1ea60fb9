"""Benchmark: Allocate latency through the real gRPC unix socket, and relayout time on a simulated 8-GPU node.

Run: python tests/bench/allocate.py  (last line: one JSON object with the figures)
- allocate_p50_ms / allocate_p99_ms: 10,000 Allocate calls (one MIG device each) from a client
  on the plugin's unix socket, one at a time, as the kubelet makes them.
- relayout_s: from a new desired annotation (8 × H200, 7 × 1g.18gb -> 4 × 1g.18gb + 1 × 3g.71gb
  per GPU) to the ListAndWatch stream showing the new device list: read NVML, plan, apply 120
  simulated NVML steps, report, re-advertise.
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

from gpupart.core.spec import Mode
from gpupart.core.wire import DesiredGroup, encode_desired
from gpupart_plugin.actuator import Actuator
from gpupart_plugin.agent import NodeAgent
from gpupart_plugin.allocator import Allocator
from gpupart_plugin.api import deviceplugin_pb2 as api
from gpupart_plugin.api import deviceplugin_pb2_grpc as api_grpc
from gpupart_plugin.devices import DeviceHub
from gpupart_plugin.metrics import NodeMetrics
from gpupart_plugin.mps import MpsDaemons
from gpupart_plugin.registration import DevicePlugins, socket_name
from gpupart_plugin.simgpu import SimulatedGpus

CALLS = 10_000
RESOURCE = "nvidia.com/mig-1g.18gb"


def desired(counts: dict[str, int]) -> str:
    return encode_desired((DesiredGroup("bench", 1, None, Mode.MIG, tuple(counts.items())),))


def client(socket: str, ids: list[str]) -> None:
    """Allocate CALLS times, one device per call; prints [p50_ms, p99_ms]."""
    with grpc.insecure_channel(f"unix://{socket}") as channel:
        stub = api_grpc.DevicePluginStub(channel)
        requests = [
            api.AllocateRequest(
                container_requests=[api.ContainerAllocateRequest(devices_ids=[ids[n % len(ids)]])]
            )
            for n in range(CALLS)
        ]
        for request in requests[:500]:  # warm-up: channel, server thread pool
            stub.Allocate(request, timeout=5)
        samples = []
        for request in requests:
            start = time.perf_counter()
            stub.Allocate(request, timeout=5)
            samples.append(time.perf_counter() - start)
    samples.sort()
    print(json.dumps([statistics.median(samples) * 1000, samples[int(CALLS * 0.99) - 1] * 1000]))


def main() -> None:
    directory = Path(tempfile.mkdtemp(prefix="gp-bench-", dir="/tmp"))
    sim = SimulatedGpus(["H200-141GB"] * 8, node="bench")
    hub, metrics = DeviceHub(), NodeMetrics()
    allocator = Allocator(hub, "bench", lambda: ())
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
    agent = NodeAgent(actuator, hub, plugins, lambda _s, _i: None, metrics)
    agent.reconcile(desired({"1g.18gb": 7}))
    channel = grpc.insecure_channel(f"unix://{directory / socket_name(RESOURCE)}")
    stub = api_grpc.DevicePluginStub(channel)
    try:
        ids = [d.id for d in hub.all_devices()]
        # The client runs in its own process, as the kubelet does: in this process it would
        # compete with the server for the GIL and measure that instead.
        done = subprocess.run(
            [sys.executable, __file__, "--client", str(directory / socket_name(RESOURCE)), *ids],
            capture_output=True,
            text=True,
            timeout=600,
            check=True,
        )
        p50, p99 = json.loads(done.stdout.strip().splitlines()[-1])
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
        plugins.stop()
        shutil.rmtree(directory, ignore_errors=True)
    print(
        f"Allocate over gRPC ({CALLS} calls): p50 {p50:.3f} ms, p99 {p99:.3f} ms; "
        f"relayout of 8 GPUs to updated ListAndWatch: {relayout:.3f} s",
        file=sys.stderr,
    )
    print(
        json.dumps(
            {
                "allocate_p50_ms": round(p50, 3),
                "allocate_p99_ms": round(p99, 3),
                "relayout_s": round(relayout, 3),
            }
        )
    )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--client"]:
        client(sys.argv[2], sys.argv[3:])
    else:
        main()
