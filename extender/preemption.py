"""The preempt verb on one snapshot: which of kube-scheduler's candidate victims free what a GPU pod asks.

Shared-GPU pods: the cheapest set of lower-priority pods on one GPU (`choose_victims`), plus
the victims kube-scheduler chose that hold no shared GPU (it needed them for what it counts
in-tree); its victims on other GPUs are dropped, they free nothing for us. Where the GPU
already fits, kube-scheduler's victims stand. MIG and whole-GPU pods: kube-scheduler's victims
stand if their removal frees what the pod asks, else the node goes. See
docs/adr-005-preemption.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gpupart.core.scheduling.demand import PodDemand
from gpupart.core.scheduling.evaluate import Fit, evaluate
from gpupart.core.scheduling.preemption import Budget, choose_victims, order_victims, violations
from gpupart.core.scheduling.scoring import FragmentationModel
from gpupart.core.scheduling.terms import ScoringConfig

from .snapshot import Snapshot


@dataclass(frozen=True, slots=True)
class NodeVictims:
    """Victims on one candidate node (pod UIDs, highest priority first) and the PDB violations
    their eviction makes: a node of ExtenderPreemptionArgs or ExtenderPreemptionResult."""

    uids: tuple[str, ...]
    violations: int


@dataclass(frozen=True, slots=True)
class Freed:
    """The GPU of a node that the chosen victims free for the pod (to propose to the cache)."""

    gpu: int
    victims: tuple[str, ...]


def victims_on(
    snap: Snapshot,
    node: str,
    offered: NodeVictims,
    demand: PodDemand,
    uid: str,
    budgets: Sequence[Budget],
    scoring: ScoringConfig,
    model: FragmentationModel,
) -> tuple[NodeVictims | None, Freed | None]:
    """The victims that let pod `uid` fit on `node` (None: none do), and the GPU they free."""
    request = demand.request
    if not (request.mig or request.whole_gpus or request.shared):
        return offered, None  # not a GPU pod: nothing of ours to check
    # Lower-priority pods nominated here lose their nomination when this pod preempts
    # (kube-scheduler clears it); the pod's own reservation is its own.
    gone = {
        e.uid
        for e in snap.nominated_on(node)
        if e.uid == uid or e.placed.tenant.priority < demand.priority
    }
    if request.mig or request.whole_gpus:
        after = snap.view_excluding(node, gone | set(offered.uids))
        if after is None:
            return None, None
        verdict = evaluate(after, demand, config=scoring, model=model)
        return (offered if isinstance(verdict, Fit) else None), None
    view = snap.view_excluding(node, gone)
    if view is None:
        return None, None
    if isinstance(evaluate(view, demand, config=scoring, model=model), Fit):
        return offered, None  # the GPU has room: kube-scheduler's victims are for its own counts
    entries = {e.uid: e for e in snap.pods_on(node)}
    evictable = frozenset(
        e.key
        for e in entries.values()
        if e.placed.request.shared and e.placed.tenant.priority < demand.priority
    )
    chosen = choose_victims(view, demand, evictable=evictable, budgets=budgets, config=scoring)
    if chosen is None:
        return None, None
    by_key = {e.key: e for e in entries.values()}
    theirs = [u for u in offered.uids if not (u in entries and entries[u].placed.request.shared)]
    known = [entries[u].placed.tenant for u in theirs if u in entries]
    ordered = order_victims([*chosen.pods, *known])
    uids = tuple(by_key[t.pod].uid for t in ordered) + tuple(u for u in theirs if u not in entries)
    return NodeVictims(uids, violations(ordered, budgets)), Freed(chosen.gpu, uids)
