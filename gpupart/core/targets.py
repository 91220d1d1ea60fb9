"""What each GPU of a node should be, from the desired annotation's groups (first group naming a GPU wins)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from gpupart.core.spec import Disruption, Mode, MpsSettings
from gpupart.core.wire import DesiredGroup


@dataclass(frozen=True, slots=True)
class GpuTarget:
    """One GPU's wanted configuration; `partition` is None when no partition selects the GPU."""

    mode: Mode
    mig: tuple[tuple[str, int], ...] = ()
    mps: MpsSettings | None = None
    replicas: int = 0
    disruption: Disruption = Disruption.WHEN_IDLE
    partition: str | None = None

    @property
    def slots(self) -> int:
        if self.mode is Mode.MPS and self.mps is not None:
            return self.mps.max_clients
        if self.mode is Mode.TIME_SLICING:
            return max(1, self.replicas)
        return 0


UNPARTITIONED = GpuTarget(Mode.NONE)


def gpu_targets(groups: Iterable[DesiredGroup], indices: Iterable[int]) -> dict[int, GpuTarget]:
    """Each GPU index's target; the operator orders groups by priority, so the first match wins.

    A GPU that no group names returns to a whole GPU (the partition that held it was removed).
    """
    groups = tuple(groups)
    targets = {}
    for index in indices:
        target = UNPARTITIONED
        for group in groups:
            if group.gpus is None or index in group.gpus:
                target = GpuTarget(
                    mode=group.mode,
                    mig=tuple((p, n) for p, n in group.mig if n),
                    mps=group.mps,
                    replicas=group.replicas or 0,
                    disruption=group.disruption,
                    partition=group.partition,
                )
                break
        targets[index] = target
    return targets
