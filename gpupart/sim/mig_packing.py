"""MIG mode of the simulator: requests rounded up to MIG profiles and packed online onto GPUs whose
layouts the core's exact solver (`gpupart.core.mig.layout.fit_layout`) chooses, with a lower bound.

A shared request of s thousandths of a GPU takes the smallest profile with at least s * 7 / 1000
compute slices; whole-GPU requests take whole GPUs of one node. Instances never move once
placed (`keep`), so only layouts that extend the current one are considered.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from gpupart.core.mig.catalogue import GpuModel, MigProfile, require_gpu_model
from gpupart.core.mig.layout import Layout, fit_layout, layout_counts
from gpupart.core.scheduling.scoring import MILLI
from gpupart.sim.replay import arrivals
from gpupart.sim.trace import Node, Pod

COMPUTE_SLICES = 7
MEMORY_SLICES = 8


@dataclass(frozen=True, slots=True)
class MigResult:
    """What the MIG replay measured; `lower_bound_gpus` is a proven minimum for the accepted set."""

    arrived: int
    accepted: int
    rejected: int
    gpus: int
    gpus_used: int
    lower_bound_gpus: int
    requested_milli: int
    """GPU share the accepted requests asked for (before rounding up to profiles)."""
    granted_slices: int
    """Compute slices the accepted requests hold after rounding (whole GPUs count 7)."""
    profiles: dict[str, int]


def smallest_profile(model: GpuModel, share_milli: int) -> MigProfile:
    """The smallest plain profile (no media extensions) with compute for `share_milli`."""
    need = max(1, math.ceil(share_milli * COMPUTE_SLICES / MILLI))
    options = [p for p in model.profiles if "+" not in p.name and "-" not in p.name]
    fitting = [p for p in options if p.compute_slices >= need]
    return min(fitting, key=lambda p: (p.compute_slices, p.memory_slices, p.name))


def lower_bound(instances: Sequence[MigProfile], whole_gpus: int) -> int:
    """GPUs any layout needs: each GPU has 7 compute and 8 memory slices, at most 7 instances,
    and room for one instance of 4 or more compute slices."""
    if not instances:
        return whole_gpus
    compute = sum(p.compute_slices for p in instances)
    memory = sum(p.memory_slices for p in instances)
    large = sum(1 for p in instances if p.compute_slices >= 4)
    return whole_gpus + max(
        math.ceil(compute / COMPUTE_SLICES),
        math.ceil(memory / MEMORY_SLICES),
        math.ceil(len(instances) / COMPUTE_SLICES),
        large,
    )


def pack_mig(nodes: Sequence[Node], pods: Sequence[Pod], *, seed: int, load: float) -> MigResult:
    """Replay `pods` (same arrival protocol as `replay`) onto MIG GPUs, best fit by free slices."""
    rng = random.Random(seed)
    ordered = sorted(nodes, key=lambda node: node.name)
    models = [require_gpu_model(node.model) for node in ordered]
    capacity = sum(node.gpu_milli for node in ordered)
    sequence = arrivals(pods, capacity, load=load, rng=rng)
    layouts: list[list[Layout]] = [[() for _ in range(node.gpus)] for node in ordered]
    whole: list[list[bool]] = [[False] * node.gpus for node in ordered]
    cpu = [node.cpu_milli for node in ordered]
    memory = [node.memory_mib for node in ordered]
    accepted_instances: list[MigProfile] = []
    whole_gpus = accepted = requested = granted = 0
    profiles: dict[str, int] = {}
    for pod in sequence:
        hosts = [
            n
            for n, node in enumerate(ordered)
            if cpu[n] >= pod.cpu_milli
            and memory[n] >= pod.memory_mib
            and (pod.num_gpu == 0 or pod.accepts(node.model))
        ]
        target = -1
        if pod.num_gpu == 0:
            target = hosts[0] if hosts else -1
        elif pod.gpu_milli < MILLI:
            found = _place_instance(hosts, models, layouts, whole, pod.gpu_milli)
            if found is not None:
                target, profile = found
                profiles[profile.name] = profiles.get(profile.name, 0) + 1
                accepted_instances.append(profile)
                granted += profile.compute_slices
        else:
            for n in hosts:
                free = _empty_gpus(layouts[n], whole[n])
                if len(free) >= pod.num_gpu:
                    target = n
                    for index in free[: pod.num_gpu]:
                        whole[n][index] = True
                    whole_gpus += pod.num_gpu
                    granted += pod.num_gpu * COMPUTE_SLICES
                    break
        if target >= 0:
            cpu[target] -= pod.cpu_milli
            memory[target] -= pod.memory_mib
            accepted += 1
            requested += pod.total_gpu_milli
    used = sum(
        1
        for n in range(len(ordered))
        for i in range(len(layouts[n]))
        if layouts[n][i] or whole[n][i]
    )
    return MigResult(
        arrived=len(sequence),
        accepted=accepted,
        rejected=len(sequence) - accepted,
        gpus=capacity // MILLI,
        gpus_used=used,
        lower_bound_gpus=lower_bound(accepted_instances, whole_gpus),
        requested_milli=requested,
        granted_slices=granted,
        profiles=dict(sorted(profiles.items())),
    )


def _empty_gpus(layouts: list[Layout], whole: list[bool]) -> list[int]:
    """Indices of a node's GPUs holding neither MIG instances nor a whole-GPU pod."""
    return [i for i, layout in enumerate(layouts) if not layout and not whole[i]]


def _place_instance(
    hosts: list[int],
    models: list[GpuModel],
    layouts: list[list[Layout]],
    whole: list[list[bool]],
    share_milli: int,
) -> tuple[int, MigProfile] | None:
    """Put one instance on the fullest GPU whose layout can grow by it; empty GPUs last.

    Returns the node and the profile placed, or None when no GPU can take it.
    """
    candidates = []
    for n in hosts:
        model = models[n]
        for i, layout in enumerate(layouts[n]):
            if whole[n][i]:
                continue
            used = sum(
                model.require_profile(instance.profile).compute_slices for instance in layout
            )
            candidates.append((-used if layout else 1, n, i))
    candidates.sort()
    for _, n, i in candidates:
        profile = smallest_profile(models[n], share_milli)
        counts = layout_counts(layouts[n][i])
        counts[profile.name] = counts.get(profile.name, 0) + 1
        new_layout = fit_layout(models[n], counts, keep=layouts[n][i])
        if new_layout is not None:
            layouts[n][i] = new_layout
            return n, profile
    return None
