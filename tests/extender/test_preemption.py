"""Preemption: victim selection on one GPU (gpupart.core.scheduling.preemption), the preempt verb over HTTP,
PodDisruptionBudgets in the cache, and the reservation a nominated pod holds.

Covers: minimality and kube-scheduler's order (PDB violations, highest victim priority, count),
never a pod of equal or higher priority, PDB preference and counting, multi-container pods,
pods spread over two GPUs of one node (victims all on one), required anti-affinity, compute and
client slots, the memory reserve, a property test against a brute-force search, both wire forms
with upstream's golden JSON, MIG victims checked for a free slice, nodes dropped, and a
nominated pod's reservation (others kept out, the pod itself let in, dropped at bind or when
the nomination clears).
"""

from __future__ import annotations

import json
from itertools import combinations
from typing import Any

import pytest
from extender_objects import FakeBinder, keys, mig_gpu, node, pod, shared_gpu
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st

from gpupart.core.api.resources import GpuRequest
from gpupart.core.api.selectors import NOTHING, AffinityTerm, selector_from_set
from gpupart.core.api.spec import Mode
from gpupart.core.api.wire import PodAssignment
from gpupart.core.errors import InvalidInput
from gpupart.core.scheduling.demand import PodDemand
from gpupart.core.scheduling.evaluate import Fit, evaluate
from gpupart.core.scheduling.preemption import Budget, choose_victims, parse_budget, violations
from gpupart.core.scheduling.shares import fragmentation_model
from gpupart.core.scheduling.terms import ScoringConfig
from gpupart.core.scheduling.views import GpuView, NodeView, Tenant
from gpupart_extender.app import create_app
from gpupart_extender.cache import NODE, PDB, POD, ClusterCache
from gpupart_extender.metrics import Metrics
from gpupart_extender.models import ExtenderPreemptionArgs
from gpupart_extender.preemption import NodeVictims
from gpupart_extender.service import ExtenderService
from gpupart_extender.settings import ExtenderSettings

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


MPS = {"nvidia.com/gpu.shared": 1, "gpupart.io/gpu-memory": 20000}


def _cluster() -> ClusterCache:
    """n1: GPU 0 two priority-0 pods, GPU 1 a priority-1000 and a priority-0 pod; n2: the same
    with priority 500 on GPU 0 (so n1's GPU 0 is the cheaper); n-mig: one 3g.40gb slice, held."""
    cache = ClusterCache(keys=keys)
    cache.replace(
        NODE,
        [
            node("n1", [shared_gpu(0, memory=40000), shared_gpu(1, memory=40000)]),
            node("n2", [shared_gpu(0, memory=40000), shared_gpu(1, memory=40000)]),
            node("n-mig", [mig_gpu(0, [("3g.40gb", 0, 4)])]),
        ],
    )
    placed = {
        "a": ("n1", 0, 0), "b": ("n1", 0, 0), "c": ("n1", 1, 1000), "d": ("n1", 1, 0),
        "e": ("n2", 0, 500), "f": ("n2", 0, 0), "g": ("n2", 1, 2000), "h": ("n2", 1, 0),
    }  # fmt: skip
    pods = [
        pod(n, MPS, node=where, priority=prio, labels={"app": n},
            assignment=PodAssignment(where, g, f"GPU-{g:04d}", 20000))
        for n, (where, g, prio) in placed.items()
    ]  # fmt: skip
    pods.append(pod("train", {"nvidia.com/mig-3g.40gb": 1}, node="n-mig", priority=0))
    pods.append(pod("cpu-only", {"cpu": "2"}, node="n1", priority=0))
    cache.replace(POD, pods)
    cache.replace(PDB, [])
    return cache


@pytest.fixture
def preempting() -> tuple[TestClient, ExtenderService]:
    settings_ = ExtenderSettings()
    service = ExtenderService(
        _cluster(),
        settings_.scoring(),
        keys=keys,
        binder=FakeBinder(),
        metrics=Metrics(),
        ttl_seconds=30,
    )
    return TestClient(create_app(settings_, service)), service


def uid(name: str) -> str:
    return f"uid-team-a-{name}"


def _meta(victims: dict[str, list[str]]) -> dict[str, Any]:
    return {
        n: {"Pods": [{"UID": uid(v)} for v in vs], "NumPDBViolations": 0}
        for n, vs in victims.items()
    }


def test_preempt_keeps_the_victims_on_one_gpu_and_drops_what_frees_nothing(
    preempting: tuple[TestClient, ExtenderService],
) -> None:
    client, service = preempting
    high = pod("infer", {"nvidia.com/gpu.shared": 1, "gpupart.io/gpu-memory": 40000}, priority=1000)
    # kube-scheduler's dry run picked one slot's worth of victims on each node, on GPU 1 of n1
    # (which frees no room: its other pod has priority 1000) and a CPU-only pod it needed.
    body = {"Pod": high, "NodeNameToMetaVictims": _meta({"n1": ["d", "cpu-only"], "n2": ["h"]})}
    reply = client.post("/gpupart/preempt", json=body)
    assert reply.status_code == 200, reply.text
    result = reply.json()["NodeNameToMetaVictims"]
    assert result == {
        "n1": {
            "Pods": [{"UID": uid("a")}, {"UID": uid("b")}, {"UID": uid("cpu-only")}],
            "NumPDBViolations": 0,
        },
        "n2": {"Pods": [{"UID": uid("e")}, {"UID": uid("f")}], "NumPDBViolations": 0},
    }
    text = client.get("/metrics").text
    assert "gpupart_extender_preemption_requests_total 1.0" in text
    assert "gpupart_extender_preemption_victims_total 5.0" in text
    # More than a GPU holds: every node dropped, nothing evicted.
    body["Pod"] = pod(
        "huge", {"nvidia.com/gpu.shared": 1, "gpupart.io/gpu-memory": 50000}, priority=1000
    )
    assert client.post("/gpupart/preempt", json=body).json() == {"NodeNameToMetaVictims": {}}
    assert "gpupart_extender_preemption_nodes_dropped_total 2.0" in client.get("/metrics").text


def test_preempt_full_victims_form_and_upstream_golden_json(
    preempting: tuple[TestClient, ExtenderService],
) -> None:
    client, service = preempting
    # kubernetes/kube-scheduler extender/v1 types_test.go (TestCompatibility), args and result.
    golden_args = (
        '{"Pod":{"metadata":{"name":"podname","creationTimestamp":null},"spec":{"containers":null},"status":{}},'
        '"NodeNameToVictims":{"foo":{"Pods":[{"metadata":{"name":"podname","creationTimestamp":null},'
        '"spec":{"containers":null},"status":{}}],"NumPDBViolations":1}},'
        '"NodeNameToMetaVictims":{"foo":{"Pods":[{"UID":"myuid"}],"NumPDBViolations":1}}}'
    )
    args = ExtenderPreemptionArgs.model_validate_json(golden_args)
    assert args.NodeNameToMetaVictims is not None and args.NodeNameToVictims is not None
    assert args.NodeNameToMetaVictims["foo"].Pods[0].UID == "myuid"  # type: ignore[union-attr,index]
    assert args.NodeNameToVictims["foo"].NumPDBViolations == 1  # type: ignore[union-attr]
    # Not a GPU pod: the extender has nothing to check and passes the victims through.
    reply = client.post("/gpupart/preempt", content=golden_args)
    assert (
        reply.text
        == '{"NodeNameToMetaVictims": {"foo": {"Pods": [{"UID": "myuid"}], "NumPDBViolations": 1}}}'
    )
    assert json.loads(reply.text) == json.loads(
        '{"NodeNameToMetaVictims":{"foo":{"Pods":[{"UID":"myuid"}],"NumPDBViolations":1}}}'
    )
    # nodeCacheCapable false: full Pods in, UIDs out; a PDB counted.
    service.cache.replace(
        PDB,
        [{"metadata": {"name": "keep", "namespace": "team-a"},
          "spec": {"selector": {"matchLabels": {"app": "a"}}}, "status": {"disruptionsAllowed": 0}}],
    )  # fmt: skip
    high = pod("infer", {"nvidia.com/gpu.shared": 1, "gpupart.io/gpu-memory": 40000}, priority=1000)
    full = {
        "Pod": high,
        "NodeNameToVictims": {
            "n1": {"Pods": [pod("d", MPS, node="n1", priority=0)], "NumPDBViolations": 0}
        },
    }
    result = client.post("/gpupart/preempt", json=full).json()["NodeNameToMetaVictims"]
    assert result == {"n1": {"Pods": [{"UID": uid("a")}, {"UID": uid("b")}], "NumPDBViolations": 1}}


def test_mig_victims_are_checked_for_a_free_slice(
    preempting: tuple[TestClient, ExtenderService],
) -> None:
    client, _ = preempting
    mig = pod("mig", {"nvidia.com/mig-3g.40gb": 1}, priority=1000)
    kept = client.post(
        "/gpupart/preempt", json={"Pod": mig, "NodeNameToMetaVictims": _meta({"n-mig": ["train"]})}
    )
    assert kept.json()["NodeNameToMetaVictims"] == _meta({"n-mig": ["train"]})
    wrong = client.post(
        "/gpupart/preempt",
        json={"Pod": mig, "NodeNameToMetaVictims": _meta({"n-mig": ["cpu-only"]})},
    )
    assert wrong.json() == {"NodeNameToMetaVictims": {}}


def test_preempt_refuses_a_pod_it_cannot_read(
    preempting: tuple[TestClient, ExtenderService],
) -> None:
    client, _ = preempting
    bad = pod("bad", {"nvidia.com/gpu.shared": 1, "gpupart.io/gpu-memory": "-5"})
    reply = client.post("/gpupart/preempt", json={"Pod": bad, "NodeNameToMetaVictims": {}})
    assert (
        reply.status_code == 400 and "invalid pod: Pod.spec.containers[0]" in reply.json()["Error"]
    )
    assert client.post("/gpupart/preempt", content=b"{").status_code == 400


def test_a_multi_container_pod_frees_all_its_containers_ask() -> None:
    cache = ClusterCache(keys=keys)
    cache.replace(NODE, [node("n", [shared_gpu(0, memory=40000, clients=3)])])
    two = pod("two", MPS, node="n", priority=0, assignment=PodAssignment("n", 0, "GPU-0000", 30000))
    two["spec"]["containers"].append(
        {
            "name": "side",
            "image": "x",
            "resources": {
                "limits": {"nvidia.com/gpu.shared": "1", "gpupart.io/gpu-memory": "10000"}
            },
        }
    )
    one = pod("one", {"nvidia.com/gpu.shared": 1, "gpupart.io/gpu-memory": 5000}, node="n", priority=0,
              assignment=PodAssignment("n", 0, "GPU-0000", 5000))  # fmt: skip
    cache.replace(POD, [two, one])
    service = ExtenderService(
        cache, ScoringConfig(reserve_fraction=0), keys=keys, binder=FakeBinder(), metrics=Metrics()
    )
    # 2 slots and 30000 MiB: only the two-container pod frees both at once.
    high = pod("infer", {"nvidia.com/gpu.shared": 2, "gpupart.io/gpu-memory": 30000}, priority=1000)
    kept = service.preempt(high, {"n": NodeVictims((uid("one"),), 0)})
    assert kept == {"n": NodeVictims((uid("two"),), 0)}


def test_a_nominated_pod_keeps_the_room_its_victims_freed() -> None:
    cache = _cluster()
    binder = FakeBinder()
    service = ExtenderService(
        cache, ScoringConfig(), keys=keys, binder=binder, metrics=Metrics(), ttl_seconds=30
    )
    high = pod("infer", {"nvidia.com/gpu.shared": 1, "gpupart.io/gpu-memory": 40000}, priority=1000)
    service.preempt(high, {"n1": NodeVictims((uid("d"),), 0)})
    # kube-scheduler evicts a and b, and nominates the pod to n1.
    for victim in ("a", "b"):
        cache.apply(POD, "DELETED", pod(victim, MPS, node="n1"))
    high["status"]["nominatedNodeName"] = "n1"
    cache.apply(POD, "MODIFIED", high)
    view = cache.snapshot.view("n1")
    assert view is not None
    assert [t.pod for t in view.gpus[0].tenants] == ["team-a/infer"]  # on the GPU preempt freed
    low = pod("batch", {"nvidia.com/gpu.shared": 1, "gpupart.io/gpu-memory": 30000}, priority=0)
    assert "n1" in service.filter(low, ["n1"]).failed  # kept out
    assert service.filter(high, ["n1"]).passed == ["n1"]  # the pod itself is let in
    binder.live(high)
    assert service.bind("team-a", "infer", uid("infer"), "n1") == ""
    assert cache.snapshot.nomination(uid("infer")) is None  # assumed (bound) now, not nominated
    view = cache.snapshot.view("n1")
    assert view is not None and [t.pod for t in view.gpus[0].tenants] == ["team-a/infer"]
    # A nomination cleared (e.g. a higher-priority pod took the node) frees the room.
    other = pod("other", {"nvidia.com/gpu.shared": 1, "gpupart.io/gpu-memory": 10000}, priority=500)
    other["status"]["nominatedNodeName"] = "n2"
    cache.apply(POD, "ADDED", other)
    assert cache.snapshot.nomination(uid("other")) is not None
    other["status"]["nominatedNodeName"] = ""
    cache.apply(POD, "MODIFIED", other)
    assert (
        cache.snapshot.nomination(uid("other")) is None
        and cache.snapshot.counts()["nominated"] == 0
    )


def test_an_unreadable_budget_is_listed_and_not_counted() -> None:
    cache = ClusterCache(keys=keys)
    cache.replace(
        PDB,
        [{"metadata": {"name": "bad", "namespace": "x"}, "spec": {"selector": {"matchLabels": 5}}}],
    )
    assert list(cache.snapshot.budgets) == [] and cache.snapshot.unreadable_counts()[PDB] == 1
    cache.apply(
        PDB, "MODIFIED", {"metadata": {"name": "bad", "namespace": "x"}, "spec": {}, "status": {}}
    )
    assert len(list(cache.snapshot.budgets)) == 1 and cache.snapshot.unreadable_counts()[PDB] == 0
    cache.apply(PDB, "DELETED", {"metadata": {"name": "bad", "namespace": "x"}})
    assert list(cache.snapshot.budgets) == []


def test_a_nominated_pod_holds_the_gpu_its_victims_free_not_the_first_one() -> None:
    """GPU 0 holds a pod above the preemptor's priority, so only GPU 1's pod can go: the
    reservation goes where that victim's own assignment says it ran, GPU 1."""
    cache = ClusterCache(keys=keys)
    cache.replace(NODE, [node("n", [shared_gpu(0, memory=40000), shared_gpu(1, memory=40000)])])
    top = pod("top", {**MPS, "gpupart.io/gpu-memory": 20000}, node="n", priority=2000,
              assignment=PodAssignment("n", 0, "GPU-0000", 20000))  # fmt: skip
    low = pod("low", {**MPS, "gpupart.io/gpu-memory": 40000}, node="n", priority=0,
              assignment=PodAssignment("n", 1, "GPU-0001", 40000))  # fmt: skip
    cache.replace(POD, [top, low])
    cache.replace(PDB, [])
    service = ExtenderService(
        cache, ScoringConfig(reserve_fraction=0), keys=keys, binder=FakeBinder(), metrics=Metrics()
    )
    high = pod("high", {**MPS, "gpupart.io/gpu-memory": 40000}, priority=1000)
    kept = service.preempt(high, {"n": NodeVictims((uid("top"), uid("low")), 0)})
    assert kept == {"n": NodeVictims((uid("low"),), 0)}
    cache.apply(POD, "DELETED", low)
    high["status"]["nominatedNodeName"] = "n"
    cache.apply(POD, "MODIFIED", high)
    held = cache.snapshot.nomination(uid("high"))
    assert held is not None and held.placed.assignment is not None
    assert (held.placed.assignment.gpu, held.placed.assignment.gpu_uuid) == (1, "GPU-0001")
    # GPU 0 has 20000 MiB free, GPU 1 is held: a 30000 MiB pod fits nowhere until high binds.
    other = pod("other", {**MPS, "gpupart.io/gpu-memory": 30000}, priority=0)
    assert "n" in service.filter(other, ["n"]).failed
    assert service.filter(pod("small", MPS, priority=0), ["n"]).passed == ["n"]  # on GPU 0


def test_bind_counts_the_victims_until_the_watch_shows_them_gone() -> None:
    """Filter lets a nominated pod in as if its victims were gone (kube-scheduler evicted
    them); bind must not: while a victim still holds its GPU, binding would over-commit it."""
    cache = ClusterCache(keys=keys)
    cache.replace(NODE, [node("n", [shared_gpu(0, memory=40000)])])
    low = pod("low", {**MPS, "gpupart.io/gpu-memory": 40000}, node="n", priority=0,
              assignment=PodAssignment("n", 0, "GPU-0000", 40000))  # fmt: skip
    cache.replace(POD, [low])
    cache.replace(PDB, [])
    binder = FakeBinder()
    service = ExtenderService(
        cache, ScoringConfig(reserve_fraction=0), keys=keys, binder=binder, metrics=Metrics()
    )
    high = pod("high", {**MPS, "gpupart.io/gpu-memory": 40000}, priority=1000)
    assert service.preempt(high, {"n": NodeVictims((uid("low"),), 0)}) == {
        "n": NodeVictims((uid("low"),), 0)
    }
    high["status"]["nominatedNodeName"] = "n"
    cache.apply(POD, "MODIFIED", high)
    assert service.filter(high, ["n"]).passed == ["n"]
    binder.live(high)
    refused = service.bind("team-a", "high", uid("high"), "n")
    assert refused.startswith("node changed since filter: "), refused
    assert binder.bindings == []
    cache.apply(POD, "DELETED", low)  # the victim is gone now
    assert service.bind("team-a", "high", uid("high"), "n") == ""
    assert binder.bindings == [("team-a", "high", uid("high"), "n")]


@pytest.mark.parametrize(("peer", "kept"), [(500, True), (1000, False), (2000, False)])
def test_a_nomination_of_lower_priority_gives_way_and_one_of_equal_or_higher_holds(
    peer: int, kept: bool
) -> None:
    """kube-scheduler clears the nominations of lower-priority pods on the node a pod preempts
    for; an equal or higher one keeps its room (20000 of the GPU's 40000 MiB here)."""
    cache = ClusterCache(keys=keys)
    cache.replace(NODE, [node("n", [shared_gpu(0, memory=40000)])])
    low = pod("low", MPS, node="n", priority=0,
              assignment=PodAssignment("n", 0, "GPU-0000", 20000))  # fmt: skip
    nominated = pod("peer", MPS, priority=peer)
    nominated["status"]["nominatedNodeName"] = "n"
    cache.replace(POD, [low, nominated])
    cache.replace(PDB, [])
    service = ExtenderService(
        cache, ScoringConfig(reserve_fraction=0), keys=keys, binder=FakeBinder(), metrics=Metrics()
    )
    high = pod("high", {**MPS, "gpupart.io/gpu-memory": 40000}, priority=1000)
    answer = service.preempt(high, {"n": NodeVictims((uid("low"),), 0)})
    assert answer == ({"n": NodeVictims((uid("low"),), 0)} if kept else {})
