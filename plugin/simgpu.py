"""A simulated NVML from the core catalogue: the core's step semantics, NVML's error kinds, injectable faults.

Used by tests, the e2e suite, the benchmark and `gpupart node --simulate`. What a MIG step does,
and which steps a GPU refuses, is the core's (`gpupart.core.mig.planning.step_refused` and
`apply_step`, with `check_layout` for a new GPU instance): one definition shared with the plan
oracle `apply_steps`. This module adds only what NVML adds: the error kind of each refusal
(missing: NotFound, a GPU instance with compute instances: InUse, no room: InsufficientResources,
unknown profile: NotSupported), InUse for an instance with processes, NotSupported for MIG calls
on a GPU without MIG mode, a MIG mode change that stays pending until `reset` (or `reset_idle`,
the reset an administrator would run, which `gpupart node --simulate-auto-reset` calls between
passes), Xid events, lost GPUs and injected faults (in process, or from a file a running agent
reads again when it changes: `--simulate-faults`), and optionally NVML's time per GPU instance
create or destroy (`create_s`, `destroy_s`), one step at a time per GPU, GPUs in parallel.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
import uuid as uuidlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gpupart import logs
from gpupart.core.errors import InvalidInput
from gpupart.core.mig.catalogue import GpuModel, require_gpu_model
from gpupart.core.mig.layout import MigInstance, Placement
from gpupart.core.mig.planning import (
    CreateGpuInstance,
    DestroyComputeInstance,
    DestroyGpuInstance,
    GpuInstanceState,
    Refusal,
    Step,
    apply_step,
    step_refused,
)
from gpupart.core.node.devices import OfferedMigDevice, XidEvent
from gpupart_plugin.backend import (
    GpuInfo,
    GpuInstanceRecord,
    GpuProcess,
    NvmlError,
    NvmlFailure,
)

log = logging.getLogger(__name__)

MAX_FAULTS_FILE_BYTES = 64 * 1024
"""A faults file is a few entries; anything larger is refused unread."""
XID_POLL_S = 0.02
"""How often an Xid wait looks at the faults file: a real GPU's event wakes NVML's wait at
once, so the simulator's lag stays far below what the node agent adds (Xid to taint)."""

_NAMESPACE = uuidlib.UUID("6a1f0c1e-0d1b-4c59-9d0e-67707570a271")
_NVML_KINDS = {
    Refusal.MISSING: NvmlFailure.NOT_FOUND,
    Refusal.HAS_COMPUTE: NvmlFailure.IN_USE,
    Refusal.COMPLETE: NvmlFailure.INSUFFICIENT_RESOURCES,
    Refusal.NO_ROOM: NvmlFailure.INSUFFICIENT_RESOURCES,
    Refusal.UNKNOWN_PROFILE: NvmlFailure.NOT_SUPPORTED,
}
"""What NVML answers for each step the core's semantics refuse."""


@dataclass
class _Instance:
    gpu_instance_id: int
    uuid: str
    compute_instances: int = 0
    """0 or 1: one full-size compute instance fills a GPU instance (compute instance id 0)."""


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


@dataclass(frozen=True, slots=True)
class SimulatedXid:
    """An Xid on GPU `gpu` (its GPU instance, if set) that a faults file raises once."""

    gpu: int
    xid: int
    gpu_instance_id: int | None = None


def parse_faults(path: Path) -> tuple[list[Fault], list[SimulatedXid]]:
    """The faults and Xids a `--simulate-faults` file lists: a JSON list of objects, each a
    fault (`kind`, an NvmlFailure value, and optionally `operation`, `after`, `times`) or an
    Xid (`xid`, `gpu`, optionally `gpuInstanceId`); InvalidInput naming the file and the entry
    when it is not that."""
    where = f"--simulate-faults {path}"
    try:
        with path.open("rb") as f:
            data = f.read(MAX_FAULTS_FILE_BYTES + 1)
        if len(data) > MAX_FAULTS_FILE_BYTES:
            raise ValueError(f"larger than {MAX_FAULTS_FILE_BYTES} bytes")
        raw = json.loads(data)
    except (OSError, ValueError) as error:
        raise InvalidInput(where, f"cannot be read ({error})") from None
    if not isinstance(raw, list):
        raise InvalidInput(where, "must be a JSON list of faults and Xids")
    faults, xids = [], []
    for k, entry in enumerate(raw):
        try:
            if isinstance(entry, dict) and "xid" in entry:
                xids.append(_xid(entry))
                continue
            if not isinstance(entry, dict) or set(entry) - {"kind", "operation", "after", "times"}:
                raise ValueError("a fault is an object with kind, operation, after, times")
            operation = entry.get("operation")
            after, times = entry.get("after", 0), entry.get("times", 1)
            if operation is not None and not isinstance(operation, str):
                raise ValueError("operation must be a string")
            if type(after) is not int or type(times) is not int or after < 0 or times < 1:
                raise ValueError("after must be an integer ≥ 0 and times ≥ 1")
            kind = entry.get("kind")
            if kind not in set(NvmlFailure):
                raise ValueError(f"kind {kind!r} is none of {', '.join(NvmlFailure)}")
            faults.append(Fault(NvmlFailure(str(kind)), after, operation, times))
        except ValueError as error:
            raise InvalidInput(f"{where} [{k}]", str(error)) from None
    return faults, xids


def _xid(entry: dict[str, object]) -> SimulatedXid:
    if set(entry) - {"xid", "gpu", "gpuInstanceId"}:
        raise ValueError("an Xid is an object with xid, gpu, gpuInstanceId")
    xid, gpu, gi = entry.get("xid"), entry.get("gpu"), entry.get("gpuInstanceId")
    if type(xid) is not int or type(gpu) is not int or not (gi is None or type(gi) is int):
        raise ValueError("xid, gpu and gpuInstanceId must be integers")
    return SimulatedXid(gpu, xid, gi)


def simulated_bus_id(index: int) -> str:
    """A simulated GPU's PCI address: one bus per GPU."""
    return f"0000:{0x18 + index:02x}:00.0"


class SimulatedGpus:
    """In-memory GPUs of one node; thread-safe, because the health loop waits on events concurrently."""

    def __init__(
        self,
        products: list[str],
        *,
        node: str = "sim",
        mig_enabled: bool | Sequence[bool] = True,
        mode_change_needs_reset: bool = True,
        create_s: float = 0.0,
        destroy_s: float = 0.0,
        state_path: Path | None = None,
        faults_path: Path | None = None,
    ) -> None:
        """`mig_enabled`: the MIG mode every GPU starts in, or one per GPU (as a driver keeps it).

        `create_s` / `destroy_s`: seconds each GPU instance create / destroy call takes (its
        compute instance's call adds nothing), standing in for NVML's time (the dynamic MIG
        simulator assumes 1.0 s and 0.5 s); one call at a time per GPU, while other GPUs' calls
        and every read go on.
        """
        modes = (
            [mig_enabled] * len(products) if isinstance(mig_enabled, bool) else list(mig_enabled)
        )
        if len(modes) != len(products):
            raise ValueError(f"{len(modes)} MIG modes for {len(products)} GPUs")
        self._lock = threading.RLock()
        self._steps = [threading.Lock() for _ in products]
        """Per GPU: its MIG steps one at a time (as the dynamic MIG simulator models them)."""
        self._create_s, self._destroy_s = create_s, destroy_s
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
        self._state_path = state_path
        """Where MIG modes and instances outlive this object (`--simulate-state`), or None."""
        if state_path is not None and state_path.exists():
            self._load(state_path)
        self._faults_path = faults_path
        """A file whose faults replace the injected ones whenever it changes, or None."""
        self._faults_seen: tuple[int, int, int] | None = None
        """(inode, size, mtime) of the faults file as last read; None: not read yet."""

    # ---- the state file: what a real GPU keeps when the agent restarts ----

    def _load(self, path: Path) -> None:
        """Take back MIG modes and instances saved by an earlier agent on these GPUs.

        InvalidInput (naming the file) when it is unreadable or names other GPUs: a simulated
        GPU is never guessed into a state.
        """
        try:
            raw = json.loads(path.read_text())
            if [g["uuid"] for g in raw["gpus"]] != [g.uuid for g in self._gpus]:
                raise ValueError("it is for other GPUs")
            for gpu, saved in zip(self._gpus, raw["gpus"], strict=True):
                gpu.mig_enabled = bool(saved["mig_enabled"])
                gpu.mig_pending = saved["mig_pending"]
                gpu.exclusive = bool(saved["exclusive"])
                gpu.instances = {
                    MigInstance(Placement(int(i["start"]), int(i["size"])), str(i["profile"])): (
                        _Instance(int(i["id"]), str(i["uuid"]), int(i["compute_instances"]))
                    )
                    for i in saved["instances"]
                }
            self._created = int(raw["created"])
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise InvalidInput("--simulate-state", f"{path}: cannot be read ({error})") from None

    def _save(self) -> None:
        """Write the GPUs' MIG state (under `_lock`), atomically: a kill mid-write keeps the last."""
        if self._state_path is None:
            return
        document = {
            "created": self._created,
            "gpus": [
                {
                    "uuid": gpu.uuid,
                    "mig_enabled": gpu.mig_enabled,
                    "mig_pending": gpu.mig_pending,
                    "exclusive": gpu.exclusive,
                    "instances": [
                        {
                            "start": i.placement.start,
                            "size": i.placement.size,
                            "profile": i.profile,
                            "id": r.gpu_instance_id,
                            "uuid": r.uuid,
                            "compute_instances": r.compute_instances,
                        }
                        for i, r in sorted(gpu.instances.items())
                    ],
                }
                for gpu in self._gpus
            ],
        }
        partial = self._state_path.with_suffix(".partial")
        partial.write_text(json.dumps(document))
        os.replace(partial, self._state_path)

    # ---- fault injection and test controls ----

    def inject(self, fault: Fault) -> None:
        with self._lock:
            self._faults.append([fault, 0, fault.times])

    def clear_faults(self) -> None:
        with self._lock:
            self._faults.clear()

    def _read_faults_file(self) -> None:
        """The faults file's faults in place of the current ones, and its Xids raised, when it
        changed (under `_lock`).

        A missing file means no faults. One that cannot be read or parsed leaves the current
        faults as they are, and says why in the log: a test control never guesses a fault.
        """
        path = self._faults_path
        if path is None:
            return
        try:
            st = path.stat()
        except FileNotFoundError:
            if self._faults_seen is not None:
                self._faults.clear()
            self._faults_seen = None
            return
        except OSError as error:
            log.warning(
                "Ignored unreadable simulated faults",
                extra=logs.kv(path=str(path), error=str(error)),
            )
            return
        seen = (st.st_ino, st.st_size, st.st_mtime_ns)
        if seen == self._faults_seen:
            return
        self._faults_seen = seen
        try:
            faults, xids = parse_faults(path)
            if any(not 0 <= x.gpu < len(self._gpus) for x in xids):
                raise InvalidInput(f"--simulate-faults {path}", "an Xid names no GPU of this node")
        except InvalidInput as error:
            log.warning(
                "Ignored unreadable simulated faults",
                extra=logs.kv(path=str(path), error=str(error)),
            )
            return
        self._faults = [[f, 0, f.times] for f in faults]
        for x in xids:
            self._events.put(XidEvent(self._gpus[x.gpu].uuid, x.xid, x.gpu_instance_id, None))

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
            self._save()

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
            return tuple(self._info(g) for g in self._gpus)

    def indices(self) -> tuple[int, ...]:
        with self._lock:
            return tuple(g.index for g in self._gpus)

    def gpu(self, index: int) -> GpuInfo | None:
        with self._lock:
            return self._info(self._gpus[index]) if 0 <= index < len(self._gpus) else None

    def _info(self, g: _Gpu) -> GpuInfo:
        return GpuInfo(
            index=g.index,
            uuid=g.uuid,
            name=f"NVIDIA {g.model.product}",
            memory_mib=g.model.memory_mib,
            minor=g.index,
            numa_node=g.index * 2 // max(2, len(self._gpus)),
            mig_capable=True,
            mig_enabled=g.mig_enabled,
            mig_pending=g.mig_pending is not None,
            pci_bus_id=simulated_bus_id(g.index),
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
            self._save()

    def instances(self, index: int) -> tuple[GpuInstanceRecord, ...]:
        with self._lock:
            gpu = self._gpu(index)
            if not gpu.mig_enabled:
                return ()
            return tuple(
                GpuInstanceRecord(
                    OfferedMigDevice(
                        record.uuid,
                        instance,
                        record.gpu_instance_id,
                        0,
                        (100 + 10 * record.gpu_instance_id, 101 + 10 * record.gpu_instance_id),
                    ),
                    record.compute_instances,
                )
                for instance, record in sorted(gpu.instances.items())
            )

    def apply(self, step: Step) -> None:
        """The core's step semantics (`step_refused`, `apply_step`), answered with NVML's error
        kinds, after the step's latency."""
        self._gpu(step.gpu)
        with self._steps[step.gpu]:
            delay = {CreateGpuInstance: self._create_s, DestroyGpuInstance: self._destroy_s}
            seconds = delay.get(type(step), 0.0)
            if seconds:
                time.sleep(seconds)  # outside `_lock`: the other GPUs and every read go on
            self._step(step)

    def _step(self, step: Step) -> None:
        with self._lock:
            operation = type(step).__name__
            what = f"{operation} {step.instance} on GPU {step.gpu}"
            self._fault(operation, what)
            gpu = self._gpu(step.gpu)
            if not gpu.mig_enabled:
                raise NvmlError(NvmlFailure.NOT_SUPPORTED, what)
            states = {i: GpuInstanceState(i, r.compute_instances) for i, r in gpu.instances.items()}
            refused = step_refused(gpu.model, states, step)
            if refused is not None:
                raise NvmlError(
                    _NVML_KINDS[refused.refusal], what
                )  # as NVML: the kind, not the reason
            record = gpu.instances.get(step.instance)
            if (
                isinstance(step, DestroyComputeInstance | DestroyGpuInstance)
                and record is not None
                and record.gpu_instance_id in gpu.processes.values()
            ):
                raise NvmlError(NvmlFailure.IN_USE, what)  # NVML's own rule: processes on it
            after = apply_step(states, step)
            if record is None:
                record = self._new_instance(gpu)
                gpu.instances[step.instance] = record
            if step.instance in after:
                record.compute_instances = after[step.instance].compute_instances
            else:
                del gpu.instances[step.instance]
            self._save()

    def processes(self, index: int) -> tuple[GpuProcess, ...]:
        with self._lock:
            return tuple(
                GpuProcess(pid, gi) for pid, gi in sorted(self._gpu(index).processes.items())
            )

    def set_exclusive_process(self, index: int, exclusive: bool) -> None:
        with self._lock:
            self._fault("set_exclusive_process", f"set compute mode of GPU {index}")
            self._gpu(index).exclusive = exclusive
            self._save()

    def wait_xid(self, timeout_s: float) -> XidEvent | None:
        """As NVML's event wait: back as soon as an Xid is raised, here or through the faults
        file (looked at every `XID_POLL_S`: a file has no wake-up of its own)."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                self._read_faults_file()
            left = deadline - time.monotonic()
            try:
                return self._events.get(timeout=max(0.0, min(left, XID_POLL_S)))
            except queue.Empty:
                if left <= XID_POLL_S:
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
        self._read_faults_file()
        for entry in self._faults:
            fault, seen, left = entry
            assert isinstance(fault, Fault) and isinstance(seen, int) and isinstance(left, int)
            if fault.operation not in (None, operation) or left <= 0:
                continue
            entry[1] = seen + 1
            if seen >= fault.after:
                entry[2] = left - 1
                raise NvmlError(fault.kind, f"{what} (injected)")

    def _new_instance(self, gpu: _Gpu) -> _Instance:
        """A new GPU instance's ids: the lowest free GPU instance id, a UUID never used before."""
        used = {r.gpu_instance_id for r in gpu.instances.values()}
        self._created += 1
        return _Instance(
            min(set(range(1, len(used) + 2)) - used),
            f"MIG-{uuidlib.uuid5(_NAMESPACE, f'{gpu.uuid}/{self._created}')}",
        )
