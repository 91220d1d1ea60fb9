"""MIG slice reservations (`gpupart.io/mig-plan`, docs/adr-013-dynamic-mig-plans.md) in the extender.

Through the extender's HTTP entry points (real uvicorn for the main story, the ASGI app for the
rest) and the cache's watch entry points: a slice reserved for pod A is taken for every other
pod (filter refuses B with the reason, bind refuses it even on a stale filter) and free for A,
whose node scores top; a reservation counts for nothing once expired by the extender's own
clock (no watch event, no sleeping: the clock is injected), once its pod is bound, or when its
instance does not exist; a bad plan on one node costs that node its MIG pods and nothing else.
A property checks filter and bind against a reference written here for random inventories,
bound pods, reservations and pending pods.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
from extender_objects import FakeBinder, args
from extender_server import served
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from gpupart.core.api.wire import MigReservation
from gpupart_extender.app import create_app
from gpupart_extender.cache import NODE, POD, ClusterCache
from gpupart_extender.metrics import Metrics
from gpupart_extender.service import ExtenderService
from gpupart_extender.settings import ExtenderSettings
from gpupart_testsupport.objects import keys, mig_gpu, node, pod, reserve, shared, shared_gpu

MIG3 = {"nvidia.com/mig-3g.40gb": 1}
NOW = 1_700_000_000.0
"""The wall clock (Unix seconds) the tests start at."""


class Wall:
    """The cache's clock for reservation expiry, moved by hand."""

    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> float:
        return self.now


def two_slices() -> list[Any]:
    """GPU 0 with two 3g.40gb instances, at 0+4 and 4+4."""
    return [mig_gpu(0, [("3g.40gb", 0, 4), ("3g.40gb", 4, 4)])]


def cluster(wall: Wall) -> ClusterCache:
    """node-a: one 3g.40gb in use by team-a/x, the other reserved for team-b/a (60 s);
    node-b: one 3g.40gb, free; node-bad: a free 3g.40gb and an MPS GPU, a plan not JSON."""
    cache = ClusterCache(keys=keys, wall=wall)
    cache.replace(
        NODE,
        [
            node(
                "node-a",
                two_slices(),
                reservations=[reserve("team-b/a", 0, "3g.40gb", 4, 4, expires=NOW + 60)],
            ),
            node("node-b", [mig_gpu(0, [("3g.40gb", 0, 4)])]),
            node(
                "node-bad",
                [mig_gpu(0, [("3g.40gb", 0, 4)]), shared_gpu(1, memory=40000)],
                plan="{not json",
            ),
        ],
    )
    cache.replace(POD, [pod("x", MIG3, node="node-a")])
    return cache


@pytest.fixture
def wall() -> Wall:
    return Wall()


@pytest.fixture
def service(wall: Wall, binder: FakeBinder) -> ExtenderService:
    binder.live(A)
    binder.live(B)
    return ExtenderService(
        cluster(wall), ExtenderSettings().scoring(), keys=keys, binder=binder, metrics=Metrics()
    )


@pytest.fixture
def client(service: ExtenderService) -> Any:
    with TestClient(create_app(ExtenderSettings(url_prefix="/gpupart"), service)) as c:
        yield c


def bind_args(name: str, node_name: str, namespace: str = "team-b") -> dict[str, str]:
    return {
        "PodName": name,
        "PodNamespace": namespace,
        "PodUID": f"uid-{namespace}-{name}",
        "Node": node_name,
    }


A = pod("a", MIG3, namespace="team-b")
B = pod("b", MIG3, namespace="team-b")
TAKEN_REASON = (
    "node-a: 1 GPU, no free 3g.40gb slice (1 in use by team-a/x; 1 reserved for team-b/a)"
)


def test_over_http_the_reserved_slice_is_refused_to_others_and_given_to_its_pod(
    service: ExtenderService, binder: FakeBinder
) -> None:
    with served(create_app(ExtenderSettings(url_prefix="/gpupart"), service)) as http:
        out = http.post("/gpupart/filter", json=args(B, ["node-a", "node-b"])).json()
        assert out["NodeNames"] == ["node-b"]
        assert out["FailedNodes"] == {"node-a": TAKEN_REASON}
        assert out["Error"] == ""

        out = http.post("/gpupart/filter", json=args(A, ["node-a", "node-b"])).json()
        assert sorted(out["NodeNames"]) == ["node-a", "node-b"]
        scores = {
            s["Host"]: s["Score"]
            for s in http.post("/gpupart/prioritize", json=args(A, ["node-a", "node-b"])).json()
        }
        assert scores["node-a"] == 10 and scores["node-b"] < 10  # its slice's node first
        # B's scores: the reserved node is no candidate at all.
        scores_b = {
            s["Host"]: s["Score"]
            for s in http.post("/gpupart/prioritize", json=args(B, ["node-a", "node-b"])).json()
        }
        assert scores_b["node-a"] == 0

        # B's bind to node-a (as after a stale filter, or a race) is refused on fresh state.
        res = http.post("/gpupart/bind", json=bind_args("b", "node-a")).json()
        assert res["Error"] == f"node changed since filter: {TAKEN_REASON}"
        assert http.post("/gpupart/bind", json=bind_args("a", "node-a")).json() == {"Error": ""}
        assert binder.bindings == [("team-b", "a", "uid-team-b-a", "node-a")]

        # A is assumed now: its reservation served, its slice is simply in use.
        out = http.post("/gpupart/filter", json=args(B, ["node-a"])).json()
        assert out["FailedNodes"] == {
            "node-a": "node-a: 1 GPU, no free 3g.40gb slice (all 2 in use by team-a/x, team-b/a)"
        }


def test_a_reservation_expires_by_the_extenders_clock_without_any_event(
    client: TestClient, wall: Wall
) -> None:
    out = client.post("/gpupart/filter", json=args(B, ["node-a"])).json()
    assert out["FailedNodes"] == {"node-a": TAKEN_REASON}
    assert "gpupart_extender_mig_reservations 1.0" in client.get("/metrics").text
    wall.now = NOW + 59.9
    assert client.post("/gpupart/filter", json=args(B, ["node-a"])).json()["NodeNames"] == []
    wall.now = NOW + 60  # `expires` itself: gone
    assert client.post("/gpupart/filter", json=args(B, ["node-a"])).json()["NodeNames"] == [
        "node-a"
    ]
    assert client.post("/gpupart/bind", json=bind_args("b", "node-a")).json() == {"Error": ""}
    assert "gpupart_extender_mig_reservations 0.0" in client.get("/metrics").text


def test_bind_rereads_the_clock_so_an_expired_reservation_does_not_block(
    client: TestClient, wall: Wall
) -> None:
    """Filter passed B on node-b; by bind time the reservation on node-a has expired too."""
    client.post("/gpupart/filter", json=args(B, ["node-a", "node-b"]))
    wall.now = NOW + 61
    assert client.post("/gpupart/bind", json=bind_args("b", "node-a")).json() == {"Error": ""}


def test_a_bound_pod_s_reservation_stops_counting(service: ExtenderService) -> None:
    cache = service.cache
    assert cache.snapshot.mig_reservations(cache.wall()) == 1
    cache.apply(POD, "ADDED", pod("a", MIG3, namespace="team-b", node="node-b"))
    assert cache.snapshot.mig_reservations(cache.wall()) == 0
    outcome = service.filter(pod("c", MIG3), ["node-a"])
    assert outcome.passed == ["node-a"]  # the slice A's reservation held is free again
    cache.apply(POD, "DELETED", pod("a", MIG3, namespace="team-b", node="node-b"))
    assert service.filter(pod("c", MIG3), ["node-a"]).failed == {"node-a": TAKEN_REASON}


def test_a_reservation_of_an_instance_not_made_yet_takes_nothing(wall: Wall) -> None:
    """The plan reserves a 3g.40gb at 4+4 for A before the node agent made it: B's 1g.10gb pod
    fits, A is told the node has no 3g.40gb slice (yet), and no score favours the node."""
    cache = ClusterCache(keys=keys, wall=wall)
    cache.replace(
        NODE,
        [
            node(
                "node-c",
                [mig_gpu(0, [("1g.10gb", 0, 1)])],
                reservations=[reserve("team-b/a", 0, "3g.40gb", 4, 4)],
            )
        ],
    )
    cache.replace(POD, [])
    service = ExtenderService(
        cache, ExtenderSettings().scoring(), keys=keys, binder=FakeBinder(), metrics=Metrics()
    )
    assert cache.snapshot.mig_reservations(cache.wall()) == 0
    assert service.filter(pod("b", {"nvidia.com/mig-1g.10gb": 1}), ["node-c"]).passed == ["node-c"]
    outcome = service.filter(A, ["node-c"])
    assert outcome.unresolvable == {
        "node-c": "node-c: 1 GPU, none with a 3g.40gb slice (MIG slices here: 1g.10gb×1)"
    }
    # The node agent makes it: the same plan now holds it for A.
    cache.apply(
        NODE,
        "MODIFIED",
        node(
            "node-c",
            [mig_gpu(0, [("1g.10gb", 0, 1), ("3g.40gb", 4, 4)])],
            reservations=[reserve("team-b/a", 0, "3g.40gb", 4, 4)],
        ),
    )
    assert service.filter(A, ["node-c"]).passed == ["node-c"]
    assert service.prioritize(A, ["node-c"]) == [("node-c", 10)]
    # No eviction frees a reserved slice: unresolvable, kube-scheduler preempts nothing here.
    assert service.filter(B, ["node-c"]).unresolvable == {
        "node-c": "node-c: 1 GPU, no free 3g.40gb slice (all 1 reserved for team-b/a)"
    }


def test_a_bad_plan_costs_its_node_its_mig_pods_and_nothing_else(
    client: TestClient, service: ExtenderService, caplog: pytest.LogCaptureFixture
) -> None:
    nodes = ["node-a", "node-b", "node-bad"]
    out = client.post("/gpupart/filter", json=args(B, nodes)).json()
    assert out["NodeNames"] == ["node-b"]
    reason = out["FailedAndUnresolvableNodes"]["node-bad"]
    assert reason.startswith("node-bad: MIG plan unreadable: gpupart.io/mig-plan: not JSON")
    # A shared-GPU pod is not a MIG pod: the node's MPS GPU takes it.
    out = client.post("/gpupart/filter", json=args(pod("s", shared(1000)), nodes)).json()
    assert out["NodeNames"] == ["node-bad"]
    diagnosis = client.post("/gpupart/diagnose", json=B).json()
    assert diagnosis["Unreadable"]["Node node-bad"].startswith("MIG plan unreadable")
    assert 'gpupart_extender_unreadable_objects{kind="Node"} 1.0' in client.get("/metrics").text
    # Logged once per resourceVersion, not at every event.
    bad = node("node-bad", [mig_gpu(0, [("3g.40gb", 0, 4)])], plan="{not json")
    bad["metadata"]["resourceVersion"] = "2"
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            service.cache.apply(NODE, "MODIFIED", bad)
    assert [r.getMessage() for r in caplog.records].count("Skipped unreadable object") == 1
    # Fixed by the operator: MIG pods again.
    service.cache.apply(NODE, "MODIFIED", node("node-bad", [mig_gpu(0, [("3g.40gb", 0, 4)])]))
    assert client.post("/gpupart/filter", json=args(B, ["node-bad"])).json()["NodeNames"] == [
        "node-bad"
    ]


@pytest.mark.parametrize(
    ("plan", "problem"),
    [
        ('{"version":"v2","id":"p"}', "unknown format version 'v2'"),
        (
            '{"version":"v1","id":"p","reservations":[{"pod":"a/b","gpu":-1,"profile":"3g.40gb",'
            '"start":0,"size":4,"expires":1}]}',
            "gpupart.io/mig-plan.reservations[0].gpu",
        ),
        (
            '{"version":"v1","id":"p","reservations":['
            '{"pod":"a/b","gpu":0,"profile":"3g.40gb","start":0,"size":4,"expires":2e9},'
            '{"pod":"a/c","gpu":0,"profile":"3g.40gb","start":0,"size":4,"expires":2e9}]}',
            "gpupart.io/mig-plan.reservations[1]: reserves GPU 0's 3g.40gb at 0+4 for a/c, "
            "already reserved for a/b",
        ),
        ("[" * 100_000, "MIG plan unreadable"),
    ],
)
def test_plan_problems_name_the_annotation_and_the_field(
    wall: Wall, plan: str, problem: str
) -> None:
    cache = ClusterCache(keys=keys, wall=wall)
    cache.replace(NODE, [node("n", two_slices(), plan=plan), node("ok", two_slices())])
    cache.replace(POD, [])
    service = ExtenderService(
        cache, ExtenderSettings().scoring(), keys=keys, binder=FakeBinder(), metrics=Metrics()
    )
    outcome = service.filter(B, ["n", "ok"])
    assert outcome.passed == ["ok"]
    assert problem in outcome.unresolvable["n"]
    assert len(outcome.unresolvable["n"]) < 700  # bounded, however long the annotation


# --- the property -------------------------------------------------------------------------------

PROFILES = ["1g.10gb", "3g.40gb"]
PODS = ["team-b/p0", "team-b/p1", "team-b/p2", "team-b/p3"]
"""Pending pods the reservations name (and that ask), besides pods already bound."""

_device = st.tuples(st.sampled_from(PROFILES), st.integers(0, 6))
_gpu = st.lists(_device, max_size=4, unique_by=lambda d: d[1])
_reservation = st.tuples(
    st.sampled_from([*PODS, "team-a/bound-0"]),
    st.integers(0, 1),  # GPU
    st.integers(0, 4),  # which of its devices; past the last: an instance not made yet
    st.sampled_from([-10.0, 15.0, 45.0, 1000.0, 1000.0]),  # expires, after NOW
)
_step = st.one_of(
    st.tuples(
        st.just("ask"), st.sampled_from(PODS), st.sampled_from(PROFILES), st.sampled_from([1, 1, 2])
    ),
    st.tuples(st.just("tick"), st.sampled_from([5.0, 20.0])),
    # A pod a reservation names asks for the reservation's profile.
    st.tuples(st.just("reserved"), st.integers(0, 5), st.sampled_from([1, 1, 2])),
)


def _size(profile: str) -> int:
    return 1 if profile == "1g.10gb" else 4


class Reference:
    """What the extender must decide, from the objects alone: for pod X and profile p, free =
    MIG devices of p - slices of p held by bound pods - live reservations of p for other pods
    (live: not expired, pod not bound, naming a device that exists, the first for that device)."""

    def __init__(
        self,
        gpus: list[list[tuple[str, int]]],
        bound: dict[str, tuple[str, int]],
        reservations: list[MigReservation],
    ) -> None:
        self.devices = {(g, profile, start) for g, gpu in enumerate(gpus) for profile, start in gpu}
        self.bound = dict(bound)
        """Pod -> (profile, count) of the pods bound on the node."""
        self.reservations = reservations
        where = [(r.gpu, r.instance) for r in reservations]
        self.bad = len(set(where)) != len(where)

    def live(self, now: float) -> list[MigReservation]:
        kept: dict[Any, MigReservation] = {}
        for r in self.reservations:
            device = (r.gpu, r.instance.profile, r.instance.placement.start)
            if device in self.devices and r.expires > now and r.pod not in self.bound:
                kept.setdefault((r.gpu, r.instance), r)
        return list(kept.values())

    def fits(self, who: str, profile: str, count: int, now: float) -> bool:
        if self.bad:
            return False
        offered = sum(1 for _, p, _ in self.devices if p == profile)
        used = sum(n for p, n in self.bound.values() if p == profile)
        others = sum(1 for r in self.live(now) if r.instance.profile == profile and r.pod != who)
        return offered - used - others >= count


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    gpus=st.lists(_gpu, min_size=1, max_size=2),
    bound=st.lists(st.sampled_from(PROFILES), max_size=3),
    reservations=st.lists(_reservation, max_size=5, unique_by=lambda r: r[1:3]),
    twice=st.sampled_from([False] * 9 + [True]),
    steps=st.lists(_step, min_size=3, max_size=12),
)
def test_law_admissions_never_pass_offered_minus_used_minus_reserved_for_others(
    gpus: list[list[tuple[str, int]]],
    bound: list[str],
    reservations: list[tuple[str, int, int, float]],
    twice: bool,
    steps: list[Any],
) -> None:
    """Every filter and bind answer equals the reference, so no pod is ever admitted beyond
    offered - used - reserved for others, per profile; reserved pods get their slices.
    `twice`: the plan reserves one instance twice, and the node takes no MIG pod."""
    wall = Wall()
    held = []
    for who, g, k, expires in reservations:
        devices = sorted(gpus[g], key=lambda d: d[1]) if g < len(gpus) else []
        profile, start = devices[k] if k < len(devices) else ("3g.40gb", 20 + k)
        held.append(reserve(who, g, profile, start, _size(profile), expires=NOW + expires))
    if twice and held:  # one instance reserved for two pods: the plan is refused
        held.append(
            reserve(
                "team-b/p3",
                held[0].gpu,
                held[0].instance.profile,
                held[0].instance.placement.start,
                held[0].instance.placement.size,
            )
        )
    inventory = [
        mig_gpu(g, [(p, s, _size(p)) for p, s in sorted(gpu, key=lambda d: d[1])])
        for g, gpu in enumerate(gpus)
    ]
    cache = ClusterCache(keys=keys, wall=wall)
    cache.replace(NODE, [node("n", inventory, reservations=held)])
    bound_pods = {f"team-a/bound-{k}": (p, 1) for k, p in enumerate(bound)}
    cache.replace(
        POD,
        [pod(f"bound-{k}", {f"nvidia.com/mig-{p}": 1}, node="n") for k, p in enumerate(bound)],
    )
    binder = FakeBinder()
    service = ExtenderService(
        cache, ExtenderSettings().scoring(), keys=keys, binder=binder, metrics=Metrics()
    )
    reference = Reference(gpus, bound_pods, held)
    for step in steps:
        if step[0] == "tick":
            wall.now += step[1]
            continue
        if step[0] == "reserved":
            if not held:
                continue
            r = held[step[1] % len(held)]
            who, profile, count = r.pod, r.instance.profile, step[2]
        else:
            _, who, profile, count = step
        if who in reference.bound:
            continue  # bound already
        namespace, name = who.split("/")
        asking = binder.live(pod(name, {f"nvidia.com/mig-{profile}": count}, namespace=namespace))
        want = reference.fits(who, profile, count, wall.now)
        mine = any(r.pod == who for r in reference.live(wall.now))
        event(f"fits={want} own reservation={mine} bad plan={reference.bad}")
        outcome = service.filter(asking, ["n"])
        assert (outcome.passed == ["n"]) == want, (who, profile, count, outcome)
        done = service.bind(namespace, name, f"uid-{namespace}-{name}", "n")
        assert (done == "") == want, (who, profile, count, done)
        if want:
            reference.bound[who] = (profile, count)
        if not reference.bad:
            # The invariant itself: no profile is over-committed to pods beyond its reservations.
            for p in PROFILES:
                offered = sum(1 for _, q, _ in reference.devices if q == p)
                admitted = sum(
                    n for pod_name, (q, n) in reference.bound.items()
                    if q == p and pod_name not in bound_pods
                )  # fmt: skip
                initially_free = offered - sum(n for q, n in bound_pods.values() if q == p)
                assert admitted <= max(0, initially_free)


def test_nodes_sent_in_full_count_their_plan_too(wall: Wall) -> None:
    """nodeCacheCapable false: a node the cache does not know yet is read from the request,
    its reservations with it (no pods are known there)."""
    cache = ClusterCache(keys=keys, wall=wall)
    cache.replace(NODE, [])
    cache.replace(POD, [])
    service = ExtenderService(
        cache, ExtenderSettings().scoring(), keys=keys, binder=FakeBinder(), metrics=Metrics()
    )
    full = node(
        "node-new",
        [mig_gpu(0, [("3g.40gb", 0, 4)])],
        reservations=[reserve("team-b/a", 0, "3g.40gb", 0, 4, expires=NOW + 60)],
    )
    assert service.filter(B, ["node-new"], [full]).unresolvable == {
        "node-new": "node-new: 1 GPU, no free 3g.40gb slice (all 1 reserved for team-b/a)"
    }
    assert service.filter(A, ["node-new"], [full]).passed == ["node-new"]
    wall.now = NOW + 60
    assert service.filter(B, ["node-new"], [full]).passed == ["node-new"]
