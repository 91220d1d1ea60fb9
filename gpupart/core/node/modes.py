"""Mode plans: the steps that take one GPU between whole, MIG, MPS and time-slicing, as data like MIG instance steps.

`plan_mode` turns what the agent reads of a GPU (`GpuNow`) and its target into steps: MIG mode
on or off, the MPS control daemon started (with its limits) or stopped, and, when leaving MIG
mode, the instance steps that empty the GPU first. A mode change of a GPU in use is refused
(PlanBlocked names the use). A MIG mode step always ends a plan: what follows depends on the
GPU once the change took effect (a reset may be needed), so the agent reads the GPU again and
plans again. Time-slicing has no GPU-side state; the agent remembers it (`GpuNow.remembered`).
"""

from __future__ import annotations

from dataclasses import dataclass

from gpupart.core.api.spec import GpuConfig, Mode
from gpupart.core.errors import PlanBlocked
from gpupart.core.mig.planning import GpuInstanceState, Step, plan_layout
from gpupart.core.node.mps import MpsLimits, mps_limits


@dataclass(frozen=True, slots=True)
class EnableMig:
    """MIG mode on (also cancels a pending switch to whole GPU); may wait for a GPU reset."""

    gpu: int


@dataclass(frozen=True, slots=True)
class DisableMig:
    """MIG mode off (also cancels a pending switch to MIG); the GPU holds no instance then."""

    gpu: int


@dataclass(frozen=True, slots=True)
class StartMpsDaemon:
    """Compute mode EXCLUSIVE_PROCESS and the GPU's MPS control daemon serving `limits`
    (started, or reconfigured when it serves other limits)."""

    gpu: int
    limits: MpsLimits


@dataclass(frozen=True, slots=True)
class StopMpsDaemon:
    """The GPU's MPS control daemon stopped, compute mode back to DEFAULT."""

    gpu: int


ModeStep = EnableMig | DisableMig | StartMpsDaemon | StopMpsDaemon
MIG_MODE_STEPS = (EnableMig, DisableMig)
GpuStep = Step | ModeStep
"""Any step of a GPU's plan: a MIG instance step or a mode step."""


@dataclass(frozen=True, slots=True)
class GpuNow:
    """One GPU as the agent reads it before planning."""

    gpu: int
    memory_mib: int
    mig_enabled: bool
    mig_pending: bool = False
    """A MIG mode change waits for a GPU reset."""
    mps_started: bool = False
    """An MPS control daemon was started for the GPU (and not stopped)."""
    mps_serving: MpsLimits | None = None
    """The limits of the daemon that answers now; None when none answers."""
    remembered: Mode = Mode.NONE
    """The mode the agent applied last where NVML cannot tell (time-slicing or whole)."""
    instances: tuple[GpuInstanceState, ...] = ()
    """Its GPU instances (MIG mode), each with whether it is in use."""
    in_use: str = ""
    """Why the whole GPU counts as in use ('pods a/b', '3 processes', ...); '' when idle."""

    @property
    def mode(self) -> Mode:
        if self.mig_enabled:
            return Mode.MIG
        if self.mps_started:
            return Mode.MPS
        return self.remembered


def plan_mode(now: GpuNow, target: GpuConfig) -> tuple[GpuStep, ...]:
    """Steps from `now` to the target's mode (not to its MIG layout: `plan_counts` does that).

    Empty when the GPU is in that mode already (the MPS daemon serving the target's limits).
    PlanBlocked when the change would break a use of the GPU; InvalidInput when the target's
    MPS figures do not fit the GPU.
    """
    if target.mode is Mode.MIG:
        if now.mig_enabled:
            return (EnableMig(now.gpu),) if now.mig_pending else ()
        if now.mig_pending:
            return ()  # enabling waits for a reset
        _require_idle(now)
        return (*_stop_mps(now), EnableMig(now.gpu))
    if now.mig_enabled or now.mig_pending:
        steps: tuple[GpuStep, ...] = ()
        if now.mig_enabled:
            busy = [s.instance for s in now.instances if s.in_use]
            if busy:
                raise PlanBlocked(
                    f"leaving MIG mode destroys {', '.join(map(str, busy))}, in use; "
                    "it changes once they are idle"
                )
            steps = plan_layout(now.gpu, now.instances, ())
        return (*steps, DisableMig(now.gpu))
    if now.mode is not target.mode:
        _require_idle(now)
    if target.mode is Mode.MPS and target.mps is not None:
        limits = mps_limits(target, now.memory_mib)
        return () if now.mps_serving == limits else (StartMpsDaemon(now.gpu, limits),)
    return _stop_mps(now)


def _require_idle(now: GpuNow) -> None:
    if now.in_use:
        raise PlanBlocked(f"in use by {now.in_use}; it leaves {now.mode} mode once idle")


def _stop_mps(now: GpuNow) -> tuple[GpuStep, ...]:
    return (StopMpsDaemon(now.gpu),) if now.mps_started else ()
