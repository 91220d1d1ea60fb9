"""GPU shares, the simulator's unit: a node view as the scoring policy's NodeLeftover, and the fragmentation term.

The bridge from scheduling's node views to `scoring` (the same policy code the simulator
replays): share of a shared pod in thousandths of a GPU, a node's free shares and CPU, the
fragmentation model over the observed mix of pod shapes, and the policy's score as a term.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping
from itertools import chain, repeat

from gpupart.core.api.resources import GpuRequest
from gpupart.core.api.spec import Mode
from gpupart.core.scheduling.scoring import (
    DEFAULT_POLICY,
    MILLI,
    FragmentationModel,
    NodeLeftover,
    Policy,
    Request,
    score_placement,
    typical_pods,
)
from gpupart.core.scheduling.views import GpuView, NodeView

UNLIMITED = 1 << 62
"""Room used in fragmentation states for memory, and for CPU on nodes whose CPU is unknown."""


def fragmentation_term(
    model: FragmentationModel,
    state: NodeLeftover,
    request: Request,
    gpus: tuple[int, ...],
    *,
    policy: Policy = DEFAULT_POLICY,
) -> float:
    """The simulator's policy score for placing `request` on `gpus`, divided by 100 (in [0, 1]).

    `scoring.score_placement`: for gpupart int(sigmoid((C_before - C_after) / 1000) * 100) with
    node cost C = F + S (FGD's expected fragmentation plus GPU share stranded without CPU), the
    number `scoring.score_node` gives the same placement. 1 = the placement lowers the cost most.
    """
    return score_placement(policy, state, request, gpus, model=model) / 100.0


def share_milli(memory_mib: int, compute_percent: int, gpu: GpuView, slots: int = 1) -> int:
    """A shared pod's GPU share in thousandths: the larger of its memory and compute shares.

    A pod that asks neither memory nor compute holds one client slot: 1000 / maxClients.
    """
    milli = compute_percent * 10
    if memory_mib and gpu.memory_mib:
        milli = max(milli, math.ceil(MILLI * memory_mib / gpu.memory_mib))
    if milli == 0:
        milli = math.ceil(MILLI * slots / gpu.replicas) if gpu.replicas else MILLI
    return min(MILLI, milli)


def node_leftover(node: NodeView) -> NodeLeftover:
    """The node as the simulator's policy sees it: free CPU and free thousandths of each non-MIG GPU.

    Free CPU is allocatable minus the pods' requests (millicores), as in the simulator; a node
    without allocatable CPU gets UNLIMITED, which turns the stranded-share term off (S = 0, FGD).
    Memory is UNLIMITED (GPU memory is in the shares). Whole GPUs in use are counted from the
    lowest index, as the simulator does (the device plugin picks which one, and fragmentation
    depends only on the multiset of free shares).
    """
    used_whole = sum(t.count for t in node.whole_tenants)
    left = []
    product = ""
    for gpu in node.gpus:
        if gpu.mode is Mode.MIG:
            continue
        product = product or gpu.product
        if gpu.mode.is_shared:
            used = sum(
                share_milli(t.memory_mib, t.compute_percent, gpu, t.count) for t in gpu.tenants
            )
            left.append(max(0, MILLI - used))
        elif used_whole > 0:
            used_whole -= 1
            left.append(0)
        else:
            left.append(MILLI)
    cpu_left = UNLIMITED if node.cpu_milli is None else max(0, node.cpu_milli - node.cpu_used_milli)
    return NodeLeftover(cpu_left, UNLIMITED, tuple(left), product)


Shape = tuple[int, int, int]
"""A GPU pod in the observed mix: (GPU count, milli per GPU, CPU millicores)."""


def fragmentation_model(shapes: Iterable[Shape]) -> FragmentationModel:
    """The simulator's FragmentationModel over an observed mix of pod shapes.

    Shapes go through `scoring.typical_pods`, so the extender's typical pods are chosen exactly
    as the simulator chooses them (most frequent shapes covering 95 % of pods, a pod without a
    CPU request counted as 100m), and `cpu_per_gpu` is the mix's CPU per GPU share.
    """
    return fragmentation_model_of(Counter(shapes))


def fragmentation_model_of(mix: Mapping[Shape, int]) -> FragmentationModel:
    """`fragmentation_model` from shape counts (one scoring Request per shape, `count` times)."""
    pods = chain.from_iterable(
        repeat(Request(cpu, 0, num, milli), count)
        for (num, milli, cpu), count in sorted(mix.items())
        if count > 0
    )
    return FragmentationModel.of(typical_pods(pods))


def demand_shape(request: GpuRequest, gpu: GpuView | None, cpu_milli: int = 0) -> Shape | None:
    """(GPU count, milli per GPU, CPU) of a request for the fragmentation mix; None for MIG."""
    if request.whole_gpus:
        return (request.whole_gpus, MILLI, cpu_milli)
    if request.shared and gpu is not None:
        milli = share_milli(request.memory_mib, request.compute_percent, gpu, request.shared)
        return (1, milli, cpu_milli)
    return None
