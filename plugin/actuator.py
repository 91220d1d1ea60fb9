"""The layout actuator: one idempotent pass that reads the GPUs, plans with the core, applies, and reports.

Every pass starts from what NVML says now, so a pass after a crash mid-apply finishes or undoes
the half-built work. An instance that a pod or process uses is never destroyed. A failed step
is followed by a rollback to the previous layout (or, failing that, to the in-use instances
only), and the report names what is on the GPU afterwards. A dynamic MIG GPU goes to the exact
layout the operator's MIG plan names for it, and is otherwise left as it is
(docs/adr-013-dynamic-mig-plans.md).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from gpupart import logs
from gpupart.core.api.spec import GpuConfig, Mode
from gpupart.core.api.wire import (
    DesiredGroup,
    GpuReport,
    GpuState,
    Inventory,
    InventoryGpu,
    MigDevice,
    MigPlan,
    NodeReport,
    PlanReport,
)
from gpupart.core.errors import GpupartError, InfeasibleLayout, InvalidInput, PlanBlocked
from gpupart.core.mig.layout import Layout, check_layout
from gpupart.core.mig.planning import (
    CreateComputeInstance,
    GpuInstanceState,
    layout_of,
    plan_counts,
    plan_layout,
)
from gpupart.core.node.devices import OfferedGpu, OfferedMigDevice
from gpupart.core.node.modes import (
    MIG_MODE_STEPS,
    DisableMig,
    EnableMig,
    GpuNow,
    GpuStep,
    ModeStep,
    StartMpsDaemon,
    StopMpsDaemon,
    plan_mode,
)
from gpupart.core.node.targets import gpu_targets
from gpupart_plugin.backend import GpuBackend, GpuInfo, GpuInstanceRecord, NvmlError
from gpupart_plugin.mps import MpsDaemons
from gpupart_plugin.podresources import DeviceUsage, UsageSource, device_usage

log = logging.getLogger(__name__)

Progress = Callable[[OfferedGpu, frozenset[str]], None]
"""Called from a GPU's thread after each instance a MIG plan creates there (GI and CI made):
the GPU's view now and the MIG device UUIDs on it in use (as `PassResult.used`)."""


@dataclass(frozen=True, slots=True)
class PassResult:
    report: NodeReport
    views: tuple[OfferedGpu, ...]
    failed: int
    used: frozenset[str] = field(default_factory=frozenset)
    """MIG device UUIDs a pod or process held at the end of the pass (all of a GPU's while
    PodResources does not answer: unknown counts as used)."""
    holders: frozenset[str] = field(default_factory=frozenset)
    """The pods (namespace/name) PodResources listed with devices at the pass."""

    @property
    def waiting(self) -> bool:
        """A GPU waits on something no event announces: pods PodResources still lists (Blocked),
        or a MIG mode change waiting for its GPU reset (Pending); another pass may apply it."""
        return any(g.state in (GpuState.BLOCKED, GpuState.PENDING) for g in self.report.gpus)


class Actuator:
    """Applies desired groups to this node's GPUs through a GpuBackend."""

    def __init__(self, backend: GpuBackend, usage: UsageSource, mps: MpsDaemons) -> None:
        self.backend = backend
        self.usage = usage
        self.mps = mps
        # TimeSlicing and None look the same to NVML; the agent remembers which it applied.
        self._shared_modes: dict[int, tuple[Mode, int]] = {}

    def resume(self, previous: Inventory) -> None:
        """The time-sliced GPUs and their client slots from the inventory published before a restart.

        NVML cannot tell a time-sliced GPU from a whole one (an MPS GPU has its daemon's marker,
        a MIG GPU its mode), so without this a restart would forget them. A GPU is taken back
        only when its index and UUID both match what NVML reports now.
        """
        uuids = {g.index: g.uuid for g in self.backend.gpus()}
        for gpu in previous.gpus:
            if gpu.mode is not Mode.TIME_SLICING:
                continue
            if uuids.get(gpu.index) != gpu.uuid or gpu.replicas < 1:
                log.warning(
                    "Ignored earlier mode",
                    extra=logs.kv(gpu=gpu.index, mode=gpu.mode, reason="not this GPU now"),
                )
                continue
            self._shared_modes[gpu.index] = (Mode.TIME_SLICING, gpu.replicas)
            log.info(
                "Resumed mode", extra=logs.kv(gpu=gpu.index, mode=gpu.mode, slots=gpu.replicas)
            )

    def reconcile(
        self,
        groups: tuple[DesiredGroup, ...] | None,
        plan: MigPlan | None = None,
        progress: Progress | None = None,
    ) -> PassResult:
        """One pass; `groups` None (no desired annotation yet) changes nothing and reports.

        `plan`: the MIG plan on the node (None: none there), followed on its dynamic MIG GPUs
        and answered in `NodeReport.plan`. `progress`: told of each instance the plan creates
        as soon as it exists, from that GPU's thread (calls from two GPUs may overlap).
        """
        usage = device_usage(self.usage)
        gpus = self.backend.gpus()
        try:
            targets = gpu_targets(groups or (), [g.index for g in gpus])
        except InvalidInput as error:
            log.error("Refused desired layout", extra=logs.kv(err=error))
            return self.refuse(str(error), groups or (), plan)
        planned, refusals = self._check_plan(plan, gpus, None if groups is None else targets)

        def one(info: GpuInfo) -> tuple[GpuReport, OfferedGpu, frozenset[str]]:
            target = None if groups is None else targets[info.index]
            try:
                report = self._gpu(info, target, usage, planned.get(info.index), progress)
            except GpupartError as error:
                # An NVML read failed outside a plan (GPU lost, no permission): say so, go on.
                log.error("Failed to reconcile GPU", extra=logs.kv(gpu=info.index, err=error))
                report = GpuReport(info.index, GpuState.FAILED, Mode.NONE, message=str(error))
            view = self._view(info.index)
            return report, view, self._held(info.index, view.mig, usage)

        # One thread per GPU: each GPU's steps run in order, GPUs at the same time (a plan's
        # instances on two GPUs take one create's time, not two). Each touches only its own
        # GPU, MPS daemon and `_shared_modes` entry; the backend is thread-safe (NVML is, and
        # so is the simulated GPU).
        with ThreadPoolExecutor(max(1, len(gpus)), thread_name_prefix="gpu") as pool:
            done = list(pool.map(one, gpus))
        reports = [report for report, _, _ in done]
        views = tuple(view for _, view, _ in done)
        used = frozenset[str]().union(*(held for _, _, held in done))
        failed = sum(r.state is GpuState.FAILED for r in reports)
        observed = tuple(sorted({(g.partition, g.generation) for g in groups or ()}))
        answer = None if plan is None else plan_report(plan.id, refusals, planned, reports)
        if answer is not None and answer.state is not GpuState.APPLIED:
            log.info(
                "Reported MIG plan",
                extra=logs.kv(plan=answer.id, state=answer.state, reason=answer.message),
            )
        holders = frozenset[str]().union(*usage.pods.values())
        report = NodeReport(observed, tuple(reports), answer)
        return PassResult(report, views, failed, used, holders)

    def refuse(
        self, reason: str, groups: tuple[DesiredGroup, ...] = (), plan: MigPlan | None = None
    ) -> PassResult:
        """A desired state not to apply: nothing changes, every GPU reports Failed with the
        reason, and the groups it names count as observed so their partitions show why. A MIG
        plan on the node is not followed either, and its report says why."""
        result = self.reconcile(None)
        reports = tuple(
            GpuReport(g.index, GpuState.FAILED, g.mode, g.layout, reason)
            for g in result.report.gpus
        )
        observed = tuple(sorted({(g.partition, g.generation) for g in groups}))
        answer = (
            None
            if plan is None
            else PlanReport(
                plan.id, GpuState.FAILED, f"not followed: the desired state is refused ({reason})"
            )
        )
        report = NodeReport(observed, reports, answer)
        return replace(result, report=report, failed=len(reports))

    def _check_plan(
        self,
        plan: MigPlan | None,
        gpus: Sequence[GpuInfo],
        targets: Mapping[int, GpuConfig] | None,
    ) -> tuple[dict[int, Layout], tuple[str, ...]]:
        """The layouts to follow per GPU index, and why the plan is not followed where it is not.

        A GPU whose target is not dynamic MIG (the desired annotation changed under the plan)
        is left out, and the rest of the plan is followed. A GPU this node does not have, or a
        layout its model cannot hold, refuses the whole plan before any step (the operator's
        view of the node is wrong: none of it is followed).
        """
        if plan is None:
            return {}, ()
        here = {g.index for g in gpus}
        planned: dict[int, Layout] = {}
        left_out: list[str] = []
        broken: list[str] = []
        for gpu in plan.gpus:
            if gpu.index not in here:
                broken.append(f"GPU {gpu.index}: not on this node")
                continue
            target = None if targets is None else targets[gpu.index]
            if target is None or target.mode is not Mode.MIG or not target.dynamic:
                wanted = (
                    "no desired state yet"
                    if target is None
                    else f"its target is {_target_text(target)}"
                )
                left_out.append(f"GPU {gpu.index}: not a dynamic MIG GPU ({wanted}); left as it is")
                continue
            try:
                check_layout(self.backend.model(gpu.index), gpu.layout)
            except GpupartError as error:
                broken.append(_on_gpu(gpu.index, str(error)))
                continue
            planned[gpu.index] = tuple(sorted(gpu.layout))
        if broken:
            log.error("Refused MIG plan", extra=logs.kv(plan=plan.id, err="; ".join(broken)))
            return {}, (*broken, *left_out)
        return planned, tuple(left_out)

    # ---- one GPU ----

    def _gpu(
        self,
        info: GpuInfo,
        target: GpuConfig | None,
        usage: DeviceUsage,
        planned: Layout | None = None,
        progress: Progress | None = None,
    ) -> GpuReport:
        index = info.index
        if index not in self._shared_modes and info.uuid in usage.shared:
            # Not taken back from the last inventory (`resume`), yet pods hold client slots on
            # a GPU without an MPS daemon: it is time-sliced, not whole.
            slots = target.replicas if target is not None else usage.shared[info.uuid]
            self._shared_modes[index] = (Mode.TIME_SLICING, slots)
            log.warning("Assumed time-slicing after restart", extra=logs.kv(gpu=index, slots=slots))
        if target is None:
            return self._report(index, GpuState.APPLIED, "no desired layout on this node yet")
        mig = target.mode is Mode.MIG
        if mig and not info.mig_capable:
            return self._report(index, GpuState.FAILED, f"{info.name} does not support MIG")
        states: list[GpuInstanceState] | None = None
        for _ in range(2):  # a MIG mode step ends a plan: plan again on the GPU as it is then
            now = self._now(info, target, usage)
            try:
                steps = plan_mode(now, target)
            except PlanBlocked as blocked:
                return self._report(index, GpuState.BLOCKED, str(blocked), self._pods(info, usage))
            states = list(now.instances) if not steps else None
            problem = self._run(info, now.instances, steps, usage)
            if problem:
                return self._report(index, GpuState.FAILED, problem)
            if not steps or not isinstance(steps[-1], MIG_MODE_STEPS):
                break
            info = self._fresh(index)
            if info.mig_enabled is not mig:
                break
        if info.mig_enabled is not mig:
            return self._report(
                index,
                GpuState.PENDING,
                f"MIG mode is {'en' if mig else 'dis'}abled but takes effect after a GPU reset "
                "or node reboot",
            )
        if mig:
            return self._layout(info, target, usage, states, planned, progress)
        self._shared_modes[index] = (target.mode, target.replicas)
        return self._report(index, GpuState.APPLIED, "")

    def _layout(
        self,
        info: GpuInfo,
        target: GpuConfig,
        usage: DeviceUsage,
        states: list[GpuInstanceState] | None,
        planned: Layout | None,
        progress: Progress | None,
    ) -> GpuReport:
        """The MIG layout on a GPU in MIG mode: the target's counts, or on a dynamic GPU the
        plan's exact layout (none named: its instances stay as they are)."""
        index = info.index
        if target.dynamic and planned is None:
            return self._report(index, GpuState.APPLIED, "")
        states = self._states(info, usage) if states is None else states
        try:
            if planned is not None:
                layout, steps = planned, plan_layout(index, states, planned)
            else:
                model = self.backend.model(index)
                layout, steps = plan_counts(model, index, states, dict(target.mig))
        except PlanBlocked as blocked:
            pods = self._pods(info, usage)
            return self._report(index, GpuState.BLOCKED, str(blocked), pods)
        except (InfeasibleLayout, GpupartError) as error:
            return self._report(index, GpuState.FAILED, str(error))
        if steps:
            problem = self._run(
                info, states, steps, usage, progress if planned is not None else None
            )
            if problem:
                return self._report(index, GpuState.FAILED, problem)
            log.info(
                "Applied MIG plan" if planned is not None else "Applied MIG layout",
                extra=logs.kv(gpu=index, layout=_text(layout), steps=len(steps)),
            )
        return self._report(index, GpuState.APPLIED, "")

    # ---- reading a GPU ----

    def _now(self, info: GpuInfo, target: GpuConfig, usage: DeviceUsage) -> GpuNow:
        """The GPU for `plan_mode`: what it serves, its instances, and, for a mode change, its use."""
        now = self._observed(info)
        if now.mps_started and target.mode is Mode.MPS:
            now = replace(now, mps_serving=self.mps.serving(info.uuid))
        if info.mig_enabled:
            now = replace(now, instances=tuple(self._states(info, usage)))
        # Only a change of mode asks whether the whole GPU is in use (`plan_mode`): read the
        # pods and NVML processes then, not on every pass.
        if now.mode is not target.mode:
            now = replace(now, in_use=self._in_use(info, usage))
        return now

    def _observed(self, info: GpuInfo) -> GpuNow:
        """The GPU's mode as NVML, the MPS markers and this agent's memory say (no further reads)."""
        return GpuNow(
            gpu=info.index,
            memory_mib=info.memory_mib,
            mig_enabled=info.mig_enabled,
            mig_pending=info.mig_pending,
            mps_started=info.uuid in self.mps.running(),
            remembered=self._shared_modes.get(info.index, (Mode.NONE, 0))[0],
        )

    def _in_use(self, info: GpuInfo, usage: DeviceUsage) -> str:
        """Why pods or processes use the GPU (a mode change would break them); '' when idle."""
        pods = self._pods(info, usage)
        if pods:
            return f"pods {', '.join(pods)}"
        processes = self.backend.processes(info.index)
        if processes:
            return f"{len(processes)} processes"
        return "" if usage.known else f"unknown pods ({usage.problem})"

    def _pods(self, info: GpuInfo, usage: DeviceUsage) -> tuple[str, ...]:
        """Pods holding the GPU or one of its MIG devices."""
        return usage.of(info.uuid, *(r.slice.uuid for r in self._records(info)))

    def _records(self, info: GpuInfo) -> tuple[GpuInstanceRecord, ...]:
        return self.backend.instances(info.index) if info.mig_enabled else ()

    def _fresh(self, index: int) -> GpuInfo:
        return next(g for g in self.backend.gpus() if g.index == index)

    def _states(self, info: GpuInfo, usage: DeviceUsage) -> list[GpuInstanceState]:
        records = self.backend.instances(info.index)
        held = self._held(info.index, (r.slice for r in records), usage)
        return [
            GpuInstanceState(r.slice.instance, r.compute_instances, in_use=r.slice.uuid in held)
            for r in records
        ]

    def _held(
        self, index: int, slices: Iterable[OfferedMigDevice], usage: DeviceUsage
    ) -> frozenset[str]:
        """The UUIDs among `slices` that a pod (PodResources) or a process (NVML) holds; all of
        them when PodResources did not answer."""
        slices = tuple(slices)
        if not slices:
            return frozenset()
        busy_gis = {p.gpu_instance_id for p in self.backend.processes(index)}
        return frozenset(
            s.uuid
            for s in slices
            if not usage.known or usage.of(s.uuid) or s.gpu_instance_id in busy_gis
        )

    def _run(
        self,
        info: GpuInfo,
        before: Iterable[GpuInstanceState],
        steps: Iterable[GpuStep],
        usage: DeviceUsage,
        progress: Progress | None = None,
    ) -> str:
        """Execute a plan in order; '' when done, else what failed and what the rollback did.

        A failed instance step rolls the layout back; a failed mode step raises (NvmlError):
        there is no layout to restore, and the next pass plans again from what NVML says.
        `progress` hears of each instance once its compute instance exists.
        """
        before = tuple(before)
        told = False
        for step in steps:
            try:
                self._execute(info, step)
            except NvmlError as error:
                if isinstance(step, ModeStep):
                    raise
                log.warning("Failed to apply step", extra=logs.kv(gpu=info.index, err=error))
                if told:
                    # A pod may have been given an instance advertised during this pass: ask
                    # PodResources again so the rollback keeps what is in use now.
                    usage = device_usage(self.usage)
                outcome = self._roll_back(info, layout_of(before), usage)
                return f"{error}; {outcome}"
            if progress is not None and isinstance(step, CreateComputeInstance):
                view = self._view(info.index)
                progress(view, self._held(info.index, view.mig, usage))
                told = True
        return ""

    def _execute(self, info: GpuInfo, step: GpuStep) -> None:
        index = info.index
        match step:
            case EnableMig() | DisableMig():
                enabled = isinstance(step, EnableMig)
                self.backend.set_mig_mode(index, enabled)
                if enabled:
                    self._shared_modes.pop(index, None)
                log.info(
                    "Enabled MIG mode" if enabled else "Disabled MIG mode", extra=logs.kv(gpu=index)
                )
            case StartMpsDaemon():
                self.backend.set_exclusive_process(index, True)
                self.mps.ensure(info.uuid, step.limits)
            case StopMpsDaemon():
                self.mps.stop(info.uuid)
                self.backend.set_exclusive_process(index, False)
                self._shared_modes.pop(index, None)
            case _:
                self.backend.apply(step)

    def _roll_back(self, info: GpuInfo, old: Layout, usage: DeviceUsage) -> str:
        """Back to the old layout, else down to the in-use instances; never leave it half-built unsaid."""
        for goal_name in ("old", "in-use"):
            try:
                states = self._states(info, usage)
                goal = old if goal_name == "old" else layout_of(s for s in states if s.in_use)
                for step in plan_layout(info.index, states, goal):
                    self.backend.apply(step)
            except (NvmlError, GpupartError) as error:
                log.warning(
                    "Failed to roll back",
                    extra=logs.kv(gpu=info.index, goal=goal_name, err=error),
                )
                continue
            if goal_name == "old":
                return f"rolled back to the previous layout ({_text(old) or 'empty'})"
            return f"cleared the GPU down to the instances in use ({_text(goal) or 'empty'})"
        half = [str(r.slice.instance) for r in self._records(info) if not r.compute_instances]
        return "could not roll back; the GPU holds what the report shows" + (
            f" plus half-built instances {', '.join(half)}" if half else ""
        )

    def _report(
        self, index: int, state: GpuState, message: str, pods: tuple[str, ...] = ()
    ) -> GpuReport:
        info = self._fresh(index)
        mode = self._observed(info).mode
        layout = layout_of(
            GpuInstanceState(r.slice.instance, r.compute_instances) for r in self._records(info)
        )
        if message:
            log.info("Reported GPU state", extra=logs.kv(gpu=index, state=state, reason=message))
        return GpuReport(index, state, mode, layout, message, pods)

    def _view(self, index: int) -> OfferedGpu:
        info = self._fresh(index)
        mode = self._observed(info).mode
        slices: tuple[OfferedMigDevice, ...] = tuple(
            r.slice for r in self._records(info) if r.compute_instances
        )
        slots, memory, compute, pipe = 0, 0, 0, ""
        if mode.is_shared:
            slots = self._shared_modes.get(index, (mode, 1))[1]
        if mode is Mode.MPS:
            pipe = str(self.mps.pipe_directory(info.uuid))
            limits = self.mps.limits(info.uuid)
            if limits is not None:
                slots, memory, compute = (
                    limits.max_clients,
                    limits.memory_mib,
                    limits.compute_percent,
                )
        try:
            product = self.backend.model(index).product
        except GpupartError:
            product = info.name
        return OfferedGpu(
            index=index,
            uuid=info.uuid,
            product=product,
            memory_mib=info.memory_mib,
            minor=info.minor,
            numa_node=info.numa_node,
            mode=mode,
            mig=slices,
            replicas=slots,
            mps_pipe_directory=pipe,
            mps_memory_mib=memory,
            mps_compute_percent=compute,
        )


def inventory(
    views: Iterable[OfferedGpu], used: frozenset[str] = frozenset()
) -> tuple[InventoryGpu, ...]:
    """The inventory annotation's content (core wire format) from the pass's views; `used`:
    the MIG device UUIDs in use (`PassResult.used`)."""
    return tuple(
        InventoryGpu(
            index=v.index,
            uuid=v.uuid,
            product=v.product,
            memory_mib=v.memory_mib,
            mode=v.mode,
            mig_devices=tuple(MigDevice(m.uuid, m.instance, m.uuid in used) for m in v.mig),
            replicas=v.replicas,
            client_memory_mib=v.mps_memory_mib if v.mode is Mode.MPS else 0,
            client_compute_percent=v.mps_compute_percent if v.mode is Mode.MPS else 0,
        )
        for v in views
    )


PLAN_SEVERITY = (GpuState.APPLIED, GpuState.PENDING, GpuState.BLOCKED, GpuState.FAILED)
"""A plan's state is its worst GPU's: Failed over Blocked over Pending."""


def plan_report(
    plan_id: str,
    refusals: Iterable[str],
    planned: Mapping[int, Layout],
    reports: Iterable[GpuReport],
) -> PlanReport:
    """The answer to a plan: Applied when every GPU it names holds its layout, else the worst
    of Failed (`refusals`: the plan not followed there) > Blocked > Pending, each GPU's reason
    in index order (`GPU 2: ...; GPU 3: ...`)."""
    outcomes = [(GpuState.FAILED, reason) for reason in refusals]
    by_index = {r.index: r for r in reports}
    for index, layout in sorted(planned.items()):
        gpu = by_index[index]
        if gpu.state is GpuState.APPLIED:
            if set(gpu.layout) != set(layout):  # never expected: a step reported done was not
                outcomes.append(
                    (GpuState.FAILED, f"GPU {index}: holds {_text(gpu.layout) or 'nothing'}")
                )
            continue
        outcomes.append((gpu.state, _on_gpu(index, gpu.message)))
    if not outcomes:
        return PlanReport(plan_id, GpuState.APPLIED)
    worst = max((state for state, _ in outcomes), key=PLAN_SEVERITY.index)
    return PlanReport(plan_id, worst, "; ".join(reason for _, reason in outcomes))


def _on_gpu(index: int, message: str) -> str:
    """`message` about GPU `index`, opening with `GPU <index>: ` once (core messages often do)."""
    prefix = f"GPU {index}: "
    return message if message.startswith(prefix) else prefix + message


def _target_text(target: GpuConfig) -> str:
    return "static MIG" if target.mode is Mode.MIG else str(target.mode)


def _text(layout: Layout) -> str:
    return ", ".join(str(i) for i in layout)
