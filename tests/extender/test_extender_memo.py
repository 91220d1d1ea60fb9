"""The verdict memo (per node state and pod shape) never answers differently from a fresh evaluation.

Random event sequences on a few nodes with equal inventories (so states are shared between
nodes and come back after changes), random demands, anti-affinity labels and terms, CPU
requests (GPU pods and CPU-only pods) and allocatable CPU that changes or goes missing: after
every step, filter and prioritize answers must equal `evaluate` on the node's current view.
The same name lists come back again and again, so most answers come from a patched list memo.
MIG plans reserve slices for the asking pods ("new", "other") or a bound one, some of instances
not made yet, expiring as the clock moves: a pod with a reservation on a node must get its own
verdict there, never one kept for its shape.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from extender_objects import FakeBinder
from hypothesis import HealthCheck, given, settings
from hypothesis import event as note
from hypothesis import strategies as st

from gpupart.core.api.wire import PodAssignment
from gpupart.core.scheduling.demand import parse_demand
from gpupart.core.scheduling.evaluate import Fit, NoFit, evaluate
from gpupart.core.scheduling.terms import Weights
from gpupart.core.scheduling.views import anonymous
from gpupart_extender.answers import DETAILED_NODES
from gpupart_extender.cache import NODE, POD, ClusterCache
from gpupart_extender.metrics import Metrics
from gpupart_extender.objects import PodEntry, read_pod
from gpupart_extender.service import ExtenderService
from gpupart_extender.settings import ExtenderSettings
from gpupart_testsupport.objects import (
    keys,
    mig_gpu,
    node,
    pod,
    reserve,
    shared,
    shared_gpu,
    whole_gpu,
)

NODES = ["n0", "n1", "n2", "n3"]
MEMORY = 40000
ALLOCATABLE = [None, "4", "64"]
"""A node's allocatable CPU: unknown (the policy degrades to FGD), scarce, plenty."""


def _inventory(kind: int) -> list[Any]:
    if kind == 0:
        return [shared_gpu(0, memory=MEMORY, clients=4), shared_gpu(1, memory=MEMORY, clients=4)]
    if kind == 1:
        return [mig_gpu(0, [("3g.40gb", 0, 4), ("3g.40gb", 4, 4)]), whole_gpu(1)]
    return [whole_gpu(0), whole_gpu(1)]


_gpu_resources = st.one_of(
    st.builds(
        shared,
        memory=st.sampled_from([0, 5000, 10000, 20000, 35000]),
        compute=st.sampled_from([0, 20, 50]),
    ),
    st.just({"nvidia.com/mig-3g.40gb": 1}),
    st.sampled_from([{"nvidia.com/gpu": 1}, {"nvidia.com/gpu": 2}]),
    st.just({}),  # a CPU-only pod
)
_cpu = st.sampled_from([None, "500m", "2", "6"])


def _with_cpu(resources: dict[str, str | int], cpu: str | None) -> dict[str, str | int]:
    return resources if cpu is None else {**resources, "cpu": cpu}


_resources = st.builds(_with_cpu, _gpu_resources, _cpu)
_asked = st.builds(
    _with_cpu,
    st.sampled_from(
        [
            shared(10000),
            {"nvidia.com/mig-3g.40gb": 1},
            {"nvidia.com/mig-3g.40gb": 1},
            {"nvidia.com/mig-3g.40gb": 2},
            {"nvidia.com/gpu": 1},
        ]
    ),
    st.sampled_from([None, "4"]),
)
_labels = st.sampled_from([{}, {"app": "a"}, {"app": "b"}])
_affinity = st.sampled_from(
    [
        None,
        {
            "podAntiAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": [
                    {"labelSelector": {"matchLabels": {"app": "b"}}}
                ]
            }
        },
    ]
)

_order = st.permutations([*NODES, "ghost"])
_asking = st.sampled_from(["new", "other"])
"""The pending pods (namespace team-a); plans reserve slices for them."""
_plan = st.lists(
    st.tuples(
        st.sampled_from(["team-a/new", "team-a/other", "team-a/p1"]),
        st.sampled_from([0, 4, 8]),  # 3g.40gb at 0+4 and 4+4 exist (inventory 1), 8+4 never
        st.sampled_from([20.0, 60.0, 1e6, 1e6]),  # expires, after the event's time
    ),
    max_size=3,
)
_events = st.lists(
    st.one_of(
        # (op, node index, pod index, resources, labels, gpu)
        st.tuples(
            st.sampled_from(["add", "delete", "finish"]),
            st.integers(0, len(NODES) - 1),
            st.integers(0, 5),
            _resources,
            _labels,
            st.sampled_from([None, 0, 1]),
        ),
        st.tuples(
            st.just("inventory"),
            st.integers(0, len(NODES) - 1),
            st.integers(0, 2),
            st.sampled_from(ALLOCATABLE),
            _plan,
        ),
        st.tuples(st.just("assume"), st.integers(0, len(NODES) - 1), st.integers(0, 5)),
        st.tuples(st.just("forget"), st.integers(0, 5)),
        st.tuples(st.just("late")),
        # Few distinct demands, asked often: answers come from the memo most of the time.
        # kube-scheduler lists the same nodes in a new order each time (parallel filter).
        st.tuples(st.just("ask"), _asked, _labels, _affinity, _asking, _order),
        st.tuples(st.just("ask"), _asked, _labels, _affinity, _asking, _order),
    ),
    min_size=5,
    max_size=60,
)


def _reservations(plan: list[Any], now: float) -> list[Any]:
    return [reserve(who, 0, "3g.40gb", start, 4, expires=now + t) for who, start, t in plan]


class _Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def _fresh_score(
    cache: ClusterCache, service: ExtenderService, clock: _Clock, p: Any, name: str
) -> int:
    view = cache.snapshot.view(name)
    assert view is not None
    demand = parse_demand(p, anti_affinity_label="app")
    fresh = evaluate(view, demand, config=service.scoring, model=service.model(clock()))
    return fresh.score if isinstance(fresh, Fit) else 0


def _apply(
    cache: ClusterCache, service: ExtenderService, clock: _Clock, event: Any, asked: list[Any]
) -> None:
    op = event[0]
    if op == "inventory":
        held = _reservations(event[4], clock.now)
        cache.apply(
            NODE,
            "MODIFIED",
            node(NODES[event[1]], _inventory(event[2]), cpu=event[3], reservations=held),
        )
    elif op in ("add", "delete", "finish"):
        _, n, k, resources, labels, gpu = event
        name = NODES[n]
        assignment = None
        if gpu is not None and "nvidia.com/gpu.shared" in resources:
            memory = int(resources.get("gpupart.io/gpu-memory", 0))
            compute = int(resources.get("gpupart.io/gpu-compute", 0))
            assignment = PodAssignment(name, gpu, f"GPU-{gpu:04d}", memory, compute)
        obj = pod(f"p{k}", resources, node=name, labels=labels, assignment=assignment)
        if op == "finish":
            obj["status"]["phase"] = "Succeeded"
        cache.apply(POD, "DELETED" if op == "delete" else "MODIFIED", obj)
    elif op == "assume":
        _, n, k = event
        resources = {**shared(5000), "cpu": "3"}
        entry = read_pod(pod(f"x{k}", resources, node=NODES[n], labels={"app": "a"}))
        assert entry is not None
        cache.assume(PodEntry(f"assumed-{k}", entry.key, NODES[n], entry.placed), expires=1e9)
    elif op == "forget":
        cache.forget(f"assumed-{event[1]}")
    elif op == "late":
        # prioritize with the survivors of an earlier filter, the cluster changed since:
        # a node that no longer fits is still scored (0), never left out.
        if asked:
            p, passed = asked[-1]
            scores = dict(service.prioritize(p, passed))
            assert set(scores) == set(passed)
            for name in passed:
                assert scores[name] == _fresh_score(cache, service, clock, p, name)
    else:
        _, resources, labels, affinity, asking, names = event
        # Both pending pods ask alike, one after the other: a verdict kept for the shape must
        # not leak from one to the other where either holds a reservation.
        for who in (asking, "other" if asking == "new" else "new"):
            _ask(
                cache,
                service,
                clock,
                pod(who, resources, labels=labels, affinity=affinity),
                names,
                asked,
            )


def _ask(
    cache: ClusterCache,
    service: ExtenderService,
    clock: _Clock,
    p: Any,
    names: list[str],
    asked: list[Any],
) -> None:
    outcome = service.filter(p, names)
    scores = dict(service.prioritize(p, names))
    model = service.model(clock())
    demand = parse_demand(p, anti_affinity_label="app")
    verdicts = {}
    for name in NODES:
        view = cache.snapshot.view(name)
        assert view is not None
        if any(r.pod == demand.pod for r in view.reserved) and demand.request.mig:
            note("asked where it holds a reservation")
        verdicts[name] = evaluate(view, demand, config=service.scoring, model=model)
    # In full: the first failed nodes by (resolvable first, closest, name), "ghost"
    # (unknown: the farthest) included.
    failing = [
        (int(v.unresolvable), v.shortfall, n) for n, v in verdicts.items() if isinstance(v, NoFit)
    ]
    in_full = {n for *_, n in sorted([*failing, (0, 1000, "ghost")])[:DETAILED_NODES]}
    for name, fresh in verdicts.items():
        if isinstance(fresh, Fit):
            assert name in outcome.passed and scores[name] == fresh.score
        else:
            where = outcome.unresolvable if fresh.unresolvable else outcome.failed
            text = fresh.reason if name in in_full else fresh.summary
            assert where.get(name) == text and scores[name] == 0
            assert name not in fresh.summary
    assert "ghost" in outcome.failed and scores["ghost"] == 0
    # The survivors, as kube-scheduler sends them to prioritize: a list of its own.
    assert service.prioritize(p, list(outcome.passed)) == [(n, scores[n]) for n in outcome.passed]
    asked.append((p, list(outcome.passed)))


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    kinds=st.lists(st.integers(0, 2), min_size=len(NODES), max_size=len(NODES)),
    cpus=st.lists(st.sampled_from(ALLOCATABLE), min_size=len(NODES), max_size=len(NODES)),
    events=_events,
    policy_only=st.booleans(),
    kept_lists=st.sampled_from([1, 16]),
    plans=st.lists(_plan, min_size=len(NODES), max_size=len(NODES)),
)
def test_memoised_answers_equal_a_fresh_evaluation(
    kinds: list[int],
    cpus: list[str | None],
    events: list[Any],
    policy_only: bool,
    kept_lists: int,
    plans: list[Any],
) -> None:
    """`policy_only`: the score is the fragmentation term alone, so a memo that missed a change
    the policy sees (CPU use, allocatable, the mix) shows in the 0-10 score. `kept_lists`: the
    bound on kept name lists across pod shapes."""
    clock = _Clock()
    cache = ClusterCache(keys=keys, wall=clock)
    cache.replace(
        NODE,
        [
            node(n, _inventory(k), cpu=c, reservations=_reservations(plan, clock.now))
            for n, k, c, plan in zip(NODES, kinds, cpus, plans, strict=True)
        ],
    )
    cache.replace(POD, [])
    scoring = ExtenderSettings().scoring()
    if policy_only:
        scoring = dataclasses.replace(scoring, weights=Weights(0, 0, 0, 1))
    service = ExtenderService(
        cache,
        scoring,
        keys=keys,
        binder=FakeBinder(),
        metrics=Metrics(),
        clock=clock,
        kept_lists=kept_lists,
    )
    asked: list[Any] = []
    for event in events:
        _apply(cache, service, clock, event, asked)
        # kept_lists=1: shapes take each other's kept list, answers must not change.
        assert sum(len(m.batches) for m in service._memo.shapes.values()) <= kept_lists
        clock.now += 7  # the model is looked at again now and then (refresh 60 s)


def test_nodes_in_the_same_state_share_a_state_id_up_to_pod_names() -> None:
    cache = ClusterCache(keys=keys)
    cache.replace(NODE, [node(n, _inventory(0)) for n in NODES[:3]])
    a0 = PodAssignment("n0", 0, "GPU-0000", 5000)
    a1 = PodAssignment("n1", 0, "GPU-0000", 5000)
    cache.replace(
        POD,
        [
            pod("web-1", shared(5000), node="n0", labels={"app": "a"}, assignment=a0),
            pod("web-2", shared(5000), node="n1", labels={"app": "a"}, assignment=a1),
        ],
    )
    sigs = cache.snapshot.signatures
    assert sigs["n0"][1] == sigs["n1"][1] != sigs["n2"][1]
    v0, v1 = cache.snapshot.view("n0"), cache.snapshot.view("n1")
    assert v0 is not None and v1 is not None and anonymous(v0) == anonymous(v1)
    before = sigs["n2"]
    cache.apply(POD, "ADDED", pod("other", shared(5000), node="n2", labels={"app": "b"}))
    assert cache.snapshot.signatures["n2"] is not before  # a change makes a new tuple


def test_state_ids_are_never_reused_when_the_table_outgrows_its_bound() -> None:
    cache = ClusterCache(keys=keys, max_states=2)
    cache.replace(NODE, [node(n, _inventory(k)) for n, k in zip(NODES, [0, 1, 2, 0], strict=True)])
    service = ExtenderService(
        cache, ExtenderSettings().scoring(), keys=keys, binder=FakeBinder(), metrics=Metrics()
    )
    assert sorted(service.filter(pod("new", shared(1000)), NODES).passed) == ["n0", "n3"]
    before = {sig[1] for sig in cache.snapshot.signatures.values()}
    cache.apply(POD, "ADDED", pod("a", shared(100), node="n0"))  # the table starts afresh
    after = {sig[1] for sig in cache.snapshot.signatures.values()}
    assert set(cache.snapshot.signatures) == set(NODES) and not before & after
    # Answers kept for the old ids never match again: the same service answers afresh.
    out = service.filter(pod("new", shared(1000)), NODES)
    assert sorted(out.passed) == ["n0", "n3"]


def test_in_use_reasons_name_each_nodes_own_pods_though_the_state_is_shared() -> None:
    cache = ClusterCache(keys=keys)
    cache.replace(NODE, [node(n, _inventory(1)) for n in NODES[:2]])
    cache.replace(
        POD,
        [
            pod(f"{n}-{k}", {"nvidia.com/mig-3g.40gb": 1}, node=n, labels={"app": "a"})
            for n in NODES[:2]
            for k in range(2)
        ],
    )
    assert cache.snapshot.signatures["n0"][1] == cache.snapshot.signatures["n1"][1]
    service = ExtenderService(
        cache, ExtenderSettings().scoring(), keys=keys, binder=FakeBinder(), metrics=Metrics()
    )
    out = service.filter(pod("new", {"nvidia.com/mig-3g.40gb": 1}), NODES[:2])
    assert "team-a/n0-0, team-a/n0-1" in out.failed["n0"]
    assert "team-a/n1-0, team-a/n1-1" in out.failed["n1"]
    # Reasons without pod names are shared, with each node's own name at the head.
    out = service.filter(pod("new", {"nvidia.com/mig-7g.80gb": 1}), NODES[:2])
    assert out.unresolvable["n1"].startswith("n1: 2 GPUs, none with a 7g.80gb slice")
