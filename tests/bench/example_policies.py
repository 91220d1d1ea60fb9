"""The built-in example's policy ranking: is the order `gpupart simulate` shows more than one seed?

Run as `.venv/bin/python tests/bench/example_policies.py` from the repository root. Replays the
built-in example (`gpupart.sim.example`, workload seed 7, load 1.3) with every policy over replay
seeds 42-61 (mean, standard deviation), then 10 draws of the example (workload seeds 1-10) times
10 replay seeds (42-51), counting the runs where gpupart allocates more than FGD and FGD more
than BestFit. Prints a short report and one JSON object on its last line (the figures that
README.md and docs/simulator.md quote).
"""

from __future__ import annotations

import json
import statistics
import time

from gpupart.core.scheduling.scoring import Policy
from gpupart.sim.example import EXAMPLE_SEED, example_workload
from gpupart.sim.replay import replay

POLICIES = (Policy.RANDOM, Policy.BESTFIT, Policy.FGD, Policy.GPUPART)
LOAD = 1.3


def allocation(workload_seed: int, policy: Policy, seed: int) -> float:
    example = example_workload(workload_seed)
    result = replay(example.nodes, example.pods, policy=policy, seed=seed, load=LOAD)
    return result.allocation_ratio


def main() -> None:
    started = time.perf_counter()
    seeds = range(42, 62)
    means: dict[str, dict[str, float]] = {}
    for policy in POLICIES:
        values = [allocation(EXAMPLE_SEED, policy, seed) for seed in seeds]
        means[policy.value] = {
            "mean": round(statistics.mean(values), 2),
            "sd": round(statistics.stdev(values), 2),
        }
        print(
            f"{policy.value:<8} {means[policy.value]['mean']:6.2f} (sd {means[policy.value]['sd']})"
        )
    gpupart_over_fgd = fgd_over_bestfit = runs = 0
    for workload_seed in range(1, 11):
        for seed in range(42, 52):
            ours, fgd, bestfit = (
                allocation(workload_seed, policy, seed)
                for policy in (Policy.GPUPART, Policy.FGD, Policy.BESTFIT)
            )
            gpupart_over_fgd += ours > fgd
            fgd_over_bestfit += fgd > bestfit
            runs += 1
    print(
        f"gpupart > fgd in {gpupart_over_fgd}/{runs} runs, fgd > bestfit in {fgd_over_bestfit}/{runs}"
    )
    print(
        json.dumps(
            {
                "bench": "example_policies",
                "load": LOAD,
                "replay_seeds": [seeds.start, seeds.stop - 1],
                "allocation_percent": means,
                "runs": runs,
                "gpupart_above_fgd": gpupart_over_fgd,
                "fgd_above_bestfit": fgd_over_bestfit,
                "seconds": round(time.perf_counter() - started, 1),
            },
            separators=(",", ":"),
        )
    )


if __name__ == "__main__":
    main()
