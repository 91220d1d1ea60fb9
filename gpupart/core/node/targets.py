"""What each GPU of a node should be (a GpuConfig), from the desired annotation's groups; first naming a GPU wins."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from gpupart.core.api.spec import GpuConfig, Interface, Mode
from gpupart.core.api.wire import DESIRED_ANNOTATION, DesiredGroup
from gpupart.core.errors import InvalidInput

UNPARTITIONED = GpuConfig(Mode.NONE)
"""The target of a GPU that no partition selects: a whole GPU."""


def gpu_targets(groups: Iterable[DesiredGroup], indices: Iterable[int]) -> dict[int, GpuConfig]:
    """Each GPU index's target; the operator orders groups by priority, so the first match wins.

    A GPU that no group names returns to a whole GPU (the partition that held it was removed),
    served through the node's interface: the groups' (the operator never gives one node groups
    of two interfaces, ADR 023), so a DRA node never offers its other GPUs through the device
    plugin, where a pod asking `nvidia.com/gpu` would take that path instead of DRA's.
    A group that names a GPU twice, or one this node does not have, is InvalidInput: the
    operator never writes one, so the whole desired state is suspect and nothing is applied.
    MIG profiles asked zero times are left out of the target.
    """
    groups = tuple(groups)
    indices = tuple(indices)
    check_groups(groups, indices)
    node_interface = groups[0].config.interface if groups else Interface.DEVICE_PLUGIN
    unpartitioned = replace(UNPARTITIONED, interface=node_interface)
    targets = {}
    for index in indices:
        target = unpartitioned
        for group in groups:
            if group.gpus is None or index in group.gpus:
                config = group.config
                target = replace(config, mig=tuple((p, n) for p, n in config.mig if n))
                break
        targets[index] = target
    return targets


def check_groups(groups: Iterable[DesiredGroup], indices: Iterable[int]) -> None:
    """InvalidInput when a group names a GPU twice or a GPU index not among `indices`."""
    have = set(indices)
    for position, group in enumerate(groups):
        if group.gpus is None:
            continue
        where = f"{DESIRED_ANNOTATION}.groups[{position}].gpus"
        if len(set(group.gpus)) != len(group.gpus):
            raise InvalidInput(
                where, f"partition {group.partition} names a GPU twice: {list(group.gpus)[:64]}"
            )
        missing = sorted(set(group.gpus) - have)
        if missing:
            raise InvalidInput(
                where,
                f"partition {group.partition} names GPU {', '.join(map(str, missing[:8]))}; "
                f"this node has {_indices(have)}",
            )


def _indices(have: set[int]) -> str:
    if not have:
        return "no GPU"
    return "GPU " + ", ".join(map(str, sorted(have)))
