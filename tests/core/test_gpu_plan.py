"""Each GPU's pass, decided (`gpupart.core.node.gpuplan`): what the actuator runs, or why nothing runs.

Aspects: no desired state changes nothing; a MIG target on a GPU without MIG fails; a mode
change ends the steps (read again), and one that did not take effect is Pending; a change of
mode under pods, processes or unknown use is Blocked and names them; a static MIG GPU gets its
counts, a dynamic one its plan's exact layout or nothing; MPS and time-slicing are remembered
once applied, and client slots held on a GPU the agent forgot make it time-sliced; a MIG plan is
followed where the GPU is dynamic MIG and refused whole when the operator's view of the node is
wrong; the plan's answer is its worst GPU's. Law: planning, running the steps and planning
again reaches the target and then plans no step.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpupart.core.api.spec import GpuConfig, Mode, MpsSettings
from gpupart.core.api.wire import (
    DesiredGroup,
    GpuReport,
    GpuState,
    MigPlan,
    NodeReport,
    PlannedGpu,
    PlanReport,
)
from gpupart.core.mig.catalogue import GpuModel, require_gpu_model
from gpupart.core.mig.layout import Layout, MigInstance, Placement, layout_counts
from gpupart.core.mig.planning import GpuInstanceState, Step, apply_steps, layout_of
from gpupart.core.node.gpuplan import (
    FollowedPlan,
    GpuFacts,
    GpuPlan,
    RememberedMode,
    answer_mig_plan,
    follow_mig_plan,
    plan_gpu,
    refused_report,
)
from gpupart.core.node.modes import (
    DisableMig,
    EnableMig,
    GpuStep,
    ModeStep,
    StartMpsDaemon,
    StopMpsDaemon,
)
from gpupart.core.node.mps import MpsLimits

H200 = require_gpu_model("H200-141GB")
WHOLE = GpuFacts(0, "NVIDIA H200", H200.memory_mib, mig_capable=True, mig_enabled=False)
IN_MIG = replace(WHOLE, mig_enabled=True, model=H200)


def at(profile: str, start: int) -> MigInstance:
    return MigInstance(Placement(start, H200.require_profile(profile).memory_slices), profile)


def static(*counts: tuple[str, int]) -> GpuConfig:
    return GpuConfig(Mode.MIG, counts)


DYNAMIC = GpuConfig(Mode.MIG, (("1g.18gb", 1),), dynamic=True)
MPS = GpuConfig(Mode.MPS, mps=MpsSettings(), replicas=4)
SMALL = (at("1g.18gb", 3), at("3g.71gb", 4))


def holding(facts: GpuFacts, layout: Layout, *, busy: Layout = ()) -> GpuFacts:
    states = tuple(GpuInstanceState(i, in_use=i in busy) for i in layout)
    return replace(facts, instances=states)


# ---- one GPU ----


def test_no_desired_state_changes_nothing() -> None:
    assert plan_gpu(holding(IN_MIG, SMALL), None) == GpuPlan(
        message="no desired layout on this node yet"
    )


def test_a_mig_target_on_a_gpu_without_mig_fails() -> None:
    decided = plan_gpu(replace(WHOLE, mig_capable=False, name="NVIDIA A10"), static(("1g.18gb", 1)))
    assert (decided.steps, decided.state) == ((), GpuState.FAILED)
    assert decided.message == "NVIDIA A10 does not support MIG"


def test_a_mode_change_ends_the_steps_and_waits_for_a_reset_when_it_did_not_take_effect() -> None:
    target = static(("3g.71gb", 2))
    first = plan_gpu(WHOLE, target)
    assert first.steps == (EnableMig(0),) and first.again
    pending = plan_gpu(replace(WHOLE, mig_pending=True), target, switched=True)
    assert (pending.steps, pending.state) == ((), GpuState.PENDING)
    assert pending.message.startswith("MIG mode is enabled but takes effect after a GPU reset")
    # The next pass, still waiting: no step again, still Pending.
    assert plan_gpu(replace(WHOLE, mig_pending=True), target).state is GpuState.PENDING
    done = plan_gpu(IN_MIG, target, switched=True)
    assert done.state is GpuState.APPLIED and not done.again
    assert done.layout is not None and layout_counts(done.layout) == {"3g.71gb": 2}
    assert layout_of(apply_steps(H200, (), _instance_steps(done))) == done.layout


@pytest.mark.parametrize(
    ("facts", "words", "pods"),
    [
        (replace(WHOLE, pods=("ml/a", "ml/b")), "in use by pods ml/a, ml/b", ("ml/a", "ml/b")),
        (replace(WHOLE, processes=2), "in use by 2 processes", ()),
        (
            replace(WHOLE, usage_known=False, usage_problem="kubelet PodResources: UNAVAILABLE"),
            "in use by unknown pods (kubelet PodResources: UNAVAILABLE)",
            (),
        ),
    ],
    ids=["pods", "processes", "unknown"],
)
def test_a_mode_change_under_use_is_blocked_and_names_it(
    facts: GpuFacts, words: str, pods: tuple[str, ...]
) -> None:
    decided = plan_gpu(facts, static(("7g.141gb", 1)))
    assert (decided.steps, decided.state, decided.blocking) == ((), GpuState.BLOCKED, pods)
    assert decided.message.startswith(words), decided.message


def test_a_static_gpu_keeps_in_use_instances_and_is_blocked_when_they_are_in_the_way() -> None:
    seven = tuple(at("1g.18gb", s) for s in range(7))
    busy = holding(IN_MIG, seven, busy=(seven[6],))
    kept = plan_gpu(busy, static(("1g.18gb", 1), ("3g.71gb", 1)))
    assert kept.state is GpuState.APPLIED and kept.layout is not None
    assert seven[6] in kept.layout, "the in-use instance stays where it is"
    blocked = plan_gpu(busy, static(("7g.141gb", 1)))
    assert (blocked.steps, blocked.state) == ((), GpuState.BLOCKED)


def test_a_static_gpu_without_its_mig_geometry_fails_with_nvmls_reason() -> None:
    facts = replace(IN_MIG, model=None, model_problem="read profiles of GPU 0: NVML NotSupported")
    decided = plan_gpu(facts, static(("1g.18gb", 1)))
    assert (decided.state, decided.message) == (
        GpuState.FAILED,
        "read profiles of GPU 0: NVML NotSupported",
    )


def test_a_dynamic_gpu_follows_only_its_plans_exact_layout() -> None:
    assert plan_gpu(holding(IN_MIG, SMALL), DYNAMIC) == GpuPlan(), "no plan: as it is"
    other = (at("1g.18gb", 3), at("2g.35gb", 0))
    decided = plan_gpu(holding(IN_MIG, SMALL), DYNAMIC, planned=other)
    assert decided.follows_plan and decided.layout == other
    assert all(step.instance != at("1g.18gb", 3) for step in _instance_steps(decided)), "kept"
    blocked = plan_gpu(holding(IN_MIG, SMALL, busy=(at("3g.71gb", 4),)), DYNAMIC, planned=other)
    assert blocked.state is GpuState.BLOCKED
    assert "3g.71gb at slots 4-7, in use" in blocked.message


def test_leaving_mig_destroys_the_idle_instances_then_disables_and_refuses_under_use() -> None:
    decided = plan_gpu(holding(IN_MIG, SMALL), GpuConfig(Mode.NONE))
    assert decided.again and decided.steps[-1] == DisableMig(0)
    assert (
        layout_of(apply_steps(H200, holding(IN_MIG, SMALL).instances, _instance_steps(decided)))
        == ()
    )
    busy = holding(IN_MIG, SMALL, busy=(SMALL[0],))
    assert plan_gpu(busy, GpuConfig(Mode.NONE)).state is GpuState.BLOCKED


def test_mps_is_started_then_kept_and_remembered() -> None:
    limits = MpsLimits(4, H200.memory_mib // 4, 25)
    start = plan_gpu(WHOLE, MPS)
    assert start.steps == (StartMpsDaemon(0, limits),) and not start.again
    assert start.remember == RememberedMode(Mode.MPS, 4)
    serving = replace(WHOLE, mps_started=True, mps_serving=limits)
    assert plan_gpu(serving, MPS) == GpuPlan(remember=RememberedMode(Mode.MPS, 4))
    whole = plan_gpu(serving, GpuConfig(Mode.NONE))
    assert whole.steps == (StopMpsDaemon(0),) and whole.remember == RememberedMode(Mode.NONE, 0)


def test_client_slots_on_a_forgotten_gpu_make_it_time_sliced() -> None:
    forgot = replace(WHOLE, held_slots=3, pods=("ml/a",))
    sliced = GpuConfig(Mode.TIME_SLICING, replicas=5)
    decided = plan_gpu(forgot, sliced)
    assert decided.assumed == RememberedMode(Mode.TIME_SLICING, 5), "the target's slots"
    assert decided.steps == () and decided.state is GpuState.APPLIED
    assert plan_gpu(forgot, None).assumed == RememberedMode(Mode.TIME_SLICING, 3)
    # Remembered: nothing assumed; the whole-GPU wish is Blocked by the pod.
    known = replace(forgot, remembered=RememberedMode(Mode.TIME_SLICING, 5))
    blocked = plan_gpu(known, GpuConfig(Mode.NONE))
    assert blocked.assumed is None and blocked.state is GpuState.BLOCKED


# ---- the node's MIG plan ----

MODELS = {0: H200, 1: H200}
TARGETS = {0: static(("1g.18gb", 7)), 1: DYNAMIC}


def mig_plan(layouts: dict[int, Layout]) -> MigPlan:
    return MigPlan("p1", tuple(PlannedGpu(i, layout) for i, layout in sorted(layouts.items())))


def test_a_plan_is_followed_on_dynamic_gpus_and_left_out_elsewhere() -> None:
    followed = follow_mig_plan(mig_plan({0: SMALL, 1: SMALL}), MODELS, TARGETS)
    assert followed == FollowedPlan(
        {1: SMALL}, ("GPU 0: not a dynamic MIG GPU (its target is static MIG); left as it is",)
    )
    unset = follow_mig_plan(mig_plan({1: SMALL}), MODELS, None)
    assert unset.refusals == ("GPU 1: not a dynamic MIG GPU (no desired state yet); left as it is",)
    assert follow_mig_plan(None, MODELS, TARGETS) == FollowedPlan()


@pytest.mark.parametrize(
    ("layouts", "models", "words"),
    [
        (
            {1: (at("3g.71gb", 0), at("2g.35gb", 2))},
            MODELS,
            "GPU 1: 2g.35gb at slots 2-3 overlaps 3g.71gb",
        ),
        (
            {1: (MigInstance(Placement(1, 4), "3g.71gb"),)},
            MODELS,
            "GPU 1: 3g.71gb at slots 1-4 is not a placement of 3g.71gb on H200-141GB",
        ),
        ({1: (MigInstance(Placement(2, 1), "9g.1tb"),)}, MODELS, "GPU 1: MIG profile '9g.1tb'"),
        ({7: SMALL}, MODELS, "GPU 7: not on this node"),
        ({1: SMALL}, {0: H200, 1: "read profiles: NVML NotSupported"}, "GPU 1: read profiles"),
    ],
    ids=["overlap", "placement", "profile", "not-here", "no-geometry"],
)
def test_a_plan_the_node_cannot_hold_is_refused_whole(
    layouts: dict[int, Layout], models: dict[int, GpuModel | str], words: str
) -> None:
    followed = follow_mig_plan(mig_plan({0: SMALL, **layouts}), models, {**TARGETS, 0: DYNAMIC})
    assert followed.layouts == {}, "none of it is followed"
    assert followed.refused.startswith(words), followed.refused
    assert followed.refusals[0].startswith(words)


def test_a_plans_answer_is_its_worst_gpus_with_each_reason_once_prefixed() -> None:
    followed = FollowedPlan({1: SMALL, 2: SMALL}, ("GPU 0: left as it is",))
    reports = (
        GpuReport(1, GpuState.BLOCKED, Mode.MIG, (), "GPU 1: removes x, in use"),
        GpuReport(2, GpuState.PENDING, Mode.NONE, (), "MIG mode is enabled but ..."),
    )
    assert answer_mig_plan("p1", followed, reports) == PlanReport(
        "p1",
        GpuState.FAILED,
        "GPU 0: left as it is; GPU 1: removes x, in use; GPU 2: MIG mode is enabled but ...",
    )
    applied = (GpuReport(1, GpuState.APPLIED, Mode.MIG, SMALL),)
    assert answer_mig_plan("p1", FollowedPlan({1: SMALL}), applied) == PlanReport(
        "p1", GpuState.APPLIED
    )
    short = (GpuReport(1, GpuState.APPLIED, Mode.MIG, SMALL[:1]),)
    assert answer_mig_plan("p1", FollowedPlan({1: SMALL}), short).message == (
        f"GPU 1: holds {SMALL[0]}"
    )


def test_a_refused_desired_state_fails_every_gpu_and_the_plan() -> None:
    gpus = (GpuReport(0, GpuState.APPLIED, Mode.MIG, SMALL),)
    groups = (DesiredGroup("p", 2, None, DYNAMIC), DesiredGroup("p", 2, (0,), DYNAMIC))
    assert refused_report("bad", gpus, groups, mig_plan({0: SMALL})) == NodeReport(
        (("p", 2),),
        (GpuReport(0, GpuState.FAILED, Mode.MIG, SMALL, "bad"),),
        PlanReport("p1", GpuState.FAILED, "not followed: the desired state is refused (bad)"),
    )


# ---- law: plan, run, plan again ----

COUNTS = [
    (("1g.18gb", 7),),
    (("3g.71gb", 1), ("4g.71gb", 1)),
    (("2g.35gb", 3),),
    (("1g.35gb", 4),),
    (("7g.141gb", 1),),
]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(COUNTS), min_size=1, max_size=4), st.booleans())
def test_law_running_each_plan_reaches_the_target_and_then_plans_nothing(
    wishes: list[tuple[tuple[str, int], ...]], starts_in_mig: bool
) -> None:
    facts = IN_MIG if starts_in_mig else WHOLE
    for counts in wishes:
        target = static(*counts)
        switched = False
        for _ in range(3):
            decided = plan_gpu(facts, target, switched=switched)
            facts = _run(facts, decided.steps)
            if not decided.again:
                break
            switched = True
        assert decided.state is GpuState.APPLIED, decided.message
        assert layout_counts(layout_of(facts.instances)) == dict(counts)
        assert plan_gpu(facts, target).steps == (), "idempotent"


def _instance_steps(decided: GpuPlan) -> tuple[Step, ...]:
    return tuple(s for s in decided.steps if not isinstance(s, ModeStep))


def _run(facts: GpuFacts, steps: tuple[GpuStep, ...]) -> GpuFacts:
    """The GPU after `steps`, as a GPU that needs no reset for a MIG mode change."""
    for step in steps:
        if isinstance(step, EnableMig):
            facts = replace(facts, mig_enabled=True, model=H200)
        elif isinstance(step, DisableMig):
            facts = replace(facts, mig_enabled=False, model=None, instances=())
        elif not isinstance(step, StartMpsDaemon | StopMpsDaemon):
            facts = replace(facts, instances=apply_steps(H200, facts.instances, (step,)))
    return facts
