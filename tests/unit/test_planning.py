"""Plans from an actual MIG layout to a desired one.

Aspects: applying plan(a, d) to a gives d; plan(d, d) is empty; instances that already match
are never touched; in-use instances are never destroyed unless disruption is allowed;
half-built instances (GPU instance without compute instance) are finished; steps are ordered
destroy-before-create so the GPU never holds overlapping instances.
"""

from functools import cache

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpupart.core.errors import InfeasibleLayout, PlanBlocked
from gpupart.core.mig.catalogue import GpuModel, require_gpu_model
from gpupart.core.mig.layout import MigInstance, Placement, fit_layout, layout_counts
from gpupart.core.mig.planning import (
    CreateComputeInstance,
    CreateGpuInstance,
    DestroyComputeInstance,
    DestroyGpuInstance,
    GpuInstanceState,
    apply_steps,
    layout_of,
    plan_counts,
    plan_layout,
)

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
