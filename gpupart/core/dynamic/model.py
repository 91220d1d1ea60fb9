"""What the dynamic MIG planner sees: GPUs with their instances and states, pending demand, policy."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from gpupart.core.api.spec import DEFAULT_DYNAMIC, DynamicMig
from gpupart.core.mig.catalogue import GpuModel
from gpupart.core.mig.layout import MigInstance


class Use(StrEnum):
    """The state of one GPU instance, as far as the planner is concerned."""

    IN_USE = "in-use"
    """Bound to a running or bound pod: never destroyed or moved."""
    IDLE = "idle"
    """Free since `Instance.since`: reusable as is; destroyable for a pending pod, or for the warm
    mix once older than the hysteresis."""
    RESERVED = "reserved"
    """Planned or created for a pending pod: treated as in use."""


@dataclass(frozen=True, slots=True, order=True)
class Instance:
    """A GPU instance of a dynamic GPU, with its state; `pod` is its user or the pod it is reserved for."""

    instance: MigInstance
    use: Use = Use.IDLE
    pod: str = ""
    since: float = 0.0
    """When it became idle (seconds, the caller's clock)."""

    @property
    def fixed(self) -> bool:
        return self.use is not Use.IDLE

    def describe(self, now: float) -> str:
        """E.g. ``1g.10gb in use at slot 2 by team-a/train``, for reasons a person reads."""
        where = f"{self.instance.profile} {self.use.replace('-', ' ')} at {self.instance.placement}"
        if self.use is Use.IN_USE:
            return f"{where} by {self.pod}"
        if self.use is Use.RESERVED:
            return f"{self.instance.profile} at {self.instance.placement} reserved for {self.pod}"
        return f"{where} for {now - self.since:g} s"


@dataclass(frozen=True, slots=True)
class Gpu:
    """One MIG GPU of the cluster: where it is, its model, its instances, the policy it follows."""

    node: str
    index: int
    model: GpuModel
    instances: tuple[Instance, ...] = ()
    policy: DynamicMig = DEFAULT_DYNAMIC

    @property
    def name(self) -> str:
        return f"{self.node} GPU {self.index}"


@dataclass(frozen=True, slots=True)
class MigDemand:
    """A pending pod's MIG request: one profile per instance (all on one node), priority, age."""

    pod: str
    profiles: tuple[str, ...]
    priority: int = 0
    pending_since: float = 0.0
    nodes: frozenset[str] | None = None
    """The nodes the pod may run on (its node selector and required node affinity); None: any."""

    def may_use(self, node: str) -> bool:
        return self.nodes is None or node in self.nodes


@dataclass(frozen=True, slots=True)
class Mix:
    """The observed demand mix: each profile's share of recent requests (sums to 1, or empty)."""

    shares: tuple[tuple[str, float], ...] = ()

    @classmethod
    def of(cls, counts: Mapping[str, float]) -> Mix:
        total = sum(value for value in counts.values() if value > 0)
        if total <= 0:
            return cls()
        return cls(tuple(sorted((p, v / total) for p, v in counts.items() if v > 0)))
