"""Preemption on shared GPUs: which lower-priority pods on one GPU to evict so a pod fits (pure).

kube-scheduler's preemption dry run counts only what it sees in-tree (client slots, CPU); it
cannot tell which pods hold the memory of which GPU. The extender's preempt verb asks
`choose_victims` for each candidate node: the cheapest set of pods, all on one shared GPU and
all of lower priority than the pod, whose removal lets the pod fit on that GPU (memory with the
reserve where the GPU can hold it, client slots, compute, required anti-affinity).

"Cheapest" is kube-scheduler's own order for victims (`pickOneNodeForPreemption`): fewest
PodDisruptionBudget violations, then the lowest highest-priority victim, then the fewest
victims, then the lowest sum of priorities. Pods of equal or higher priority are never chosen.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpupart.core.api.selectors import LabelSelector, parse_label_selector
from gpupart.core.errors import InvalidInput
from gpupart.core.scheduling.demand import PodDemand, must_avoid
from gpupart.core.scheduling.terms import ScoringConfig
from gpupart.core.scheduling.views import GpuView, NodeView, Tenant

SEARCH_STEPS = 20_000
"""Subsets tried per GPU before the best set found so far is taken (docs/extender.md, Priority
and preemption): the bound keeps one request's cost fixed whatever the GPU holds."""


_OFFSET = 1 << 31
"""Added to each priority in the sum (priorities are int32): the sum only grows with victims."""


@dataclass(frozen=True, slots=True)
class Budget:
    """A PodDisruptionBudget as kube-scheduler's preemption reads it."""

    namespace: str
    name: str
    selector: LabelSelector
    """`spec.selector`; an absent or empty one covers no pod (kube-scheduler's preemption)."""
    allowed: int
    """`status.disruptionsAllowed`."""
    disrupted: frozenset[str] = frozenset()
    """`status.disruptedPods`: names already counted by the API server, never counted again."""

    def covers(self, tenant: Tenant) -> bool:
        """kube-scheduler's `filterPodsWithPDBViolation`: a pod without labels, in another
        namespace, already in `disruptedPods`, or under an empty selector is not covered."""
        if not tenant.labels or tenant.namespace != self.namespace or self.selector.empty:
            return False
        if tenant.pod.partition("/")[2] in self.disrupted:
            return False
        return self.selector.matches(dict(tenant.labels))


def parse_budget(obj: Mapping[str, Any]) -> Budget:
    """A Budget from a policy/v1 PodDisruptionBudget object; InvalidInput names the field."""
    meta = obj.get("metadata")
    spec = obj.get("spec") or {}
    status = obj.get("status") or {}
    if not isinstance(meta, Mapping) or not isinstance(spec, Mapping):
        raise InvalidInput("PodDisruptionBudget", "metadata and spec must be objects")
    if not isinstance(status, Mapping):
        raise InvalidInput("PodDisruptionBudget.status", "must be an object")
    # A selector Kubernetes cannot build raises here: the extender then counts the budget for
    # no pod, as kube-scheduler does ("an invalid selector ... does not match the pod").
    selector = parse_label_selector(spec.get("selector"), "PodDisruptionBudget.spec.selector")
    allowed = status.get("disruptionsAllowed") or 0
    if not isinstance(allowed, int) or isinstance(allowed, bool):
        raise InvalidInput(
            "PodDisruptionBudget.status.disruptionsAllowed", f"must be an integer, got {allowed!r}"
        )
    disrupted = status.get("disruptedPods") or {}
    if not isinstance(disrupted, Mapping):
        raise InvalidInput("PodDisruptionBudget.status.disruptedPods", "must be an object")
    return Budget(
        str(meta.get("namespace") or "default"),
        str(meta.get("name") or ""),
        selector,
        allowed,
        frozenset(str(k) for k in disrupted),
    )


def violations(victims: Iterable[Tenant], budgets: Sequence[Budget]) -> int:
    """How many victims, evicted in this order, take a budget below zero (kube-scheduler's
    `filterPodsWithPDBViolation`: each victim uses one disruption of every budget covering it)."""
    if not budgets:
        return 0
    left = [b.allowed for b in budgets]
    count = 0
    for tenant in victims:
        violated = False
        for n, budget in enumerate(budgets):
            if budget.covers(tenant):
                left[n] -= 1
                violated = violated or left[n] < 0
        count += violated
    return count


@dataclass(frozen=True, slots=True)
class Victims:
    """Pods to evict, highest priority first (kube-scheduler reads the first as the highest)."""

    gpu: int
    pods: tuple[Tenant, ...]
    violations: int

    @property
    def key(self) -> tuple[int, int, int, int]:
        """kube-scheduler's order: PDB violations, highest priority, count, sum of priorities."""
        top = self.pods[0].priority if self.pods else -_OFFSET
        # Offset as kube-scheduler does, so that negative priorities add up to more, not less.
        total = sum(t.priority + _OFFSET for t in self.pods)
        return (self.violations, top, len(self.pods), total)


def order_victims(pods: Iterable[Tenant]) -> tuple[Tenant, ...]:
    """Highest priority first, then by name (a stable order for the same set)."""
    return tuple(sorted(pods, key=lambda t: (-t.priority, t.pod)))


def choose_victims(
    node: NodeView,
    demand: PodDemand,
    *,
    evictable: frozenset[str],
    budgets: Sequence[Budget],
    config: ScoringConfig,
) -> Victims | None:
    """The cheapest victims on one shared GPU of `node` whose removal lets `demand` fit there;
    None when no GPU can take it whatever is evicted (or it fits without evicting anything).

    Only tenants named in `evictable` (pod keys: bound pods of lower priority) may be chosen;
    the others, and every pod of equal or higher priority, stay.
    """
    request = demand.request
    if not request.shared:
        return None
    unplaced = sum(t.memory_mib for t in node.unplaced_tenants)
    shared = [g for g in node.gpus if g.mode.is_shared]
    room = sum(g.free_memory_mib for g in shared) - unplaced
    best: Victims | None = None
    for gpu in shared:
        found = _on_gpu(gpu, demand, evictable, budgets, config, room if unplaced else None)
        if found is not None and (best is None or found.key < best.key):
            best = found
    return best


def _on_gpu(
    gpu: GpuView,
    demand: PodDemand,
    evictable: frozenset[str],
    budgets: Sequence[Budget],
    config: ScoringConfig,
    node_room: int | None,
) -> Victims | None:
    request = demand.request
    if request.memory_mib > gpu.memory_mib:
        return None
    if gpu.replicas and request.shared > gpu.replicas:
        return None
    if request.compute_percent > 100:
        return None
    if not gpu.holds_client(demand.client_memory_mib, demand.client_compute_percent):
        return None
    reserve = math.ceil(config.reserve_fraction * request.memory_mib)
    if request.memory_mib + reserve > gpu.memory_mib:
        reserve = 0  # the GPU cannot hold the margin even empty: the bare request
    # Signed: a GPU can be over-committed for a while (victims terminating while a nominated
    # pod holds its reservation), and then more than the request has to go.
    free = gpu.memory_mib - gpu.used_memory_mib
    memory = max(0, request.memory_mib + reserve - free) if request.memory_mib else 0
    if node_room is not None and request.memory_mib:
        # Pods whose GPU is unknown use memory somewhere on the node: freed here, counted there.
        memory = max(memory, request.memory_mib - node_room)
    slots = max(0, gpu.used_replicas + request.shared - gpu.replicas) if gpu.replicas else 0
    compute = (
        max(0, gpu.used_compute_percent + request.compute_percent - 100)
        if request.compute_percent
        else 0
    )
    forced: list[Tenant] = []
    candidates: list[Tenant] = []
    for tenant in gpu.tenants:
        lower = tenant.priority < demand.priority and tenant.pod in evictable
        if demand.terms and must_avoid(tenant, demand, config.anti_affinity_label):
            if not lower:
                return None  # a pod the new one must not share with, and it may not go
            forced.append(tenant)
        elif lower:
            candidates.append(tenant)
    need = (
        memory - sum(t.memory_mib for t in forced),
        slots - sum(t.count for t in forced),
        compute - sum(t.compute_percent for t in forced),
    )
    if not forced and max(need) <= 0:
        return None  # fits already: nothing of ours to evict here
    chosen = _cheapest(forced, candidates, need, budgets)
    if chosen is None:
        return None
    pods = order_victims(chosen)
    return Victims(gpu.index, pods, violations(pods, budgets))


def _cheapest(
    forced: list[Tenant],
    candidates: list[Tenant],
    need: tuple[int, int, int],
    budgets: Sequence[Budget],
) -> list[Tenant] | None:
    """Branch and bound over the candidates for the set of the smallest `Victims.key` that,
    with `forced`, frees `need` (memory, slots, compute); None when even all of them do not."""
    # Cheap ones first, so that good sets are found early and bound the rest of the search.
    pool = sorted(
        candidates,
        key=lambda t: (violations([t], budgets), t.priority, -t.memory_mib, -t.count, t.pod),
    )
    sizes = [(t.memory_mib, t.count, t.compute_percent) for t in pool]
    # What all candidates from position i on free together: a set that cannot reach `need`
    # even with all of them is not extended.
    suffix = [(0, 0, 0)] * (len(pool) + 1)
    for i in range(len(pool) - 1, -1, -1):
        m, s, c = sizes[i]
        nm, ns, nc = suffix[i + 1]
        suffix[i] = (m + nm, s + ns, c + nc)
    if any(suffix[0][d] < need[d] for d in range(3)):
        return None
    best: list[Tenant] | None = None
    best_key: tuple[int, int, int, int] | None = None
    steps = 0
    chosen = list(forced)

    def key_of(pods: list[Tenant]) -> tuple[int, int, int, int]:
        return Victims(-1, order_victims(pods), violations(order_victims(pods), budgets)).key

    def search(i: int, left: tuple[int, int, int]) -> None:
        nonlocal best, best_key, steps
        steps += 1
        if steps > SEARCH_STEPS:
            return
        if max(left) <= 0:
            key = key_of(chosen)
            if best_key is None or key < best_key:
                best, best_key = list(chosen), key
            return  # more victims only cost more
        if i == len(pool) or any(suffix[i][d] < left[d] for d in range(3)):
            return
        if best_key is not None and chosen and key_of(chosen) >= best_key:
            return  # every key part only grows as victims are added
        m, s, c = sizes[i]
        chosen.append(pool[i])
        search(i + 1, (left[0] - m, left[1] - s, left[2] - c))
        chosen.pop()
        search(i + 1, left)

    search(0, need)
    return best
