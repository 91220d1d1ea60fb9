"""The score terms of scheduling, each in [0, 1], and their weighted mean on kube-scheduler's 0-10 scale.

Terms (formulas in docs/extender.md): memory headroom (binpack or spread), priority (high
priority wants low contention, low priority packs), anti-affinity (pods of one group avoid a GPU
or a node); the fragmentation term lives in `shares` (it is the simulator's policy score).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

MAX_SCORE = 10
"""kube-scheduler's MaxExtenderPriority; scores are 0..MAX_SCORE."""


class Strategy(StrEnum):
    BINPACK = "binpack"
    SPREAD = "spread"


class AffinityScope(StrEnum):
    GPU = "gpu"
    NODE = "node"


class Conflict(StrEnum):
    """How close the nearest pod of the same group (or matching an anti-affinity term) sits."""

    NONE = "none"
    NODE = "node"
    """On the node, on another GPU."""
    MAYBE_GPU = "maybe_gpu"
    """On the node, and the device plugin (not the extender) picks the GPU: it may be the same."""
    GPU = "gpu"


@dataclass(frozen=True, slots=True)
class Weights:
    headroom: float = 1.0
    priority: float = 1.0
    anti_affinity: float = 2.0
    fragmentation: float = 2.0


@dataclass(frozen=True, slots=True)
class ScoringConfig:
    weights: Weights = Weights()
    strategy: Strategy = Strategy.BINPACK
    reserve_fraction: float = 0.15
    """Per GPU, keep this share of the pod's memory request free for peaks while another GPU fits."""
    anti_affinity_scope: AffinityScope = AffinityScope.GPU
    high_priority: int = 1000
    """`spec.priority` at and above which a pod gets the least contended GPU."""
    low_priority: int = 0
    """`spec.priority` at and below which a pod packs tightest."""
    anti_affinity_label: str = "app"
    """Pods with the same value of this label avoid sharing a GPU ("" turns the term off)."""


@dataclass(frozen=True, slots=True)
class Terms:
    headroom: float
    priority: float
    anti_affinity: float
    fragmentation: float
    eats_reserve: bool = False


def headroom_term(left_after: float, capacity: float, strategy: Strategy) -> float:
    """Share of capacity left after placing: binpack scores 1 - share, spread scores share."""
    if capacity <= 0:
        return 0.0
    share = min(1.0, max(0.0, left_after / capacity))
    return 1.0 - share if strategy is Strategy.BINPACK else share


def priority_level(priority: int, config: ScoringConfig) -> float:
    """`spec.priority` mapped linearly to [0, 1] between the low and high marks."""
    span = config.high_priority - config.low_priority
    if span <= 0:
        return 1.0 if priority >= config.high_priority else 0.0
    return min(1.0, max(0.0, (priority - config.low_priority) / span))


def priority_term(priority: int, contention: float, config: ScoringConfig) -> float:
    """h * (1 - c) + (1 - h) * c: high priority (h=1) wants low contention c, low priority packs."""
    level = priority_level(priority, config)
    c = min(1.0, max(0.0, contention))
    return level * (1.0 - c) + (1.0 - level) * c


def anti_affinity_term(conflict: Conflict, scope: AffinityScope) -> float:
    """1 with no same-group pod near; 0 when one shares the GPU (or the node, with scope node)."""
    if conflict is Conflict.GPU:
        return 0.0
    if conflict is Conflict.MAYBE_GPU:
        return 0.0 if scope is AffinityScope.NODE else 0.5
    if conflict is Conflict.NODE:
        return 0.0 if scope is AffinityScope.NODE else 1.0
    return 1.0


def combine(terms: Terms, weights: Weights) -> int:
    """Weighted mean of the terms scaled to 0..10; a placement eating the reserve scores at most 1."""
    total = weights.headroom + weights.priority + weights.anti_affinity + weights.fragmentation
    if total <= 0:
        return 0
    mean = weighted_sum(terms, weights) / total
    score = min(MAX_SCORE, max(0, round(mean * MAX_SCORE)))
    return min(score, 1) if terms.eats_reserve else score


def weighted_sum(terms: Terms, weights: Weights) -> float:
    return (
        weights.headroom * terms.headroom
        + weights.priority * terms.priority
        + weights.anti_affinity * terms.anti_affinity
        + weights.fragmentation * terms.fragmentation
    )
