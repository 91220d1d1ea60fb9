"""Scheduling decisions through `evaluate`, on node views and demands built as the extender builds them.

Nodes come from `assemble_node` (inventory plus bound pods read by `tenant_of`), pods from
`parse_demand`; nothing here reaches into the term formulas. Covers: properties against a
reference written here (a fit never over-commits a GPU's memory with the reserve, its client
slots or its compute; it exists exactly when some GPU has room; required podAntiAffinity is
never violated; more free memory never turns a fit into a no-fit nor moves a no-fit further
from fitting; a MIG fit exists exactly when offered - in use - reserved for other pods covers
the request; a no-fit's shortfall is that of the closest GPU; the score is the documented
weighted mean), the direction of each term, the fragmentation term as the simulator's own
policy score, CPU counted as kube-scheduler counts it, and reading a Pod into a PodDemand.
The reasons a person reads are golden, all in one file: `scheduling_reasons.json`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpupart.core.api.pods import parse_pod_request, pod_cpu_milli
from gpupart.core.api.resources import GpuRequest, node_cpu_milli
from gpupart.core.api.spec import Mode
from gpupart.core.api.wire import PodAssignment
from gpupart.core.errors import InvalidInput
from gpupart.core.scheduling.demand import (
    PodDemand,
    parse_demand,
    tenant_of,
)
from gpupart.core.scheduling.evaluate import FailureKind, Fit, NoFit, Verdict, evaluate
from gpupart.core.scheduling.preemption import choose_victims
from gpupart.core.scheduling.scoring import (
    DEFAULT_POLICY,
    FragmentationModel,
    NodeLeftover,
    Policy,
    Request,
    score_node,
    score_placement,
)
from gpupart.core.scheduling.shares import demand_shape, fragmentation_model
from gpupart.core.scheduling.terms import AffinityScope, ScoringConfig, Strategy, Weights
from gpupart.core.scheduling.views import NodeView, PlacedPod, assemble_node
from gpupart_testsupport.objects import (
    H100_MIB,
    mig_gpu,
    pod,
    reserve,
    shared,
    shared_gpu,
    whole_gpu,
)

CONFIG = ScoringConfig()
MODEL = fragmentation_model([(1, 250, 0)] * 5 + [(1, 1000, 0)] * 5)
ONLY_HEADROOM = Weights(1, 0, 0, 0)
ONLY_PRIORITY = Weights(0, 1, 0, 0)
ONLY_FRAGMENTATION = Weights(0, 0, 0, 1)
ROOM = 1 << 40
"""CPU and memory that never run out in a hand-written NodeLeftover."""


def resources(replicas: int = 1, memory: int = 0, compute: int = 0) -> dict[str, str | int]:
    res = shared(memory, compute)
    res["nvidia.com/gpu.shared"] = replicas
    return res


def bound(
    name: str,
    res: dict[str, str | int],
    *,
    gpu: int | None = None,
    app: str = "",
    ns: str = "team-a",
    cpu: int = 0,
) -> PlacedPod:
    """A pod bound to node n1 as the extender's cache reads it (assigned to `gpu` if given)."""
    raw = pod(name, res, namespace=ns, node="n1", labels={"app": app} if app else None)
    request = parse_pod_request(raw)
    assignment = None
    if gpu is not None:
        assignment = PodAssignment("n1", gpu, f"GPU-{gpu:04d}", request.memory_mib)
    return PlacedPod(tenant_of(raw, request), request, assignment, cpu)


def on_gpu(
    name: str, gpu: int, *, memory: int = 0, compute: int = 0, app: str = "", ns: str = "team-a"
) -> PlacedPod:
    return bound(name, resources(1, memory, compute), gpu=gpu, app=app, ns=ns)


def ask(
    res: dict[str, str | int], *, app: str = "", priority: int | None = None, affinity: Any = None
) -> PodDemand:
    raw = pod(
        "new", res, labels={"app": app} if app else None, priority=priority, affinity=affinity
    )
    return parse_demand(raw, anti_affinity_label="app")


def decide(
    node: NodeView,
    demand: PodDemand,
    config: ScoringConfig = CONFIG,
    model: FragmentationModel = MODEL,
) -> Verdict:
    return evaluate(node, demand, config=config, model=model)


def fit(
    node: NodeView,
    demand: PodDemand,
    config: ScoringConfig = CONFIG,
    model: FragmentationModel = MODEL,
) -> Fit:
    verdict = decide(node, demand, config, model)
    assert isinstance(verdict, Fit), verdict
    return verdict


def no_fit(node: NodeView, demand: PodDemand, config: ScoringConfig = CONFIG) -> NoFit:
    verdict = decide(node, demand, config)
    assert isinstance(verdict, NoFit), verdict
    return verdict


def required_away_from(app: str) -> dict[str, Any]:
    term = {"labelSelector": {"matchLabels": {"app": app}}, "topologyKey": "gpupart.io/gpu"}
    return {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [term]}}


def documented_score(verdict: Fit, weights: Weights) -> int:
    """docs/extender.md: round(10 · Σ wᵢ·tᵢ / Σ wᵢ), at most 1 when the placement eats the reserve."""
    t = verdict.terms
    total = weights.headroom + weights.priority + weights.anti_affinity + weights.fragmentation
    if total <= 0:
        return 0
    mean = (
        weights.headroom * t.headroom
        + weights.priority * t.priority
        + weights.anti_affinity * t.anti_affinity
        + weights.fragmentation * t.fragmentation
    ) / total
    score = min(10, max(0, round(10 * mean)))
    return min(score, 1) if t.eats_reserve else score


# --- the reference: shared GPUs -----------------------------------------------------------------


@dataclass(frozen=True)
class Holder:
    memory: int
    compute: int
    replicas: int
    app: str


@dataclass(frozen=True)
class SharedGpu:
    memory: int
    replicas: int
    """0: no slot limit reported."""
    holders: tuple[Holder, ...]

    def used(self, what: str) -> int:
        return sum(getattr(h, what) for h in self.holders)

    @property
    def free_memory(self) -> int:
        """Tenants may report more than the GPU has (an inventory that shrank): none is free."""
        return max(0, self.memory - self.used("memory"))


@dataclass(frozen=True)
class Ask:
    replicas: int
    memory: int
    compute: int
    avoid: str
    """Required podAntiAffinity against pods with this app label ("" for none)."""


def build(gpus: list[SharedGpu]) -> NodeView:
    inventory = tuple(
        shared_gpu(i, memory=g.memory, clients=g.replicas) for i, g in enumerate(gpus)
    )
    pods = [
        bound(f"p{i}-{n}", resources(h.replicas, h.memory, h.compute), gpu=i, app=h.app)
        for i, g in enumerate(gpus)
        for n, h in enumerate(g.holders)
    ]
    return assemble_node("n1", inventory, pods)


def demand_of(a: Ask) -> PodDemand:
    return ask(
        resources(a.replicas, a.memory, a.compute),
        affinity=required_away_from(a.avoid) if a.avoid else None,
    )


def lacks(g: SharedGpu, a: Ask) -> int:
    """Thousandths of the ask this GPU lacks in its scarcest of slots, memory and compute."""

    def part(missing: int, wanted: int) -> int:
        return min(1000, math.ceil(1000 * max(missing, 0) / wanted)) if wanted else 0

    return max(
        part(g.used("replicas") + a.replicas - g.replicas, a.replicas) if g.replicas else 0,
        part(a.memory - g.free_memory, a.memory),
        part(a.compute - (100 - g.used("compute")), a.compute),
    )


def has_room(g: SharedGpu, a: Ask) -> bool:
    if g.replicas and g.used("replicas") + a.replicas > g.replicas:
        return False
    if a.memory and g.free_memory < a.memory:
        return False
    if a.compute and g.used("compute") + a.compute > 100:
        return False
    return not (a.avoid and any(h.app == a.avoid for h in g.holders))


def comfortable(g: SharedGpu, a: Ask) -> bool:
    """Room with the reserve kept: ceil(reserve_fraction × memory asked) MiB stay free."""
    return g.free_memory - a.memory >= math.ceil(CONFIG.reserve_fraction * a.memory)


holders = st.builds(
    Holder,
    memory=st.sampled_from([0, 1000, 5000, 12000, 20000]),
    compute=st.sampled_from([0, 10, 30, 60]),
    replicas=st.integers(1, 2),
    app=st.sampled_from(["", "web", "db"]),
)
shared_gpus = st.builds(
    SharedGpu,
    memory=st.sampled_from([16000, 24000, 40000]),
    replicas=st.sampled_from([0, 2, 4]),
    holders=st.lists(holders, max_size=3).map(tuple),
)
asks = st.builds(
    Ask,
    replicas=st.integers(1, 2),
    memory=st.sampled_from([0, 2000, 8000, 15000, 30000]),
    compute=st.sampled_from([0, 20, 50]),
    avoid=st.sampled_from(["", "", "db"]),
)


@settings(max_examples=300)
@given(st.lists(shared_gpus, min_size=1, max_size=4), asks)
def test_law_a_shared_fit_never_overcommits_and_exists_exactly_when_a_gpu_has_room(
    gpus: list[SharedGpu], a: Ask
) -> None:
    """Memory (with the reserve while another GPU keeps it), client slots and compute are never
    over-committed; required podAntiAffinity is never violated; a no-fit is short by what the
    closest GPU lacks, and unresolvable exactly when no GPU could take the pod even empty."""
    verdict = decide(build(gpus), demand_of(a))
    roomy = [g for g in gpus if has_room(g, a)]
    if isinstance(verdict, Fit):
        assert verdict.gpu is not None
        chosen = gpus[verdict.gpu]
        assert has_room(chosen, a)  # slots, memory, compute, anti-affinity
        if any(comfortable(g, a) for g in roomy):
            assert comfortable(chosen, a) and not verdict.terms.eats_reserve
        else:
            assert verdict.terms.eats_reserve and verdict.score <= 1
        assert 0 <= verdict.score <= 10 and verdict.score == documented_score(
            verdict, CONFIG.weights
        )
        for term in (verdict.terms.headroom, verdict.terms.priority, verdict.terms.anti_affinity):
            assert 0.0 <= term <= 1.0
        assert 0.0 <= verdict.terms.fragmentation <= 1.0
    else:
        assert roomy == []
        assert verdict.shortfall == min(lacks(g, a) for g in gpus)
        never = [bool(g.replicas and a.replicas > g.replicas) or a.memory > g.memory for g in gpus]
        assert verdict.unresolvable == all(never)
        if all(never):
            assert verdict.kind is FailureKind.TOO_SMALL


@given(st.lists(shared_gpus, min_size=1, max_size=4), asks, st.data())
def test_law_more_free_memory_never_hurts(
    gpus: list[SharedGpu], a: Ask, data: st.DataObject
) -> None:
    """Freeing memory on a GPU (a tenant shrinks) never turns a fit into a no-fit, never moves a
    no-fit further from fitting, and never lowers the score of spread scored by headroom alone.
    With the default weights the score moves either way (binpack prefers fuller GPUs, and the
    fragmentation term moves with the free shares): a probe of 3,000 cases found both."""
    busy = [(i, n) for i, g in enumerate(gpus) for n, h in enumerate(g.holders) if h.memory]
    if not busy:
        return
    i, n = data.draw(st.sampled_from(busy))
    old = gpus[i].holders[n]
    smaller = Holder(data.draw(st.integers(0, old.memory - 1)), old.compute, old.replicas, old.app)
    freed = list(gpus)
    freed[i] = SharedGpu(
        gpus[i].memory, gpus[i].replicas, (*gpus[i].holders[:n], smaller, *gpus[i].holders[n + 1 :])
    )
    spread = ScoringConfig(weights=ONLY_HEADROOM, strategy=Strategy.SPREAD)
    for config in (CONFIG, spread):
        before, after = (
            decide(build(gpus), demand_of(a), config),
            decide(build(freed), demand_of(a), config),
        )
        if isinstance(before, Fit):
            assert isinstance(after, Fit)
            if config is spread:
                assert after.score >= before.score
        elif isinstance(after, NoFit):
            assert after.shortfall <= before.shortfall


def test_the_shortfall_is_the_closest_gpus_not_the_first() -> None:
    """GPU 0 lacks half the memory, GPU 1 a quarter: the node is a quarter short."""
    inv = (shared_gpu(0, memory=20000), shared_gpu(1, memory=20000))
    node = assemble_node("n", inv, [on_gpu("a", 0, memory=12000), on_gpu("b", 1, memory=8000)])
    assert no_fit(node, ask(shared(16000))).shortfall == 250
    mig = no_fit(mig_node(2), ask({"nvidia.com/mig-3g.40gb": 1}))
    assert mig.shortfall == 1000  # no free slice of the two asked for by one
    whole = assemble_node(
        "w", (whole_gpu(0), whole_gpu(1), whole_gpu(2)), [bound("a", {"nvidia.com/gpu": 2})]
    )
    assert no_fit(whole, ask({"nvidia.com/gpu": 3})).shortfall == 667  # 2 of 3 missing


# --- MIG and whole GPUs against a reference ------------------------------------------------------


_MIG_INVENTORY = (
    mig_gpu(0, [("3g.40gb", 0, 4)]),
    mig_gpu(1, [("3g.40gb", 0, 4), ("1g.10gb", 4, 1)]),
)


def mig_node(used: int) -> NodeView:
    """node-7: GPU 0 with one 3g.40gb slice, GPU 1 with a 3g.40gb and a 1g.10gb; `used` 3g pods."""
    pods = [bound(f"train-{i}", {"nvidia.com/mig-3g.40gb": 1}) for i in range(used)]
    return assemble_node("node-7", _MIG_INVENTORY, pods)


@given(
    st.dictionaries(st.sampled_from(["1g.10gb", "3g.40gb"]), st.integers(0, 3), min_size=1),
    st.dictionaries(st.sampled_from(["1g.10gb", "3g.40gb"]), st.integers(0, 3)),
    st.sampled_from(["1g.10gb", "3g.40gb", "7g.80gb"]),
    st.integers(1, 3),
    st.lists(st.tuples(st.sampled_from(["team-a/new", "team-b/a", "team-b/b"]), st.integers(0, 7))),
)
def test_law_a_mig_fit_exists_exactly_when_enough_slices_are_free_for_the_pod(
    offered: dict[str, int],
    used: dict[str, int],
    profile: str,
    count: int,
    reserved: list[tuple[str, int]],
) -> None:
    """Free for the pod = offered - in use - reserved for other pods; `reserved` names a device
    by its position (past the last one: an instance that does not exist yet, which takes
    nothing); the first reservation of a device is the one that counts."""
    used = {p: min(n, offered.get(p, 0)) for p, n in used.items()}
    profiles = [p for p, n in offered.items() for _ in range(n)]
    slices = [(p, k, 1) for k, p in enumerate(profiles)]  # each at a placement of its own
    pods = [
        bound(f"{p}-{k}", {f"nvidia.com/mig-{p}": 1}) for p, n in used.items() for k in range(n)
    ]
    holds = [
        reserve(who, 0, *slices[k]) if k < len(slices) else reserve(who, 0, "3g.40gb", 20 + k, 1)
        for who, k in reserved
    ]
    holder: dict[int, str] = {}
    for who, k in reserved:
        if k < len(slices):
            holder.setdefault(k, who)
    others = sum(1 for k, who in holder.items() if slices[k][0] == profile and who != "team-a/new")
    own = any(slices[k][0] == profile and who == "team-a/new" for k, who in holder.items())
    node = assemble_node("n", (mig_gpu(0, slices),), pods, reservations=holds)
    verdict = decide(node, ask({f"nvidia.com/mig-{profile}": count}))
    total = offered.get(profile, 0)
    free = total - used.get(profile, 0) - others
    assert isinstance(verdict, Fit) == (free >= count)
    if isinstance(verdict, Fit):
        assert verdict.score == 10 or not own  # its reserved slice's node comes first
    else:
        assert verdict.unresolvable == (total - others < count)
        if total >= count:
            # A slice may be reserved and in use at once (the kubelet picks any of the profile).
            assert verdict.shortfall == math.ceil(1000 * (count - max(free, 0)) / count)


@given(st.integers(0, 4), st.integers(0, 4), st.integers(1, 5))
def test_law_a_whole_gpu_fit_exists_exactly_when_enough_gpus_are_free(
    total: int, used: int, count: int
) -> None:
    used = min(used, total)
    pods = [bound(f"w{k}", {"nvidia.com/gpu": 1}) for k in range(used)]
    node = assemble_node("n", tuple(whole_gpu(i) for i in range(total)), pods)
    verdict = decide(node, ask({"nvidia.com/gpu": count}))
    assert isinstance(verdict, Fit) == (total - used >= count)
    if isinstance(verdict, NoFit):
        assert verdict.unresolvable == (total < count)


def test_mig_fits_when_a_slice_of_the_profile_is_free() -> None:
    verdict = fit(mig_node(1), ask({"nvidia.com/mig-3g.40gb": 1}))
    assert verdict.gpu is None and 0 <= verdict.score <= 10  # the device plugin picks the slice


def test_mig_binpack_prefers_the_fuller_node() -> None:
    request = ask({"nvidia.com/mig-3g.40gb": 1})
    assert fit(mig_node(1), request).terms.headroom > fit(mig_node(0), request).terms.headroom


def test_whole_gpus_are_counted_per_node() -> None:
    one_used = assemble_node("n", (whole_gpu(0), whole_gpu(1)), [bound("a", {"nvidia.com/gpu": 1})])
    fit(one_used, ask({"nvidia.com/gpu": 1}))
    assert not no_fit(one_used, ask({"nvidia.com/gpu": 2})).unresolvable
    assert no_fit(one_used, ask({"nvidia.com/gpu": 3})).unresolvable


def test_summaries_are_equal_for_nodes_failing_alike() -> None:
    """What kube-scheduler counts under one reason: no node, GPU or pod names in the summary."""
    verdicts = [
        no_fit(
            assemble_node(f"n{n}", (shared_gpu(0, memory=20000),), [on_gpu(t, 0, memory=m)]),
            ask(shared(16000)),
        )
        for n, (t, m) in enumerate((("a", 5000), ("b", 9000)))
    ]
    assert verdicts[0].reason != verdicts[1].reason
    assert verdicts[0].summary == verdicts[1].summary


def test_pods_without_a_readable_gpu_count_against_the_node() -> None:
    node = assemble_node("n", (shared_gpu(0, memory=20000),), [bound("lost", shared(15000))])
    assert node.unplaced_tenants and not node.gpus[0].tenants
    assert no_fit(node, ask(shared(10000))).kind is FailureKind.IN_USE
    fit(node, ask(shared(5000)))


def test_modes_of_inventory_are_honoured() -> None:
    ts = assemble_node("n", (shared_gpu(0, mode=Mode.TIME_SLICING, clients=4),), ())
    fit(ts, ask(shared()))
    for only in (
        (mig_gpu(0, [("7g.80gb", 0, 8)]),),
        (whole_gpu(0),),
    ):
        verdict = no_fit(assemble_node("n", only, ()), ask(shared()))
        assert verdict.unresolvable and verdict.kind is FailureKind.NO_SUCH_RESOURCE
    assert (
        no_fit(assemble_node("n", None, ()), ask({"nvidia.com/gpu": 1})).kind
        is FailureKind.NO_INVENTORY
    )


# --- each term's direction ---------------------------------------------------------------------


def two_gpus(used_on_1: int, *, app: str = "", memory: int = 40000) -> NodeView:
    """Two shared GPUs of `memory` MiB; GPU 1 holds a pod using `used_on_1` MiB."""
    inv = (shared_gpu(0, memory=memory), shared_gpu(1, memory=memory))
    return assemble_node("n", inv, [on_gpu("a", 1, memory=used_on_1, app=app)])


def test_headroom_binpack_scores_the_share_used_and_spread_the_share_left() -> None:
    # 10000 MiB on an empty 40000 MiB GPU leaves 3/4; on one with 20000 used, 1/4.
    request = ask(shared(10000))
    for used, left in ((0, 0.75), (20000, 0.25)):
        node = assemble_node(
            "n", (shared_gpu(0, memory=40000),), [on_gpu("a", 0, memory=used)] if used else []
        )
        assert fit(node, request).terms.headroom == pytest.approx(1 - left)
        spread = ScoringConfig(strategy=Strategy.SPREAD)
        assert fit(node, request, spread).terms.headroom == pytest.approx(left)


def test_binpack_picks_the_fuller_gpu_and_spread_the_emptier() -> None:
    node, request = two_gpus(20000), ask(shared(10000))
    assert fit(node, request, ScoringConfig(weights=ONLY_HEADROOM)).gpu == 1
    assert (
        fit(node, request, ScoringConfig(weights=ONLY_HEADROOM, strategy=Strategy.SPREAD)).gpu == 0
    )


def test_reserve_is_kept_while_another_gpu_fits() -> None:
    # GPU 1 fits 10000 MiB exactly (reserve 1500 eaten); GPU 0 fits with room to spare.
    verdict = fit(two_gpus(30000), ask(shared(10000)))
    assert verdict.gpu == 0 and not verdict.terms.eats_reserve
    # With only the tight GPU left, the pod still fits but the node scores at most 1.
    tight = assemble_node("n", (shared_gpu(1, memory=40000),), [on_gpu("a", 1, memory=30000)])
    verdict = fit(tight, ask(shared(10000)))
    assert verdict.terms.eats_reserve and verdict.score <= 1


def test_high_priority_goes_where_contention_is_lowest_and_low_priority_packs() -> None:
    node = assemble_node(
        "n", (shared_gpu(0), shared_gpu(1)), [on_gpu("a", 1, memory=40000, compute=50)]
    )
    only = ScoringConfig(weights=ONLY_PRIORITY)
    high = fit(node, ask(shared(1000), priority=CONFIG.high_priority), only)
    low = fit(node, ask(shared(1000), priority=CONFIG.low_priority), only)
    assert high.gpu == 0 and low.gpu == 1
    middle = (CONFIG.high_priority + CONFIG.low_priority) // 2
    assert fit(node, ask(shared(1000), priority=middle), only).terms.priority == pytest.approx(0.5)


def test_same_app_avoids_sharing_a_gpu() -> None:
    node, request = two_gpus(30000, app="web", memory=H100_MIB), ask(shared(10000), app="web")
    verdict = fit(node, request)
    assert verdict.gpu == 0 and verdict.terms.anti_affinity == 1.0  # gpu scope: the node is fine
    other_app = fit(node, ask(shared(10000), app="db"), ScoringConfig(weights=Weights(1, 0, 1, 0)))
    assert other_app.gpu == 1  # binpack onto the used GPU
    alone = assemble_node("n", (shared_gpu(0),), [on_gpu("web-1", 0, memory=30000, app="web")])
    assert fit(alone, request).terms.anti_affinity == 0.0  # the only GPU holds one


def test_node_scope_penalises_a_same_app_pod_on_another_gpu() -> None:
    config = ScoringConfig(anti_affinity_scope=AffinityScope.NODE)
    node = two_gpus(30000, app="web", memory=H100_MIB)
    assert fit(node, ask(shared(10000), app="web"), config).terms.anti_affinity == 0.0


def test_a_same_app_mig_pod_may_share_the_gpu_the_device_plugin_picks() -> None:
    node = assemble_node(
        "n",
        (mig_gpu(0, [("3g.40gb", 0, 4), ("3g.40gb", 4, 4)]),),
        [bound("w", {"nvidia.com/mig-3g.40gb": 1}, app="web")],
    )
    request = ask({"nvidia.com/mig-3g.40gb": 1}, app="web")
    assert fit(node, request).terms.anti_affinity == 0.5
    assert (
        fit(
            node, request, ScoringConfig(anti_affinity_scope=AffinityScope.NODE)
        ).terms.anti_affinity
        == 0.0
    )
    assert fit(node, ask({"nvidia.com/mig-3g.40gb": 1}, app="db")).terms.anti_affinity == 1.0


def test_the_group_label_only_scores_also_for_a_pod_with_required_terms() -> None:
    """The same-app label is soft: a pod that also has a required term (away from db) still
    shares the only GPU with a pod of its own app, scored 0 for it, and never evicts it."""
    alone = assemble_node("n", (shared_gpu(0),), [on_gpu("web-1", 0, memory=30000, app="web")])
    request = ask(shared(10000), app="web", priority=1000, affinity=required_away_from("db"))
    assert fit(alone, request).terms.anti_affinity == 0.0
    everyone = frozenset({"team-a/web-1"})
    assert choose_victims(alone, request, evictable=everyone, budgets=(), config=CONFIG) is None


def test_required_pod_anti_affinity_excludes_the_gpu_in_its_namespace_only() -> None:
    new = parse_demand(
        pod("new", shared(1000), affinity=required_away_from("db")), anti_affinity_label="app"
    )
    node = assemble_node("n", (shared_gpu(0),), [on_gpu("db-0", 0, app="db")])
    assert no_fit(node, new).kind is FailureKind.ANTI_AFFINITY
    elsewhere = assemble_node("n", (shared_gpu(0),), [on_gpu("db-0", 0, app="db", ns="other")])
    fit(elsewhere, new)


@given(st.sampled_from([Weights(), Weights(1, 0, 1, 0), Weights(0, 0, 0, 0), Weights(3, 1, 0, 2)]))
def test_the_score_is_the_weighted_mean_of_the_terms(weights: Weights) -> None:
    for node, request in (
        (two_gpus(20000), ask(shared(8000))),
        (mig_node(1), ask({"nvidia.com/mig-3g.40gb": 1})),
    ):
        verdict = fit(node, request, ScoringConfig(weights=weights))
        assert verdict.score == documented_score(verdict, weights)
    if weights == Weights(0, 0, 0, 0):
        assert verdict.score == 0


# --- the fragmentation term is the simulator's policy ----------------------------------------------

# Typical pods: half a GPU with 4 cores, so the mix asks 8 millicores per GPU thousandth.
CPU_MODEL = fragmentation_model([(1, 500, 4000)] * 10)


def cpu_node(name: str, *, allocatable: int | None, used: int, gpu_used: int = 0) -> NodeView:
    """Two 40000 MiB MPS GPUs; GPU 0 holds a `gpu_used` MiB pod; CPU-only pods use `used` m."""
    inv = (shared_gpu(0, memory=40000), shared_gpu(1, memory=40000))
    pods = [bound("batch", {"cpu": f"{used}m"}, cpu=used)]
    if gpu_used:
        pods.append(on_gpu("infer", 0, memory=gpu_used))
    return assemble_node(name, inv, pods, cpu_milli=allocatable)


def test_the_fragmentation_term_prefers_the_gpu_that_keeps_typical_sizes_placeable() -> None:
    # Typical pods want 250 or a whole 1000. Free: GPU0 300, GPU1 1000. A 250 pod on GPU0 leaves
    # 50 (fragment) but keeps GPU1 whole; on GPU1 it breaks the only whole GPU.
    node = assemble_node(
        "n",
        (shared_gpu(0, memory=40000), shared_gpu(1, memory=40000)),
        [on_gpu("a", 0, memory=28000)],
    )
    verdict = fit(node, ask(shared(10000)), ScoringConfig(weights=ONLY_FRAGMENTATION))
    assert verdict.gpu == 0
    state = NodeLeftover(ROOM, ROOM, (300, 1000), "H100")
    on_whole = (
        score_placement(DEFAULT_POLICY, state, Request(0, 0, 1, 250), (1,), model=MODEL) / 100
    )
    assert 0.0 < on_whole < verdict.terms.fragmentation < 1.0


def test_the_fragmentation_model_uses_the_simulators_typical_pods() -> None:
    model = fragmentation_model([(1, 500, 0)] * 99 + [(2, 1000, 0)])
    shapes = {(t.request.num_gpu, t.request.gpu_milli) for t in model.typical}
    assert shapes == {(1, 500)}  # the 1 % shape falls outside the 95 % coverage
    assert fragmentation_model([]).typical == ()


def test_the_node_that_would_strand_gpu_share_without_cpu_scores_lower() -> None:
    # Same GPUs, same allocatable CPU; "drained" has 28 cores left, "roomy" 64. The pod takes a
    # quarter GPU and 24 cores: on "drained" 4 cores would be left for 1.75 free GPUs, which feed
    # only half a GPU at the mix's 8 cores per GPU.
    request = ask({**shared(10000), "cpu": "24"})
    assert request.cpu_milli == 24000
    roomy = fit(cpu_node("roomy", allocatable=64000, used=0), request, model=CPU_MODEL)
    drained = fit(cpu_node("drained", allocatable=64000, used=36000), request, model=CPU_MODEL)
    assert roomy.terms.fragmentation == 0.5  # nothing stranded before or after
    assert drained.terms.fragmentation == 0.22  # int(sigmoid(-1250 / 1000) * 100) / 100
    assert roomy.score > drained.score  # kube-scheduler sees the difference
    # FGD's F alone sees no difference: 4 cores still host a typical pod.
    for cpu_left in (64000, 28000):
        state = NodeLeftover(cpu_left, ROOM, (1000, 1000), "H100")
        assert (
            score_placement(Policy.FGD, state, Request(24000, 0, 1, 250), (0,), model=CPU_MODEL)
            == 50
        )
    # Without allocatable CPU the node degrades to FGD (S = 0): both score alike.
    blind = [
        fit(cpu_node(n, allocatable=None, used=u), request, model=CPU_MODEL)
        for n, u in (("a", 0), ("b", 36000))
    ]
    assert blind[0] == blind[1] == roomy


def test_the_fragmentation_term_is_score_node_of_the_default_policy() -> None:
    assert DEFAULT_POLICY is Policy.GPUPART
    # Extender side: GPU 0 has 30000 of 40000 MiB used (250 free thousandths), GPU 1 is empty;
    # 20 of 32 cores requested. The pod asks 8000 MiB (200 thousandths) and 6 cores.
    view = cpu_node("n1", allocatable=32000, used=20000, gpu_used=30000)
    shared_fit = fit(view, ask({**shared(8000), "cpu": "6"}), model=CPU_MODEL)
    # Simulator side: the same node and pod as the replay engine states them.
    state = NodeLeftover(12000, 256 * 1024, (250, 1000), shared_gpu(0).product)
    placement = score_node(DEFAULT_POLICY, state, Request(6000, 0, 1, 200), model=CPU_MODEL)
    assert placement is not None and placement.gpus == (shared_fit.gpu,) == (0,)
    assert shared_fit.terms.fragmentation == placement.score / 100 == 0.47
    # Whole GPUs too: the lowest free GPUs, scored as score_node scores them.
    pods = [bound("w", {"nvidia.com/gpu": 1, "cpu": "20"}, cpu=20000)]
    node = assemble_node("w", (whole_gpu(0), whole_gpu(1)), pods, cpu_milli=32000)
    whole_fit = fit(node, ask({"nvidia.com/gpu": 1, "cpu": "6"}), model=CPU_MODEL)
    wplace = score_node(
        DEFAULT_POLICY,
        NodeLeftover(12000, 1 << 20, (0, 1000), "H100"),
        Request(6000, 0, 1, 1000),
        model=CPU_MODEL,
    )
    assert wplace is not None and whole_fit.terms.fragmentation == wplace.score / 100


def test_the_policy_sees_whole_gpus_in_use_and_shared_shares_but_no_mig() -> None:
    """GPU 0 whole and taken, GPU 1 whole and free, GPU 2 MIG (left out), GPU 3 shared with
    400 of 1000 MiB used: the policy's state is (0, 1000, 600)."""
    inv = (whole_gpu(0), whole_gpu(1), mig_gpu(2, [("1g.10gb", 0, 1)]), shared_gpu(3, memory=1000))
    node = assemble_node("n", inv, [bound("w", {"nvidia.com/gpu": 1}), on_gpu("s", 3, memory=400)])
    state = NodeLeftover(ROOM, ROOM, (0, 1000, 600), "H100")
    whole_fit = fit(node, ask({"nvidia.com/gpu": 1}))
    assert (
        whole_fit.terms.fragmentation
        == score_placement(DEFAULT_POLICY, state, Request(0, 0, 1, 1000), (1,), model=MODEL) / 100
    )
    shared_fit = fit(node, ask(shared(300)))
    assert shared_fit.gpu == 3
    assert (
        shared_fit.terms.fragmentation
        == score_placement(DEFAULT_POLICY, state, Request(0, 0, 1, 300), (2,), model=MODEL) / 100
    )


def test_a_shared_pods_share_is_the_larger_of_memory_and_compute() -> None:
    """The mix's shapes (demand_shape): thousandths of the GPU, else one slot of its replicas."""
    gpu = assemble_node("n", (shared_gpu(0, memory=1000, clients=4),), ()).gpus[0]
    assert demand_shape(GpuRequest(shared=1, memory_mib=250), gpu) == (1, 250, 0)
    assert demand_shape(GpuRequest(shared=1, memory_mib=100, compute_percent=40), gpu) == (
        1,
        400,
        0,
    )
    assert demand_shape(GpuRequest(shared=1), gpu, 500) == (1, 250, 500)  # one of four slots
    assert demand_shape(GpuRequest(whole_gpus=2), None, 100) == (2, 1000, 100)
    assert demand_shape(GpuRequest(mig=(("1g.10gb", 1),)), None) is None


# --- reading pods --------------------------------------------------------------------------------


def test_cpu_of_a_pod_and_of_a_node_as_kube_scheduler_counts_them() -> None:
    raw = pod("p", {**shared(1000), "cpu": "1500m"})
    raw["spec"]["containers"].append({"name": "side", "resources": {"limits": {"cpu": "500m"}}})
    assert parse_demand(raw, anti_affinity_label="app").cpu_milli == 2000
    raw["spec"]["initContainers"] = [
        {"name": "sidecar", "restartPolicy": "Always", "resources": {"requests": {"cpu": "1"}}},
        {"name": "setup", "resources": {"requests": {"cpu": "2500m"}}},
    ]
    raw["spec"]["overhead"] = {"cpu": "100m"}
    # max(containers 2 + sidecar 1, setup 2.5 + sidecar 1) + overhead 0.1
    assert pod_cpu_milli(raw) == 3600
    assert pod_cpu_milli(pod("q", shared())) == 0
    raw["spec"]["overhead"] = {"cpu": "lots"}
    with pytest.raises(InvalidInput, match="overhead.cpu"):
        parse_demand(raw, anti_affinity_label="app")
    assert node_cpu_milli({"status": {"allocatable": {"cpu": "7910m"}}}) == 7910
    assert node_cpu_milli({"status": {"allocatable": {"cpu": "8"}}}) == 8000
    assert node_cpu_milli({"status": {"allocatable": {"memory": "1Gi"}}}) is None
    assert node_cpu_milli({"status": {"allocatable": {"cpu": "many"}}}) is None
    assert node_cpu_milli({}) is None


def test_parse_demand_reads_priority_group_and_request() -> None:
    d = parse_demand(
        pod("p", shared(2048, 25), labels={"app": "web"}, priority=500), anti_affinity_label="app"
    )
    assert d.pod == "team-a/p" and d.priority == 500 and d.group == "web"
    assert d.request == GpuRequest(shared=1, memory_mib=2048, compute_percent=25)


@pytest.mark.parametrize(
    ("res", "where"),
    [
        ({"nvidia.com/gpu.shared": "-1"}, "nvidia.com/gpu.shared"),
        ({"nvidia.com/gpu.shared": 1, "gpupart.io/gpu-memory": "10Gi"}, "gpupart.io/gpu-memory"),
        ({"nvidia.com/gpu.shared": 1, "gpupart.io/gpu-compute": 150}, "percentage"),
        ({"nvidia.com/gpu": "lots"}, "not a Kubernetes quantity"),
    ],
)
def test_parse_demand_refuses_bad_quantities(res: dict[str, str | int], where: str) -> None:
    with pytest.raises(InvalidInput, match=where):
        parse_demand(pod("p", res), anti_affinity_label="app")


def test_parse_demand_refuses_a_bad_priority_and_selector() -> None:
    raw = pod("p", shared())
    raw["spec"]["priority"] = "high"
    with pytest.raises(InvalidInput, match="priority"):
        parse_demand(raw, anti_affinity_label="app")
    bad_op = {
        "podAntiAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {"labelSelector": {"matchExpressions": [{"key": "app", "operator": "Near"}]}}
            ]
        }
    }
    with pytest.raises(InvalidInput, match="unknown operator"):
        parse_demand(pod("p", shared(), affinity=bad_op), anti_affinity_label="app")


@given(
    used=st.lists(st.integers(0, 40000), min_size=1, max_size=4),
    want=st.integers(1, H100_MIB),
    prio=st.integers(-5, 5000),
)
def test_law_a_fit_never_overcommits_memory_on_h100s(used: list[int], want: int, prio: int) -> None:
    inv = tuple(shared_gpu(i) for i in range(len(used)))
    node = assemble_node("n", inv, [on_gpu(f"p{i}", i, memory=m) for i, m in enumerate(used) if m])
    verdict = decide(node, ask(shared(want), priority=prio))
    if isinstance(verdict, Fit):
        assert verdict.gpu is not None and used[verdict.gpu] + want <= H100_MIB
        assert 0 <= verdict.score <= 10
    else:
        assert all(u + want > H100_MIB for u in used)


# --- golden reasons ------------------------------------------------------------------------------

GOLDEN = Path(__file__).with_name("scheduling_reasons.json")


def golden_cases() -> dict[str, tuple[NodeView, PodDemand]]:
    """Each way a node fails, as kube-scheduler's events and `kubectl describe pod` show it."""
    mig3 = {"nvidia.com/mig-3g.40gb": 1}
    one_whole_used = assemble_node(
        "n", (whole_gpu(0), whole_gpu(1)), [bound("a", {"nvidia.com/gpu": 1})]
    )
    two_shared = (shared_gpu(0, memory=20000), shared_gpu(1, memory=20000))
    return {
        "mig: every slice of the profile in use": (mig_node(2), ask(mig3)),
        "mig: fewer free slices than asked": (mig_node(1), ask({"nvidia.com/mig-3g.40gb": 2})),
        "mig: no slice of the profile": (mig_node(0), ask({"nvidia.com/mig-7g.80gb": 1})),
        "mig: fewer slices than asked, even free": (
            mig_node(0),
            ask({"nvidia.com/mig-3g.40gb": 3}),
        ),
        "whole: in use": (one_whole_used, ask({"nvidia.com/gpu": 2})),
        "whole: fewer GPUs than asked": (one_whole_used, ask({"nvidia.com/gpu": 3})),
        "whole: none offered whole": (
            assemble_node("n", two_shared, ()),
            ask({"nvidia.com/gpu": 1}),
        ),
        "no inventory": (
            assemble_node("n", None, (), problem="no GPU inventory"),
            ask({"nvidia.com/gpu": 1}),
        ),
        "shared: memory is per GPU": (
            assemble_node(
                "n", two_shared, [on_gpu("a", 0, memory=5000), on_gpu("b", 1, memory=5000)]
            ),
            ask(shared(16000)),
        ),
        "shared: larger than any GPU": (assemble_node("n", two_shared[:1], ()), ask(shared(30000))),
        "shared: client slots taken": (
            assemble_node("n", (shared_gpu(0, clients=2),), [on_gpu("a", 0), on_gpu("b", 0)]),
            ask(shared()),
        ),
        "shared: compute taken": (
            assemble_node("n", (shared_gpu(0),), [on_gpu("a", 0, compute=80)]),
            ask(shared(compute=30)),
        ),
        "shared: required podAntiAffinity": (
            assemble_node("n", (shared_gpu(0),), [on_gpu("db-0", 0, app="db")]),
            ask(shared(1000), affinity=required_away_from("db")),
        ),
        "shared: pods without a GPU assignment": (
            assemble_node("n", two_shared[:1], [bound("lost", shared(15000))]),
            ask(shared(10000)),
        ),
        "shared: only MIG here": (
            assemble_node("n", (mig_gpu(0, [("7g.80gb", 0, 8)]),), ()),
            ask(shared()),
        ),
        "mig: the free slice is reserved for another pod": (
            assemble_node(
                "node-7",
                _MIG_INVENTORY,
                [bound("train-0", mig3)],
                reservations=[reserve("team-b/a", 1, "3g.40gb", 0, 4)],
            ),
            ask(mig3),
        ),
        "mig: every slice reserved for other pods": (
            assemble_node(
                "node-7",
                _MIG_INVENTORY,
                (),
                reservations=[
                    reserve("team-b/a", 0, "3g.40gb", 0, 4),
                    reserve("team-b/b", 1, "3g.40gb", 0, 4),
                ],
            ),
            ask(mig3),
        ),
        "mig: fewer free slices than asked, one reserved": (
            assemble_node(
                "node-7", _MIG_INVENTORY, (), reservations=[reserve("team-b/a", 0, "3g.40gb", 0, 4)]
            ),
            ask({"nvidia.com/mig-3g.40gb": 2}),
        ),
        "mig: unreadable MIG plan": (
            assemble_node(
                "node-7",
                _MIG_INVENTORY,
                (),
                plan_problem="MIG plan unreadable: gpupart.io/mig-plan: not JSON (Expecting value: "
                "line 1 column 1 (char 0))",
            ),
            ask(mig3),
        ),
        "shared: many pods in the way": (
            assemble_node("n", two_shared[:1], [on_gpu(f"p{k}", 0, memory=4000) for k in range(5)]),
            ask(shared(8000)),
        ),
    }


def reason_record(verdict: Verdict) -> dict[str, Any]:
    assert isinstance(verdict, NoFit), verdict
    return {
        "reason": verdict.reason,
        "summary": verdict.summary,
        "kind": str(verdict.kind),
        "unresolvable": verdict.unresolvable,
        "shortfall": verdict.shortfall,
    }


def test_golden_reasons() -> None:
    """Every reason text, summary, kind and shortfall, as `scheduling_reasons.json` holds them."""
    want = json.loads(GOLDEN.read_text())
    got = {
        name: reason_record(decide(node, demand)) for name, (node, demand) in golden_cases().items()
    }
    assert got.keys() == want.keys()
    for name in want:
        assert got[name] == want[name], name


def test_a_container_above_the_gpus_mps_ceilings_is_refused_with_them_named() -> None:
    # The MPS daemon's defaults cap each client (container), whatever it asks: the filter refuses
    # such a pod there (no preemption can help), and passes one whose containers each fit.
    ceiling = dataclasses.replace(
        shared_gpu(0, clients=8), client_memory_mib=9216, client_compute_percent=25
    )
    node = assemble_node("n", (ceiling,), [])
    verdict = no_fit(node, ask(shared(20000, 20)))
    assert "GPU 0: MPS lets one container hold at most 9216 MiB and 25% compute" in verdict.reason
    assert verdict.unresolvable and verdict.kind is FailureKind.TOO_SMALL
    assert "MPS lets one" in no_fit(node, ask(shared(8000, 30))).reason
    fit(node, ask(shared(9216, 25)))
    two = pod("two", {})
    two["spec"]["containers"] = [
        {"name": n, "resources": {"limits": {k: str(v) for k, v in shared(8000, 20).items()}}}
        for n in ("a", "b")
    ]  # 16000 MiB and 40 % in all, each container within the ceilings
    fit(node, parse_demand(two, anti_affinity_label="app"))
    # A GPU without ceilings (time-slicing) takes the big pod.
    plain = assemble_node("t", (shared_gpu(0, mode=Mode.TIME_SLICING, clients=8),), [])
    fit(plain, ask(shared(20000, 30)))
