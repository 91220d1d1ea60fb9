"""The node agent follows MIG plans on dynamic GPUs: exact placements, in-use instances kept, one report per plan."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from plugin_fakes import Pods

from gpupart.core.api.spec import GpuConfig, Mode
from gpupart.core.api.wire import (
    DesiredGroup,
    GpuState,
    MigPlan,
    MigReservation,
    NodeReport,
    PlannedGpu,
    PlanReport,
    decode_inventory,
    decode_report,
    encode_desired,
    encode_mig_plan,
)
from gpupart.core.errors import GpupartError
from gpupart.core.mig.catalogue import require_gpu_model
from gpupart.core.mig.layout import Layout, MigInstance, Placement, check_layout, layout_counts
from gpupart_plugin.actuator import Actuator
from gpupart_plugin.agent import NodeAgent
from gpupart_plugin.annotations import NodeAnnotations
from gpupart_plugin.backend import NvmlFailure
from gpupart_plugin.deviceplugin.hub import DeviceHub
from gpupart_plugin.deviceplugin.sink import DevicePluginSink
from gpupart_plugin.metrics import NodeMetrics
from gpupart_plugin.mps import MpsDaemons
from gpupart_plugin.podresources import PodDevices
from gpupart_plugin.simgpu import Fault, SimulatedGpus

H200 = "H200-141GB"
MODEL = require_gpu_model(H200)


def at(profile: str, start: int) -> MigInstance:
    return MigInstance(Placement(start, MODEL.require_profile(profile).memory_slices), profile)


# Not where the solver would put them: 1g.18gb at slot 3 splits the GPU's halves.
SMALL = (at("1g.18gb", 3), at("3g.71gb", 4))
OTHER = (at("1g.18gb", 3), at("2g.35gb", 0))


def dynamic(gpus: tuple[int, ...] | None = None) -> DesiredGroup:
    return DesiredGroup("dyn", 1, gpus, GpuConfig(Mode.MIG, (("1g.18gb", 1),), dynamic=True))


def static(counts: tuple[tuple[str, int], ...], gpus: tuple[int, ...]) -> DesiredGroup:
    return DesiredGroup("fixed", 1, gpus, GpuConfig(Mode.MIG, counts))


def plan(plan_id: str, layouts: Mapping[int, Layout]) -> MigPlan:
    gpus = tuple(PlannedGpu(i, tuple(sorted(layout))) for i, layout in sorted(layouts.items()))
    return MigPlan(plan_id, gpus)


def hold(pods: Pods, pod: str, sim: SimulatedGpus, index: int, instance: MigInstance) -> None:
    """`pod` holds the MIG device at `instance` on GPU `index`, as PodResources lists it."""
    resource = f"nvidia.com/mig-{instance.profile}"
    pods.held.append(PodDevices(pod, resource, (uuids(sim, index)[instance],)))


def actuator(sim: SimulatedGpus, pods: Pods, tmp_path: Path) -> Actuator:
    return Actuator(sim, pods, MpsDaemons(tmp_path / "mps", ["true"]))


def uuids(sim: SimulatedGpus, index: int = 0) -> dict[MigInstance, str]:
    """The complete instances on a GPU and their MIG UUIDs, as the backend reports them."""
    return {r.device.instance: r.device.uuid for r in sim.instances(index) if r.compute_instances}


def test_a_plan_creates_instances_at_the_exact_placements_it_names(tmp_path: Path) -> None:
    sim = SimulatedGpus([H200])
    result = actuator(sim, Pods(), tmp_path).reconcile((dynamic(),), plan("p1", {0: SMALL}))
    assert set(uuids(sim)) == set(SMALL)
    assert result.report.plan == PlanReport("p1", GpuState.APPLIED)
    gpu = result.report.gpus[0]
    assert gpu.state is GpuState.APPLIED and gpu.layout == SMALL
    assert "CreateGpuInstance" in sim.calls


def test_a_dynamic_gpu_never_gets_its_warm_counts_without_a_plan(tmp_path: Path) -> None:
    sim = SimulatedGpus([H200])
    result = actuator(sim, Pods(), tmp_path).reconcile((dynamic(),))
    assert sim.calls == [] and uuids(sim) == {}
    assert result.report.gpus[0].state is GpuState.APPLIED
    assert result.report.plan is None


def test_kept_in_use_instances_keep_their_uuids(tmp_path: Path) -> None:
    sim, pods = SimulatedGpus([H200]), Pods()
    agent = actuator(sim, pods, tmp_path)
    agent.reconcile((dynamic(),), plan("p1", {0: SMALL}))
    before = uuids(sim)
    hold(pods, "ml/a", sim, 0, at("1g.18gb", 3))
    result = agent.reconcile((dynamic(),), plan("p2", {0: OTHER}))
    assert result.report.plan == PlanReport("p2", GpuState.APPLIED)
    after = uuids(sim)
    assert set(after) == set(OTHER)
    assert after[at("1g.18gb", 3)] == before[at("1g.18gb", 3)], "the pod's instance was kept"


@pytest.mark.parametrize("holder", ["pod", "process"])
def test_a_plan_that_would_destroy_an_instance_in_use_is_blocked_and_destroys_nothing(
    tmp_path: Path, holder: str
) -> None:
    sim, pods = SimulatedGpus([H200]), Pods()
    agent = actuator(sim, pods, tmp_path)
    agent.reconcile((dynamic(),), plan("p1", {0: SMALL}))
    busy = at("3g.71gb", 4)
    if holder == "pod":
        hold(pods, "ml/train", sim, 0, busy)
    else:
        sim.start_process(0, 4242, busy)
    before, calls = uuids(sim), len(sim.calls)
    result = agent.reconcile((dynamic(),), plan("p2", {0: OTHER}))
    assert sim.calls[calls:] == [], "no step ran"
    assert uuids(sim) == before
    gpu = result.report.gpus[0]
    assert gpu.state is GpuState.BLOCKED
    assert gpu.blocking_pods == (("ml/train",) if holder == "pod" else ())
    assert result.report.plan is not None
    assert result.report.plan.state is GpuState.BLOCKED
    assert result.report.plan.message.startswith("GPU 0: ")
    assert "3g.71gb at slots 4-7, in use" in result.report.plan.message
    assert not result.report.plan.message.startswith("GPU 0: GPU 0:")
    assert result.waiting, "a Blocked plan is retried"


def test_a_plan_that_does_not_name_a_gpu_leaves_it_as_it_is(tmp_path: Path) -> None:
    sim = SimulatedGpus([H200, H200])
    agent = actuator(sim, Pods(), tmp_path)
    agent.reconcile((dynamic(),), plan("p1", {0: SMALL, 1: OTHER}))
    kept = uuids(sim, 1)
    result = agent.reconcile((dynamic(),), plan("p2", {0: OTHER}))
    assert uuids(sim, 1) == kept
    assert set(uuids(sim, 0)) == set(OTHER)
    assert [g.state for g in result.report.gpus] == [GpuState.APPLIED, GpuState.APPLIED]
    assert result.report.plan == PlanReport("p2", GpuState.APPLIED)
    # No plan at all: nothing changes either.
    calls = len(sim.calls)
    assert agent.reconcile((dynamic(),)).report.plan is None
    assert len(sim.calls) == calls


def test_static_gpus_keep_their_counts_and_a_plan_naming_one_is_failed_for_it(
    tmp_path: Path,
) -> None:
    sim = SimulatedGpus([H200, H200])
    agent = actuator(sim, Pods(), tmp_path)
    groups = (static((("1g.18gb", 7),), (0,)), dynamic((1,)))
    result = agent.reconcile(groups, plan("p1", {0: SMALL, 1: SMALL}))
    assert layout_counts(uuids(sim, 0)) == {"1g.18gb": 7}, "the static GPU followed its counts"
    assert set(uuids(sim, 1)) == set(SMALL), "the rest of the plan was followed"
    assert result.report.plan == PlanReport(
        "p1",
        GpuState.FAILED,
        "GPU 0: not a dynamic MIG GPU (its target is static MIG); left as it is",
    )
    assert [g.state for g in result.report.gpus] == [GpuState.APPLIED, GpuState.APPLIED]


def test_a_plan_before_any_desired_state_changes_nothing(tmp_path: Path) -> None:
    sim = SimulatedGpus([H200])
    result = actuator(sim, Pods(), tmp_path).reconcile(None, plan("p1", {0: SMALL}))
    assert sim.calls == []
    assert result.report.plan == PlanReport(
        "p1", GpuState.FAILED, "GPU 0: not a dynamic MIG GPU (no desired state yet); left as it is"
    )


# Every reason a plan is refused: tests/core/test_gpu_plan.py; here that no step runs for one.
@pytest.mark.parametrize(
    ("layouts", "words"),
    [
        ({1: (at("3g.71gb", 0), at("2g.35gb", 2))}, "GPU 1: 2g.35gb at slots 2-3 overlaps 3g.71gb"),
        ({7: SMALL}, "GPU 7: not on this node"),
    ],
)
def test_a_plan_with_a_layout_the_gpu_cannot_hold_is_refused_whole(
    tmp_path: Path, layouts: dict[int, Layout], words: str
) -> None:
    sim = SimulatedGpus([H200, H200])
    agent = actuator(sim, Pods(), tmp_path)
    agent.reconcile((dynamic(),), plan("p1", {0: OTHER, 1: OTHER}))
    before, calls = (uuids(sim, 0), uuids(sim, 1)), len(sim.calls)
    result = agent.reconcile((dynamic(),), plan("p2", {0: SMALL, **layouts}))
    assert len(sim.calls) == calls and (uuids(sim, 0), uuids(sim, 1)) == before, "nothing changed"
    answer = result.report.plan
    assert answer is not None and answer.id == "p2" and answer.state is GpuState.FAILED
    assert answer.message.startswith(words), answer.message
    assert [g.state for g in result.report.gpus] == [GpuState.APPLIED, GpuState.APPLIED]


def test_a_failed_step_rolls_back_and_fails_the_plan(tmp_path: Path) -> None:
    sim = SimulatedGpus([H200])
    agent = actuator(sim, Pods(), tmp_path)
    agent.reconcile((dynamic(),), plan("p1", {0: SMALL}))
    before = uuids(sim)
    sim.inject(Fault(NvmlFailure.INSUFFICIENT_RESOURCES, operation="CreateGpuInstance"))
    result = agent.reconcile((dynamic(),), plan("p2", {0: OTHER}))
    assert set(uuids(sim)) == set(before), "back to the previous layout"
    answer = result.report.plan
    assert answer is not None and answer.state is GpuState.FAILED
    assert "InsufficientResources" in answer.message and "rolled back" in answer.message
    assert agent.reconcile((dynamic(),), plan("p2", {0: OTHER})).report.plan == PlanReport(
        "p2", GpuState.APPLIED
    )


def test_a_plan_on_a_gpu_waiting_for_its_mig_mode_is_pending(tmp_path: Path) -> None:
    sim = SimulatedGpus([H200, H200], mig_enabled=[False, True])
    agent = actuator(sim, Pods(), tmp_path)
    result = agent.reconcile((dynamic(),), plan("p1", {0: SMALL, 1: SMALL}))
    answer = result.report.plan
    assert answer is not None and answer.state is GpuState.PENDING
    assert answer.message.startswith(
        "GPU 0: MIG mode is enabled but takes effect after a GPU reset"
    )
    assert set(uuids(sim, 1)) == set(SMALL)
    sim.reset(0)
    again = agent.reconcile((dynamic(),), plan("p1", {0: SMALL, 1: SMALL}))
    assert again.report.plan == PlanReport("p1", GpuState.APPLIED)


def test_a_new_agent_with_the_same_plan_makes_no_step(tmp_path: Path) -> None:
    sim, pods = SimulatedGpus([H200, H200]), Pods()
    the_plan = plan("p1", {0: SMALL, 1: OTHER})
    actuator(sim, pods, tmp_path).reconcile((dynamic(),), the_plan)
    before, calls = (uuids(sim, 0), uuids(sim, 1)), list(sim.calls)
    restarted = actuator(sim, pods, tmp_path).reconcile((dynamic(),), the_plan)
    assert sim.calls == calls, "no step, no second create"
    assert (uuids(sim, 0), uuids(sim, 1)) == before
    assert restarted.report.plan == PlanReport("p1", GpuState.APPLIED)


def test_the_inventory_marks_the_mig_devices_pods_or_processes_hold(tmp_path: Path) -> None:
    sim, pods = SimulatedGpus([H200]), Pods()
    agent = actuator(sim, pods, tmp_path)
    layout = (at("1g.18gb", 0), at("1g.18gb", 1), at("2g.35gb", 2), at("3g.71gb", 4))
    agent.reconcile((dynamic(),), plan("p1", {0: layout}))
    hold(pods, "ml/a", sim, 0, at("1g.18gb", 1))
    sim.start_process(0, 7, at("3g.71gb", 4))
    result = agent.reconcile((dynamic(),), plan("p1", {0: layout}))
    ids = uuids(sim)
    assert result.used == {ids[at("1g.18gb", 1)], ids[at("3g.71gb", 4)]}
    pods.down = True  # unknown counts as used
    assert agent.reconcile((dynamic(),), plan("p1", {0: layout})).used == set(ids.values())


# --- through the agent: annotation texts in, state and inventory out ---------------------------


class Published:
    def __init__(self) -> None:
        self.states: list[str] = []
        self.inventories: list[str] = []

    def __call__(self, state: str, inventory: str, _capacity: Mapping[str, int]) -> None:
        self.states.append(state)
        self.inventories.append(inventory)

    @property
    def report(self) -> NodeReport:
        return decode_report(self.states[-1])


def node_agent(sim: SimulatedGpus, pods: Pods, tmp_path: Path) -> tuple[NodeAgent, Published]:
    published = Published()
    sinks = (DevicePluginSink(DeviceHub(), None, NodeMetrics()), NodeAnnotations(published))
    agent = NodeAgent(actuator(sim, pods, tmp_path), sinks, NodeMetrics())
    return agent, published


def test_an_unreadable_plan_changes_no_dynamic_gpu_and_is_reported_failed(tmp_path: Path) -> None:
    sim, pods = SimulatedGpus([H200, H200]), Pods()
    agent, published = node_agent(sim, pods, tmp_path)
    desired = encode_desired((static((("3g.71gb", 2),), (0,)), dynamic((1,))))
    agent.reconcile(desired, encode_mig_plan(plan("p1", {1: SMALL})))
    kept, calls = uuids(sim, 1), len(sim.calls)
    desired = encode_desired((static((("7g.141gb", 1),), (0,)), dynamic((1,))))
    # A start slot as text: the whole plan is unreadable, even its GPU 1 (which would empty it).
    instance = '{"profile": "1g.18gb", "start": "3", "size": 1}'
    bad = f'{{"version": "v1", "id": "p2", "gpus": [{{"index": 1, "layout": [{instance}]}}]}}'
    agent.reconcile(desired, bad)
    assert uuids(sim, 1) == kept, "the dynamic GPU kept its instances"
    assert layout_counts(uuids(sim, 0)) == {"7g.141gb": 1}, "the static GPU got its pass"
    assert all("GPU 1" not in c for c in sim.calls[calls:])
    assert published.report.plan == PlanReport(
        "",
        GpuState.FAILED,
        "gpupart.io/mig-plan.gpus[0].layout[0].start: must be a whole number, got str '3'",
    )
    agent.reconcile(desired, "not JSON")
    report = published.report.plan
    assert report is not None and report.message.startswith("gpupart.io/mig-plan: not JSON")


def test_a_refused_desired_state_fails_the_plan_too(tmp_path: Path) -> None:
    sim = SimulatedGpus([H200])
    agent, published = node_agent(sim, Pods(), tmp_path)
    agent.reconcile('{"version": "v9"}', encode_mig_plan(plan("p1", {0: SMALL})))
    assert sim.calls == []
    report = published.report.plan
    assert report is not None and report.id == "p1" and report.state is GpuState.FAILED
    assert report.message.startswith(
        "not followed: the desired state is refused (gpupart.io/desired"
    )


def test_the_published_state_and_inventory_carry_the_plan_and_use(tmp_path: Path) -> None:
    sim, pods = SimulatedGpus([H200]), Pods()
    agent, published = node_agent(sim, pods, tmp_path)
    reserved = MigReservation("ml/a", "uid-a", 0, at("3g.71gb", 4), expires=1e9)
    text = encode_mig_plan(MigPlan("p1", (PlannedGpu(0, SMALL),), (reserved,)))
    agent.reconcile(encode_desired((dynamic(),)), text)
    assert published.report.plan == PlanReport("p1", GpuState.APPLIED)
    hold(pods, "ml/a", sim, 0, at("3g.71gb", 4))
    agent.reconcile(encode_desired((dynamic(),)), text)
    (gpu,) = decode_inventory(published.inventories[-1]).gpus
    assert {(d.instance, d.used) for d in gpu.mig_devices} == {
        (at("1g.18gb", 3), False),
        (at("3g.71gb", 4), True),
    }
    agent.reconcile(encode_desired((dynamic(),)), None)
    assert published.report.plan is None


# --- property: random plans over random in-use instances ---------------------------------------

CANDIDATES = [(p.name, start) for p in MODEL.profiles for start in p.starts]


@st.composite
def layouts(draw: st.DrawFn) -> Layout:
    """A legal H200 layout: candidate placements in a random order, each kept if it still fits."""
    chosen: list[MigInstance] = []
    for name, start in draw(st.lists(st.sampled_from(CANDIDATES), max_size=10)):
        instance = at(name, start)
        try:
            check_layout(MODEL, (*chosen, instance))
        except GpupartError:
            continue
        chosen.append(instance)
    return tuple(sorted(chosen))


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            layouts(), st.sets(st.integers(0, 6), max_size=3), st.booleans(), st.integers(0, 8)
        ),
        min_size=1,
        max_size=5,
    )
)
def test_random_plans_never_destroy_an_instance_in_use(
    tmp_path_factory: pytest.TempPathFactory,
    rounds: list[tuple[Layout, set[int], bool, int]],
) -> None:
    sim, pods = SimulatedGpus([H200]), Pods()
    agent = actuator(sim, pods, tmp_path_factory.mktemp("plans"))
    for number, (layout, picks, by_process, fault_at) in enumerate(rounds):
        present = sorted(uuids(sim).items())
        held = {present[i] for i in picks if i < len(present)}
        pods.held, pid = [], 100
        for instance, uuid in held:
            if by_process:
                sim.start_process(0, pid := pid + 1, instance)
            else:
                pods.held.append(PodDevices("ns/p", "r", (uuid,)))
        if fault_at < 4:
            sim.inject(Fault(NvmlFailure.OTHER, after=fault_at))
        result = agent.reconcile((dynamic(),), plan(f"p{number}", {0: layout}))
        sim.clear_faults()
        after = uuids(sim)
        assert all(after.get(instance) == uuid for instance, uuid in held), (
            "an in-use instance went"
        )
        answer = result.report.plan
        assert answer is not None and answer.id == f"p{number}"
        assert answer.state is not GpuState.APPLIED or set(after) == set(layout)
        if {i for i, _ in held} <= set(layout) and fault_at >= 4:
            assert answer.state is GpuState.APPLIED, answer.message
        if answer.state is GpuState.BLOCKED:
            assert set(after) == {i for i, _ in present}, "a Blocked plan ran no step"
        for p in range(101, pid + 1):
            sim.stop_process(0, p)


# --- each instance offered as soon as it exists, the answer only at the end --------------------

THREE = (at("1g.18gb", 0), at("1g.18gb", 1), at("1g.18gb", 2))


@dataclass(frozen=True)
class Offer:
    """One publish and what the node showed at that moment."""

    plan: PlanReport | None
    inventory: frozenset[MigInstance]
    hub: frozenset[str]
    made: frozenset[MigInstance]
    """The complete instances on the GPU then (NVML's view)."""


def test_each_instance_a_plan_creates_is_offered_at_once_without_the_plan_answer(
    tmp_path: Path,
) -> None:
    sim, hub = SimulatedGpus([H200]), DeviceHub()
    offers: list[Offer] = []

    def publish(state: str, inventory: str, _capacity: Mapping[str, int]) -> None:
        # Called in the pass's GPU thread: NVML's view here is the pass's progress.
        (gpu,) = decode_inventory(inventory).gpus
        listed = hub.listings().get("nvidia.com/mig-1g.18gb")
        offers.append(
            Offer(
                decode_report(state).plan,
                frozenset(d.instance for d in gpu.mig_devices),
                listed.ids if listed is not None else frozenset(),
                frozenset(uuids(sim)),
            )
        )

    sinks = (DevicePluginSink(hub, None, NodeMetrics()), NodeAnnotations(publish))
    agent = NodeAgent(actuator(sim, Pods(), tmp_path), sinks, NodeMetrics())
    desired = encode_desired((dynamic(),))
    agent.reconcile(desired, encode_mig_plan(plan("p0", {0: ()})))
    assert [o.plan for o in offers] == [PlanReport("p0", GpuState.APPLIED)]
    offers.clear()

    agent.reconcile(desired, encode_mig_plan(plan("p1", {0: THREE})))
    ids = uuids(sim)
    assert len(offers) == 4, "one publish per created instance, then the pass's own"
    for n, offer in enumerate(offers[:3], start=1):
        made = frozenset(THREE[:n])
        assert offer.made == made, "published while the pass still creates the rest"
        assert offer.inventory == made and offer.hub == {ids[i] for i in made}
        assert offer.plan == PlanReport("p0", GpuState.APPLIED), "still the previous answer"
    assert offers[-1].plan == PlanReport("p1", GpuState.APPLIED)
    assert offers[-1].inventory == set(THREE) and offers[-1].hub == set(ids.values())


def test_the_first_pass_after_a_start_publishes_only_at_its_end(tmp_path: Path) -> None:
    """No state published yet, so none to keep while the pass runs: nothing before its answer."""
    sim = SimulatedGpus([H200])
    agent, published = node_agent(sim, Pods(), tmp_path)
    agent.reconcile(encode_desired((dynamic(),)), encode_mig_plan(plan("p1", {0: THREE})))
    assert len(published.states) == 1
    assert published.report.plan == PlanReport("p1", GpuState.APPLIED)
