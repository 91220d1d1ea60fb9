"""Dynamic MIG benchmark: ours against static-best, nos-like, HAMi-like and first-fit on W1-W3.

W1: the Alibaba default trace's GPU pods (creation and deletion times kept, the first
`W1_PODS` by creation time) mapped to MIG profiles, on 4 A100-80GB and 4 H100-80GB nodes of
8 GPUs. W2: the shifting inference mix on 2 x 8 A100-80GB. W3: the adversarial 1g / 3g-4g
alternation on 2 x 8 A100-80GB. Then the planner's CPU time per decision at 1,000 GPUs.
Operation latencies: the defaults of `Latencies`, printed in the result. Last line: one JSON object.

    python tests/bench/dynamic_mig.py [--trace-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

from gpupart.core.dynamic.model import (
    Gpu,
    Instance,
    MigDemand,
    Use,
)
from gpupart.core.dynamic.planner import plan
from gpupart.core.mig.catalogue import require_gpu_model
from gpupart.core.mig.layout import fit_layout
from gpupart.sim.dynamic.dra import DRA_POLICIES
from gpupart.sim.dynamic.policies import POLICY_NAMES, geometries, run_policy
from gpupart.sim.dynamic.simulation import Latencies, SimNode
from gpupart.sim.dynamic.workloads import from_trace, w2_shifting_inference, w3_adversarial
from gpupart.sim.trace import parse_pods

W1_PODS = 500
SEED = 42


def workloads(trace_dir: Path) -> dict[str, tuple[list[SimNode], tuple]]:
    a100 = require_gpu_model("A100-SXM4-80GB")
    h100 = require_gpu_model("H100-SXM5-80GB")
    small = [SimNode(f"node-{k}", a100, 8) for k in range(2)]
    mixed = [SimNode(f"a100-{k}", a100, 8) for k in range(4)]
    mixed += [SimNode(f"h100-{k}", h100, 8) for k in range(4)]
    found = {}
    source = trace_dir / "openb_pod_list_default.csv"
    if source.exists():
        pods = parse_pods(source.read_text(encoding="utf-8"), source=str(source))
        found["W1"] = (mixed, from_trace(pods, limit=W1_PODS))
    else:
        print(f"W1 skipped: {source} not found", file=sys.stderr)
    found["W2"] = (small, w2_shifting_inference(seed=SEED, gpus=16, hours=6, load=0.85))
    found["W3"] = (small, w3_adversarial(seed=SEED, gpus=16, rounds=8))
    return found


def planner_ms_at_1000_gpus(rounds: int = 20) -> float:
    """Mean planner time for 1,000 GPUs (125 nodes x 8) half full, with 20 pending pods."""
    rng = random.Random(SEED)
    model = require_gpu_model("A100-SXM4-80GB")
    layouts = [fit_layout(model, dict(g)) for g in geometries(model)]
    profiles = ("1g.10gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb")
    total = 0.0
    for r in range(rounds):
        gpus = []
        for n in range(125):
            for index in range(8):
                layout = rng.choice(layouts) or ()
                instances = tuple(
                    Instance(i, Use.IN_USE, f"run-{n}-{index}-{k}")
                    if rng.random() < 0.5
                    else Instance(i, Use.IDLE, since=rng.uniform(0, 200))
                    for k, i in enumerate(layout)
                )
                gpus.append(Gpu(f"node-{n:03d}", index, model, instances))
        demand = [
            MigDemand(f"p-{r}-{k}", (rng.choice(profiles),), rng.randrange(2), rng.uniform(0, 100))
            for k in range(20)
        ]
        started = time.perf_counter()
        plan(gpus, demand, now=200.0)
        total += time.perf_counter() - started
    return 1000 * total / rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--trace-dir", default="../shared/traces/alibaba-gpu-v2023")
    parser.add_argument("--plot", metavar="FILE.png", help="draw p95 time-to-bind and allocation")
    parser.add_argument(
        "--replot", metavar="JSON", help="only draw --plot from a saved result line"
    )
    args = parser.parse_args()
    if args.replot:
        plot(json.loads(Path(args.replot).read_text().splitlines()[-1]), Path(args.plot))
        return
    latencies = Latencies()
    out: dict = {"workloads": {}}
    started = time.perf_counter()
    for name, (nodes, pods) in workloads(Path(args.trace_dir)).items():
        out["workloads"][name] = {}
        # The DRA device orders are measured against each other by tests/bench/dra.py.
        for policy in (p for p in POLICY_NAMES if p not in DRA_POLICIES):
            t = time.perf_counter()
            result, note = run_policy(
                policy, nodes, pods, latencies=latencies, timer=time.perf_counter
            )
            figures = result.figures()
            out["workloads"][name][policy] = figures
            print(
                f"{name} {policy:<12} {json.dumps(figures)} {note} ({time.perf_counter() - t:.1f} s)",
                file=sys.stderr,
            )
    out["planner_ms_per_decision_1000_gpus"] = round(planner_ms_at_1000_gpus(), 2)
    out["latencies_s"] = {
        "create": latencies.create,
        "destroy": latencies.destroy,
        "advertise": latencies.advertise,
        "plugin_restart_nos": latencies.plugin_restart,
    }
    out["goals"] = goals(out)
    out["seconds"] = round(time.perf_counter() - started, 1)
    if args.plot:
        plot(out, Path(args.plot))
    print(json.dumps(out, separators=(",", ":")))


def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(out["workloads"])
    figure, axes = plt.subplots(2, len(names), figsize=(4 * len(names), 6), squeeze=False)
    for column, name in enumerate(names):
        runs = out["workloads"][name]
        policies = list(runs)
        for row, (field, label) in enumerate(
            (("bind_p95_s", "p95 time-to-bind (s, log)"), ("allocation", "allocation (%)"))
        ):
            axis = axes[row][column]
            axis.bar(policies, [max(runs[p][field], 0.01) for p in policies])
            if row == 0:
                axis.set_yscale("log")
                axis.set_title(name)
            axis.set_ylabel(label)
            axis.tick_params(axis="x", rotation=45)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def goals(out: dict) -> dict:
    w2 = out["workloads"].get("W2", {})
    result: dict = {}
    if w2:
        ours = w2["gpupart"]
        result["w2_allocation_10_points_above_static"] = (
            ours["allocation"] >= w2["static_best"]["allocation"] + 10
        )
    for name, runs in out["workloads"].items():
        ours = runs["gpupart"]
        result[f"{name}_p95_at_most_0.7x_nos"] = (
            ours["bind_p95_s"] <= 0.7 * runs["nos"]["bind_p95_s"]
        )
        result[f"{name}_p95_at_most_hami"] = ours["bind_p95_s"] <= runs["hami"]["bind_p95_s"]
        result[f"{name}_ops_at_most_1.5x_hami"] = (
            ours["ops_per_hour"] <= 1.5 * runs["hami"]["ops_per_hour"]
        )
        result[f"{name}_no_disruption"] = ours["disruptions"] == 0
    result["planner_at_most_50ms_at_1000_gpus"] = out["planner_ms_per_decision_1000_gpus"] <= 50
    return result


if __name__ == "__main__":
    main()
