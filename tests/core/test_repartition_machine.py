"""A GPU driven through random repartitions, crashes mid-apply and pods coming and going.

Hypothesis drives a state machine over the core's plan and the simulated GPU semantics
(`apply_steps`): the layout is always valid, an in-use instance is never destroyed, and after a
crash halfway through a plan, the next plan from what is really there converges.
"""

import itertools
from functools import cache

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from gpupart.core.errors import PlanBlocked
from gpupart.core.mig.catalogue import GpuModel, require_gpu_model
from gpupart.core.mig.layout import check_layout, fit_layout, layout_counts
from gpupart.core.mig.planning import GpuInstanceState, apply_steps, layout_of, plan_counts

MODEL = require_gpu_model("H100-SXM5-80GB")


@cache
def feasible_counts(model: GpuModel) -> tuple[dict[str, int], ...]:
    found = []
    for vector in itertools.product(*(range(p.max_count + 1) for p in model.profiles)):
        counts = {p.name: n for p, n in zip(model.profiles, vector, strict=True) if n}
        if fit_layout(model, counts) is not None:
            found.append(counts)
    return tuple(found)


class RepartitionedGpu(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.states: tuple[GpuInstanceState, ...] = ()
        self.target: dict[str, int] | None = None
        self.crashed: dict[str, int] | None = None

    def busy(self) -> set:
        return {s.instance for s in self.states if s.in_use}

    @rule(
        counts=st.sampled_from(feasible_counts(MODEL)), crash_after=st.none() | st.integers(0, 12)
    )
    def repartition(self, counts, crash_after):
        before = self.busy()
        try:
            layout, steps = plan_counts(MODEL, 0, self.states, counts)
        except PlanBlocked:
            # Blocked is allowed only when an in-use instance stands in the way.
            assert before, "blocked although nothing is in use"
            return
        done = steps if crash_after is None else steps[:crash_after]
        self.states = apply_steps(MODEL, self.states, done)
        assert before <= {s.instance for s in self.states}, "an in-use instance was destroyed"
        finished = crash_after is None or crash_after >= len(steps)
        self.target, self.crashed = (counts, None) if finished else (None, counts)
        if finished:
            assert layout_of(self.states) == layout

    @precondition(lambda self: self.crashed is not None)
    @rule()
    def restart_converges(self):
        """After a crash, planning the same counts from the real state finishes the job."""
        assert self.crashed is not None
        try:
            layout, steps = plan_counts(MODEL, 0, self.states, self.crashed)
        except PlanBlocked:
            assert self.busy(), "blocked although nothing is in use"
            return
        self.states = apply_steps(MODEL, self.states, steps)
        assert layout_of(self.states) == layout
        assert layout_counts(layout) == self.crashed
        assert all(s.compute_instances == 1 for s in self.states)
        self.target, self.crashed = self.crashed, None

    @precondition(lambda self: self.states)
    @rule(data=st.data())
    def pod_starts_or_stops(self, data):
        index = data.draw(st.integers(0, len(self.states) - 1))
        chosen = self.states[index]
        if chosen.compute_instances:
            flipped = GpuInstanceState(chosen.instance, chosen.compute_instances, not chosen.in_use)
            self.states = tuple(sorted((*self.states[:index], flipped, *self.states[index + 1 :])))

    @invariant()
    def layout_is_valid(self):
        check_layout(MODEL, [s.instance for s in self.states])


TestRepartitionedGpu = RepartitionedGpu.TestCase
