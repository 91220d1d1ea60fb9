"""The layout actuator: one idempotent pass that reads the GPUs, plans with the core, applies, and reports.

Every pass starts from what NVML says now, so a pass after a crash mid-apply finishes or undoes
the half-built work. An instance that a pod or process uses is never destroyed. A failed step
is followed by a rollback to the previous layout (or, failing that, to the in-use instances
only), and the report names what is on the GPU afterwards.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from gpupart.core.api.spec import GpuConfig, Mode
from gpupart.core.api.wire import (
    DesiredGroup,
    GpuReport,
    GpuState,
    InventoryGpu,
    MigDevice,
    NodeReport,
)
from gpupart.core.errors import GpupartError, InfeasibleLayout, InvalidInput, PlanBlocked
from gpupart.core.mig.layout import Layout
from gpupart.core.mig.planning import GpuInstanceState, Step, layout_of, plan_counts, plan_layout
from gpupart.core.node.devices import SLOT_SEPARATOR, MigSlice, OfferedGpu
from gpupart.core.node.mps import mps_limits
from gpupart.core.node.targets import gpu_targets
from gpupart_plugin.backend import GpuBackend, GpuInfo, GpuInstanceRecord, NvmlError
from gpupart_plugin.mps import MpsDaemons
from gpupart_plugin.podresources import PodDevices

log = logging.getLogger(__name__)

UsageSource = Callable[[], tuple[PodDevices, ...]]
"""Lists the devices pods hold (the kubelet PodResources API); raises GpupartError when it cannot."""


@dataclass(frozen=True, slots=True)
class PassResult:
    report: NodeReport
    views: tuple[OfferedGpu, ...]
    failed: int


@dataclass(frozen=True, slots=True)
class _Usage:
    """Pods per device-owning UUID (GPU or MIG); `known` is False when the kubelet did not answer."""

    pods: Mapping[str, frozenset[str]]
    known: bool
    problem: str = ""
    shared: Mapping[str, int] = field(default_factory=dict)
    """GPU UUID -> client slots held on it (a shared GPU, even when the agent restarted)."""

    def of(self, *uuids: str) -> tuple[str, ...]:
        return tuple(sorted({pod for u in uuids for pod in self.pods.get(u, ())}))


def _usage(source: UsageSource) -> _Usage:
    try:
        listed = source()
    except GpupartError as error:
        return _Usage({}, known=False, problem=str(error))
    pods: dict[str, set[str]] = {}
    shared: dict[str, int] = {}
    for entry in listed:
        for device_id in entry.device_ids:
            owner, slot, _ = device_id.partition(SLOT_SEPARATOR)
            pods.setdefault(owner, set()).add(entry.pod)
            if slot:
                shared[owner] = shared.get(owner, 0) + 1
    return _Usage({k: frozenset(v) for k, v in pods.items()}, known=True, shared=shared)


class Actuator:
    """Applies desired groups to this node's GPUs through a GpuBackend."""

    def __init__(self, backend: GpuBackend, usage: UsageSource, mps: MpsDaemons) -> None:
        self.backend = backend
        self.usage = usage
        self.mps = mps
        # TimeSlicing and None look the same to NVML; the agent remembers which it applied.
        self._shared_modes: dict[int, tuple[Mode, int]] = {}

    def reconcile(self, groups: tuple[DesiredGroup, ...] | None) -> PassResult:
        """One pass; `groups` None (no desired annotation yet) changes nothing and reports."""
        usage = _usage(self.usage)
        gpus = self.backend.gpus()
        try:
            targets = gpu_targets(groups or (), [g.index for g in gpus])
        except InvalidInput as error:
            log.error("Refused desired layout err=%s", error)
            return self.refuse(str(error), groups or ())
        reports, views, failed = [], [], 0
        for info in gpus:
            target = None if groups is None else targets[info.index]
            try:
                report = self._gpu(info, target, usage)
            except GpupartError as error:
                # An NVML read failed outside a plan (GPU lost, no permission): say so, go on.
                log.error("Failed to reconcile GPU gpu=%d err=%s", info.index, error)
                report = GpuReport(info.index, GpuState.FAILED, Mode.NONE, message=str(error))
            failed += report.state is GpuState.FAILED
            reports.append(report)
            views.append(self._view(info.index))
        observed = tuple(sorted({(g.partition, g.generation) for g in groups or ()}))
        return PassResult(NodeReport(observed, tuple(reports)), tuple(views), failed)

    def refuse(self, reason: str, groups: tuple[DesiredGroup, ...] = ()) -> PassResult:
        """A desired state not to apply: nothing changes, every GPU reports Failed with the
        reason, and the groups it names count as observed so their partitions show why."""
        result = self.reconcile(None)
        reports = tuple(
            GpuReport(g.index, GpuState.FAILED, g.mode, g.layout, reason)
            for g in result.report.gpus
        )
        observed = tuple(sorted({(g.partition, g.generation) for g in groups}))
        return PassResult(NodeReport(observed, reports), result.views, len(reports))

    # ---- one GPU ----

    def _gpu(self, info: GpuInfo, target: GpuConfig | None, usage: _Usage) -> GpuReport:
        if info.index not in self._shared_modes and info.uuid in usage.shared:
            # Restarted while pods hold client slots: the GPU is shared, not whole.
            slots = target.replicas if target is not None else usage.shared[info.uuid]
            self._shared_modes[info.index] = (Mode.TIME_SLICING, slots)
        current = self._current_mode(info)
        if target is None:
            return self._report(info.index, GpuState.APPLIED, "no desired layout on this node yet")
        if target.mode is Mode.MIG:
            return self._mig(info, target, usage, current)
        return self._shared_or_whole(info, target, usage, current)

    def _mig(self, info: GpuInfo, target: GpuConfig, usage: _Usage, current: Mode) -> GpuReport:
        index = info.index
        if not info.mig_capable:
            return self._report(index, GpuState.FAILED, f"{info.name} does not support MIG")
        if not info.mig_enabled:
            if not info.mig_pending:
                blocked = self._busy(info, usage, current)
                if blocked is not None:
                    return blocked
                self._stop_shared(info)
                self.backend.set_mig_mode(index, True)
                log.info("Enabled MIG mode gpu=%d", index)
            if not self._fresh(index).mig_enabled:
                return self._report(
                    index,
                    GpuState.PENDING,
                    "MIG mode is enabled but takes effect after a GPU reset or node reboot",
                )
        elif info.mig_pending:
            self.backend.set_mig_mode(index, True)  # cancels a pending switch back to whole GPU
        model = self.backend.model(index)
        states = self._states(info, usage)
        try:
            layout, steps = plan_counts(model, index, states, dict(target.mig))
        except PlanBlocked as blocked:
            pods = self._pods_on_busy(info, usage)
            return self._report(index, GpuState.BLOCKED, str(blocked), pods)
        except (InfeasibleLayout, GpupartError) as error:
            return self._report(index, GpuState.FAILED, str(error))
        if steps:
            problem = self._apply(info, states, steps, usage)
            if problem:
                return self._report(index, GpuState.FAILED, problem)
            log.info(
                "Applied MIG layout gpu=%d layout=%s steps=%d", index, _text(layout), len(steps)
            )
        return self._report(index, GpuState.APPLIED, "")

    def _shared_or_whole(
        self, info: GpuInfo, target: GpuConfig, usage: _Usage, current: Mode
    ) -> GpuReport:
        index = info.index
        if info.mig_enabled or info.mig_pending:
            if info.mig_enabled:
                states = self._states(info, usage)
                busy = [s for s in states if s.in_use]
                if busy:
                    message = (
                        f"leaving MIG mode destroys {', '.join(str(s.instance) for s in busy)}, "
                        "in use; it changes once they are idle"
                    )
                    return self._report(
                        index, GpuState.BLOCKED, message, self._pods_on_busy(info, usage)
                    )
                steps = plan_layout(index, states, ())
                problem = self._apply(info, states, steps, usage)
                if problem:
                    return self._report(index, GpuState.FAILED, problem)
            self.backend.set_mig_mode(index, False)
            log.info("Disabled MIG mode gpu=%d", index)
            if self._fresh(index).mig_enabled:
                return self._report(
                    index,
                    GpuState.PENDING,
                    "MIG mode is disabled but takes effect after a GPU reset or node reboot",
                )
            current = Mode.NONE
        if current is not target.mode:
            blocked = self._busy(info, usage, current)
            if blocked is not None:
                return blocked
        if target.mode is Mode.MPS and target.mps is not None:
            limits = mps_limits(target, info.memory_mib)
            if current is not Mode.MPS:
                self.backend.set_exclusive_process(index, True)
            self.mps.ensure(info.uuid, limits)
        else:
            self._stop_shared(info)
        self._shared_modes[index] = (target.mode, target.replicas)
        return self._report(index, GpuState.APPLIED, "")

    # ---- helpers ----

    def _current_mode(self, info: GpuInfo) -> Mode:
        if info.mig_enabled:
            return Mode.MIG
        if info.uuid in self.mps.running():
            return Mode.MPS
        return self._shared_modes.get(info.index, (Mode.NONE, 0))[0]

    def _busy(self, info: GpuInfo, usage: _Usage, current: Mode) -> GpuReport | None:
        """A Blocked report when pods or processes use the GPU (a mode change would break them)."""
        uuids = [info.uuid, *(r.slice.uuid for r in self._records(info))]
        pods = usage.of(*uuids)
        processes = self.backend.processes(info.index)
        if not pods and not processes and usage.known:
            return None
        why = (
            f"pods {', '.join(pods)}"
            if pods
            else f"{len(processes)} processes"
            if processes
            else f"unknown pods ({usage.problem})"
        )
        return self._report(
            info.index,
            GpuState.BLOCKED,
            f"in use by {why}; it leaves {current} mode once idle",
            pods,
        )

    def _stop_shared(self, info: GpuInfo) -> None:
        if info.uuid in self.mps.running():
            self.mps.stop(info.uuid)
            self.backend.set_exclusive_process(info.index, False)
        self._shared_modes.pop(info.index, None)

    def _records(self, info: GpuInfo) -> tuple[GpuInstanceRecord, ...]:
        return self.backend.instances(info.index) if info.mig_enabled else ()

    def _fresh(self, index: int) -> GpuInfo:
        return next(g for g in self.backend.gpus() if g.index == index)

    def _states(self, info: GpuInfo, usage: _Usage) -> list[GpuInstanceState]:
        processes = self.backend.processes(info.index)
        busy_gis = {p.gpu_instance_id for p in processes}
        return [
            GpuInstanceState(
                r.slice.instance,
                r.compute_instances,
                in_use=not usage.known
                or bool(usage.of(r.slice.uuid))
                or r.slice.gpu_instance_id in busy_gis,
            )
            for r in self.backend.instances(info.index)
        ]

    def _pods_on_busy(self, info: GpuInfo, usage: _Usage) -> tuple[str, ...]:
        return usage.of(*(r.slice.uuid for r in self.backend.instances(info.index)))

    def _apply(
        self,
        info: GpuInfo,
        before: list[GpuInstanceState],
        steps: Iterable[Step],
        usage: _Usage,
    ) -> str:
        """Run the steps; on a failure roll back and return what happened, else ''."""
        try:
            for step in steps:
                self.backend.apply(step)
        except NvmlError as error:
            log.warning("Failed to apply step gpu=%d err=%s", info.index, error)
            outcome = self._roll_back(info, layout_of(before), usage)
            return f"{error}; {outcome}"
        return ""

    def _roll_back(self, info: GpuInfo, old: Layout, usage: _Usage) -> str:
        """Back to the old layout, else down to the in-use instances; never leave it half-built unsaid."""
        for goal_name in ("old", "in-use"):
            try:
                states = self._states(info, usage)
                goal = old if goal_name == "old" else layout_of(s for s in states if s.in_use)
                for step in plan_layout(info.index, states, goal):
                    self.backend.apply(step)
            except (NvmlError, GpupartError) as error:
                log.warning(
                    "Failed to roll back gpu=%d goal=%s err=%s", info.index, goal_name, error
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
        mode = self._current_mode(info)
        layout = layout_of(
            GpuInstanceState(r.slice.instance, r.compute_instances) for r in self._records(info)
        )
        if message:
            log.info("Reported GPU state gpu=%d state=%s reason=%s", index, state, message)
        return GpuReport(index, state, mode, layout, message, pods)

    def _view(self, index: int) -> OfferedGpu:
        info = self._fresh(index)
        mode = self._current_mode(info)
        slices: tuple[MigSlice, ...] = tuple(
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


def inventory(views: Iterable[OfferedGpu]) -> tuple[InventoryGpu, ...]:
    """The inventory annotation's content (core wire format) from the pass's views."""
    return tuple(
        InventoryGpu(
            index=v.index,
            uuid=v.uuid,
            product=v.product,
            memory_mib=v.memory_mib,
            mode=v.mode,
            mig_devices=tuple(MigDevice(m.uuid, m.instance) for m in v.mig),
            replicas=v.replicas,
        )
        for v in views
    )


def _text(layout: Layout) -> str:
    return ", ".join(str(i) for i in layout)
