"""The built-in example workload of `gpupart simulate`: a small A100/H100 cluster and a mixed
workload of MIG-sized, shared (MPS-style) and whole-GPU requests, generated from a seed.

Deterministic for a seed and needs no file, so the simulator runs anywhere out of the box.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from gpupart.core.scheduling.scoring import MILLI
from gpupart.sim.trace import Node, Pod

EXAMPLE_SEED = 7
"""Seed of the example workload itself (the replay seed is separate)."""

# (name prefix, count, CPU milli, memory MiB, GPUs, model): 24 nodes, 160 GPUs.
EXAMPLE_NODES: tuple[tuple[str, int, int, int, int, str], ...] = (
    ("a100-80", 8, 128_000, 1_048_576, 8, "A100-SXM4-80GB"),
    ("a100-40", 8, 64_000, 524_288, 4, "A100-SXM4-40GB"),
    ("h100", 8, 192_000, 2_097_152, 8, "H100-SXM5-80GB"),
)
# (kind, weight, per-GPU share choices in thousandths, GPU count, CPU milli choices)
# MIG-sized shares are the compute fractions of the 1g/2g/3g/4g profiles (1/7 .. 4/7);
# MPS-style shares are round percentages of a GPU.
EXAMPLE_MIX: tuple[tuple[str, float, tuple[int, ...], int, tuple[int, ...]], ...] = (
    ("mig", 0.35, (142, 142, 285, 428, 571), 1, (2_000, 4_000, 8_000)),
    ("shared", 0.30, (250, 500, 500, 750), 1, (4_000, 8_000)),
    ("whole", 0.25, (MILLI,), 1, (8_000, 12_000, 16_000)),
    ("multi", 0.07, (MILLI,), 2, (16_000, 24_000)),
    ("node", 0.03, (MILLI,), 8, (64_000,)),
)
H100_ONLY_SHARE = 0.1
"""Share of whole-GPU pods pinned to H100 (a `gpu_spec` constraint)."""
EXAMPLE_PODS = 150
"""About 85 % of the example's GPU capacity; replay tunes it to the load."""


@dataclass(frozen=True, slots=True)
class Example:
    nodes: tuple[Node, ...]
    pods: tuple[Pod, ...]


def example_nodes() -> tuple[Node, ...]:
    nodes = []
    for prefix, count, cpu, memory, gpus, model in EXAMPLE_NODES:
        for index in range(count):
            nodes.append(Node(f"{prefix}-{index:02d}", cpu, memory, gpus, model))
    return tuple(nodes)


def example_workload(seed: int = EXAMPLE_SEED, *, pods: int = EXAMPLE_PODS) -> Example:
    """The example cluster and `pods` requests drawn from `EXAMPLE_MIX` with `seed`."""
    rng = random.Random(seed)
    kinds = [entry[0] for entry in EXAMPLE_MIX]
    weights = [entry[1] for entry in EXAMPLE_MIX]
    table = {entry[0]: entry for entry in EXAMPLE_MIX}
    out = []
    for index in range(pods):
        kind = rng.choices(kinds, weights)[0]
        _, _, shares, count, cpus = table[kind]
        share = rng.choice(shares)
        cpu = rng.choice(cpus)
        spec: tuple[str, ...] = ()
        if kind == "whole" and rng.random() < H100_ONLY_SHARE:
            spec = ("H100-SXM5-80GB",)
        memory = max(1024, cpu * 4 // 1000 * 1024)  # 4 GiB per core, as a typical request
        out.append(Pod(f"example-{index:04d}", cpu, memory, count, share, spec))
    return Example(example_nodes(), tuple(out))
