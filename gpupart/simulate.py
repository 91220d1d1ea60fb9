"""`gpupart simulate`: the shell around the replay engine (files, progress bar, table, JSON, plot).

Reads the CSVs, calls the pure core (`gpupart.sim.replay`), and prints. Bad input exits with
code 2 and one line on stderr naming the file and line. matplotlib is imported only for --plot.

Over 400 lines on purpose: the example, trace and MIG (static and dynamic) runs share the flags,
the input errors and the table and JSON printing.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from gpupart.core.errors import GpupartError
from gpupart.core.scheduling.scoring import DEFAULT_POLICY, Policy
from gpupart.sim.dynamic.simulation import DEFAULT_LATENCIES, Latencies
from gpupart.sim.example import EXAMPLE_SEED, example_workload
from gpupart.sim.replay import ReplayResult, replay
from gpupart.sim.trace import Node, Pod, parse_nodes, parse_pods

EXIT_BAD_INPUT = 2
PROGRESS_AFTER_S = 1.0
"""Runs shorter than this never show a progress bar."""
POLICY_ORDER = (Policy.RANDOM, Policy.BESTFIT, Policy.FGD, Policy.GPUPART)


class InputError(Exception):
    """Bad input found by the shell (unreadable file, flag misuse); exit code 2."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--nodes", metavar="CSV", help="node list (sn,cpu_milli,memory_mib,gpu,model)"
    )
    parser.add_argument(
        "--pods", metavar="CSV", help="pod list in Alibaba cluster-trace-gpu-v2023 format"
    )
    parser.add_argument(
        "--policy",
        default=None,
        help="random, bestfit, fgd, gpupart (ours), a comma list, or 'all' "
        "(default: all for the built-in example, gpupart for a trace)",
    )
    parser.add_argument("--seed", type=int, default=42, help="replay seed (default 42)")
    parser.add_argument(
        "--load",
        type=float,
        default=1.3,
        help="arrived GPU demand as a multiple of capacity (default 1.3; 0 = the trace as is)",
    )
    parser.add_argument(
        "--tie-break",
        choices=("shuffled", "name"),
        default="shuffled",
        help="node order for equal scores: 'shuffled' renames nodes with a seeded permutation "
        "as the FGD authors' simulator does (default); 'name' uses the names as given",
    )
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object instead of a table"
    )
    parser.add_argument(
        "--plot", metavar="FILE.png", help="draw allocation and fragmentation curves"
    )
    parser.add_argument(
        "--mig",
        action="store_true",
        help="built-in example in MIG mode: requests rounded up to MIG profiles, layouts planned",
    )
    dynamic = parser.add_argument_group("dynamic MIG (--mig --dynamic)")
    dynamic.add_argument(
        "--dynamic",
        action="store_true",
        help="with --mig: replay arrivals and departures with instances created on demand, "
        "ours against the baselines (built-in: the shifting inference mix W2; or --nodes/--pods)",
    )
    dynamic.add_argument(
        "--gpu-model",
        default="A100-SXM4-80GB",
        help="MIG product(s) for the trace's GPU nodes, a comma list assigned in turn by node "
        "name (default A100-SXM4-80GB)",
    )
    dynamic.add_argument(
        "--max-pods",
        type=int,
        default=None,
        help="replay only the first N GPU pods by creation time",
    )
    for flag, default, what in (
        ("--create-s", DEFAULT_LATENCIES.create, "GPU + compute instance create"),
        ("--destroy-s", DEFAULT_LATENCIES.destroy, "compute + GPU instance destroy"),
        ("--advertise-s", DEFAULT_LATENCIES.advertise, "our device plugin advertising an instance"),
        ("--plugin-restart-s", DEFAULT_LATENCIES.plugin_restart, "NVIDIA plugin restart (nos)"),
    ):
        dynamic.add_argument(
            flag, type=float, default=default, help=f"{what} (s, default {default:g})"
        )


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except (GpupartError, InputError) as error:
        sys.stderr.write(f"gpupart simulate: error: {error}\n")
        return EXIT_BAD_INPUT


def _run(args: argparse.Namespace) -> int:
    if args.dynamic:
        if not args.mig:
            raise InputError("--dynamic needs --mig")
        return _run_dynamic(args)
    if args.mig:
        if args.nodes or args.pods:
            raise InputError("--mig runs the built-in example; it takes no --nodes/--pods")
        return _run_mig(args)
    nodes, pods, source, label = _workload(args)
    policies = _policies(args.policy, default_all=label == "built-in example")
    if args.load < 0:
        raise InputError(f"--load must be 0 or more, got {args.load}")
    if args.plot:
        _require_matplotlib()
    results: list[tuple[ReplayResult, float]] = []
    for policy in policies:
        bar = _ProgressBar(sys.stderr, f"{policy.value:>8}")
        started = time.perf_counter()
        result = replay(
            nodes,
            pods,
            policy=policy,
            seed=args.seed,
            load=args.load,
            progress=bar.update,
            shuffle_nodes=args.tie_break == "shuffled",
        )
        bar.close()
        results.append((result, time.perf_counter() - started))
    if args.json:
        sys.stdout.write(json.dumps(_json(results, source=source), separators=(",", ":")) + "\n")
    else:
        sys.stdout.write(_table(results, label=label))
    if args.plot:
        _plot(results, Path(args.plot), title=label)
        if not args.json:
            sys.stdout.write(f"plot written to {args.plot}\n")
    return 0


def _workload(args: argparse.Namespace) -> tuple[tuple[Node, ...], tuple[Pod, ...], str, str]:
    if not args.nodes and not args.pods:
        example = example_workload(EXAMPLE_SEED)
        return example.nodes, example.pods, "built-in example", "built-in example"
    if not args.nodes or not args.pods:
        raise InputError("a trace needs both --nodes and --pods")
    nodes = parse_nodes(_read(args.nodes), source=args.nodes)
    pods = parse_pods(_read(args.pods), source=args.pods)
    label = f"{Path(args.pods).stem} on {Path(args.nodes).stem}"
    return nodes, pods, f"{args.nodes} + {args.pods}", label


def _read(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise InputError(f"{path}: not a UTF-8 text file ({error.reason})") from None
    except OSError as error:
        raise InputError(f"{path}: cannot read: {error.strerror or error}") from None


def _policies(text: str | None, *, default_all: bool) -> tuple[Policy, ...]:
    if text is None:
        return POLICY_ORDER if default_all else (DEFAULT_POLICY,)
    if text.strip() == "all":
        return POLICY_ORDER
    chosen = []
    for name in text.split(","):
        name = name.strip().lower()
        try:
            chosen.append(Policy(name))
        except ValueError:
            known = ", ".join(p.value for p in POLICY_ORDER)
            raise InputError(f"unknown policy {name!r} (known: {known}, all)") from None
    return tuple(dict.fromkeys(chosen))


def _json(results: Sequence[tuple[ReplayResult, float]], *, source: str) -> dict[str, Any]:
    runs = [_run_json(result, seconds) for result, seconds in results]
    main = next((run for run in runs if run["policy"] == DEFAULT_POLICY.value), runs[0])
    out = dict(main)
    out["source"] = source
    if len(runs) > 1:
        out["runs"] = runs
    return out


def _run_json(result: ReplayResult, seconds: float) -> dict[str, Any]:
    return {
        "policy": result.policy.value,
        "seed": result.seed,
        "load": result.load,
        "allocation_ratio": round(result.allocation_ratio, 4),
        "unallocated_gpus": round(result.unallocated_gpus, 3),
        "failed_pods": result.failed,
        "failed_by_kind": dict(sorted(result.failed_by_kind.items())),
        "unplaceable_pods": {
            "count": result.unplaceable,
            "examples": list(result.unplaceable_examples),
        },
        "placed_pods": result.placed,
        "arrived_pods": result.pods,
        "nodes": result.nodes,
        "gpus": result.gpus,
        "fragmentation": round(result.fragmentation, 4),
        "curve": [round(value, 4) for value in result.curve],
        "fragmentation_curve": [round(value, 4) for value in result.fragmentation_curve],
        "curve_note": "index = percent of GPU capacity arrived; value = percent allocated",
        "seconds": round(seconds, 3),
    }


def _table(results: Sequence[tuple[ReplayResult, float]], *, label: str) -> str:
    first = results[0][0]
    lines = [
        f"{label}: {first.nodes} nodes, {first.gpus} GPUs, {first.pods} pods arrived "
        f"(load {first.load:g}, seed {first.seed})",
        "",
        f"{'policy':<9} {'alloc@100%':>10} {'alloc@end':>9} {'unalloc GPUs':>12} "
        f"{'failed pods':>11} {'frag %':>7} {'time s':>7}",
    ]
    for result, seconds in results:
        at_100 = result.curve[100] if len(result.curve) > 100 else result.curve[-1]
        lines.append(
            f"{result.policy.value:<9} {at_100:>10.2f} {result.allocation_ratio:>9.2f} "
            f"{result.unallocated_gpus:>12.1f} {result.failed:>11d} {result.fragmentation:>7.2f} "
            f"{seconds:>7.2f}"
        )
    lines.append("")
    lines.append("alloc = % of cluster GPU capacity allocated, by % of capacity arrived")
    if first.unplaceable:
        pods = "pod" if first.unplaceable == 1 else "pods"
        lines.append(
            f"{first.unplaceable} arrived {pods} could not be placed on any node "
            "(counted as failed), e.g.:"
        )
        lines.extend(f"  {why}" for why in first.unplaceable_examples)
    return "\n".join(lines) + "\n"


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401 - optional, only for --plot
    except ImportError:
        raise InputError("--plot needs matplotlib: pip install 'gpupart[plot]'") from None


def _plot(results: Sequence[tuple[ReplayResult, float]], path: Path, *, title: str) -> None:
    import matplotlib  # optional, only for --plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (top, bottom) = plt.subplots(2, 1, figsize=(8, 8), sharex=True)
    for result, _ in results:
        x = list(range(len(result.curve)))
        top.plot(x, list(result.curve), label=result.policy.value)
        bottom.plot(x, list(result.fragmentation_curve), label=result.policy.value)
    top.set_ylabel("GPU allocation (% of capacity)")
    top.set_title(title)
    top.legend()
    top.grid(True, alpha=0.3)
    bottom.set_ylabel("fragmentation (% of capacity)")
    bottom.set_xlabel("arrived GPU demand (% of capacity)")
    bottom.grid(True, alpha=0.3)
    figure.tight_layout()
    try:
        figure.savefig(path)
    except OSError as error:
        raise InputError(f"{path}: cannot write plot: {error.strerror or error}") from None
    finally:
        plt.close(figure)


class _ProgressBar:
    """A one-line bar on stderr, only on a terminal and only once a run has taken a second."""

    WIDTH = 30

    def __init__(self, stream: TextIO, label: str) -> None:
        self.stream = stream
        self.label = label
        self.started = time.perf_counter()
        self.enabled = stream.isatty()
        self.shown = False

    def update(self, done: int, total: int) -> None:
        if not self.enabled or time.perf_counter() - self.started < PROGRESS_AFTER_S:
            return
        filled = self.WIDTH * done // total if total else self.WIDTH
        percent = 100 * done // total if total else 100
        bar = "#" * filled + "." * (self.WIDTH - filled)
        self.stream.write(f"\r{self.label} [{bar}] {percent:3d}% {done}/{total} pods")
        self.stream.flush()
        self.shown = True

    def close(self) -> None:
        if self.shown:
            self.stream.write("\r" + " " * (self.WIDTH + len(self.label) + 30) + "\r")
            self.stream.flush()


def _run_mig(args: argparse.Namespace) -> int:
    """MIG mode of the built-in example: profiles, exact layouts, accepted requests vs a bound."""
    from gpupart.sim.mig_packing import pack_mig

    example = example_workload(EXAMPLE_SEED)
    started = time.perf_counter()
    result = pack_mig(example.nodes, example.pods, seed=args.seed, load=args.load)
    seconds = time.perf_counter() - started
    data = {
        "mode": "mig",
        "seed": args.seed,
        "load": args.load,
        "arrived_pods": result.arrived,
        "accepted_pods": result.accepted,
        "rejected_pods": result.rejected,
        "gpus": result.gpus,
        "gpus_used": result.gpus_used,
        "lower_bound_gpus": result.lower_bound_gpus,
        "requested_gpu_share": round(result.requested_milli / 1000, 3),
        "granted_compute_slices": result.granted_slices,
        "profiles": result.profiles,
        "seconds": round(seconds, 3),
    }
    if args.json:
        sys.stdout.write(json.dumps(data, separators=(",", ":")) + "\n")
        return 0
    rounding = 100.0 * (result.granted_slices / 7 * 1000 / result.requested_milli - 1)
    sys.stdout.write(
        f"built-in example, MIG mode: {result.gpus} GPUs, {result.arrived} requests arrived "
        f"(load {args.load:g}, seed {args.seed})\n\n"
        f"accepted requests   {result.accepted} ({result.rejected} rejected)\n"
        f"GPUs used           {result.gpus_used} (lower bound for the accepted set: "
        f"{result.lower_bound_gpus})\n"
        f"rounding to profiles costs {rounding:.1f} % more compute than requested\n"
        f"instances           "
        + ", ".join(f"{name} x{count}" for name, count in result.profiles.items())
        + "\n"
    )
    return 0


def _run_dynamic(args: argparse.Namespace) -> int:
    """Dynamic MIG: each policy over one workload, with operation latencies, in a table or JSON."""
    from gpupart.core.mig.catalogue import require_gpu_model
    from gpupart.sim.dynamic.policies import POLICY_NAMES, run_policy
    from gpupart.sim.dynamic.simulation import SimNode
    from gpupart.sim.dynamic.workloads import from_trace, w2_shifting_inference

    latencies = Latencies(args.create_s, args.destroy_s, args.advertise_s, args.plugin_restart_s)
    if any(
        value < 0
        for value in (args.create_s, args.destroy_s, args.advertise_s, args.plugin_restart_s)
    ):
        raise InputError("operation latencies must be 0 or more seconds")
    if args.nodes or args.pods:
        trace_nodes, trace_pods, source, label = _workload(args)
        models = [require_gpu_model(name.strip()) for name in args.gpu_model.split(",")]
        gpu_nodes = sorted((n for n in trace_nodes if n.gpus > 0), key=lambda n: n.name)
        nodes = [SimNode(n.name, models[k % len(models)], n.gpus) for k, n in enumerate(gpu_nodes)]
        pods = from_trace(trace_pods, limit=args.max_pods)
        if not pods:
            raise InputError(f"{args.pods}: no GPU pod with creation_time and deletion_time")
    else:
        model = require_gpu_model("A100-SXM4-80GB")
        nodes = [SimNode(f"node-{k}", model, 8) for k in range(2)]
        pods = w2_shifting_inference(seed=args.seed, gpus=16, hours=4, load=0.6)
        source = label = f"built-in W2 (shifting inference mix, seed {args.seed})"
    names = (
        POLICY_NAMES
        if args.policy in (None, "all")
        else tuple(dict.fromkeys(name.strip() for name in args.policy.split(",")))
    )
    unknown = [name for name in names if name not in POLICY_NAMES]
    if unknown:
        raise InputError(f"unknown policy {unknown[0]!r} (known: {', '.join(POLICY_NAMES)}, all)")
    runs = {}
    notes = {}
    for name in names:
        result, note = run_policy(name, nodes, pods, latencies=latencies, timer=time.perf_counter)
        runs[name] = result.figures()
        notes[name] = note
    data = {
        "mode": "mig-dynamic",
        "source": source,
        "nodes": len(nodes),
        "gpus": sum(n.gpus for n in nodes),
        "pods": len(pods),
        "latencies_s": {
            "create": latencies.create,
            "destroy": latencies.destroy,
            "advertise": latencies.advertise,
            "plugin_restart": latencies.plugin_restart,
        },
        "policies": runs,
        "notes": {name: note for name, note in notes.items() if note},
    }
    if args.json:
        sys.stdout.write(json.dumps(data, separators=(",", ":")) + "\n")
        return 0
    lines = [
        f"{label}: {data['nodes']} nodes, {data['gpus']} MIG GPUs, {len(pods)} pods",
        f"latencies: create {latencies.create:g} s, destroy {latencies.destroy:g} s, advertise "
        f"{latencies.advertise:g} s, NVIDIA plugin restart (nos) {latencies.plugin_restart:g} s",
        "",
        f"{'policy':<12} {'alloc %':>7} {'served':>11} {'bind p50':>8} {'p95':>7} {'p99':>7} "
        f"{'ops/h':>7} {'disrupt':>7} {'ms/dec':>7}",
    ]
    for name, f in runs.items():
        lines.append(
            f"{name:<12} {f['allocation']:>7.2f} {f['served']:>5}/{f['pods']:<5} "
            f"{f['bind_p50_s']:>8.1f} {f['bind_p95_s']:>7.1f} {f['bind_p99_s']:>7.1f} "
            f"{f['ops_per_hour']:>7.1f} {f['disruptions']:>7} {f['ms_per_decision']:>7.2f}"
        )
    lines.append("")
    lines.append(
        "alloc = time-averaged share of memory slices held by pods (first to last arrival); "
        "bind = seconds from arrival to bound"
    )
    lines += [f"{name}: {note}" for name, note in notes.items() if note]
    sys.stdout.write("\n".join(lines) + "\n")
    return 0
