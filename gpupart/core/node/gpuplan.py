"""Each GPU's pass, decided: from what NVML reports, the target and the MIG plan, the steps to run or a refusal.

Rule: every decision of a pass lives here, none in the actuator. The actuator reads the GPU
(`GpuFacts`), asks `plan_gpu`, executes the steps it returns in order, rolls back a failed
instance step, and reports what NVML says afterwards. `plan_gpu` chooses between a mode
change (`plan_mode`), a MIG plan's exact layout (`plan_layout`) and the target's counts
(`plan_counts`), and says what the pass reports when the steps are done; a MIG mode step ends
the steps (`GpuPlan.again`): the actuator reads the GPU again and asks again with `switched`.
For the whole node: which GPUs follow a MIG plan (`follow_mig_plan`), the plan's answer
(`answer_mig_plan`) and the report of a refused desired state (`refused_report`).
No I/O here: everything read comes in as arguments (docs/adr-013-dynamic-mig-plans.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from gpupart.core.api.spec import GpuConfig, Mode
from gpupart.core.api.wire import DesiredGroup, GpuReport, GpuState, MigPlan, NodeReport, PlanReport
from gpupart.core.errors import GpupartError, PlanBlocked
from gpupart.core.mig.catalogue import GpuModel
from gpupart.core.mig.layout import Layout, check_layout
from gpupart.core.mig.planning import GpuInstanceState, plan_counts, plan_layout
from gpupart.core.node.modes import MIG_MODE_STEPS, GpuNow, GpuStep, plan_mode
from gpupart.core.node.mps import MpsLimits


@dataclass(frozen=True, slots=True)
class RememberedMode:
    """A mode NVML cannot tell (time-slicing looks like a whole GPU) that the agent applied, with its client slots."""

    mode: Mode
    slots: int


@dataclass(frozen=True, slots=True)
class GpuFacts:
    """One GPU as the actuator reads it for a round: NVML, the MPS daemon, PodResources and the agent's memory."""

    index: int
    name: str
    memory_mib: int
    mig_capable: bool
    mig_enabled: bool
    mig_pending: bool = False
    """A MIG mode change waits for a GPU reset."""
    model: GpuModel | None = None
    """The GPU's MIG geometry as NVML states it; read in MIG mode only, None when not read or
    NVML did not answer (`model_problem` says why)."""
    model_problem: str = ""
    mps_started: bool = False
    """An MPS control daemon was started for the GPU (its marker is there)."""
    mps_serving: MpsLimits | None = None
    """The limits of the GPU's daemon that answers now; asked only when the target is MPS
    (the one plan that compares them), None otherwise or when none answers."""
    remembered: RememberedMode | None = None
    """What the agent applied last where NVML cannot tell; None: nothing remembered."""
    instances: tuple[GpuInstanceState, ...] = ()
    """Its GPU instances (MIG mode), each with whether a pod or process holds it."""
    pods: tuple[str, ...] = ()
    """Pods (namespace/name) that PodResources lists on the GPU or one of its MIG devices."""
    processes: int = 0
    """Processes NVML lists on the GPU."""
    usage_known: bool = True
    """PodResources answered; when it did not, every pod use is unknown (`usage_problem`: why)."""
    usage_problem: str = ""
    held_slots: int = 0
    """Client slots (shared-GPU device ids) pods hold on the GPU, as PodResources lists them."""


@dataclass(frozen=True, slots=True)
class GpuPlan:
    """The steps to run on one GPU, in order, and what the pass reports once they ran.

    No step and a state other than Applied: a refusal (Blocked names the use, Failed the
    problem, Pending the reset a MIG mode change waits for). A failed step is the actuator's
    to report (with its rollback); the state here is for steps that all succeed.
    """

    steps: tuple[GpuStep, ...] = ()
    state: GpuState = GpuState.APPLIED
    message: str = ""
    blocking: tuple[str, ...] = ()
    """The pods a Blocked report names."""
    again: bool = False
    """A MIG mode step ends the steps: read the GPU again and plan again (`switched`)."""
    layout: Layout | None = None
    """The MIG layout the steps reach (MIG instance steps only), for the log."""
    follows_plan: bool = False
    """The steps are a MIG plan's: the actuator offers each instance as soon as it exists."""
    assumed: RememberedMode | None = None
    """To remember now: pods hold client slots on a GPU the agent has no memory of, without an
    MPS daemon, so it is time-sliced (an agent restarted without its last inventory)."""
    remember: RememberedMode | None = None
    """To remember once the steps ran: the mode NVML will not tell."""


def plan_gpu(
    gpu: GpuFacts,
    target: GpuConfig | None,
    *,
    planned: Layout | None = None,
    switched: bool = False,
) -> GpuPlan:
    """What to do on `gpu` for `target` (None: no desired annotation yet, change nothing).

    `planned`: the exact layout a MIG plan names for it (`follow_mig_plan`); a dynamic MIG GPU
    without one keeps its instances. `switched`: the GPU as read again after a MIG mode step;
    a mode that did not take effect then waits for a reset (Pending). InvalidInput when the
    target's MPS figures do not fit the GPU.
    """
    assumed = None
    remembered = gpu.remembered
    if not switched and remembered is None and gpu.held_slots:
        slots = target.replicas if target is not None else gpu.held_slots
        assumed = remembered = RememberedMode(Mode.TIME_SLICING, slots)
    if target is None:
        return GpuPlan(message="no desired layout on this node yet", assumed=assumed)
    mig = target.mode is Mode.MIG
    if mig and not gpu.mig_capable:
        return GpuPlan(
            state=GpuState.FAILED, message=f"{gpu.name} does not support MIG", assumed=assumed
        )
    if switched and gpu.mig_enabled is not mig:
        return pending_mode(mig)
    now = GpuNow(
        gpu=gpu.index,
        memory_mib=gpu.memory_mib,
        mig_enabled=gpu.mig_enabled,
        mig_pending=gpu.mig_pending,
        mps_started=gpu.mps_started,
        mps_serving=gpu.mps_serving,
        remembered=remembered.mode if remembered is not None else Mode.NONE,
        instances=gpu.instances,
        in_use=_in_use(gpu),
    )
    try:
        steps = plan_mode(now, target)
    except PlanBlocked as blocked:
        return GpuPlan(
            state=GpuState.BLOCKED, message=str(blocked), blocking=gpu.pods, assumed=assumed
        )
    if steps and (mig or isinstance(steps[-1], MIG_MODE_STEPS)):
        # What follows depends on the GPU once the change took effect: read it again.
        return GpuPlan(steps, again=True, assumed=assumed)
    if gpu.mig_enabled is not mig:
        return _with(pending_mode(mig), assumed)
    if not mig:
        return GpuPlan(
            steps, assumed=assumed, remember=RememberedMode(target.mode, target.replicas)
        )
    return _with(_mig_layout(gpu, target, planned), assumed)


def pending_mode(mig: bool) -> GpuPlan:
    """A MIG mode change that waits for a GPU reset."""
    return GpuPlan(
        state=GpuState.PENDING,
        message=f"MIG mode is {'en' if mig else 'dis'}abled but takes effect after a GPU reset "
        "or node reboot",
    )


def _mig_layout(gpu: GpuFacts, target: GpuConfig, planned: Layout | None) -> GpuPlan:
    """On a GPU in MIG mode: the target's counts, or on a dynamic GPU the plan's exact layout
    (none named: its instances stay as they are)."""
    if target.dynamic and planned is None:
        return GpuPlan()
    try:
        if planned is not None:
            layout, steps = planned, plan_layout(gpu.index, gpu.instances, planned)
        elif gpu.model is None:
            problem = gpu.model_problem or f"GPU {gpu.index}: NVML did not state its MIG profiles"
            return GpuPlan(state=GpuState.FAILED, message=problem)
        else:
            counts = dict(target.mig)
            layout, steps = plan_counts(gpu.model, gpu.index, gpu.instances, counts)
    except PlanBlocked as blocked:
        return GpuPlan(state=GpuState.BLOCKED, message=str(blocked), blocking=gpu.pods)
    except GpupartError as error:  # InfeasibleLayout, UnknownProfile
        return GpuPlan(state=GpuState.FAILED, message=str(error))
    return GpuPlan(steps, layout=layout, follows_plan=planned is not None)


def _in_use(gpu: GpuFacts) -> str:
    """Why pods or processes use the whole GPU (a mode change would break them); '' when idle."""
    if gpu.pods:
        return f"pods {', '.join(gpu.pods)}"
    if gpu.processes:
        return f"{gpu.processes} processes"
    return "" if gpu.usage_known else f"unknown pods ({gpu.usage_problem})"


def _with(plan: GpuPlan, assumed: RememberedMode | None) -> GpuPlan:
    return plan if assumed is None else replace(plan, assumed=assumed)


# ---- the node: a MIG plan followed, answered; a desired state refused ----


@dataclass(frozen=True, slots=True)
class FollowedPlan:
    """Which GPUs follow a MIG plan, to which layouts, and why the plan is not followed elsewhere."""

    layouts: Mapping[int, Layout] = field(default_factory=dict)
    refusals: tuple[str, ...] = ()
    """Per GPU not followed, why (`GPU 2: ...`), in the plan's order."""
    refused: str = ""
    """Why the whole plan is refused ('' when it is followed where it can be)."""


def follow_mig_plan(
    plan: MigPlan | None,
    models: Mapping[int, GpuModel | str],
    targets: Mapping[int, GpuConfig] | None,
) -> FollowedPlan:
    """The layouts a MIG plan asks of this node's GPUs, checked before any step.

    `models`: the MIG geometry (or why NVML did not state it) of every GPU of this node that
    the plan names; a GPU missing there is not on this node. `targets`: each GPU's target
    (None: no desired state yet). A GPU whose target is not dynamic MIG (the desired
    annotation changed under the plan) is left out and the rest is followed. A GPU this node
    does not have, or a layout its model cannot hold, refuses the whole plan: the operator's
    view of the node is wrong, none of it is followed.
    """
    if plan is None:
        return FollowedPlan()
    planned: dict[int, Layout] = {}
    left_out: list[str] = []
    broken: list[str] = []
    for gpu in plan.gpus:
        model = models.get(gpu.index)
        if model is None:
            broken.append(f"GPU {gpu.index}: not on this node")
            continue
        target = None if targets is None else targets[gpu.index]
        if target is None or target.mode is not Mode.MIG or not target.dynamic:
            wanted = "no desired state yet" if target is None else f"its target is {_text(target)}"
            left_out.append(f"GPU {gpu.index}: not a dynamic MIG GPU ({wanted}); left as it is")
            continue
        if isinstance(model, str):
            broken.append(_on_gpu(gpu.index, model))
            continue
        try:
            check_layout(model, gpu.layout)
        except GpupartError as error:
            broken.append(_on_gpu(gpu.index, str(error)))
            continue
        planned[gpu.index] = tuple(sorted(gpu.layout))
    if broken:
        return FollowedPlan({}, (*broken, *left_out), "; ".join(broken))
    return FollowedPlan(planned, tuple(left_out))


PLAN_SEVERITY = (GpuState.APPLIED, GpuState.PENDING, GpuState.BLOCKED, GpuState.FAILED)
"""A plan's state is its worst GPU's: Failed over Blocked over Pending."""


def answer_mig_plan(
    plan_id: str, followed: FollowedPlan, reports: Iterable[GpuReport]
) -> PlanReport:
    """The answer to a plan: Applied when every GPU it names holds its layout, else the worst
    of Failed (the plan not followed there) > Blocked > Pending, each GPU's reason in index
    order (`GPU 2: ...; GPU 3: ...`)."""
    outcomes = [(GpuState.FAILED, reason) for reason in followed.refusals]
    by_index = {r.index: r for r in reports}
    for index, layout in sorted(followed.layouts.items()):
        gpu = by_index[index]
        if gpu.state is GpuState.APPLIED:
            if set(gpu.layout) != set(layout):  # never expected: a step reported done was not
                outcomes.append(
                    (GpuState.FAILED, f"GPU {index}: holds {layout_text(gpu.layout) or 'nothing'}")
                )
            continue
        outcomes.append((gpu.state, _on_gpu(index, gpu.message)))
    if not outcomes:
        return PlanReport(plan_id, GpuState.APPLIED)
    worst = max((state for state, _ in outcomes), key=PLAN_SEVERITY.index)
    return PlanReport(plan_id, worst, "; ".join(reason for _, reason in outcomes))


def observed(groups: Iterable[DesiredGroup]) -> tuple[tuple[str, int], ...]:
    """The (partition, generation) pairs a report says it acted on."""
    return tuple(sorted({(g.partition, g.generation) for g in groups}))


def refused_report(
    reason: str,
    gpus: Iterable[GpuReport],
    groups: Iterable[DesiredGroup] = (),
    plan: MigPlan | None = None,
) -> NodeReport:
    """A desired state not applied: every GPU (`gpus`: as they are) Failed with the reason, the
    groups it names observed so their partitions show why, a MIG plan answered not followed."""
    reports = tuple(GpuReport(g.index, GpuState.FAILED, g.mode, g.layout, reason) for g in gpus)
    answer = (
        None
        if plan is None
        else PlanReport(
            plan.id, GpuState.FAILED, f"not followed: the desired state is refused ({reason})"
        )
    )
    return NodeReport(observed(groups), reports, answer)


def layout_text(layout: Layout) -> str:
    return ", ".join(str(i) for i in layout)


def _on_gpu(index: int, message: str) -> str:
    """`message` about GPU `index`, opening with `GPU <index>: ` once (core messages often do)."""
    prefix = f"GPU {index}: "
    return message if message.startswith(prefix) else prefix + message


def _text(target: GpuConfig) -> str:
    return "static MIG" if target.mode is Mode.MIG else str(target.mode)
