"""A simulated NVML built from the core catalogue: same answers and error kinds as NVML, with injectable faults.

Used by tests, the e2e suite, the benchmark and `gpupart node --simulate`. It follows NVML where
the agent depends on it: destroying a GPU instance with compute instances or processes is InUse,
an overlapping or unplaceable instance is InsufficientResources, MIG calls on a GPU without MIG
mode are NotSupported, and a MIG mode change stays pending until `reset` (or `reset_idle`, the
reset an administrator would run, which `gpupart node --simulate-auto-reset` calls between passes).
"""

from __future__ import annotations

import queue
import threading
import uuid as uuidlib
from collections.abc import Sequence
from dataclasses import dataclass, field

from gpupart.core.mig.catalogue import GpuModel, require_gpu_model
from gpupart.core.mig.layout import MigInstance
from gpupart.core.mig.planning import (
    CreateComputeInstance,
    CreateGpuInstance,
    DestroyComputeInstance,
    DestroyGpuInstance,
    Step,
)
from gpupart.core.node.devices import MigSlice, XidEvent
from gpupart_plugin.backend import (
    GpuInfo,
    GpuInstanceRecord,
    GpuProcess,
    NvmlError,
    NvmlFailure,
)

_NAMESPACE = uuidlib.UUID("6a1f0c1e-0d1b-4c59-9d0e-67707570a271")


@dataclass
class _Instance:
    gpu_instance_id: int
    compute_instance_ids: list[int]
    uuid: str


@dataclass
class _Gpu:
    index: int
    uuid: str
    model: GpuModel
    mig_enabled: bool
    mig_pending: bool | None = None
    """The mode after the next reset, when it differs from the current one."""
    instances: dict[MigInstance, _Instance] = field(default_factory=dict)
    processes: dict[int, int | None] = field(default_factory=dict)
    """pid -> GPU instance id (None: whole GPU)."""
    exclusive: bool = False
    lost: bool = False


@dataclass(frozen=True, slots=True)
class Fault:
    """Fail the `after`-th matching mutating call from now (0 = the next one) with `kind`."""

    kind: NvmlFailure
    after: int = 0
    operation: str | None = None
    """Only calls of this operation count (e.g. "CreateGpuInstance", "set_mig_mode"); None: any."""
    times: int = 1


class SimulatedGpus:
    """In-memory GPUs of one node; thread-safe, because the health loop waits on events concurrently."""

    def __init__(
        self,
        products: list[str],
        *,
        node: str = "sim",
        mig_enabled: bool | Sequence[bool] = True,
        mode_change_needs_reset: bool = True,
    ) -> None:
        """`mig_enabled`: the MIG mode every GPU starts in, or one per GPU (as a driver keeps it)."""
        modes = (
            [mig_enabled] * len(products) if isinstance(mig_enabled, bool) else list(mig_enabled)
        )
        if len(modes) != len(products):
            raise ValueError(f"{len(modes)} MIG modes for {len(products)} GPUs")
        self._lock = threading.RLock()
        self._gpus = [
            _Gpu(
                index,
                f"GPU-{uuidlib.uuid5(_NAMESPACE, f'{node}/{index}')}",
                require_gpu_model(product),
                mig,
            )
            for index, (product, mig) in enumerate(zip(products, modes, strict=True))
        ]
        self._needs_reset = mode_change_needs_reset
        self._faults: list[list[object]] = []  # [Fault, calls seen, failures left]
        self._events: queue.Queue[XidEvent] = queue.Queue()
        self._created = 0
        self.calls: list[str] = []
        """Every mutating call, in order (for tests and the benchmark)."""

    # ---- fault injection and test controls ----

    def inject(self, fault: Fault) -> None:
        with self._lock:
            self._faults.append([fault, 0, fault.times])

    def clear_faults(self) -> None:
        with self._lock:
            self._faults.clear()

    def start_process(self, index: int, pid: int, instance: MigInstance | None = None) -> None:
        """A CUDA process on the whole GPU, or on the GPU instance at `instance`."""
        with self._lock:
            gpu = self._gpu(index)
            gi = None if instance is None else gpu.instances[instance].gpu_instance_id
            gpu.processes[pid] = gi

    def stop_process(self, index: int, pid: int) -> None:
        with self._lock:
            self._gpu(index).processes.pop(pid, None)

    def reset(self, index: int) -> None:
        """GPU reset: applies a pending MIG mode; instances do not survive it."""
        with self._lock:
            gpu = self._gpu(index)
            if gpu.processes:
                raise NvmlError(NvmlFailure.IN_USE, f"reset GPU {index}")
            if gpu.mig_pending is not None:
                gpu.mig_enabled, gpu.mig_pending = gpu.mig_pending, None
            gpu.instances.clear()

    def reset_idle(self) -> tuple[int, ...]:
        """Reset every GPU with a pending MIG mode change and no process; the indices reset.

        What an administrator does on a real node (`nvidia-smi -r` once the GPU is idle); a GPU
        still in use keeps its pending change until a later call.
        """
        with self._lock:
            due = [g.index for g in self._gpus if g.mig_pending is not None and not g.processes]
            for index in due:
                self.reset(index)
            return tuple(due)

    def inject_xid(
        self, index: int, xid: int, gpu_instance_id: int | None = None, ci: int | None = None
    ) -> None:
        self._events.put(XidEvent(self._gpu(index).uuid, xid, gpu_instance_id, ci))

    def set_lost(self, index: int, lost: bool) -> None:
        """A lost GPU stops answering (the health probe fails) until set back."""
        with self._lock:
            self._gpu(index).lost = lost

    def exclusive(self, index: int) -> bool:
        with self._lock:
            return self._gpu(index).exclusive

    # ---- GpuBackend ----

    def gpus(self) -> tuple[GpuInfo, ...]:
        with self._lock:
            return tuple(
                GpuInfo(
                    index=g.index,
                    uuid=g.uuid,
                    name=f"NVIDIA {g.model.product}",
                    memory_mib=g.model.memory_mib,
                    minor=g.index,
                    numa_node=g.index * 2 // max(2, len(self._gpus)),
                    mig_capable=True,
                    mig_enabled=g.mig_enabled,
                    mig_pending=g.mig_pending is not None,
                )
                for g in self._gpus
            )

    def model(self, index: int) -> GpuModel:
        return self._gpu(index).model

    def set_mig_mode(self, index: int, enabled: bool) -> None:
        with self._lock:
            self._fault("set_mig_mode", f"set MIG mode of GPU {index}")
            gpu = self._gpu(index)
            if gpu.processes or gpu.instances:
                raise NvmlError(NvmlFailure.IN_USE, f"set MIG mode of GPU {index}")
            if enabled == gpu.mig_enabled:
                gpu.mig_pending = None
            elif self._needs_reset:
                gpu.mig_pending = enabled
            else:
                gpu.mig_enabled = enabled

    def instances(self, index: int) -> tuple[GpuInstanceRecord, ...]:
        with self._lock:
            gpu = self._gpu(index)
            if not gpu.mig_enabled:
                return ()
            return tuple(
                GpuInstanceRecord(
                    MigSlice(
                        record.uuid,
                        instance,
                        record.gpu_instance_id,
                        record.compute_instance_ids[0] if record.compute_instance_ids else 0,
                        (100 + 10 * record.gpu_instance_id, 101 + 10 * record.gpu_instance_id),
                    ),
                    len(record.compute_instance_ids),
                )
                for instance, record in sorted(gpu.instances.items())
            )

    def apply(self, step: Step) -> None:
        with self._lock:
            operation = type(step).__name__
            self._fault(operation, f"{operation} {step.instance} on GPU {step.gpu}")
            gpu = self._gpu(step.gpu)
            what = f"{operation} {step.instance} on GPU {step.gpu}"
            if not gpu.mig_enabled:
                raise NvmlError(NvmlFailure.NOT_SUPPORTED, what)
            record = gpu.instances.get(step.instance)
            match step:
                case CreateGpuInstance():
                    self._create_gpu_instance(gpu, step.instance, what)
                case CreateComputeInstance():
                    if record is None:
                        raise NvmlError(NvmlFailure.NOT_FOUND, what)
                    if record.compute_instance_ids:
                        # One full-size compute instance fills the GPU instance.
                        raise NvmlError(NvmlFailure.INSUFFICIENT_RESOURCES, what)
                    record.compute_instance_ids.append(0)
                case DestroyComputeInstance():
                    if record is None or not record.compute_instance_ids:
                        raise NvmlError(NvmlFailure.NOT_FOUND, what)
                    if record.gpu_instance_id in gpu.processes.values():
                        raise NvmlError(NvmlFailure.IN_USE, what)
                    record.compute_instance_ids.pop()
                case DestroyGpuInstance():
                    if record is None:
                        raise NvmlError(NvmlFailure.NOT_FOUND, what)
                    if (
                        record.compute_instance_ids
                        or record.gpu_instance_id in gpu.processes.values()
                    ):
                        raise NvmlError(NvmlFailure.IN_USE, what)
                    del gpu.instances[step.instance]

    def processes(self, index: int) -> tuple[GpuProcess, ...]:
        with self._lock:
            return tuple(
                GpuProcess(pid, gi) for pid, gi in sorted(self._gpu(index).processes.items())
            )

    def set_exclusive_process(self, index: int, exclusive: bool) -> None:
        with self._lock:
            self._fault("set_exclusive_process", f"set compute mode of GPU {index}")
            self._gpu(index).exclusive = exclusive

    def wait_xid(self, timeout_s: float) -> XidEvent | None:
        try:
            return self._events.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def responsive(self, uuid: str) -> bool:
        with self._lock:
            return any(g.uuid == uuid and not g.lost for g in self._gpus)

    # ---- internals ----

    def _gpu(self, index: int) -> _Gpu:
        if not 0 <= index < len(self._gpus):
            raise NvmlError(NvmlFailure.NOT_FOUND, f"GPU {index}")
        return self._gpus[index]

    def _fault(self, operation: str, what: str) -> None:
        self.calls.append(operation)
        for entry in self._faults:
            fault, seen, left = entry
            assert isinstance(fault, Fault) and isinstance(seen, int) and isinstance(left, int)
            if fault.operation not in (None, operation) or left <= 0:
                continue
            entry[1] = seen + 1
            if seen >= fault.after:
                entry[2] = left - 1
                raise NvmlError(fault.kind, f"{what} (injected)")

    def _create_gpu_instance(self, gpu: _Gpu, instance: MigInstance, what: str) -> None:
        profile = gpu.model.find_profile(instance.profile)
        if profile is None:
            raise NvmlError(NvmlFailure.NOT_SUPPORTED, what)
        placement = instance.placement
        if placement.start not in profile.starts or placement.size != profile.memory_slices:
            raise NvmlError(NvmlFailure.INSUFFICIENT_RESOURCES, what)
        same = sum(1 for i in gpu.instances if i.profile == instance.profile)
        existing = [gpu.model.require_profile(i.profile) for i in gpu.instances]
        compute = sum(p.compute_slices for p in existing)
        engines = sum((p.engines for p in existing), profile.engines)
        if (
            any(i.placement.overlaps(placement) for i in gpu.instances)
            or same >= profile.max_count
            or len(gpu.instances) >= gpu.model.max_instances
            or compute + profile.compute_slices > gpu.model.compute_slices
            or not engines.within(gpu.model.engines)  # NVML: media engines taken
        ):
            raise NvmlError(NvmlFailure.INSUFFICIENT_RESOURCES, what)
        used = {r.gpu_instance_id for r in gpu.instances.values()}
        gi_id = min(set(range(1, len(used) + 2)) - used)
        self._created += 1
        mig_uuid = f"MIG-{uuidlib.uuid5(_NAMESPACE, f'{gpu.uuid}/{self._created}')}"
        gpu.instances[instance] = _Instance(gi_id, [], mig_uuid)
