"""Preemption's victim selection on one GPU (gpupart.core.scheduling.preemption).

Covers: minimality and kube-scheduler's order (PDB violations, highest victim priority, count),
never a pod of equal or higher priority, PDB preference and counting, pods spread over two GPUs
of one node (victims all on one), required anti-affinity, compute and client slots, the memory
reserve, and a property test against a brute-force search. The preempt verb over HTTP is
tested with the extender (tests/extender/test_extender_preemption.py).
"""

from __future__ import annotations

from itertools import combinations
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpupart.core.api.resources import GpuRequest
from gpupart.core.api.selectors import NOTHING, AffinityTerm, selector_from_set
from gpupart.core.api.spec import Mode
from gpupart.core.errors import InvalidInput
from gpupart.core.scheduling.demand import PodDemand
from gpupart.core.scheduling.evaluate import Fit, evaluate
from gpupart.core.scheduling.preemption import Budget, choose_victims, parse_budget, violations
from gpupart.core.scheduling.shares import fragmentation_model
from gpupart.core.scheduling.terms import ScoringConfig
from gpupart.core.scheduling.views import GpuView, NodeView, Tenant

NO_RESERVE = ScoringConfig(reserve_fraction=0.0)
MODEL = fragmentation_model(())


def tenant(
    name: str, memory: int, priority: int = 0, *, slots: int = 1, compute: int = 0, **labels: str
) -> Tenant:
    return Tenant(
        f"team-a/{name}",
        "team-a",
        tuple(sorted(labels.items())),
        priority,
        slots,
        memory_mib=memory,
        compute_percent=compute,
    )


def gpu(index: int, *tenants: Tenant, memory: int = 40000, clients: int = 16) -> GpuView:
    return GpuView(
        index,
        f"GPU-{index}",
        "H100",
        memory,
        Mode.MPS,
        clients,
        tenants=tenants,
        used_memory_mib=sum(t.memory_mib for t in tenants),
        used_compute_percent=sum(t.compute_percent for t in tenants),
        used_replicas=sum(t.count for t in tenants),
    )


def demand(memory: int, priority: int = 1000, *, slots: int = 1, compute: int = 0) -> PodDemand:
    return PodDemand(
        "team-a/new",
        "team-a",
        GpuRequest(shared=slots, memory_mib=memory, compute_percent=compute),
        priority,
    )


def everyone(view: NodeView) -> frozenset[str]:
    return frozenset(t.pod for g in view.gpus for t in g.tenants)


def choose(
    view: NodeView,
    d: PodDemand,
    budgets: tuple[Budget, ...] = (),
    config: ScoringConfig = NO_RESERVE,
):
    return choose_victims(view, d, evictable=everyone(view), budgets=budgets, config=config)


def names(victims: Any) -> list[str]:
    return [t.pod.split("/")[1] for t in victims.pods]


# --- victim selection ----------------------------------------------------------------------


def test_the_fewest_victims_that_free_the_memory() -> None:
    view = NodeView("n", (gpu(0, tenant("s1", 10000), tenant("s2", 10000), tenant("big", 20000)),))
    found = choose(view, demand(20000))
    assert found is not None and names(found) == ["big"] and found.gpu == 0


def test_lowest_highest_priority_before_fewest_victims() -> None:
    view = NodeView(
        "n",
        (
            gpu(0, tenant("mid", 40000, 500)),
            gpu(1, tenant("low-a", 20000, 0), tenant("low-b", 20000, 0)),
        ),
    )
    found = choose(view, demand(40000))
    assert found is not None and found.gpu == 1 and names(found) == ["low-a", "low-b"]


def test_never_a_pod_of_equal_or_higher_priority() -> None:
    view = NodeView(
        "n",
        (
            gpu(0, tenant("peer", 20000, 1000), tenant("low", 20000)),
            gpu(1, tenant("boss", 40000, 2000)),
        ),
    )
    assert choose(view, demand(40000)) is None
    # Allowed to go but not named evictable (e.g. a pod nominated here, not yet bound): stays.
    view = NodeView("n", (gpu(0, tenant("a", 20000), tenant("b", 20000)),))
    assert (
        choose_victims(
            view, demand(40000), evictable=frozenset({"team-a/a"}), budgets=(), config=NO_RESERVE
        )
        is None
    )


def test_victims_are_on_one_gpu_of_a_node_with_pods_on_two() -> None:
    # 20000 MiB free in all on the node, 10000 per GPU: evicting one pod on each would not do.
    view = NodeView(
        "n",
        (
            gpu(0, tenant("x0", 15000, 10), tenant("y0", 15000, 20)),
            gpu(1, tenant("x1", 15000, 10), tenant("y1", 15000, 30)),
        ),
    )
    found = choose(view, demand(25000))
    assert found is not None
    # The lowest priority (10) on either GPU; GPU 0 by index: 10000 + 15000 free there.
    assert found.gpu == 0 and names(found) == ["x0"]
    assert {t.pod for t in found.pods} <= {t.pod for t in view.gpus[0].tenants}


def test_pdb_violations_first_and_counted() -> None:
    budget = Budget("team-a", "keep", selector_from_set({"app": "db"}), 0)
    view = NodeView(
        "n",
        (gpu(0, tenant("db", 40000, 0, app="db")), gpu(1, tenant("web", 40000, 500, app="web"))),
    )
    found = choose(view, demand(40000), (budget,))
    assert found is not None and names(found) == ["web"] and found.violations == 0
    only = NodeView("n", (gpu(0, tenant("db", 40000, 0, app="db")),))
    found = choose(only, demand(40000), (budget,))
    assert found is not None and names(found) == ["db"] and found.violations == 1
    # One disruption allowed: the first pod it covers uses it, the second violates.
    two = NodeView("n", (gpu(0, tenant("db-0", 20000, app="db"), tenant("db-1", 20000, app="db")),))
    found = choose(
        two, demand(40000), (Budget("team-a", "keep", selector_from_set({"app": "db"}), 1),)
    )
    assert found is not None and found.violations == 1


def test_budget_rules_as_kube_scheduler_reads_them() -> None:
    db = tenant("db", 1, app="db")
    assert violations([db], [Budget("team-a", "b", NOTHING, 0)]) == 0  # absent selector: none
    assert violations([db], [Budget("team-b", "b", selector_from_set({"app": "db"}), 0)]) == 0
    already = Budget("team-a", "b", selector_from_set({"app": "db"}), 0, frozenset({"db"}))
    assert violations([db], [already]) == 0  # the API server counted it already
    parsed = parse_budget(
        {
            "metadata": {"name": "b", "namespace": "team-a"},
            "spec": {
                "selector": {
                    "matchExpressions": [{"key": "app", "operator": "In", "values": ["db"]}]
                }
            },
            "status": {"disruptionsAllowed": 0, "disruptedPods": {"x": "2026-01-01T00:00:00Z"}},
        }
    )
    assert parsed.allowed == 0 and parsed.disrupted == {"x"} and violations([db], [parsed]) == 1
    assert parse_budget({"metadata": {"name": "e"}, "spec": {"selector": {}}}).selector.empty
    with pytest.raises(InvalidInput, match=r"status.disruptionsAllowed"):
        parse_budget({"metadata": {}, "spec": {}, "status": {"disruptionsAllowed": "1"}})
    with pytest.raises(InvalidInput, match=r"selector.matchExpressions\[0\].operator"):
        parse_budget(
            {"metadata": {}, "spec": {"selector": {"matchExpressions": [{"operator": "Near"}]}}}
        )


def test_client_slots_and_compute_count_like_memory() -> None:
    full = NodeView("n", (gpu(0, tenant("a", 0, slots=2), tenant("b", 0, slots=1), clients=3),))
    found = choose(full, demand(0, slots=2))
    assert found is not None and names(found) == ["a"]
    busy = NodeView("n", (gpu(0, tenant("c1", 0, compute=60), tenant("c2", 0, compute=30)),))
    found = choose(busy, demand(0, compute=50))
    assert found is not None and names(found) == ["c1"]
    assert choose(busy, demand(50000)) is None  # more than the GPU has: nothing helps


def test_a_pod_it_must_not_share_with_goes_too_or_the_gpu_is_out() -> None:
    d = PodDemand(
        "team-a/new",
        "team-a",
        GpuRequest(shared=1, memory_mib=10000),
        1000,
        terms=(_required(("app", "db")),),
    )
    view = NodeView("n", (gpu(0, tenant("db", 1000, 0, app="db")),))
    found = choose(view, d)
    assert found is not None and names(found) == ["db"]
    held = NodeView("n", (gpu(0, tenant("db", 1000, 2000, app="db")),))
    assert choose(held, d) is None


def _required(label: tuple[str, str]) -> Any:
    from gpupart.core.scheduling.demand import AntiAffinityTerm

    return AntiAffinityTerm(
        AffinityTerm(selector_from_set(dict([label])), frozenset({"team-a"})), True
    )


def test_the_reserve_is_freed_where_the_gpu_can_hold_it() -> None:
    view = NodeView("n", (gpu(0, tenant("a", 10000), tenant("b", 25000), memory=40000),))
    # 20000 + 15 % = 23000: evicting `a` leaves 15000 free; `b` leaves 30000.
    found = choose(view, demand(20000), config=ScoringConfig(reserve_fraction=0.15))
    assert found is not None and names(found) == ["b"]
    # 38000 + 15 % > 40000: the bare request.
    found = choose(view, demand(38000), config=ScoringConfig(reserve_fraction=0.15))
    assert found is not None and sorted(names(found)) == ["a", "b"]


@st.composite
def gpus_and_demand(draw: st.DrawFn) -> tuple[NodeView, PodDemand]:
    views = []
    for index in range(draw(st.integers(1, 2))):
        tenants = [
            tenant(
                f"p{index}-{n}",
                draw(st.sampled_from([0, 5000, 10000, 20000])),
                draw(st.sampled_from([0, 10, 500, 1000, 2000])),
                slots=draw(st.integers(1, 2)),
                compute=draw(st.sampled_from([0, 20, 50])),
                app=draw(st.sampled_from(["a", "b"])),
            )
            for n in range(draw(st.integers(0, 6)))
        ]
        views.append(gpu(index, *tenants, clients=draw(st.sampled_from([4, 8]))))
    d = demand(
        draw(st.sampled_from([0, 10000, 30000])),
        draw(st.sampled_from([500, 1000])),
        slots=draw(st.integers(1, 2)),
        compute=draw(st.sampled_from([0, 30])),
    )
    return NodeView("n", tuple(views)), d


@settings(max_examples=150, deadline=None)
@given(gpus_and_demand(), st.booleans())
def test_victims_make_room_and_no_cheaper_set_exists(
    case: tuple[NodeView, PodDemand], pdb: bool
) -> None:
    view, d = case
    budgets = (Budget("team-a", "b", selector_from_set({"app": "b"}), 1),) if pdb else ()
    found = choose(view, d, budgets)

    def fits_without(g: GpuView, gone: set[str]) -> bool:
        kept = tuple(t for t in g.tenants if t.pod not in gone)
        return isinstance(
            evaluate(
                NodeView("n", (gpu(g.index, *kept, memory=g.memory_mib, clients=g.replicas),)),
                d,
                config=NO_RESERVE,
                model=MODEL,
            ),
            Fit,
        )

    best = None
    for g in view.gpus:
        if fits_without(g, set()):
            continue
        lower = [t for t in g.tenants if t.priority < d.priority]
        for k in range(1, len(lower) + 1):
            for subset in combinations(lower, k):
                if fits_without(g, {t.pod for t in subset}):
                    ordered = sorted(subset, key=lambda t: (-t.priority, t.pod))
                    key = (violations(ordered, budgets), ordered[0].priority, k)
                    best = key if best is None or key < best else best
    if best is None:
        assert found is None
        return
    assert found is not None
    assert all(t.priority < d.priority for t in found.pods)
    on = next(g for g in view.gpus if g.index == found.gpu)
    assert {t.pod for t in found.pods} <= {t.pod for t in on.tenants}
    assert fits_without(on, {t.pod for t in found.pods})
    assert found.key[:3] == best


# --- the preempt verb, the cache's budgets and nominated pods --------------------------------
