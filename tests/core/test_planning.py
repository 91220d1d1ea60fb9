"""Plans from an actual MIG layout to a desired one.

Aspects: applying plan(a, d) to a gives d; plan(d, d) is empty; instances that already match
are never touched; in-use instances are never destroyed unless disruption is allowed;
half-built instances (GPU instance without compute instance) are finished; steps are ordered
destroy-before-create so the GPU never holds overlapping instances; `step_refused` names why a
step cannot apply. Mode plans (`plan_mode`): examples per mode pair, refusals under use, and the
law that a plan (at most one more after a MIG mode step, which always ends a plan) reaches the
target mode without destroying an in-use instance, after which the plan is empty.
"""

from dataclasses import replace
from functools import cache

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpupart.core.api.spec import GpuConfig, Mode, MpsSettings
from gpupart.core.errors import InfeasibleLayout, PlanBlocked
from gpupart.core.mig.catalogue import GpuModel, require_gpu_model
from gpupart.core.mig.layout import MigInstance, Placement, fit_layout, layout_counts
from gpupart.core.mig.planning import (
    CreateComputeInstance,
    CreateGpuInstance,
    DestroyComputeInstance,
    DestroyGpuInstance,
    GpuInstanceState,
    Refusal,
    apply_steps,
    layout_of,
    plan_counts,
    plan_layout,
    step_refused,
)
from gpupart.core.node.modes import (
    MIG_MODE_STEPS,
    DisableMig,
    EnableMig,
    GpuNow,
    StartMpsDaemon,
    StopMpsDaemon,
    plan_mode,
)
from gpupart.core.node.mps import mps_limits

A100 = require_gpu_model("A100-SXM4-80GB")
A30 = require_gpu_model("A30-24GB")


@cache
def layouts(model: GpuModel) -> tuple:
    import itertools

    found = []
    for vector in itertools.product(*(range(p.max_count + 1) for p in model.profiles)):
        layout = fit_layout(
            model, {p.name: n for p, n in zip(model.profiles, vector, strict=True) if n}
        )
        if layout is not None:
            found.append(layout)
    return tuple(found)


@st.composite
def gpu_states(draw):
    model = draw(st.sampled_from([A100, A30]))
    actual_layout = draw(st.sampled_from(layouts(model)))
    states = tuple(
        GpuInstanceState(i, compute_instances=draw(st.integers(0, 1)), in_use=draw(st.booleans()))
        for i in actual_layout
    )
    desired = draw(st.sampled_from(layouts(model)))
    return model, states, desired


@given(gpu_states())
def test_law_applying_the_plan_reaches_the_desired_layout(case):
    model, actual, desired = case
    steps = plan_layout(0, actual, desired, allow_disruption=True)
    after = apply_steps(model, actual, steps)
    assert layout_of(after) == desired
    assert all(s.compute_instances == 1 for s in after)


@given(gpu_states())
def test_law_plan_of_desired_to_itself_is_empty(case):
    model, _, desired = case
    settled = tuple(GpuInstanceState(i) for i in desired)
    assert plan_layout(0, settled, desired) == ()


@given(gpu_states())
def test_law_in_use_instances_are_never_touched_without_permission(case):
    model, actual, desired = case
    busy = {s.instance for s in actual if s.in_use}
    try:
        steps = plan_layout(0, actual, desired)
    except PlanBlocked as error:
        assert busy - set(desired), "blocked although every in-use instance is kept"
        assert "in use" in str(error)
        return
    assert not any(
        isinstance(step, DestroyComputeInstance | DestroyGpuInstance) and step.instance in busy
        for step in steps
    )


@given(gpu_states())
def test_law_matching_instances_are_kept(case):
    model, actual, desired = case
    steps = plan_layout(0, actual, desired, allow_disruption=True)
    complete = {s.instance for s in actual if s.compute_instances}
    touched = {step.instance for step in steps}
    assert not (complete & set(desired)) & touched


@given(gpu_states())
def test_law_plan_counts_keeps_busy_instances_or_says_blocked(case):
    model, actual, desired = case
    counts = layout_counts(desired)
    try:
        layout, steps = plan_counts(model, 0, actual, counts)
    except PlanBlocked:
        return
    except InfeasibleLayout:
        pytest.fail("desired counts come from a valid layout, so they are feasible")
    assert layout_counts(layout) == counts
    after = apply_steps(model, actual, steps)
    assert layout_of(after) == layout
    assert {s.instance for s in actual if s.in_use} <= set(layout)


def test_destroys_come_before_creates():
    actual = (GpuInstanceState(MigInstance(Placement(0, 8), "7g.80gb")),)
    desired = (MigInstance(Placement(0, 4), "4g.40gb"), MigInstance(Placement(4, 4), "3g.40gb"))
    steps = plan_layout(0, actual, desired)
    assert steps == (
        DestroyComputeInstance(0, actual[0].instance),
        DestroyGpuInstance(0, actual[0].instance),
        CreateGpuInstance(0, desired[0]),
        CreateComputeInstance(0, desired[0]),
        CreateGpuInstance(0, desired[1]),
        CreateComputeInstance(0, desired[1]),
    )


def test_half_built_instance_is_finished_not_rebuilt():
    instance = MigInstance(Placement(4, 4), "3g.40gb")
    steps = plan_layout(3, (GpuInstanceState(instance, compute_instances=0),), (instance,))
    assert steps == (CreateComputeInstance(3, instance),)


def test_busy_instance_blocks_with_its_name():
    busy = GpuInstanceState(MigInstance(Placement(0, 1), "1g.10gb"), in_use=True)
    with pytest.raises(PlanBlocked, match="1g.10gb at slot 0, in use"):
        plan_layout(1, (busy,), (MigInstance(Placement(0, 8), "7g.80gb"),))


def test_plan_counts_moves_nothing_that_already_fits():
    actual = tuple(GpuInstanceState(MigInstance(Placement(s, 1), "1g.10gb")) for s in (0, 1))
    layout, steps = plan_counts(A100, 0, actual, {"1g.10gb": 2, "3g.40gb": 1})
    assert steps == (
        CreateGpuInstance(0, MigInstance(Placement(4, 4), "3g.40gb")),
        CreateComputeInstance(0, MigInstance(Placement(4, 4), "3g.40gb")),
    )


def test_plan_counts_blocked_by_busy_instance_says_so():
    actual = (GpuInstanceState(MigInstance(Placement(3, 1), "1g.10gb"), in_use=True),)
    with pytest.raises(PlanBlocked, match="4g.40gb needs start slot 0"):
        plan_counts(A100, 0, actual, {"1g.10gb": 1, "4g.40gb": 1})
    layout, _ = plan_counts(A100, 0, actual, {"1g.10gb": 1, "4g.40gb": 1}, allow_disruption=True)
    assert MigInstance(Placement(0, 4), "4g.40gb") in layout


def test_apply_steps_refuses_steps_a_gpu_would_refuse():
    instance = MigInstance(Placement(0, 4), "4g.40gb")
    with pytest.raises(InfeasibleLayout, match="still has compute instances"):
        apply_steps(A100, (GpuInstanceState(instance),), (DestroyGpuInstance(0, instance),))
    with pytest.raises(InfeasibleLayout, match="overlaps"):
        apply_steps(
            A100,
            (GpuInstanceState(instance),),
            (CreateGpuInstance(0, MigInstance(Placement(0, 2), "2g.20gb")),),
        )


def test_step_refused_says_why_for_each_step():
    instance = MigInstance(Placement(0, 4), "4g.40gb")
    complete = {instance: GpuInstanceState(instance)}
    half = {instance: GpuInstanceState(instance, compute_instances=0)}
    cases = [
        ({}, DestroyComputeInstance(0, instance), Refusal.MISSING),
        (half, DestroyComputeInstance(0, instance), Refusal.MISSING),
        ({}, DestroyGpuInstance(0, instance), Refusal.MISSING),
        (complete, DestroyGpuInstance(0, instance), Refusal.HAS_COMPUTE),
        ({}, CreateComputeInstance(0, instance), Refusal.MISSING),
        (complete, CreateComputeInstance(0, instance), Refusal.COMPLETE),
        (complete, CreateGpuInstance(0, MigInstance(Placement(2, 2), "2g.20gb")), Refusal.NO_ROOM),
        ({}, CreateGpuInstance(0, MigInstance(Placement(0, 1), "9g.1gb")), Refusal.UNKNOWN_PROFILE),
    ]
    for states, step, why in cases:
        refused = step_refused(A100, states, step)
        assert refused is not None and refused.refusal is why, (states, step)
    assert step_refused(A100, half, CreateComputeInstance(0, instance)) is None


# --- mode plans (gpupart.core.node.modes) ------------------------------------------------------

MPS4 = GpuConfig(Mode.MPS, mps=MpsSettings(), replicas=4)
MIG_TARGET = GpuConfig(Mode.MIG, mig=(("3g.40gb", 2),))
WHOLE = GpuConfig(Mode.NONE)
SLICED = GpuConfig(Mode.TIME_SLICING, replicas=3)
GIB80 = 81920
FOUR = mps_limits(GpuConfig(Mode.MPS, mps=MpsSettings(), replicas=4), GIB80)


def now(**fields):
    return GpuNow(gpu=0, memory_mib=GIB80, **{"mig_enabled": False, **fields})


def test_mode_plan_examples():
    three = MigInstance(Placement(0, 4), "3g.40gb")
    cases = [
        (now(mps_started=True, mps_serving=FOUR), MIG_TARGET, (StopMpsDaemon(0), EnableMig(0))),
        (now(), MPS4, (StartMpsDaemon(0, FOUR),)),
        (now(mps_started=True, mps_serving=FOUR), MPS4, ()),
        # Other limits on the running daemon: configured again, even in use (same mode).
        (
            now(
                mps_started=True,
                mps_serving=mps_limits(GpuConfig(Mode.MPS, mps=MpsSettings(), replicas=2), GIB80),
                in_use="pods a/b",
            ),
            MPS4,
            (StartMpsDaemon(0, FOUR),),
        ),
        (now(mps_started=True), WHOLE, (StopMpsDaemon(0),)),
        (now(remembered=Mode.TIME_SLICING, in_use="pods a/b"), SLICED, ()),
        (now(remembered=Mode.TIME_SLICING), WHOLE, ()),
        (
            now(mig_enabled=True, instances=(GpuInstanceState(three),)),
            MPS4,
            (DestroyComputeInstance(0, three), DestroyGpuInstance(0, three), DisableMig(0)),
        ),
        (now(mig_enabled=True, mig_pending=True), MIG_TARGET, (EnableMig(0),)),  # cancels
        (now(mig_enabled=True), MIG_TARGET, ()),
        (now(mig_pending=True), MIG_TARGET, ()),  # waits for a reset
        (now(mig_pending=True), WHOLE, (DisableMig(0),)),  # cancels
    ]
    for state, target, steps in cases:
        assert plan_mode(state, target) == steps, (state, target)


def test_mode_plan_refuses_a_mode_change_under_use():
    with pytest.raises(PlanBlocked, match="in use by pods a/b; it leaves MPS mode once idle"):
        plan_mode(now(mps_started=True, in_use="pods a/b"), MIG_TARGET)
    with pytest.raises(PlanBlocked, match="it leaves TimeSlicing mode"):
        plan_mode(now(remembered=Mode.TIME_SLICING, in_use="2 processes"), MPS4)
    busy = GpuInstanceState(MigInstance(Placement(0, 4), "3g.40gb"), in_use=True)
    with pytest.raises(PlanBlocked, match="leaving MIG mode destroys 3g.40gb at slots 0-3, in use"):
        plan_mode(now(mig_enabled=True, instances=(busy,)), WHOLE)


@st.composite
def gpu_nows(draw):
    mig = draw(st.booleans())
    started = not mig and draw(st.booleans())
    instances = ()
    if mig:
        layout = draw(st.sampled_from(layouts(A100)))
        instances = tuple(
            GpuInstanceState(i, draw(st.integers(0, 1)), in_use=draw(st.booleans())) for i in layout
        )
    return now(
        mig_enabled=mig,
        mig_pending=draw(st.booleans()),
        mps_started=started,
        mps_serving=draw(st.sampled_from([None, FOUR])) if started else None,
        remembered=Mode.NONE if mig or started else draw(st.sampled_from(SHARED_OR_WHOLE)),
        instances=instances,
        in_use=draw(st.sampled_from(["", "pods a/b"])),
    )


SHARED_OR_WHOLE = (Mode.NONE, Mode.TIME_SLICING)


def executed(state: GpuNow, steps, target: GpuConfig) -> GpuNow:
    """What the GPU and the agent are after `steps`, a mode change taking effect at once."""
    for step in steps:
        match step:
            case EnableMig():
                state = replace(state, mig_enabled=True, mig_pending=False, remembered=Mode.NONE)
            case DisableMig():
                assert state.instances == (), "MIG mode off on a GPU that holds instances"
                state = replace(state, mig_enabled=False, mig_pending=False)
            case StartMpsDaemon():
                state = replace(state, mps_started=True, mps_serving=step.limits)
            case StopMpsDaemon():
                state = replace(state, mps_started=False, mps_serving=None, remembered=Mode.NONE)
            case _:
                after = apply_steps(A100, state.instances, (step,))
                state = replace(state, instances=after)
    if target.mode is not Mode.MIG and not state.mig_enabled:
        state = replace(state, remembered=Mode.NONE if target.mode is Mode.MPS else target.mode)
    return state


@given(gpu_nows(), st.sampled_from([MPS4, MIG_TARGET, WHOLE, SLICED]))
def test_law_mode_plans_reach_the_target_mode_and_then_stay_empty(state, target):
    busy = {s.instance for s in state.instances if s.in_use}
    if target.mode is Mode.MIG and state.mig_pending and not state.mig_enabled:
        assert plan_mode(state, target) == (), "MIG mode asked already: it waits for a reset"
        return
    for _ in range(2):  # a MIG mode step ends a plan: at most one more plan after it
        try:
            steps = plan_mode(state, target)
        except PlanBlocked:
            changes = state.mode is not target.mode or state.mig_pending
            assert state.in_use or busy, "blocked although nothing uses the GPU"
            assert changes, "blocked although the mode stays"
            return
        mig_steps = [i for i, s in enumerate(steps) if isinstance(s, MIG_MODE_STEPS)]
        assert mig_steps in ([], [len(steps) - 1]), "a MIG mode step ends a plan"
        destroyed = {s.instance for s in steps if isinstance(s, DestroyGpuInstance)}
        assert not destroyed & busy, "an in-use instance was destroyed"
        state = executed(state, steps, target)
        if not mig_steps:
            break
    assert state.mode is target.mode
    assert plan_mode(state, target) == (), "a plan from the reached state is empty"
