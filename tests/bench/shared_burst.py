"""Benchmark: a burst of shared-GPU pods on 2 nodes, each container's limits checked, and the cost of exactness.

Starts the full local stack of the e2e tests (etcd, kube-apiserver, kube-scheduler with the
chart's gpupart-scheduler profile, `gpupart operator`, `gpupart extender`, and per node a real
kubelet with the fake CRI runtime, tests/support/kubelet.py, served by `gpupart node --simulate
2xA100-SXM4-80GB:mig-off`). An MPS partition gives each GPU 16 client slots; then `--pods` pods
(one container, two containers, or an init + an app container, every container with its own
memory and compute limits) are created at once. The extender binds one shared pod per node at
a time until the device plugin has recorded what it gave (docs/adr-001-shared-gpu-admission.md).

Figures (last line, JSON):
- pods, mismatches (containers whose GPU, MPS memory limit or thread percentage, as the kubelet
  handed them to the runtime, are not their own pod's assignment and their own limits; must be
  0), refused (pods the kubelet failed at admission);
- admit_p50_s / admit_p99_s: from the pod seen bound to the pod seen Running (watch);
- bound_p50_s / bound_p99_s: from the burst's start to the pod seen bound (the gate's queueing);
- makespan_s: from the burst's start to the last pod Running.

Run: .venv/bin/python tests/bench/shared_burst.py [--pods 40]
Needs the binaries from scripts/build-k8s-bins.sh (GPUPART_K8S_BIN or the build cache).
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from gpupart.core.api.wire import ASSIGNMENT_ANNOTATION, decode_assignment
from gpupart_testsupport.cluster import (
    ControlPlane,
    bin_dir_from_env,
    missing_binaries,
    wait_for,
)
from gpupart_testsupport.stack import Stack

REPO = Path(__file__).resolve().parents[2]

SHARED, MEMORY, COMPUTE = "nvidia.com/gpu.shared", "gpupart.io/gpu-memory", "gpupart.io/gpu-compute"
LABEL = "gpupart.io/bench"


def _terminate(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def step(text: str) -> None:
    print(f"shared_burst: {text}", file=sys.stderr, flush=True)


def burst_pod(n: int) -> tuple[dict[str, Any], dict[str, tuple[int, int]]]:
    """Pod n of shape n % 3, and each container's (memory MiB, compute %)."""
    names = [["main"], ["serve", "proxy"], ["fetch", "serve"]][n % 3]
    limits = {c: (2000 + 10 * n + i, 3 + i) for i, c in enumerate(names)}
    containers = [
        {
            "name": c,
            "image": "gpupart/cuda:0",
            "resources": {"limits": {SHARED: "1", MEMORY: str(m), COMPUTE: str(p)}},
        }
        for c, (m, p) in limits.items()
    ]
    spec: dict[str, Any] = {
        "schedulerName": "gpupart-scheduler",
        "nodeSelector": {LABEL: "burst"},
        "terminationGracePeriodSeconds": 0,
        "containers": containers[1:] if n % 3 == 2 else containers,
    }
    if n % 3 == 2:
        containers[0]["env"] = [{"name": "FAKE_RUNTIME_EXIT_CODE", "value": "0"}]  # it finishes
        spec["initContainers"] = containers[:1]
    manifest = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"burst-{n}"}, "spec": spec}
    return manifest, limits


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pods", type=int, default=40)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, _terminate)
    bin_dir = bin_dir_from_env()
    missing = missing_binaries(bin_dir)
    if missing:
        print(f"shared_burst: missing {', '.join(missing)} in {bin_dir}", file=sys.stderr)
        return 2
    from kubernetes import client, watch

    workdir = Path(tempfile.mkdtemp(prefix="gpupart-bench-"))
    cp = ControlPlane(bin_dir=bin_dir, workdir=workdir)
    stack: Stack | None = None
    try:
        step("starting the control plane and the gpupart stack")
        cp.start(scheduler_config={})
        cp.kubectl("apply", "-f", str(REPO / "charts" / "gpupart" / "crds"))
        api = cp.api_client()
        core = client.CoreV1Api(api)
        (workdir / "stack").mkdir()
        stack = Stack(cp, api, workdir / "stack")
        nodes = ["burst-0", "burst-1"]
        labels = {LABEL: "burst", "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"}
        stack.start_operator()
        stack.start_scheduler(stack.start_extender())
        for n in nodes:
            stack.start_real_node(n, "2xA100-SXM4-80GB:mig-off", labels, auto_reset=True)
        partition = {
            "apiVersion": "gpupart.io/v1alpha1",
            "kind": "GpuPartition",
            "metadata": {"name": "burst"},
            "spec": {
                "nodeSelector": {"matchLabels": {LABEL: "burst"}},
                "mode": "MPS",
                "mps": {"maxClients": 16},
            },
        }
        client.CustomObjectsApi(api).create_cluster_custom_object(
            "gpupart.io", "v1alpha1", "gpupartitions", partition
        )

        def slots(node: str) -> int:
            allocatable = core.read_node(node).status.allocatable or {}
            return int(allocatable.get(SHARED, "0"))

        wait_for(lambda: all(slots(n) == 32 for n in nodes), 120, "32 slots per node")

        bound_at: dict[str, float] = {}
        running_at: dict[str, float] = {}
        stop = threading.Event()

        def follow() -> None:
            stream = watch.Watch().stream(core.list_namespaced_pod, "default", timeout_seconds=600)
            try:
                for event in stream:
                    obj, now = event["object"], time.monotonic()
                    if obj.spec.node_name:
                        bound_at.setdefault(obj.metadata.name, now)
                    if obj.status.phase in ("Running", "Failed"):
                        running_at.setdefault(obj.metadata.name, now)
                    if stop.is_set():
                        return
            except Exception:  # noqa: BLE001 - the API server stops under it at the end
                return

        threading.Thread(target=follow, daemon=True).start()
        time.sleep(0.5)
        step(f"creating {args.pods} pods at once")
        limits = {}
        started = time.monotonic()
        for n in range(args.pods):
            manifest, limits[f"burst-{n}"] = burst_pod(n)
            core.create_namespaced_pod("default", manifest)
        wait_for(lambda: set(running_at) >= set(limits), 600, "every pod Running or Failed", 0.1)
        stop.set()
        mismatches = refused = 0
        for name, wanted in limits.items():
            placed = core.read_namespaced_pod(name, "default")
            if placed.status.phase != "Running":
                refused += 1
                continue
            gpu = decode_assignment(placed.metadata.annotations[ASSIGNMENT_ANNOTATION]).gpu_uuid
            envs = stack.real_nodes[placed.spec.node_name].environments("default", name)
            for container, (memory, compute) in wanted.items():
                env = envs.get(container, {})
                if (
                    env.get("NVIDIA_VISIBLE_DEVICES") != gpu
                    or env.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT") != f"{gpu}={memory}M"
                    or env.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE") != str(compute)
                ):
                    mismatches += 1
        admit = [running_at[n] - bound_at[n] for n in limits if n in bound_at]
        bound = [bound_at[n] - started for n in limits if n in bound_at]
        admitted = [running_at[n] - started for n in limits]
        figures = {
            "pods": args.pods,
            "mismatches": mismatches,
            "refused": refused,
            "admit_p50_s": round(statistics.median(admit), 3) if admit else None,
            "admit_p99_s": round(percentile(admit, 0.99), 3) if admit else None,
            "bound_p50_s": round(statistics.median(bound), 3) if bound else None,
            "bound_p99_s": round(percentile(bound, 0.99), 3) if bound else None,
            "makespan_s": round(max(admitted), 3) if admitted else None,
        }
        print(json.dumps(figures))
        return 0
    finally:
        if stack is not None:
            stack.stop()
        cp.stop()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
