"""Benchmark: the MIG solver on every profile multiset of A100-80GB and H100-80GB, and an 8-GPU node plan.

Run: python tests/bench/solver.py  (last line: one JSON object with the figures)
Timings are cold: the per-model layout table is built inside the measured time.
"""

import contextlib
import itertools
import json
import random
import time

from gpupart.core.errors import GpupartError
from gpupart.core.mig.catalogue import GpuModel, require_gpu_model
from gpupart.core.mig.layout import _layout_table, fit_layout, layout_counts
from gpupart.core.mig.planning import GpuInstanceState, plan_counts


def multisets(model: GpuModel) -> list[dict[str, int]]:
    ranges = [range(p.max_count + 1) for p in model.profiles]
    return [
        {p.name: n for p, n in zip(model.profiles, vector, strict=True) if n}
        for vector in itertools.product(*ranges)
    ]


def solve_all(model: GpuModel) -> tuple[int, int, float]:
    cases = multisets(model)
    _layout_table.cache_clear()
    start = time.perf_counter()
    feasible = sum(fit_layout(model, counts) is not None for counts in cases)
    return len(cases), feasible, time.perf_counter() - start


def node8(model: GpuModel, rng: random.Random) -> float:
    """Plan a repartition of 8 GPUs, each with a random current layout and some instances in use."""
    layouts = [layout for counts in multisets(model) if (layout := fit_layout(model, counts))]
    gpus = []
    for _ in range(8):
        current = rng.choice(layouts)
        actual = [GpuInstanceState(i, in_use=rng.random() < 0.3) for i in current]
        gpus.append((actual, layout_counts(rng.choice(layouts))))
    _layout_table.cache_clear()
    start = time.perf_counter()
    for index, (actual, counts) in enumerate(gpus):
        with contextlib.suppress(GpupartError):  # a blocked or infeasible GPU is an answer too
            plan_counts(model, index, actual, counts)
    return (time.perf_counter() - start) * 1000


def main() -> None:
    a100, h100 = require_gpu_model("A100-SXM4-80GB"), require_gpu_model("H100-SXM5-80GB")
    a100_n, a100_ok, a100_s = solve_all(a100)
    h100_n, h100_ok, h100_s = solve_all(h100)
    node_ms = node8(h100, random.Random(42))
    cases = multisets(a100)
    warm = time.perf_counter()
    for counts in cases:
        fit_layout(a100, counts)
    warm_s = time.perf_counter() - warm
    print(f"A100-80GB: {a100_n} multisets ({a100_ok} feasible) in {a100_s:.3f} s")
    print(f"H100-80GB: {h100_n} multisets ({h100_ok} feasible) in {h100_s:.3f} s")
    print(
        f"8-GPU node plan (cold table): {node_ms:.1f} ms; A100 multisets again, warm: {warm_s:.3f} s"
    )
    print(
        json.dumps(
            {
                "a100_multisets": a100_n,
                "a100_feasible": a100_ok,
                "a100_s": round(a100_s, 4),
                "h100_multisets": h100_n,
                "h100_s": round(h100_s, 4),
                "node8_ms": round(node_ms, 2),
                "a100_warm_s": round(warm_s, 4),
            }
        )
    )


if __name__ == "__main__":
    main()
