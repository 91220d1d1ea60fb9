"""Benchmark: dynamic MIG on the full local stack, from pod creation to bound for pods that needed a new slice.

Starts the full local stack of the e2e tests (etcd, kube-apiserver, kube-scheduler with the
chart's gpupart-scheduler profile, `gpupart operator`, `gpupart extender`, and per node a real
kubelet with the fake CRI runtime, tests/support/kubelet.py, served by `gpupart node --simulate
2xH100-SXM5-80GB` whose GPU-instance creates and destroys take the simulator's default
latencies, gpupart/sim/dynamic/simulation.py: 1.0 s and 0.5 s). A GpuPartition with
`spec.mig.dynamic` and no warm mix selects both nodes, so no node offers any MIG slice at the
start. Pods asking for mixed profiles then arrive in waves (`--waves` waves of `--pods`/waves,
`--gap` seconds apart); every pod of a wave leaves before the next wave, so later waves
reuse and reshape idle instances.

Figures (last line, JSON):
- pods: pods bound that needed a slice planned for them (an Event MigSlicePlanned "creating");
- bind_p50_s / bind_p95_s: creation to bound (the watch sees spec.nodeName), those pods;
- ops_per_pod: GPU instances created plus destroyed (the operator's counter) per pod served;
- disruptions: MIG devices a live pod was given (as the fake runtime saw its container's
  environment) that went missing from its node's inventory, sampled every 0.25 s, plus the
  operator's own counter of plans that would destroy a used instance; must be 0;
- all_p95_s: creation to bound over every pod (those served by an idle instance too).

Run: .venv/bin/python tests/bench/dynamic_e2e.py [--pods 24 --waves 3]
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
import urllib.request
from pathlib import Path
from typing import Any

from gpupart.core.api.wire import (
    INVENTORY_ANNOTATION,
    MIG_PLAN_ANNOTATION,
    decode_inventory,
    decode_mig_plan,
)
from gpupart.sim.dynamic.simulation import DEFAULT_LATENCIES
from gpupart_testsupport.cluster import (
    ControlPlane,
    bin_dir_from_env,
    missing_binaries,
    wait_for,
)
from gpupart_testsupport.stack import Stack

REPO = Path(__file__).resolve().parents[2]

LABEL = "gpupart.io/bench"
PROFILES = ("1g.10gb", "1g.10gb", "2g.20gb", "3g.40gb", "1g.20gb", "2g.20gb")


def _terminate(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def step(text: str) -> None:
    print(f"dynamic_e2e: {text}", file=sys.stderr, flush=True)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def mig_pod(name: str, profile: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "schedulerName": "gpupart-scheduler",
            "nodeSelector": {LABEL: "dynamic"},
            "terminationGracePeriodSeconds": 0,
            "containers": [
                {
                    "name": "main",
                    "image": "gpupart/cuda:0",
                    "resources": {"limits": {f"nvidia.com/mig-{profile}": "1"}},
                }
            ],
        },
    }


def operator_counter(port: int, name: str) -> float:
    """Sum of a counter's samples on the operator's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "_total") or line.startswith(name + "{")
    )


def breakdown(
    pods: list[str],
    created_at: dict[str, float],
    bound_at: dict[str, float],
    node_events: list[tuple[float, str, str | None, str | None, dict[str, str]]],
) -> dict[str, float | None]:
    """Median seconds from creation to: plan written, instance in the inventory, advertised."""
    planned, made, advertised = [], [], []
    for pod in pods:
        start, end = created_at[pod], bound_at[pod]
        seen = [e for e in node_events if start <= e[0] <= end]
        hit = None
        for when, node, plan_text, _, _ in seen:
            plan = decode_mig_plan(plan_text) if plan_text else None
            mine = [r for r in plan.reservations if r.pod.endswith("/" + pod)] if plan else []
            if mine:
                hit = (when, node, mine[0])
                break
        if hit is None:
            continue
        when, node, reservation = hit
        planned.append(when - start)
        before, created = None, False
        for at, name, _, inventory_text, allocatable in seen:
            if name != node or at < when:
                continue
            profile = "nvidia.com/mig-" + reservation.instance.profile
            count = int(allocatable.get(profile, "0"))
            if before is None:
                before = count
            inventory = decode_inventory(inventory_text).gpus if inventory_text else ()
            if not created and any(
                g.index == reservation.gpu and d.instance == reservation.instance
                for g in inventory
                for d in g.mig_devices
            ):
                created = True
                made.append(at - start)
            if count > before:
                advertised.append(at - start)
                break
        step(
            f"{pod}: planned {planned[-1]:.2f} s, created {made[-1] if created else float('nan'):.2f}"
            f" s, advertised {advertised[-1] if count > (before or 0) else float('nan'):.2f} s,"
            f" bound {end - start:.2f} s ({reservation.instance} on {node} GPU {reservation.gpu})"
        )

    def median(values: list[float]) -> float | None:
        return round(statistics.median(values), 3) if values else None

    return {
        "planned_p50_s": median(planned),
        "created_p50_s": median(made),
        "advertised_p50_s": median(advertised),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pods", type=int, default=24)
    parser.add_argument("--waves", type=int, default=3)
    parser.add_argument("--gap", type=float, default=2.0, help="seconds between pods' arrivals")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, _terminate)
    bin_dir = bin_dir_from_env()
    missing = missing_binaries(bin_dir)
    if missing:
        print(f"dynamic_e2e: missing {', '.join(missing)} in {bin_dir}", file=sys.stderr)
        return 2
    from kubernetes import client, watch

    latencies = DEFAULT_LATENCIES
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
        nodes = ["dyn-0", "dyn-1"]
        labels = {
            LABEL: "dynamic",
            "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
            "nvidia.com/gpu.count": "2",
        }
        metrics_port = stack.start_operator()
        stack.start_scheduler(stack.start_extender())
        for n in nodes:
            stack.start_real_node(
                n,
                "2xH100-SXM5-80GB",
                labels,
                create_s=latencies.create,
                destroy_s=latencies.destroy,
            )
        partition = {
            "apiVersion": "gpupart.io/v1alpha1",
            "kind": "GpuPartition",
            "metadata": {"name": "dynamic"},
            "spec": {
                "nodeSelector": {"matchLabels": {LABEL: "dynamic"}},
                "mode": "MIG",
                "mig": {"dynamic": {"minIdleSeconds": 0}},
            },
        }
        custom = client.CustomObjectsApi(api)
        custom.create_cluster_custom_object("gpupart.io", "v1alpha1", "gpupartitions", partition)

        def applied() -> bool:
            obj = custom.get_cluster_custom_object(
                "gpupart.io", "v1alpha1", "gpupartitions", "dynamic"
            )
            states = (obj.get("status") or {}).get("nodes") or {}
            return all(states.get(n, {}).get("state") == "Applied" for n in nodes)

        wait_for(applied, 120, "both nodes Applied")

        created_at: dict[str, float] = {}
        bound_at: dict[str, float] = {}
        stop = threading.Event()

        def follow() -> None:
            stream = watch.Watch().stream(core.list_namespaced_pod, "default", timeout_seconds=900)
            try:
                for event in stream:
                    obj, now = event["object"], time.monotonic()
                    if obj.spec.node_name:
                        bound_at.setdefault(obj.metadata.name, now)
                    if stop.is_set():
                        return
            except Exception:  # noqa: BLE001 - the API server stops under it at the end
                return

        node_events: list[tuple[float, str, str | None, str | None, dict[str, str]]] = []

        def follow_nodes() -> None:
            stream = watch.Watch().stream(core.list_node, timeout_seconds=900)
            try:
                for event in stream:
                    obj, now = event["object"], time.monotonic()
                    notes = obj.metadata.annotations or {}
                    node_events.append(
                        (
                            now,
                            obj.metadata.name,
                            notes.get(MIG_PLAN_ANNOTATION),
                            notes.get(INVENTORY_ANNOTATION),
                            dict(obj.status.allocatable or {}),
                        )
                    )
                    if stop.is_set():
                        return
            except Exception:  # noqa: BLE001 - the API server stops under it at the end
                return

        disrupted: list[str] = []

        def sample() -> None:
            """A MIG device a live pod was given (as the runtime saw it) missing from its node's
            inventory is a disruption."""
            while not stop.wait(0.25):
                try:
                    inventories = {}
                    for node in nodes:
                        text = (core.read_node(node).metadata.annotations or {}).get(
                            INVENTORY_ANNOTATION
                        )
                        gpus = decode_inventory(text).gpus if text else ()
                        inventories[node] = {d.uuid for g in gpus for d in g.mig_devices}
                    for placed in core.list_namespaced_pod("default").items:
                        node = placed.spec.node_name
                        if placed.metadata.deletion_timestamp or node not in inventories:
                            continue
                        envs = stack.real_nodes[node].environments("default", placed.metadata.name)
                        uuid = envs.get("main", {}).get("NVIDIA_VISIBLE_DEVICES")
                        if uuid and uuid not in inventories[node]:
                            disrupted.append(uuid)
                except Exception:  # noqa: BLE001 - a failed sample is skipped
                    continue

        threading.Thread(target=follow, daemon=True).start()
        threading.Thread(target=follow_nodes, daemon=True).start()
        threading.Thread(target=sample, daemon=True).start()
        time.sleep(0.5)
        per_wave = max(1, args.pods // args.waves)
        names: list[str] = []
        for wave in range(args.waves):
            step(f"wave {wave + 1}/{args.waves}: {per_wave} pods, {args.gap:g} s apart")
            batch = []
            for i in range(per_wave):
                name = f"dyn-{wave}-{i:02}"
                profile = PROFILES[(wave + i) % len(PROFILES)]
                created_at[name] = time.monotonic()
                core.create_namespaced_pod("default", mig_pod(name, profile))
                batch.append(name)
                time.sleep(args.gap)
            wait_for(lambda b=batch: all(n in bound_at for n in b), 300, "the wave bound", 0.1)
            names += batch
            core.delete_collection_namespaced_pod("default", grace_period_seconds=0)
            wait_for(lambda: not core.list_namespaced_pod("default").items, 120, "pods gone")
        stop.set()
        planned = set()
        for event in core.list_namespaced_event("default").items:
            if event.reason == "MigSlicePlanned" and (event.message or "").startswith("creating"):
                planned.add(event.involved_object.name)
        needed = [bound_at[n] - created_at[n] for n in names if n in planned]
        stages = breakdown([n for n in names if n in planned], created_at, bound_at, node_events)
        every = [bound_at[n] - created_at[n] for n in names]
        operations = operator_counter(metrics_port, "gpupart_dynamic_mig_instance_operations")
        planned_disruptions = operator_counter(metrics_port, "gpupart_dynamic_mig_disruptions")
        figures = {
            "pods": len(needed),
            "bind_p50_s": round(statistics.median(needed), 3) if needed else None,
            "bind_p95_s": round(percentile(needed, 0.95), 3) if needed else None,
            "ops_per_pod": round(operations / len(names), 3) if names else None,
            "disruptions": len(set(disrupted)) + int(planned_disruptions),
            "all_p95_s": round(percentile(every, 0.95), 3) if every else None,
            **stages,
            "served": len(names),
            "create_s": latencies.create,
            "destroy_s": latencies.destroy,
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
