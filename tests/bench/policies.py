"""Policy benchmark: every scheduling policy on the Alibaba default trace, seeds 42-44, load 1.3.

Run as `.venv/bin/python tests/bench/policies.py` from the repository root. It compares each
policy's GPU allocation ratio with the FGD authors' cached results (../shared/traces/fgd-expected),
writes a markdown table into README.md between `<!-- policies:begin -->` and
`<!-- policies:end -->`, and prints one JSON object on its last line.

`--all-traces` also replays gpupart and FGD on every pod trace in ../shared/traces and on the
CPU-heavier variants of the default trace (`gpupart_testsupport.traces`) in build/traces (the
per-trace table of docs/simulator.md); `--traces a,b` limits that to some traces;
`--no-readme` only prints.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from pathlib import Path

from gpupart.core.scheduling.scoring import Policy
from gpupart.sim.replay import replay
from gpupart.sim.trace import Node, Pod, parse_nodes, parse_pods
from gpupart_testsupport.traces import FACTORS, write_variants

ROOT = Path(__file__).resolve().parents[2]
TRACES = ROOT / ".." / "shared" / "traces"
README = ROOT / "README.md"
BEGIN, END = "<!-- policies:begin -->", "<!-- policies:end -->"
SEEDS = (42, 43, 44)
LOAD = 1.3
AUTHORS = {
    Policy.RANDOM: "01-Random",
    Policy.BESTFIT: "05-BestFit",
    Policy.FGD: "06-FGD",
}
POLICIES = (Policy.RANDOM, Policy.BESTFIT, Policy.FGD, Policy.GPUPART)


def authors_means() -> dict[tuple[str, str], float]:
    """(workload, policy) -> the authors' mean allocation % at 130 % over their seeds 42-51."""
    sums: dict[tuple[str, str], list[float]] = {}
    with (TRACES / "fgd-expected" / "analysis_allo_discrete.csv").open() as handle:
        for row in csv.DictReader(handle):
            sums.setdefault((row["workload"], row["sc_policy"]), []).append(float(row["130"]))
    return {key: sum(values) / len(values) for key, values in sums.items()}


def load_trace(name: str) -> tuple[tuple[Node, ...], tuple[Pod, ...]]:
    folder = TRACES / "alibaba-gpu-v2023"
    nodes_file = folder / "openb_node_list_gpu_node.csv"
    pods_file = write_variants()[name] if name in FACTORS else folder / f"openb_pod_list_{name}.csv"
    return (
        parse_nodes(nodes_file.read_text(), source=str(nodes_file)),
        parse_pods(pods_file.read_text(), source=str(pods_file)),
    )


def measure(trace: str, policy: Policy) -> dict[str, object]:
    nodes, pods = load_trace(trace)
    ratios, unallocated, seconds = [], [], []
    for seed in SEEDS:
        started = time.perf_counter()
        result = replay(nodes, pods, policy=policy, seed=seed, load=LOAD)
        seconds.append(time.perf_counter() - started)
        ratios.append(result.allocation_ratio)
        unallocated.append(result.unallocated_gpus)
    return {
        "trace": trace,
        "policy": policy.value,
        "allocation_ratio": [round(r, 3) for r in ratios],
        "mean": round(sum(ratios) / len(ratios), 3),
        "unallocated_gpus": round(sum(unallocated) / len(unallocated), 1),
        "seconds_per_run": round(sum(seconds) / len(seconds), 2),
    }


def default_table(rows: list[dict[str, object]], authors: dict[tuple[str, str], float]) -> str:
    lines = [
        f"GPU allocation at {LOAD:.0%} arrived load on the Alibaba `default` trace (1,213 nodes, "
        f"6,212 GPUs), seeds {SEEDS[0]}-{SEEDS[-1]}; authors = mean of the FGD paper's cached "
        "results over seeds 42-51. Reproduce: `.venv/bin/python tests/bench/policies.py`.",
        "",
        "| policy | allocation % (mean) | per seed | authors % | Δ | unallocated GPUs | s per run |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        policy = Policy(str(row["policy"]))
        reference = authors.get(("openb_pod_list_default", AUTHORS.get(policy, "06-FGD")))
        mean = float(str(row["mean"]))
        per_seed = " / ".join(f"{value:.2f}" for value in row["allocation_ratio"])  # type: ignore[attr-defined]
        ref = f"{reference:.2f}" if reference is not None else "–"
        delta = f"{mean - reference:+.2f}" if reference is not None else "–"
        if policy is Policy.GPUPART:
            ref = f"{ref} (FGD)"
        lines.append(
            f"| {policy.value} | {mean:.2f} | {per_seed} | {ref} | {delta} | "
            f"{row['unallocated_gpus']} | {row['seconds_per_run']} |"
        )
    return "\n".join(lines) + "\n"


def traces_table(rows: list[dict[str, object]], authors: dict[tuple[str, str], float]) -> str:
    by_trace: dict[str, dict[str, dict[str, object]]] = {}
    for row in rows:
        by_trace.setdefault(str(row["trace"]), {})[str(row["policy"])] = row
    lines = [
        "| trace | FGD authors | FGD here | gpupart | gpupart − FGD authors | gpupart − FGD here |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for trace, runs in by_trace.items():
        generated = trace in FACTORS
        reference = None if generated else authors.get((f"openb_pod_list_{trace}", "06-FGD"))
        fgd = float(str(runs["fgd"]["mean"]))
        ours = float(str(runs["gpupart"]["mean"]))
        ref = f"{reference:.2f}" if reference is not None else "–"
        delta = f"{ours - reference:+.2f}" if reference is not None else "–"
        label = f"{trace} (generated)" if generated else trace
        lines.append(f"| {label} | {ref} | {fgd:.2f} | {ours:.2f} | {delta} | {ours - fgd:+.2f} |")
    return "\n".join(lines) + "\n"


def write_readme(table: str) -> None:
    text = README.read_text()
    if BEGIN not in text or END not in text or text.index(BEGIN) > text.index(END):
        raise SystemExit(
            f"README.md has no {BEGIN} ... {END} markers; the table is printed above, not written"
        )
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    README.write_text(f"{head}{BEGIN}\n{table}{END}{tail}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--all-traces", action="store_true", help="also gpupart vs FGD on every trace"
    )
    parser.add_argument("--traces", help="with --all-traces: only these traces (a,b)")
    parser.add_argument(
        "--no-readme", action="store_true", help="print the table, do not write README.md"
    )
    args = parser.parse_args()
    if not TRACES.is_dir():
        raise SystemExit(f"{TRACES} is not here: the benchmark needs the shared traces")
    authors = authors_means()
    rows = []
    for policy in POLICIES:
        rows.append(measure("default", policy))
        sys.stderr.write(
            f"default {policy.value}: {rows[-1]['mean']} ({rows[-1]['seconds_per_run']} s/run)\n"
        )
    table = default_table(rows, authors)
    sys.stdout.write(table)
    figures: dict[str, object] = {"default": rows}
    if args.all_traces:
        names = sorted(
            path.stem.removeprefix("openb_pod_list_")
            for path in (TRACES / "alibaba-gpu-v2023").glob("openb_pod_list_*.csv")
        ) + list(FACTORS)
        if args.traces:
            names = [name for name in names if name in args.traces.split(",")]
        trace_rows = []
        for name in names:
            for policy in (Policy.FGD, Policy.GPUPART):
                row = next(
                    (r for r in rows if r["trace"] == name and r["policy"] == policy.value), None
                )
                trace_rows.append(row or measure(name, policy))
                sys.stderr.write(f"{name} {policy.value}: {trace_rows[-1]['mean']}\n")
        table += (
            "\ngpupart against FGD on every trace in `../shared/traces` and on the CPU-heavier "
            "variants of the default trace that `tests/bench/cpu_heavy.py` generates (seeds "
            "42-44; `--all-traces`):\n\n" + traces_table(trace_rows, authors)
        )
        sys.stdout.write(table[table.index("\ngpupart against") :])
        figures["traces"] = trace_rows
    if not args.no_readme:
        write_readme(table)
    sys.stdout.write(json.dumps(figures, separators=(",", ":")) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
