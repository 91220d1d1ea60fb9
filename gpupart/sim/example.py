"""The built-in example workload of `gpupart simulate`: a 1/20-scale miniature of the Alibaba
`default` trace (its node shapes and its pods' mix), generated from a seed.

Deterministic for a seed and needs no file, so the simulator runs anywhere out of the box. The
figures below are the trace's own (cluster-trace-gpu-v2023, `openb_node_list_gpu_node.csv` and
`openb_pod_list_default.csv`), read once and rounded; they were not chosen for any policy's result.
The trace's GPU models are renamed to MIG-capable products of the same GPU count so that
`--mig` can run the same example; nothing else in the replay depends on the model's name.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from gpupart.core.scheduling.scoring import MILLI
from gpupart.sim.trace import Node, Pod

EXAMPLE_SEED = 7
"""Seed of the example workload itself (the replay seed is separate)."""

# (name prefix, count, CPU milli, memory MiB, GPUs, model): the trace's node shapes, 1/20 of
# each (1,213 nodes, 6,212 GPUs there; 56 nodes, 290 GPUs here). The trace's G2 nodes (8 GPUs,
# 12 cores per GPU) hold most GPUs; its T4 nodes (2 GPUs, 52 cores per GPU) most spare CPU.
EXAMPLE_NODES: tuple[tuple[str, int, int, int, int, str], ...] = (
    ("a100-80", 27, 96_000, 393_216, 8, "A100-SXM4-80GB"),  # trace: 549 G2
    ("a100-pcie", 19, 104_000, 524_288, 2, "A100-PCIE-40GB"),  # 387 T4
    ("a100-40", 6, 16_000, 122_880, 2, "A100-SXM4-40GB"),  # 107 P100
    ("h100", 2, 128_000, 786_432, 8, "H100-SXM5-80GB"),  # 39 G3
    ("a100-40x4", 2, 32_000, 131_072, 4, "A100-SXM4-40GB"),  # 28 V100M16
)
# (kind, pods of that kind in the trace, CPU milli deciles of those pods): each pod draws its
# kind by these weights and its CPU uniformly among the ten deciles.
EXAMPLE_MIX: tuple[tuple[str, int, tuple[int, ...]], ...] = (
    ("cpu", 1088, (8000, 8000, 12500, 12500, 12500, 15400, 16500, 32000, 32000, 32000)),
    ("shared", 3078, (3152, 3152, 3152, 3152, 4000, 4152, 8000, 8000, 11908, 11908)),
    ("whole", 3911, (3152, 4000, 9810, 11300, 11300, 11400, 11400, 12000, 15700, 18708)),
    ("multi", 75, (14000, 17400, 32000, 32200, 64000, 64200, 64200, 88000, 88000, 120000)),
)
SHARED_SHARES: tuple[tuple[int, int], ...] = (
    (810, 1078),
    (470, 750),
    (320, 328),
    (650, 253),
    (230, 140),
    (460, 128),
    (590, 75),
    (160, 74),
    (550, 72),
    (220, 62),
)
"""(GPU share in thousandths, pods): the ten commonest shares of the trace's GPU-sharing pods
(96 % of them)."""
MULTI_GPUS: tuple[tuple[int, int], ...] = ((2, 16), (4, 15), (8, 44))
"""(GPUs, pods) of the trace's multi-GPU pods."""
EXAMPLE_PODS = 400
"""1/20 of the trace's 8,152 pods; replay tunes the count to the load."""


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
    weights = [entry[1] for entry in EXAMPLE_MIX]
    out = []
    for index in range(pods):
        kind, _, cpus = rng.choices(EXAMPLE_MIX, weights)[0]
        gpus, share = 1, MILLI
        if kind == "cpu":
            gpus, share = 0, 0
        elif kind == "shared":
            share = rng.choices([s for s, _ in SHARED_SHARES], [n for _, n in SHARED_SHARES])[0]
        elif kind == "multi":
            gpus = rng.choices([g for g, _ in MULTI_GPUS], [n for _, n in MULTI_GPUS])[0]
        cpu = rng.choice(cpus)
        memory = max(1024, cpu * 4 // 1000 * 1024)  # 4 GiB per core, as a typical request
        out.append(Pod(f"example-{index:04d}", cpu, memory, gpus, share, ()))
    return Example(example_nodes(), tuple(out))
