"""Plans: the ordered NVML steps that turn one GPU's actual MIG layout into the desired one.

A plan is data (log it, show it in status, test it); the node agent executes it step by step.
It keeps every instance that already matches, finishes half-built instances (a GPU instance
without its compute instance, left by a crash mid-apply), and never touches an instance in use
unless the caller allows disruption.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

from gpupart.core.errors import GpupartError, InfeasibleLayout, PlanBlocked, UnknownProfile
from gpupart.core.mig.catalogue import GpuModel
from gpupart.core.mig.layout import (
    Layout,
    MigInstance,
    check_layout,
    fit_layout,
    solve_layout,
)


@dataclass(frozen=True, slots=True, order=True)
class GpuInstanceState:
    """A GPU instance as read from the GPU: how many compute instances it has, and whether in use."""

    instance: MigInstance
    compute_instances: int = 1
    in_use: bool = False


@dataclass(frozen=True, slots=True)
class DestroyComputeInstance:
    gpu: int
    instance: MigInstance


@dataclass(frozen=True, slots=True)
class DestroyGpuInstance:
    gpu: int
    instance: MigInstance


@dataclass(frozen=True, slots=True)
class CreateGpuInstance:
    gpu: int
    instance: MigInstance


@dataclass(frozen=True, slots=True)
class CreateComputeInstance:
    gpu: int
    instance: MigInstance


Step = DestroyComputeInstance | DestroyGpuInstance | CreateGpuInstance | CreateComputeInstance


def plan_layout(
    gpu: int,
    actual: Iterable[GpuInstanceState],
    desired: Layout,
    *,
    allow_disruption: bool = False,
) -> tuple[Step, ...]:
    """Steps from `actual` to `desired`: destroys first (they free memory slices), then creates."""
    actual = sorted(actual)
    wanted = frozenset(desired)
    doomed = [state for state in actual if state.instance not in wanted]
    busy = [state.instance for state in doomed if state.in_use]
    if busy and not allow_disruption:
        raise PlanBlocked(
            f"GPU {gpu}: the desired layout removes {', '.join(map(str, busy))}, in use; "
            "it changes once they are idle (disruption: WhenIdle)"
        )
    steps: list[Step] = []
    for state in doomed:
        steps.extend(
            DestroyComputeInstance(gpu, state.instance) for _ in range(state.compute_instances)
        )
        steps.append(DestroyGpuInstance(gpu, state.instance))
    existing = {state.instance: state for state in actual}
    for instance in sorted(desired):
        found = existing.get(instance)
        if found is None:
            steps.append(CreateGpuInstance(gpu, instance))
        if found is None or found.compute_instances == 0:
            steps.append(CreateComputeInstance(gpu, instance))
    return tuple(steps)


def plan_counts(
    model: GpuModel,
    gpu: int,
    actual: Sequence[GpuInstanceState],
    counts: Mapping[str, int],
    *,
    allow_disruption: bool = False,
) -> tuple[Layout, tuple[Step, ...]]:
    """Choose the layout with `counts` closest to `actual`, then plan the way there.

    In-use instances stay where they are unless disruption is allowed; when that makes the
    counts impossible, PlanBlocked says which instances are in the way.
    """
    present = [state.instance for state in actual]
    busy = () if allow_disruption else tuple(s.instance for s in actual if s.in_use)
    try:
        layout = solve_layout(model, counts, keep=busy, prefer=present)
    except InfeasibleLayout as error:
        if busy and fit_layout(model, counts) is not None:
            raise PlanBlocked(f"GPU {gpu}: {error}; it changes once they are idle") from error
        raise
    return layout, plan_layout(gpu, actual, layout, allow_disruption=allow_disruption)


class Refusal(StrEnum):
    """Why a GPU refuses a step; the simulated GPU answers each with NVML's error kind."""

    MISSING = "missing"
    """No such GPU instance, or no compute instance on it to destroy."""
    HAS_COMPUTE = "has compute instances"
    """A GPU instance destroyed while it still has compute instances."""
    COMPLETE = "complete"
    """A second compute instance: the one full-size compute instance fills the GPU instance."""
    NO_ROOM = "no room"
    """The new GPU instance breaks a layout rule (placement, overlap, counts, engines)."""
    UNKNOWN_PROFILE = "unknown profile"


@dataclass(frozen=True, slots=True)
class StepRefused:
    """A step the GPU would refuse: the reason, and the error that says it to a person."""

    refusal: Refusal
    error: GpupartError


def step_refused(
    model: GpuModel, states: Mapping[MigInstance, GpuInstanceState], step: Step
) -> StepRefused | None:
    """Whether a GPU holding `states` refuses `step`, and why; None when it applies."""
    state = states.get(step.instance)
    missing = Refusal.MISSING
    match step:
        case DestroyComputeInstance():
            if state is None or state.compute_instances == 0:
                return _refused(missing, f"GPU {step.gpu}: no compute instance on {step.instance}")
        case DestroyGpuInstance():
            if state is None or state.compute_instances:
                why = missing if state is None else Refusal.HAS_COMPUTE
                return _refused(
                    why,
                    f"GPU {step.gpu}: {step.instance} is missing or still has compute instances",
                )
        case CreateGpuInstance():
            try:
                check_layout(model, (*states, step.instance))
            except UnknownProfile as error:
                return StepRefused(Refusal.UNKNOWN_PROFILE, error)
            except InfeasibleLayout as error:
                return StepRefused(Refusal.NO_ROOM, error)
        case CreateComputeInstance():
            if state is None or state.compute_instances:
                why = missing if state is None else Refusal.COMPLETE
                return _refused(
                    why,
                    f"GPU {step.gpu}: {step.instance} is missing or already has its compute instance",
                )
    return None


def _refused(refusal: Refusal, message: str) -> StepRefused:
    return StepRefused(refusal, InfeasibleLayout(message))


def apply_step(
    states: Mapping[MigInstance, GpuInstanceState], step: Step
) -> dict[MigInstance, GpuInstanceState]:
    """The instances after `step`, which `step_refused` accepted."""
    after = dict(states)
    state = after.get(step.instance)
    match step:
        case DestroyComputeInstance():
            assert state is not None
            after[step.instance] = replace(state, compute_instances=state.compute_instances - 1)
        case DestroyGpuInstance():
            del after[step.instance]
        case CreateGpuInstance():
            after[step.instance] = GpuInstanceState(step.instance, compute_instances=0)
        case CreateComputeInstance():
            assert state is not None
            after[step.instance] = replace(state, compute_instances=1)
    return after


def apply_steps(
    model: GpuModel, actual: Iterable[GpuInstanceState], steps: Iterable[Step]
) -> tuple[GpuInstanceState, ...]:
    """The state after `steps`, as the GPU would reach it; a step that cannot apply raises.

    These are the step semantics of the simulated GPU (`gpupart node --simulate`) and the test
    oracle for plans: one definition of what a GPU accepts.
    """
    states = {state.instance: state for state in actual}
    for step in steps:
        refused = step_refused(model, states, step)
        if refused is not None:
            raise refused.error
        states = apply_step(states, step)
    return tuple(sorted(states.values()))


def layout_of(states: Iterable[GpuInstanceState]) -> Layout:
    """The complete instances (those with a compute instance) as a layout."""
    return tuple(sorted(state.instance for state in states if state.compute_instances))
