"""The actuator: one idempotent pass that reads the GPUs, asks `plan_gpu`, executes, rolls back, reports.

Every decision is the core's (`gpupart.core.node.gpuplan`); here the GPUs are read, the steps
run in order, and a failed step is rolled back. Every pass starts from what NVML says now, so
a pass after a crash mid-apply finishes or undoes the half-built work. An instance that a pod
or process uses is never destroyed. A failed step is followed by a rollback to the previous
layout (or, failing that, to the in-use instances only), and the report names what is on the
GPU afterwards (docs/adr-013-dynamic-mig-plans.md).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from gpupart import logs
from gpupart.core.api.spec import GpuConfig, Interface, Mode
from gpupart.core.api.wire import (
    DesiredGroup,
    GpuReport,
    GpuState,
    Inventory,
    MigPlan,
    NodeReport,
)
from gpupart.core.errors import GpupartError, InvalidInput
from gpupart.core.mig.catalogue import GpuModel
from gpupart.core.mig.layout import Layout
from gpupart.core.mig.planning import (
    CreateComputeInstance,
    GpuInstanceState,
    layout_of,
    plan_layout,
)
from gpupart.core.node.devices import OfferedGpu, OfferedMigDevice
from gpupart.core.node.gpuplan import (
    FollowedPlan,
    GpuFacts,
    RememberedMode,
    answer_mig_plan,
    follow_mig_plan,
    layout_text,
    observed,
    pending_mode,
    plan_gpu,
    refused_report,
)
from gpupart.core.node.interface import (
    NO_CLAIMS,
    ClaimUse,
    Holders,
    Served,
    served_interface,
    wanted_interface,
)
from gpupart.core.node.modes import (
    DisableMig,
    EnableMig,
    GpuStep,
    ModeStep,
    StartMpsDaemon,
    StopMpsDaemon,
)
from gpupart.core.node.targets import gpu_targets
from gpupart_plugin.backend import GpuBackend, GpuInfo, GpuInstanceRecord, NvmlError, NvmlFailure
from gpupart_plugin.mps import MpsDaemons
from gpupart_plugin.podresources import DeviceUsage, UsageSource, device_usage

log = logging.getLogger(__name__)

ClaimSource = Callable[[], ClaimUse]
"""What this node's allocated ResourceClaims of our driver hold, per GPU (the DRA publisher's
claim watch); raises when it cannot tell (every GPU then counts as held through DRA)."""

Progress = Callable[[OfferedGpu, frozenset[str]], None]
"""Called from a GPU's thread after each instance a MIG plan creates there (GI and CI made):
the GPU's view now and the MIG device UUIDs on it in use (as `NodePass.used`)."""


@dataclass(frozen=True, slots=True)
class NodePass:
    """What one pass left on this node's GPUs: the report, each GPU's view, and their use."""

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


ROUNDS = 3
"""Plans per GPU and pass: a MIG mode step ends one, and the GPU is read and planned again."""


class Actuator:
    """Applies desired groups to this node's GPUs through a GpuBackend, as `plan_gpu` decides."""

    def __init__(
        self,
        backend: GpuBackend,
        usage: UsageSource,
        mps: MpsDaemons,
        claims: ClaimSource | None = None,
    ) -> None:
        """`claims`: None where nothing is served through DRA (no claim can hold a GPU)."""
        self.backend = backend
        self.usage = usage
        self.mps = mps
        self.claims = claims
        # TimeSlicing and None look the same to NVML; the agent remembers which it applied.
        self._remembered: dict[int, RememberedMode] = {}
        self._served: dict[int, Interface | None] = {}
        """The interface each GPU was last offered through (None: neither); absent: unknown."""
        self._targets: dict[int, GpuConfig | None] = {}
        """Each GPU's target in the last desired state applied (its interface, and whether it is
        dynamic MIG, go into its views)."""

    def resume(self, previous: Inventory) -> None:
        """The time-sliced GPUs and their client slots from the inventory published before a restart.

        NVML cannot tell a time-sliced GPU from a whole one (an MPS GPU has its daemon's marker,
        a MIG GPU its mode), so without this a restart would forget them. A GPU is taken back
        only when its index and UUID both match what NVML reports now.
        """
        uuids = {g.index: g.uuid for g in self.backend.gpus()}
        for gpu in previous.gpus:
            if uuids.get(gpu.index) == gpu.uuid:
                # Which interface served it: a restart does not withdraw a GPU for nothing.
                self._served[gpu.index] = gpu.interface
            if gpu.mode is not Mode.TIME_SLICING:
                continue
            if uuids.get(gpu.index) != gpu.uuid or gpu.replicas < 1:
                log.warning(
                    "Ignored earlier mode",
                    extra=logs.kv(gpu=gpu.index, mode=gpu.mode, reason="not this GPU now"),
                )
                continue
            self._remembered[gpu.index] = RememberedMode(Mode.TIME_SLICING, gpu.replicas)
            log.info(
                "Resumed mode", extra=logs.kv(gpu=gpu.index, mode=gpu.mode, slots=gpu.replicas)
            )

    def reconcile(
        self,
        groups: tuple[DesiredGroup, ...] | None,
        plan: MigPlan | None = None,
        progress: Progress | None = None,
    ) -> NodePass:
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
        followed = self._follow(plan, gpus, None if groups is None else targets)
        claims = self._claim_use()
        if groups is not None:
            # A pass without a desired state to apply (none yet, or refused) changes nothing:
            # the GPUs keep the targets, and so the interfaces, of the last one applied.
            self._targets = {g.index: targets[g.index] for g in gpus}

        def one(info: GpuInfo) -> tuple[GpuReport, OfferedGpu, frozenset[str]]:
            target = None if groups is None else targets[info.index]
            try:
                report = self._gpu(info, target, usage, followed.layouts.get(info.index), progress)
            except GpupartError as error:
                # An NVML read failed outside a plan (GPU lost, no permission): say so, go on.
                log.error("Failed to reconcile GPU", extra=logs.kv(gpu=info.index, err=error))
                report = GpuReport(info.index, GpuState.FAILED, Mode.NONE, message=str(error))
            view = self._view(info.index)
            wanted = self._targets.get(info.index)
            served = self._serve(view, wanted_interface(wanted), usage, claims)
            view = replace(view, interface=served.interface)
            return _moving(report, served), view, self._held(info.index, view.mig, usage)

        # One thread per GPU: each GPU's steps run in order, GPUs at the same time (a plan's
        # instances on two GPUs take one create's time, not two). Each touches only its own
        # GPU, MPS daemon and `_remembered` entry; the backend is thread-safe (NVML is, and
        # so is the simulated GPU).
        with ThreadPoolExecutor(max(1, len(gpus)), thread_name_prefix="gpu") as pool:
            done = list(pool.map(one, gpus))
        reports = [report for report, _, _ in done]
        views = tuple(view for _, view, _ in done)
        used = frozenset[str]().union(*(held for _, _, held in done))
        failed = sum(r.state is GpuState.FAILED for r in reports)
        answer = None if plan is None else answer_mig_plan(plan.id, followed, reports)
        if answer is not None and answer.state is not GpuState.APPLIED:
            log.info(
                "Reported MIG plan",
                extra=logs.kv(plan=answer.id, state=answer.state, reason=answer.message),
            )
        holders = frozenset[str]().union(*usage.pods.values())
        report = NodeReport(observed(groups or ()), tuple(reports), answer)
        return NodePass(report, views, failed, used, holders)

    def refuse(
        self, reason: str, groups: tuple[DesiredGroup, ...] = (), plan: MigPlan | None = None
    ) -> NodePass:
        """A desired state not to apply: nothing changes, every GPU reports Failed with the
        reason, and the groups it names count as observed so their partitions show why. A MIG
        plan on the node is not followed either, and its report says why."""
        result = self.reconcile(None)
        report = refused_report(reason, result.report.gpus, groups, plan)
        return replace(result, report=report, failed=len(report.gpus))

    def _claim_use(self) -> ClaimUse:
        if self.claims is None:
            return NO_CLAIMS
        try:
            return self.claims()
        except Exception as error:  # noqa: BLE001 - unknown claims: every GPU counts as held
            return ClaimUse(known=False, problem=str(error))

    def _serve(
        self, view: OfferedGpu, wanted: Interface, usage: DeviceUsage, claims: ClaimUse
    ) -> Served:
        """The interface the GPU is offered through now (`served_interface`), remembered."""
        index = view.index
        pods = Holders(usage.of(view.uuid, *(m.uuid for m in view.mig)), usage.known, usage.problem)
        now = self._served.get(index)
        served = served_interface(wanted, now, pods, claims.holders(index))
        if served.interface is not now or index not in self._served:
            log.info(
                "Served GPU through interface",
                extra=logs.kv(
                    gpu=index, interface=served.interface or "none", reason=served.message
                ),
            )
        self._served[index] = served.interface
        return served

    def _follow(
        self,
        plan: MigPlan | None,
        gpus: Sequence[GpuInfo],
        targets: Mapping[int, GpuConfig] | None,
    ) -> FollowedPlan:
        """`follow_mig_plan` with the MIG geometry of each GPU here that the plan names."""
        if plan is None:
            return FollowedPlan()
        here = {g.index for g in gpus}
        models = {g.index: self._model(g.index) for g in plan.gpus if g.index in here}
        followed = follow_mig_plan(plan, models, targets)
        if followed.refused:
            log.error("Refused MIG plan", extra=logs.kv(plan=plan.id, err=followed.refused))
        return followed

    def _model(self, index: int) -> GpuModel | str:
        try:
            return self.backend.model(index)
        except GpupartError as error:
            return str(error)

    def apply_instances(self, index: int, layout: Layout) -> str:
        """Bring GPU `index`'s MIG instances to exactly `layout` ('' when done, else what failed
        and what the rollback did): the DRA kubelet plugin's create at prepare and destroy at
        unprepare, through the same plan steps and rollback as a pass.

        The caller holds the GPU for the call (one step sequence per GPU at a time). An
        instance with NVML processes that the layout leaves out blocks the change (PlanBlocked's
        message). PodResources is not asked: the GPU is DRA's, so no device-plugin pod holds
        it, and the kubelet unprepares a claim only once its containers stopped.
        """
        info = self._fresh(index)
        if not info.mig_enabled:
            return f"GPU {index} is not in MIG mode"
        usage = DeviceUsage({}, known=True)
        before = self._states(info, usage)
        try:
            steps = plan_layout(index, before, layout)
        except GpupartError as error:  # PlanBlocked
            return str(error)
        if not steps:
            return ""
        problem = self._run(info, before, steps, usage)
        if not problem:
            log.info(
                "Applied MIG instances",
                extra=logs.kv(gpu=index, layout=layout_text(layout), steps=len(steps)),
            )
        return problem

    def view(self, index: int, info: GpuInfo | None = None) -> OfferedGpu:
        """GPU `index` as NVML, the MPS daemon and this agent's memory say now (`info`: the
        GPU as just read, else read here)."""
        return self._view(index, info)

    # ---- one GPU ----

    def _gpu(
        self,
        info: GpuInfo,
        target: GpuConfig | None,
        usage: DeviceUsage,
        planned: Layout | None = None,
        progress: Progress | None = None,
    ) -> GpuReport:
        """Read, plan, execute, and again after a MIG mode step (`GpuPlan.again`); the report."""
        index = info.index
        switched = False
        for _ in range(ROUNDS):
            facts = self._facts(info, target, usage)
            decided = plan_gpu(facts, target, planned=planned, switched=switched)
            if decided.assumed is not None:
                # Not taken back from the last inventory (`resume`), yet pods hold client slots
                # on a GPU without an MPS daemon: it is time-sliced, not whole.
                self._remembered[index] = decided.assumed
                log.warning(
                    "Assumed time-slicing after restart",
                    extra=logs.kv(gpu=index, slots=decided.assumed.slots),
                )
            if decided.steps:
                told = progress if decided.follows_plan else None
                problem = self._run(info, facts.instances, decided.steps, usage, told)
                if problem:
                    return self._report(index, GpuState.FAILED, problem)
                if decided.layout is not None:
                    log.info(
                        "Applied MIG plan" if decided.follows_plan else "Applied MIG layout",
                        extra=logs.kv(
                            gpu=index, layout=layout_text(decided.layout), steps=len(decided.steps)
                        ),
                    )
            if not decided.again:
                if decided.remember is not None:
                    self._remembered[index] = decided.remember
                return self._report(index, decided.state, decided.message, decided.blocking)
            info, switched = self._fresh(index), True
        waits = pending_mode(target is not None and target.mode is Mode.MIG)
        return self._report(index, waits.state, waits.message)

    # ---- reading a GPU ----

    def _facts(self, info: GpuInfo, target: GpuConfig | None, usage: DeviceUsage) -> GpuFacts:
        """The GPU for `plan_gpu`: NVML, the MPS markers, PodResources and this agent's memory."""
        records = self._records(info)
        model: GpuModel | None = None
        problem = ""
        if info.mig_enabled:
            found = self._model(info.index)
            model, problem = (None, found) if isinstance(found, str) else (found, "")
        started = info.uuid in self.mps.running()
        serving = None
        if started and target is not None and target.mode is Mode.MPS:
            serving = self.mps.serving(info.uuid)
        return GpuFacts(
            index=info.index,
            name=info.name,
            memory_mib=info.memory_mib,
            mig_capable=info.mig_capable,
            mig_enabled=info.mig_enabled,
            mig_pending=info.mig_pending,
            model=model,
            model_problem=problem,
            mps_started=started,
            mps_serving=serving,
            remembered=self._remembered.get(info.index),
            instances=tuple(self._states(info, usage, records)) if info.mig_enabled else (),
            pods=usage.of(info.uuid, *(r.device.uuid for r in records)),
            processes=len(self.backend.processes(info.index)),
            usage_known=usage.known,
            usage_problem=usage.problem,
            held_slots=usage.shared.get(info.uuid, 0),
        )

    def _mode(self, info: GpuInfo) -> Mode:
        """The GPU's mode as NVML, the MPS markers and this agent's memory say."""
        if info.mig_enabled:
            return Mode.MIG
        if info.uuid in self.mps.running():
            return Mode.MPS
        remembered = self._remembered.get(info.index)
        return remembered.mode if remembered is not None else Mode.NONE

    def _records(self, info: GpuInfo) -> tuple[GpuInstanceRecord, ...]:
        return self.backend.instances(info.index) if info.mig_enabled else ()

    def _fresh(self, index: int) -> GpuInfo:
        info = self.backend.gpu(index)
        if info is None:
            raise NvmlError(NvmlFailure.NOT_FOUND, f"GPU {index}")
        return info

    def _states(
        self,
        info: GpuInfo,
        usage: DeviceUsage,
        records: tuple[GpuInstanceRecord, ...] | None = None,
    ) -> list[GpuInstanceState]:
        records = self.backend.instances(info.index) if records is None else records
        held = self._held(info.index, (r.device for r in records), usage)
        return [
            GpuInstanceState(r.device.instance, r.compute_instances, in_use=r.device.uuid in held)
            for r in records
        ]

    def _held(
        self, index: int, devices: Iterable[OfferedMigDevice], usage: DeviceUsage
    ) -> frozenset[str]:
        """The UUIDs among the MIG `devices` that a pod (PodResources) or a process (NVML)
        holds; all of them when PodResources did not answer."""
        devices = tuple(devices)
        if not devices:
            return frozenset()
        busy_gis = {p.gpu_instance_id for p in self.backend.processes(index)}
        return frozenset(
            d.uuid
            for d in devices
            if not usage.known or usage.of(d.uuid) or d.gpu_instance_id in busy_gis
        )

    # ---- executing ----

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
                    self._remembered.pop(index, None)
                log.info(
                    "Enabled MIG mode" if enabled else "Disabled MIG mode", extra=logs.kv(gpu=index)
                )
            case StartMpsDaemon():
                self.backend.set_exclusive_process(index, True)
                self.mps.ensure(info.uuid, step.limits)
            case StopMpsDaemon():
                self.mps.stop(info.uuid)
                self.backend.set_exclusive_process(index, False)
                self._remembered.pop(index, None)
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
                return f"rolled back to the previous layout ({layout_text(old) or 'empty'})"
            return f"cleared the GPU down to the instances in use ({layout_text(goal) or 'empty'})"
        half = [str(r.device.instance) for r in self._records(info) if not r.compute_instances]
        return "could not roll back; the GPU holds what the report shows" + (
            f" plus half-built instances {', '.join(half)}" if half else ""
        )

    # ---- reporting what NVML says ----

    def _report(
        self, index: int, state: GpuState, message: str, pods: tuple[str, ...] = ()
    ) -> GpuReport:
        info = self._fresh(index)
        layout = layout_of(
            GpuInstanceState(r.device.instance, r.compute_instances) for r in self._records(info)
        )
        if message:
            log.info("Reported GPU state", extra=logs.kv(gpu=index, state=state, reason=message))
        return GpuReport(index, state, self._mode(info), layout, message, pods)

    def _view(self, index: int, info: GpuInfo | None = None) -> OfferedGpu:
        info = self._fresh(index) if info is None else info
        mode = self._mode(info)
        target = self._targets.get(index)
        dynamic = mode is Mode.MIG and target is not None and target.dynamic
        devices: tuple[OfferedMigDevice, ...] = tuple(
            r.device for r in self._records(info) if r.compute_instances
        )
        slots, memory, compute, pipe = 0, 0, 0, ""
        if mode.is_shared:
            remembered = self._remembered.get(index)
            slots = remembered.slots if remembered is not None else 1
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
            mig=devices,
            replicas=slots,
            mps_pipe_directory=pipe,
            mps_memory_mib=memory,
            mps_compute_percent=compute,
            interface=self._served.get(index, Interface.DEVICE_PLUGIN),
            pci_bus_id=info.pci_bus_id,
            dynamic=dynamic,
            dynamic_profiles=target.dynamic_profiles if dynamic and target else None,
        )


def _moving(report: GpuReport, served: Served) -> GpuReport:
    """A GPU that neither interface offers while it moves reports Pending with why, unless
    its pass has a worse state to say."""
    if served.interface is not None or report.state is not GpuState.APPLIED:
        return report
    return replace(
        report, state=GpuState.PENDING, message=served.message, blocking_pods=served.pods
    )
