"""`gpupart simulate`: the shell around the replay engines (flags, files, progress, tables, JSON, plot).

Reads the CSVs, calls the simulator (`gpupart.sim`), and prints. Bad input, or a flag the chosen
mode does not read, exits with code 2 and one line on stderr naming the file and line or the
flag. matplotlib is imported only for --plot.

Near 600 lines on purpose: the example, trace and MIG (static and dynamic) runs share the flags,
the mode check, the input errors, the progress reporter and the table and JSON printing; each
table carries its legend.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
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
"""Runs shorter than this never show progress."""
PROGRESS_LINE_S = 5.0
"""Off a terminal (a log, CI), one progress line per run this often, never one per pod."""
POLICY_ORDER = (Policy.RANDOM, Policy.BESTFIT, Policy.FGD, Policy.GPUPART)
DEFAULTS: dict[str, object] = {
    "seed": 42,
    "load": 1.3,
    "tie_break": "shuffled",
    "gpu_model": "A100-SXM4-80GB",
    "create_s": DEFAULT_LATENCIES.create,
    "destroy_s": DEFAULT_LATENCIES.destroy,
    "advertise_s": DEFAULT_LATENCIES.advertise,
    "plugin_restart_s": DEFAULT_LATENCIES.plugin_restart,
}
"""Flags whose default is filled in after the mode check: None in `args` means "not given"."""
MODE_FLAGS: dict[str, tuple[str, ...]] = {
    "replay": ("nodes", "pods", "policy", "seed", "load", "tie_break", "json", "plot"),
    "--mig": ("mig", "seed", "load", "json"),
    "--mig --dynamic": (
        "mig",
        "dynamic",
        "nodes",
        "pods",
        "policy",
        "seed",
        "json",
        "gpu_model",
        "max_pods",
        "create_s",
        "destroy_s",
        "advertise_s",
        "plugin_restart_s",
    ),
}
"""The flags each mode reads; any other flag given is refused, never silently ignored."""


class InputError(Exception):
    """Bad input found by the shell (unreadable file, flag misuse); exit code 2."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--nodes",
        metavar="CSV",
        help="node list (sn,cpu_milli,memory_mib,gpu,model) [default: the built-in example]",
    )
    parser.add_argument(
        "--pods",
        metavar="CSV",
        help="pod list in Alibaba cluster-trace-gpu-v2023 format [default: the built-in example]",
    )
    parser.add_argument(
        "--policy",
        metavar="NAMES",
        help="random, bestfit, fgd, gpupart (ours), a comma list, or 'all'; with --mig --dynamic: "
        "gpupart, static_best, nos, hami, first_fit, dra_nvidia_order, dra_gpupart_order "
        "[default: all for a built-in example, "
        "gpupart for a trace]",
    )
    parser.add_argument("--seed", type=int, metavar="N", help="replay seed [default: 42]")
    parser.add_argument(
        "--load",
        type=float,
        metavar="X",
        help="arrived GPU demand as a multiple of capacity; 0: the trace as is [default: 1.3]",
    )
    parser.add_argument(
        "--tie-break",
        choices=("shuffled", "name"),
        help="node order for equal scores: 'shuffled' renames nodes with a seeded permutation "
        "as the FGD authors' simulator does; 'name' uses the names as given [default: shuffled]",
    )
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object instead of a table"
    )
    parser.add_argument(
        "--plot",
        metavar="FILE.png",
        help="also draw allocation and fragmentation curves into FILE.png (needs matplotlib; "
        "not with --mig) [default: no plot]",
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
        metavar="PRODUCTS",
        help="MIG product(s) for a trace's GPU nodes, a comma list assigned in turn by node "
        "name [default: A100-SXM4-80GB]",
    )
    dynamic.add_argument(
        "--max-pods",
        type=int,
        metavar="N",
        help="replay only the first N GPU pods by arrival [default: all]",
    )
    for flag, default, what in (
        ("--create-s", DEFAULT_LATENCIES.create, "GPU + compute instance create"),
        ("--destroy-s", DEFAULT_LATENCIES.destroy, "compute + GPU instance destroy"),
        ("--advertise-s", DEFAULT_LATENCIES.advertise, "our device plugin advertising an instance"),
        ("--plugin-restart-s", DEFAULT_LATENCIES.plugin_restart, "NVIDIA plugin restart (nos)"),
    ):
        dynamic.add_argument(
            flag, type=float, metavar="S", help=f"seconds a {what} takes [default: {default:g}]"
        )


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except (GpupartError, InputError) as error:
        sys.stderr.write(f"gpupart simulate: error: {error}\n")
        return EXIT_BAD_INPUT


def _check_flags(args: argparse.Namespace) -> None:
    """Refuse a flag the chosen mode would not read, then fill in the defaults."""
    if args.dynamic and not args.mig:
        raise InputError("--dynamic needs --mig")
    mode = "--mig --dynamic" if args.dynamic else "--mig" if args.mig else "replay"
    if mode == "--mig" and (args.nodes or args.pods):
        raise InputError("--mig runs the built-in example; it takes no --nodes/--pods")
    reads = MODE_FLAGS[mode]
    for dest, value in vars(args).items():
        if dest in reads or value is None or value is False or dest not in _FLAG_DESTS:
            continue
        flag = "--" + dest.replace("_", "-")
        takes = ", ".join("--" + d.replace("_", "-") for d in reads if d not in ("mig", "dynamic"))
        what = "a replay without --mig" if mode == "replay" else mode
        raise InputError(f"{flag} does not apply to {what}, which takes {takes}")
    if mode == "--mig --dynamic":
        trace = bool(args.nodes or args.pods)
        if args.gpu_model is not None and not trace:
            raise InputError(
                "--gpu-model names the products of a trace's nodes: give --nodes/--pods"
            )
        if args.seed is not None and trace:
            raise InputError("--seed draws the built-in W2 workload; a trace replays as recorded")
    if args.max_pods is not None and args.max_pods < 1:
        raise InputError(f"--max-pods must be 1 or more, got {args.max_pods}")
    for dest, default in DEFAULTS.items():
        if getattr(args, dest, None) is None:
            setattr(args, dest, default)


_FLAG_DESTS = frozenset(
    {*DEFAULTS, "nodes", "pods", "policy", "json", "plot", "mig", "dynamic", "max_pods"}
)
"""Every dest `add_arguments` defines (args also holds the command line's own)."""


def _run(args: argparse.Namespace) -> int:
    _check_flags(args)
    if args.dynamic:
        return _run_dynamic(args)
    if args.mig:
        return _run_mig(args)
    nodes, pods, source, label = _workload(args)
    policies = _policies(args.policy, default_all=label == EXAMPLE_LABEL)
    if args.load < 0:
        raise InputError(f"--load must be 0 or more, got {args.load}")
    if args.plot:
        _require_matplotlib()
    results: list[tuple[ReplayResult, float]] = []
    for policy in policies:
        progress = Progress(sys.stderr, policy.value, "pods")
        started = time.perf_counter()
        result = replay(
            nodes,
            pods,
            policy=policy,
            seed=args.seed,
            load=args.load,
            progress=progress.update,
            shuffle_nodes=args.tie_break == "shuffled",
        )
        progress.close()
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


EXAMPLE_LABEL = "built-in example"


def _workload(args: argparse.Namespace) -> tuple[tuple[Node, ...], tuple[Pod, ...], str, str]:
    if not args.nodes and not args.pods:
        example = example_workload(EXAMPLE_SEED)
        return example.nodes, example.pods, EXAMPLE_LABEL, EXAMPLE_LABEL
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
        f"asking {100 * first.load:g} % of the GPUs (seed {first.seed})"
        if first.load
        else f"{label}: {first.nodes} nodes, {first.gpus} GPUs, {first.pods} pods (seed "
        f"{first.seed})",
        "",
        f"{'':<9} {'GPUs allocated (%)':>18} {'free':>7} {'failed':>7} {'fragmented':>10} "
        f"{'run':>6}",
        f"{'policy':<9} {'at 100 %':>9}{'at end':>9} {'GPUs':>7} {'pods':>7} {'GPUs (%)':>10} "
        f"{'(s)':>6}",
    ]
    for result, seconds in results:
        at_100 = f"{result.curve[100]:.2f}" if len(result.curve) > 100 else "-"
        lines.append(
            f"{result.policy.value:<9} {at_100:>9}{result.allocation_ratio:>9.2f} "
            f"{result.unallocated_gpus:>7.1f} {result.failed:>7d} {result.fragmentation:>10.2f} "
            f"{seconds:>6.2f}"
        )
    end = f"at {100 * first.load:g} %" if first.load else "with the whole trace"
    lines += [
        "",
        "GPUs allocated: share of the cluster's GPU capacity held by placed pods once the",
        f"  requests that arrived add up to 100 % of it, and at the end ({end}); higher is better",
        "free GPUs: capacity left unallocated at the end, in GPUs (free shares summed)",
        "failed pods: pods that fit on no node when they arrived (nothing departs: they stay out)",
        "fragmented GPUs: free share that the workload's typical pods cannot use (FGD's measure),",
        "  in % of capacity at the end; lower is better",
    ]
    if label == EXAMPLE_LABEL:
        lines += [
            "The example is a 1/20 miniature of the Alibaba default trace: most GPUs sit on",
            "8-GPU nodes with 12 cores per GPU, spare CPU on 2-GPU nodes. gpupart differs from",
            "fgd where a node's CPU runs out beside free GPUs; on the full trace its margin is",
            "smaller (README, docs/simulator.md). One seed; --seed N draws another order.",
        ]
    ranking = _ranking(results)
    if ranking:
        lines.append(ranking)
    if first.unplaceable:
        pods = "pod" if first.unplaceable == 1 else "pods"
        lines.append(
            f"{first.unplaceable} arrived {pods} could not be placed on any node "
            "(counted as failed), e.g.:"
        )
        lines.extend(f"  {why}" for why in first.unplaceable_examples)
    return "\n".join(lines) + "\n"


def _ranking(results: Sequence[tuple[ReplayResult, float]]) -> str:
    """One line comparing gpupart with fgd and fgd with bestfit in this run, where both ran."""
    end = {result.policy: result.allocation_ratio for result, _ in results}
    pairs = [(Policy.GPUPART, Policy.FGD), (Policy.FGD, Policy.BESTFIT)]
    said = [
        f"{ours.value} {end[ours] - theirs_value:+.2f} points over {theirs.value}"
        for ours, theirs in pairs
        if ours in end and (theirs_value := end.get(theirs)) is not None
    ]
    return f"In this run, GPUs allocated at the end: {'; '.join(said)}." if said else ""


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


class Progress:
    """How far a long run is, on stderr: a bar redrawn in place on a terminal; elsewhere (a
    log, CI) one line every `PROGRESS_LINE_S` and one at the end. Runs under
    `PROGRESS_AFTER_S` show nothing."""

    WIDTH = 30

    def __init__(
        self,
        stream: TextIO,
        label: str,
        unit: str,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.stream = stream
        self.label = label
        self.unit = unit
        self.clock = clock
        self.started = clock()
        self.terminal = stream.isatty()
        self.next_line = self.started + PROGRESS_LINE_S
        self.shown = False

    def update(self, done: int, total: int) -> None:
        now = self.clock()
        if now - self.started < PROGRESS_AFTER_S:
            return
        percent = 100 * done // total if total else 100
        if self.terminal:
            filled = self.WIDTH * done // total if total else self.WIDTH
            bar = "#" * filled + "." * (self.WIDTH - filled)
            self.stream.write(
                f"\r{self.label:>11} [{bar}] {percent:3d}% {done}/{total} {self.unit}"
            )
        elif now >= self.next_line and done < total:
            self.next_line = now + PROGRESS_LINE_S
            self.stream.write(
                f"gpupart simulate: {self.label}: {percent}% ({done:,} of {total:,} "
                f"{self.unit}), {now - self.started:.0f} s\n"
            )
        else:
            return
        self.stream.flush()
        self.shown = True

    def close(self) -> None:
        if not self.shown:
            return
        if self.terminal:
            self.stream.write("\r" + " " * (self.WIDTH + len(self.label) + 40) + "\r")
        else:
            seconds = self.clock() - self.started
            self.stream.write(f"gpupart simulate: {self.label}: done in {seconds:.1f} s\n")
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
        if args.max_pods is not None:
            pods = tuple(sorted(pods, key=lambda pod: (pod.arrival, pod.name))[: args.max_pods])
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
        progress = Progress(sys.stderr, name, "arrivals")
        result, note = run_policy(
            name,
            nodes,
            pods,
            latencies=latencies,
            timer=time.perf_counter,
            progress=progress.update,
        )
        progress.close()
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
    lines += [
        "",
        "alloc %: time-averaged share of the GPUs' memory slices held by running pods, from the",
        "  first to the last arrival; served: pods bound of pods arrived; bind p50/p95/p99:",
        "  seconds from a pod's arrival to its bind; ops/h: MIG instances created and destroyed",
        "  per simulated hour; disrupt: pods whose instance was destroyed while they ran;",
        "  ms/dec: CPU milliseconds per decision of the policy",
    ]
    lines += [f"{name}: {note}" for name, note in notes.items() if note]
    sys.stdout.write("\n".join(lines) + "\n")
    return 0
