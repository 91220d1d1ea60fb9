"""DRA device order benchmark, simulated: the same seeded MIG sequences through NVIDIA's order and ours.

Each run: one node of 8 H100-SXM5-80GB GPUs, dynamic MIG, arrivals and departures, replayed by
the simulator's `dra_nvidia_order` and `dra_gpupart_order` policies (kube-scheduler's first
fit over the devices `gpupart.core.dra` publishes, re-ordered after each change). Workloads
(`gpupart.sim.dynamic.workloads`): W1, a window of the Alibaba default trace's GPU pods (its
start drawn by the seed; skipped when the trace is absent), W2 (1g/2g/3g shifting mix), W3
(1g bursts then 3g/4g), W4 (300 arrivals mixed 1g to 7g), each over `SEEDS`. A loss system, as
the order's effect is seen at arrival: a pod that no device fits when it arrives is given up
(`patience_s=0`), so a stranded 4g does not wait and hold the next free room.
Progress on stderr; last line one JSON object.

    python tests/bench/dra.py [--trace-dir DIR] [--seeds N]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

from gpupart.core.dra.devices import Order
from gpupart.core.mig.catalogue import require_gpu_model
from gpupart.sim.dynamic.dra import DraOrder
from gpupart.sim.dynamic.simulation import SimNode, SimPod, simulate
from gpupart.sim.dynamic.workloads import (
    from_trace,
    w2_shifting_inference,
    w3_adversarial,
    w4_mixed_sizes,
)
from gpupart.sim.trace import parse_pods

SEEDS = 5
GPUS = 8
W1_PODS = 80
LARGE = ("4g.", "7g.")


def workloads(trace_dir: Path, seed: int) -> dict[str, tuple[SimPod, ...]]:
    found: dict[str, tuple[SimPod, ...]] = {}
    source = trace_dir / "openb_pod_list_default.csv"
    if source.exists():
        trace = from_trace(parse_pods(source.read_text(encoding="utf-8"), source=str(source)))
        # one instance per pod: multi-GPU pods are whole GPUs, which no order changes
        pods = [p for p in trace if len(p.profiles) == 1]
        start = random.Random(f"W1-{seed}").randrange(max(1, len(pods) - W1_PODS))
        window = pods[start : start + W1_PODS]
        first = window[0].arrival if window else 0.0
        found["W1"] = tuple(
            SimPod(p.name, p.profiles, p.arrival - first, p.duration, p.priority) for p in window
        )
    found["W2"] = w2_shifting_inference(seed=seed, gpus=GPUS, hours=1.0, load=0.9)
    found["W3"] = w3_adversarial(seed=seed, gpus=GPUS, rounds=2)
    found["W4"] = w4_mixed_sizes(seed=seed, gpus=GPUS, arrivals=300)
    return found


def large(profile: str) -> bool:
    return profile.startswith(LARGE)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--trace-dir", default="../shared/traces/alibaba-gpu-v2023")
    parser.add_argument("--seeds", type=int, default=SEEDS)
    args = parser.parse_args()
    node = [SimNode("node-0", require_gpu_model("H100-SXM5-80GB"), GPUS)]
    totals = {
        order.value: {"bound": 0, "bound_4g_plus": 0, "requested_4g_plus": 0, "requested": 0}
        for order in (Order.NVIDIA, Order.GPUPART)
    }
    per_workload: dict[str, dict[str, dict[str, int]]] = {}
    started = time.perf_counter()
    if not (Path(args.trace_dir) / "openb_pod_list_default.csv").exists():
        print(f"W1 skipped: no trace under {args.trace_dir}", file=sys.stderr)
    for seed in range(args.seeds):
        for name, pods in workloads(Path(args.trace_dir), seed).items():
            for order in (Order.NVIDIA, Order.GPUPART):
                t = time.perf_counter()
                result = simulate(node, pods, DraOrder(order, patience_s=0.0))
                bound = {name for name, _ in result.waits}
                figures = {
                    "bound": len(bound),
                    "bound_4g_plus": sum(
                        1 for p in pods if p.name in bound and any(map(large, p.profiles))
                    ),
                    "requested_4g_plus": sum(1 for p in pods if any(large(x) for x in p.profiles)),
                    "requested": len(pods),
                }
                for key, value in figures.items():
                    totals[order.value][key] += value
                    per_workload.setdefault(name, {}).setdefault(order.value, {}).setdefault(key, 0)
                    per_workload[name][order.value][key] += value
                print(
                    f"seed {seed} {name} {order.value:<8} {json.dumps(figures)} "
                    f"({time.perf_counter() - t:.1f} s)",
                    file=sys.stderr,
                )
    nvidia, ours = totals["nvidia"], totals["gpupart"]

    def share(f: dict[str, int], part: str, whole: str) -> float:
        return f[part] / f[whole] if f[whole] else 0.0

    ratio = (
        share(ours, "bound_4g_plus", "requested_4g_plus")
        / share(nvidia, "bound_4g_plus", "requested_4g_plus")
        if nvidia["bound_4g_plus"]
        else 0.0
    )
    points = 100 * (share(ours, "bound", "requested") - share(nvidia, "bound", "requested"))
    print(f"per workload: {json.dumps(per_workload)}", file=sys.stderr)
    print(f"seconds: {time.perf_counter() - started:.1f}", file=sys.stderr)
    out = {
        "order_simulated": totals,
        "ratio_4g_plus": round(ratio, 3),
        "overall_points": round(points, 2),
        "live": "not measured yet (next session: the real kube-scheduler replay and throughput)",
    }
    print(json.dumps(out, separators=(",", ":")))


if __name__ == "__main__":
    main()
