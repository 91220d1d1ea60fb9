"""One live round of dynamic MIG (plan_round): plans per node, reservations, in-flight plans, TTLs, in-use safety.

Aspects: a pending pod gets a plan and a reservation on a GPU with room; a node with an
unanswered plan is not planned again; reservations end when their pod is bound, gone or past
the TTL; a failed plan frees its pods; the inventory's `used` and the conservative holder count
keep used instances out of every plan; the same state gives the same plan id (no rewrite); a
reason names the pods that hold what is in the way, and the MIG device when no pod does.
"""

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from gpupart.core.api.spec import DynamicMig, Interface, Mode
from gpupart.core.api.wire import (
    GpuState,
    Inventory,
    InventoryGpu,
    MigDevice,
    MigPlan,
    MigReservation,
    PlanReport,
)
from gpupart.core.dynamic.live import DynamicGpu, NodeFacts, PendingPod, Round, plan_round
from gpupart.core.mig.catalogue import require_gpu_model
from gpupart.core.mig.layout import MigInstance, Placement, check_layout

H100 = require_gpu_model("H100-SXM5-80GB")
POLICY = DynamicMig()


def device(start: int, size: int, profile: str, *, used: bool = False, n: int = 0) -> MigDevice:
    return MigDevice(
        f"MIG-{start}-{profile}-{n}", MigInstance(Placement(start, size), profile), used
    )


def node(
    name: str = "n1",
    devices: dict[int, tuple[MigDevice, ...]] | None = None,
    *,
    gpus: int = 1,
    plan: MigPlan | None = None,
    report: PlanReport | None = None,
    holders: dict[str, int] | None = None,
) -> NodeFacts:
    devices = devices or {}
    inventory = Inventory(
        tuple(
            InventoryGpu(i, f"GPU-{name}-{i}", H100.product, 81559, Mode.MIG, devices.get(i, ()))
            for i in range(gpus)
        )
    )
    return NodeFacts(
        name,
        tuple(DynamicGpu(i, H100, POLICY, "dyn") for i in range(gpus)),
        inventory,
        plan,
        report,
        holders or {},
    )


def pod(key: str, *profiles: str, since: float = 0.0) -> PendingPod:
    return PendingPod(key, f"uid-{key}", profiles, 0, since)


def test_pending_pod_gets_a_plan_with_its_reservation() -> None:
    result = plan_round([node()], [pod("a/x", "3g.40gb")], now=100.0, ttl_s=60)
    change = result.changes["n1"]
    (r,) = change.plan.reservations
    assert (r.pod, r.uid, r.gpu, r.instance.profile, r.expires) == (
        "a/x",
        "uid-a/x",
        0,
        "3g.40gb",
        160.0,
    )
    (gpu,) = change.plan.gpus
    assert r.instance in gpu.layout
    assert (0, r.instance) in change.created
    assert result.planned[0].created and result.planned[0].node == "n1"
    assert change.plan.id  # a digest


def test_same_state_gives_the_same_plan_and_an_answered_plan_is_not_rewritten() -> None:
    first = plan_round([node()], [pod("a/x", "3g.40gb")], now=100.0).changes["n1"].plan
    again = plan_round([node()], [pod("a/x", "3g.40gb")], now=100.0).changes["n1"].plan
    assert first == again
    # Applied, the instance now exists, the pod still waits for kube-scheduler: nothing new.
    (r,) = first.reservations
    made = node(
        devices={0: (MigDevice("MIG-new", r.instance),)},
        plan=first,
        report=PlanReport(first.id, GpuState.APPLIED),
    )
    result = plan_round([made], [pod("a/x", "3g.40gb")], now=101.0)
    assert result.changes == {}
    assert result.planned == ()


def test_a_node_with_an_unanswered_plan_is_not_planned_again() -> None:
    first = plan_round([node()], [pod("a/x", "3g.40gb")], now=100.0).changes["n1"].plan
    waiting = node(plan=first, report=None)
    result = plan_round([waiting], [pod("a/x", "3g.40gb"), pod("b/y", "1g.10gb")], now=101.0)
    assert result.in_flight == ("n1",)
    assert "n1" not in result.changes
    assert [p for p, _ in result.unserved] == ["b/y"]  # a/x is being served


def test_other_nodes_are_planned_while_one_is_in_flight() -> None:
    first = plan_round([node("n1")], [pod("a/x", "3g.40gb")], now=100.0).changes["n1"].plan
    result = plan_round(
        [node("n1", plan=first), node("n2")],
        [pod("a/x", "3g.40gb"), pod("b/y", "3g.40gb")],
        now=101.0,
    )
    assert set(result.changes) == {"n2"}
    assert [r.pod for r in result.changes["n2"].plan.reservations] == ["b/y"]


def test_reservations_end_when_bound_gone_or_expired() -> None:
    first = (
        plan_round(
            [node()],
            [pod("a/x", "1g.10gb"), pod("b/y", "1g.10gb"), pod("c/z", "1g.10gb")],
            now=0,
            ttl_s=50,
        )
        .changes["n1"]
        .plan
    )
    assert len(first.reservations) == 3
    devices = tuple(MigDevice(f"MIG-{i}", r.instance) for i, r in enumerate(first.reservations))
    answered = node(devices={0: devices}, plan=first, report=PlanReport(first.id, GpuState.APPLIED))
    # a/x was bound (no longer unbound), b/y deleted, c/z still waits at t=60 > TTL.
    result = plan_round([answered], [pod("c/z", "1g.10gb")], now=60, ttl_s=50)
    assert [r.pod for r in result.expired] == ["c/z"]
    change = result.changes["n1"]
    # c/z is pending again and is served by reusing its own (now idle) instance.
    assert [r.pod for r in change.plan.reservations] == ["c/z"]
    assert change.created == ()


def test_a_failed_plan_frees_its_pods_and_names_why() -> None:
    first = plan_round([node()], [pod("a/x", "3g.40gb")], now=0).changes["n1"].plan
    failed = node(plan=first, report=PlanReport(first.id, GpuState.FAILED, "GPU 0: NVML said no"))
    result = plan_round([failed], [pod("a/x", "3g.40gb")], now=1)
    assert [(n, r.pod, why) for n, r, why in result.failed] == [
        ("n1", "a/x", "GPU 0: NVML said no")
    ]
    # Planned again from the inventory (a retry with a new reservation and plan id) ...
    (r,) = result.changes["n1"].plan.reservations
    assert r.pod == "a/x" and result.changes["n1"].plan.id != first.id
    # ... unless the caller holds the node back after the failure: then nothing is rewritten
    # but the failed reservation, and the pod waits.
    held = plan_round([replace(failed, hold=True)], [pod("a/x", "3g.40gb")], now=1)
    assert held.changes["n1"].plan.reservations == ()
    assert held.changes["n1"].plan.gpus == ()
    assert [p for p, _ in held.unserved] == ["a/x"]


def test_used_instances_are_kept_and_holders_guard_a_lagging_inventory() -> None:
    # GPU full of 1g.10gb instances, inventory marks none used, but 7 pods hold 1g.10gb there.
    full = tuple(device(i, 1, "1g.10gb", n=i) for i in range(7))
    lagging = node(devices={0: full}, holders={"1g.10gb": 7})
    result = plan_round([lagging], [pod("a/x", "7g.80gb")], now=0)
    assert result.changes == {}
    (unserved,) = result.unserved
    assert unserved[0] == "a/x"
    # Without holders the idle instances are destroyed for the 7g.
    idle = node(devices={0: full})
    change = plan_round([idle], [pod("a/x", "7g.80gb")], now=0).changes["n1"]
    assert len(change.destroyed) == 7


def test_unserved_pods_get_the_planners_reason() -> None:
    result = plan_round([node()], [pod("a/x", "7g.80gb"), pod("b/y", "7g.80gb", since=1)], now=5)
    assert [p for p, _ in result.unserved] == ["b/y"]
    assert "GPU" in result.unserved[0][1]


def test_a_reason_names_the_pod_in_the_way_not_its_mig_device() -> None:
    held = (device(0, 4, "4g.40gb", used=True), device(4, 4, "3g.40gb", used=True))
    facts = replace(
        node(devices={0: held}, holders={"4g.40gb": 1, "3g.40gb": 2}),
        holder_pods={"4g.40gb": ("team-a/train",), "3g.40gb": ("team-b/x", "team-b/y")},
    )
    ((_, why),) = plan_round([facts], [pod("a/x", "7g.80gb")], now=5).unserved
    assert "4g.40gb in use at slots 0-3 by team-a/train" in why, why
    assert "3g.40gb in use at slots 4-7 by one of team-b/x, team-b/y" in why, why
    assert "MIG-" not in why, why


def test_a_reason_names_the_mig_device_when_no_pod_holds_it() -> None:
    facts = node(devices={0: (device(0, 4, "4g.40gb", used=True),)})
    ((_, why),) = plan_round([facts], [pod("a/x", "7g.80gb")], now=5).unserved
    assert "by no pod gpupart sees (MIG-0-4g.40gb-0: a process, or a pod on its way out)" in why


# --- laws ------------------------------------------------------------------------------------

PROFILES = ("1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb")


@st.composite
def clusters(draw: st.DrawFn) -> tuple[list[NodeFacts], list[PendingPod]]:
    nodes = []
    for n in range(draw(st.integers(1, 2))):
        devices: dict[int, tuple[MigDevice, ...]] = {}
        for g in range(2):
            layout = draw(st.sampled_from(_layouts()))
            devices[g] = tuple(
                device(
                    i.placement.start, i.placement.size, i.profile, used=draw(st.booleans()), n=k
                )
                for k, i in enumerate(layout)
            )
        nodes.append(node(f"n{n}", devices, gpus=2))
    pods = [
        pod(f"ns/p{k}", draw(st.sampled_from(PROFILES)), since=float(k))
        for k in range(draw(st.integers(0, 6)))
    ]
    return nodes, pods


def _layouts() -> list[tuple[MigInstance, ...]]:
    from gpupart.core.mig.layout import fit_layout

    shapes = [{}, {"1g.10gb": 2}, {"3g.40gb": 1, "1g.10gb": 1}, {"2g.20gb": 3}, {"4g.40gb": 1}]
    return [fit_layout(H100, s) for s in shapes]


@settings(max_examples=60, deadline=None)
@given(clusters())
def test_used_instances_are_in_every_planned_layout_and_each_pod_reserved_once(
    cluster: tuple[list[NodeFacts], list[PendingPod]],
) -> None:
    nodes, pods = cluster
    result: Round = plan_round(nodes, pods, now=10.0)
    for name, change in result.changes.items():
        facts = next(n for n in nodes if n.name == name)
        assert facts.inventory is not None
        for planned in change.plan.gpus:
            check_layout(H100, planned.layout)
            used = {
                d.instance
                for g in facts.inventory.gpus
                if g.index == planned.index
                for d in g.mig_devices
                if d.used
            }
            assert used <= set(planned.layout)
        for r in change.plan.reservations:
            layout = next((g.layout for g in change.plan.gpus if g.index == r.gpu), None)
            existing = {
                d.instance
                for g in facts.inventory.gpus
                if g.index == r.gpu
                for d in g.mig_devices
                if not d.used
            }
            assert (layout is not None and r.instance in layout) or r.instance in existing
    reserved = [r.pod for c in result.changes.values() for r in c.plan.reservations]
    assert len(reserved) == len(set(reserved))
    served = set(reserved)
    assert served | {p for p, _ in result.unserved} == {p.key for p in pods}


def test_a_reservation_for_another_uid_is_not_kept() -> None:
    stale = MigPlan(
        "old",
        (),
        (MigReservation("a/x", "uid-old", 0, MigInstance(Placement(0, 4), "3g.40gb"), 1e9),),
    )
    n = node(
        devices={0: (device(0, 4, "3g.40gb"),)},
        plan=stale,
        report=PlanReport("old", GpuState.APPLIED),
    )
    result = plan_round([n], [pod("a/x", "3g.40gb")], now=0)
    (r,) = result.changes["n1"].plan.reservations
    assert r.uid == "uid-a/x"


def test_a_pod_is_planned_only_on_nodes_it_may_use() -> None:
    pending = [replace(pod("a/x", "3g.40gb"), nodes=frozenset({"n2"}))]
    result = plan_round([node("n1"), node("n2")], pending, now=0)
    assert set(result.changes) == {"n2"}
    nowhere = [replace(pod("a/x", "3g.40gb"), nodes=frozenset())]
    result = plan_round([node("n1"), node("n2")], nowhere, now=0)
    assert result.changes == {}
    ((who, why),) = result.unserved
    assert who == "a/x" and "node selector" in why


@settings(max_examples=40, deadline=None)
@given(clusters(), st.lists(st.sampled_from(["n0", "n1"]), unique=True))
def test_law_reservations_land_only_on_allowed_nodes(
    cluster: tuple[list[NodeFacts], list[PendingPod]], allowed: list[str]
) -> None:
    nodes, pods = cluster
    pods = [replace(p, nodes=frozenset(allowed)) for p in pods]
    result = plan_round(nodes, pods, now=10.0)
    for name, change in result.changes.items():
        for r in change.plan.reservations:
            assert name in allowed, (name, r)


@settings(max_examples=60, deadline=None)
@given(clusters(), st.data())
def test_law_a_gpu_not_served_through_the_device_plugin_is_never_planned(
    cluster: tuple[list[NodeFacts], list[PendingPod]], data: st.DataObject
) -> None:
    """A GPU served through DRA or moving between the interfaces (ADR 023) gets no layout and
    no reservation in any plan, and its existing instances are no one's to reserve."""
    nodes, pods = cluster
    interfaces = st.sampled_from([Interface.DEVICE_PLUGIN, Interface.DRA, None])
    served = []
    for facts in nodes:
        assert facts.inventory is not None
        gpus = tuple(replace(g, interface=data.draw(interfaces)) for g in facts.inventory.gpus)
        served.append(replace(facts, inventory=replace(facts.inventory, gpus=gpus)))
    result = plan_round(served, pods, now=10.0)
    for facts in served:
        assert facts.inventory is not None
        off = {g.index for g in facts.inventory.gpus if g.interface is not Interface.DEVICE_PLUGIN}
        change = result.changes.get(facts.name)
        if change is None:
            continue
        assert not off & {g.index for g in change.plan.gpus}, change
        assert not off & {r.gpu for r in change.plan.reservations}, change


def test_a_pod_waits_rather_than_get_a_plan_on_a_dra_gpu() -> None:
    (facts,) = [node()]
    assert facts.inventory is not None
    dra = replace(
        facts.inventory,
        gpus=tuple(replace(g, interface=Interface.DRA) for g in facts.inventory.gpus),
    )
    result = plan_round([replace(facts, inventory=dra)], [pod("a/x", "3g.40gb")], now=100.0)
    assert result.changes == {} and [p for p, _ in result.unserved] == ["a/x"]
