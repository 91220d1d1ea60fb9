"""The real NVML backend: the only module of gpupart that imports pynvml; every NVML error leaves it as NvmlError.

Profile IDs and placements come from NVML itself (they are product-specific), MIG devices are
created with explicit placements, and `read_only=True` refuses every call that changes the GPU
(the GPU test suite runs that way).

It is over 400 lines on purpose: it is the one module that imports pynvml (import contract
`nvml-one-module`), so every NVML call, and the translation of every NVML error, stays behind
one door; a split would open a second one for no gain in what a reader must hold at once (the
reads, the MIG geometry and the few writes share the handle and error helpers above them).
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pynvml

from gpupart.core.mig.catalogue import GpuModel, MediaEngines, MigProfile, find_gpu_model, gpu_model
from gpupart.core.mig.layout import MigInstance, Placement
from gpupart.core.mig.planning import (
    CreateComputeInstance,
    CreateGpuInstance,
    DestroyComputeInstance,
    DestroyGpuInstance,
    Step,
)
from gpupart.core.node.devices import OfferedMigDevice, XidEvent
from gpupart_plugin.backend import (
    GpuInfo,
    GpuInstanceRecord,
    GpuProcess,
    NvmlError,
    NvmlFailure,
)

T = TypeVar("T")
_ANY_ID = 0xFFFFFFFF
_FAILURES = {
    pynvml.NVML_ERROR_IN_USE: NvmlFailure.IN_USE,
    pynvml.NVML_ERROR_NOT_SUPPORTED: NvmlFailure.NOT_SUPPORTED,
    pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES: NvmlFailure.INSUFFICIENT_RESOURCES,
    pynvml.NVML_ERROR_NOT_FOUND: NvmlFailure.NOT_FOUND,
    pynvml.NVML_ERROR_NO_PERMISSION: NvmlFailure.NO_PERMISSION,
    pynvml.NVML_ERROR_RESET_REQUIRED: NvmlFailure.RESET_REQUIRED,
    pynvml.NVML_ERROR_GPU_IS_LOST: NvmlFailure.GPU_LOST,
}
_MINOR_LINE = re.compile(r"^gpu(\d+)/gi(\d+)(?:/ci(\d+))?/access\s+(\d+)$")


def _failure(code: int) -> NvmlFailure:
    return _FAILURES.get(code, NvmlFailure.OTHER)


def _call(what: str, function: Callable[..., T], *args: Any) -> T:
    try:
        return function(*args)
    except pynvml.NVMLError as error:
        raise NvmlError(_failure(error.value), f"{what} ({error})") from error


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


_BUS_ID = re.compile(r"([0-9a-f]{4,8}):([0-9a-f]{2}):([0-9a-f]{2})\.([0-7])")


def pci_bus_id(text: str) -> str:
    """NVML's bus id (`00000000:3B:00.0`) as `resource.kubernetes.io/pciBusID` wants it
    (`0000:3b:00.0`: a 4-digit domain, lower case); '' when it is not one."""
    match = _BUS_ID.fullmatch(text.strip().lower())
    if match is None or int(match[1], 16) > 0xFFFF:
        return ""
    return f"{int(match[1], 16):04x}:{match[2]}:{match[3]}.{match[4]}"


def _listed(
    what: str, function: Callable[..., None], parent: Any, profile_id: object, kind: Any, size: int
) -> list[Any]:
    """The handles an NVML list call fills in: (parent, profile ID, handle array, byref count)."""
    handles = (kind * max(1, size))()
    count = ctypes.c_uint(0)
    _call(what, function, parent, profile_id, handles, ctypes.byref(count))
    return list(handles[: count.value])


def _compute_profiles(gi: Any) -> Iterator[Any]:
    """The shared-engine compute-instance profiles the GPU instance offers."""
    for ci_index in range(pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT):
        try:
            raw = pynvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                gi, ci_index, pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
            )
        except pynvml.NVMLError:
            continue  # not offered for this GPU instance
        yield raw


class NvmlGpus:
    """GPUs of this node through NVML; one init for the process's lifetime."""

    def __init__(
        self,
        *,
        read_only: bool = False,
        mig_minors: Path = Path("/proc/driver/nvidia-caps/mig-minors"),
    ) -> None:
        _call("initialise NVML", pynvml.nvmlInit)
        self.read_only = read_only
        self.mig_minors = mig_minors
        self._models: dict[int, GpuModel] = {}
        self._events: Any = None

    def close(self) -> None:
        if self._events is not None:
            _call("free the event set", pynvml.nvmlEventSetFree, self._events)
        _call("shut NVML down", pynvml.nvmlShutdown)

    # ---- reads ----

    def gpus(self) -> tuple[GpuInfo, ...]:
        return tuple(self._info(index) for index in self.indices())

    def indices(self) -> tuple[int, ...]:
        return tuple(range(_call("count GPUs", pynvml.nvmlDeviceGetCount)))

    def gpu(self, index: int) -> GpuInfo | None:
        count = _call("count GPUs", pynvml.nvmlDeviceGetCount)
        return self._info(index) if 0 <= index < count else None

    def _handle(self, index: int) -> Any:
        return _call(f"get GPU {index}", pynvml.nvmlDeviceGetHandleByIndex, index)

    def _info(self, index: int) -> GpuInfo:
        handle = self._handle(index)
        try:
            current, pending = pynvml.nvmlDeviceGetMigMode(handle)
            capable = True
        except pynvml.NVMLError:
            current = pending = pynvml.NVML_DEVICE_MIG_DISABLE
            capable = False
        try:
            numa: int | None = int(pynvml.nvmlDeviceGetNumaNodeId(handle))
        except (pynvml.NVMLError, AttributeError):
            numa = None
        memory = _call(f"read memory of GPU {index}", pynvml.nvmlDeviceGetMemoryInfo, handle)
        try:
            bus = pci_bus_id(_text(pynvml.nvmlDeviceGetPciInfo_v3(handle).busId))
        except (pynvml.NVMLError, AttributeError):
            bus = ""  # an attribute left out, never guessed
        return GpuInfo(
            index=index,
            uuid=_text(_call(f"read UUID of GPU {index}", pynvml.nvmlDeviceGetUUID, handle)),
            name=_text(_call(f"read name of GPU {index}", pynvml.nvmlDeviceGetName, handle)),
            memory_mib=int(memory.total) // 2**20,
            minor=int(_call(f"read minor of GPU {index}", pynvml.nvmlDeviceGetMinorNumber, handle)),
            numa_node=numa if numa is None or numa >= 0 else None,
            mig_capable=capable,
            mig_enabled=current == pynvml.NVML_DEVICE_MIG_ENABLE,
            mig_pending=pending != current,
            pci_bus_id=bus,
        )

    def model(self, index: int) -> GpuModel:
        """The GPU's MIG geometry as NVML states it (profile IDs, memory, placements)."""
        if index not in self._models:
            self._models[index] = self._read_model(index)
        return self._models[index]

    def _read_model(self, index: int) -> GpuModel:
        handle = self._handle(index)
        info = self._info(index)
        profiles: list[MigProfile] = []
        for profile_index in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
            try:
                raw = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, profile_index)
            except pynvml.NVMLError:
                continue  # not offered by this product (NotSupported / InvalidArgument)
            count = int(raw.instanceCount)
            what = f"read placements of GPU {index} profile {raw.id}"
            # Ask for the number of placements first: a profile that fits once (+me) still has
            # a placement per start slot, more than its instance count.
            found = ctypes.c_uint(0)
            possible = pynvml.nvmlDeviceGetGpuInstancePossiblePlacements
            _call(what, possible, handle, raw.id, None, ctypes.byref(found))
            placements = (pynvml.c_nvmlGpuInstancePlacement_t * max(1, found.value))()
            _call(what, possible, handle, raw.id, placements, ctypes.byref(found))
            spots = [(p.start, p.size) for p in placements[: found.value]]
            if not spots:
                continue
            profiles.append(
                MigProfile(
                    name=_text(raw.name).removeprefix("MIG ").strip(),
                    compute_slices=int(raw.sliceCount),
                    memory_slices=int(spots[0][1]),
                    memory_mib=int(raw.memorySizeMB),
                    max_count=count,
                    starts=tuple(sorted(start for start, _ in spots)),
                    profile_id=int(raw.id),
                    engines=MediaEngines(
                        decoders=int(raw.decoderCount),
                        encoders=int(raw.encoderCount),
                        jpeg=int(raw.jpegCount),
                        ofa=int(raw.ofaCount),
                    ),
                )
            )
        if not profiles:
            raise NvmlError(NvmlFailure.NOT_SUPPORTED, f"GPU {index} reports no MIG profile")
        known = find_gpu_model(info.name)
        return gpu_model(
            known.product if known is not None else info.name,
            memory_mib=info.memory_mib,
            compute_slices=max(p.compute_slices for p in profiles),
            memory_slices=max(p.memory_slices for p in profiles),
            max_instances=max(p.max_count for p in profiles),
            profiles=tuple(profiles),
        )

    def _gpu_instances(self, index: int) -> list[tuple[MigInstance, Any, int]]:
        """(instance, GI handle, GI id) for every GPU instance."""
        handle = self._handle(index)
        found = []
        for profile in self.model(index).profiles:
            for gi in _listed(
                f"list GPU instances of GPU {index}",
                pynvml.nvmlDeviceGetGpuInstances,
                handle,
                profile.profile_id,
                pynvml.c_nvmlGpuInstance_t,
                profile.max_count,
            ):
                info = _call("read GPU instance", pynvml.nvmlGpuInstanceGetInfo, gi)
                placement = Placement(int(info.placement.start), int(info.placement.size))
                found.append((MigInstance(placement, profile.name), gi, int(info.id)))
        return found

    def _compute_instances(self, gi: Any) -> list[tuple[Any, int]]:
        found = []
        for raw in _compute_profiles(gi):
            for ci in _listed(
                "list compute instances",
                pynvml.nvmlGpuInstanceGetComputeInstances,
                gi,
                raw.id,
                pynvml.c_nvmlComputeInstance_t,
                int(raw.instanceCount),
            ):
                info = _call("read compute instance", pynvml.nvmlComputeInstanceGetInfo, ci)
                found.append((ci, int(info.id)))
        return found

    def _mig_handles(self, index: int) -> list[tuple[Any, int, int]]:
        """(MIG device handle, GI id, CI id) for each MIG device of the GPU."""
        handle = self._handle(index)
        found = []
        top = _call("count MIG devices", pynvml.nvmlDeviceGetMaxMigDeviceCount, handle)
        for j in range(top):
            try:
                mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, j)
            except pynvml.NVMLError:
                continue  # the index space is sparse
            gi = _call("read GI id", pynvml.nvmlDeviceGetGpuInstanceId, mig)
            ci = _call("read CI id", pynvml.nvmlDeviceGetComputeInstanceId, mig)
            found.append((mig, int(gi), int(ci)))
        return found

    def instances(self, index: int) -> tuple[GpuInstanceRecord, ...]:
        info = self._info(index)
        if not info.mig_enabled:
            return ()
        minor = info.minor
        caps = self._cap_minors()
        uuids = {
            (gi, ci): _text(_call("read MIG UUID", pynvml.nvmlDeviceGetUUID, mig))
            for mig, gi, ci in self._mig_handles(index)
        }
        records = []
        for instance, gi, gi_id in self._gpu_instances(index):
            cis = self._compute_instances(gi)
            ci_id = cis[0][1] if cis else 0
            records.append(
                GpuInstanceRecord(
                    OfferedMigDevice(
                        uuids.get((gi_id, ci_id), ""),
                        instance,
                        gi_id,
                        ci_id,
                        tuple(
                            m
                            for key in ((minor, gi_id, None), (minor, gi_id, ci_id))
                            if (m := caps.get(key)) is not None
                        ),
                    ),
                    len(cis),
                )
            )
        return tuple(sorted(records, key=lambda r: r.device.instance))

    def _cap_minors(self) -> dict[tuple[int, int, int | None], int]:
        """`gpu<G>/gi<I>[/ci<C>]/access <M>` lines of the nvidia-caps mig-minors file."""
        try:
            lines = self.mig_minors.read_text().splitlines()
        except OSError:
            return {}
        minors = {}
        for line in lines:
            match = _MINOR_LINE.match(line.strip())
            if match:
                gpu, gi, ci, minor = match.groups()
                minors[(int(gpu), int(gi), None if ci is None else int(ci))] = int(minor)
        return minors

    def processes(self, index: int) -> tuple[GpuProcess, ...]:
        if not self._info(index).mig_enabled:
            running = _call(
                "list processes", pynvml.nvmlDeviceGetComputeRunningProcesses, self._handle(index)
            )
            return tuple(GpuProcess(int(p.pid)) for p in running)
        found: list[GpuProcess] = []
        for mig, gi, _ in self._mig_handles(index):
            running = _call("list processes", pynvml.nvmlDeviceGetComputeRunningProcesses, mig)
            found.extend(GpuProcess(int(p.pid), gi) for p in running)
        return tuple(found)

    def responsive(self, uuid: str) -> bool:
        try:
            handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
            pynvml.nvmlDeviceGetMemoryInfo(handle)
        except pynvml.NVMLError:
            return False
        return True

    def wait_xid(self, timeout_s: float) -> XidEvent | None:
        if self._events is None:
            self._events = self._register_events()
        try:
            data = pynvml.nvmlEventSetWait_v2(self._events, int(timeout_s * 1000))
        except pynvml.NVMLError as error:
            if error.value == pynvml.NVML_ERROR_TIMEOUT:
                return None
            raise NvmlError(_failure(error.value), f"wait for GPU events ({error})") from error
        if not data.eventType & pynvml.nvmlEventTypeXidCriticalError:
            return None  # ECC counters and the like: not an Xid
        gi, ci = int(data.gpuInstanceId), int(data.computeInstanceId)
        return XidEvent(
            _text(_call("read event GPU UUID", pynvml.nvmlDeviceGetUUID, data.device)),
            int(data.eventData),
            None if gi == _ANY_ID else gi,
            None if ci == _ANY_ID else ci,
        )

    def _register_events(self) -> Any:
        events = _call("create an event set", pynvml.nvmlEventSetCreate)
        wanted = (
            pynvml.nvmlEventTypeXidCriticalError
            | pynvml.nvmlEventTypeDoubleBitEccError
            | pynvml.nvmlEventTypeSingleBitEccError
        )
        for info in self.gpus():
            handle = self._handle(info.index)
            supported = _call("read event types", pynvml.nvmlDeviceGetSupportedEventTypes, handle)
            try:
                pynvml.nvmlDeviceRegisterEvents(handle, wanted & supported, events)
            except pynvml.NVMLError as error:
                if error.value != pynvml.NVML_ERROR_NOT_SUPPORTED:
                    raise NvmlError(_failure(error.value), "register GPU events") from error
        return events

    # ---- changes ----

    def _writable(self, what: str) -> None:
        if self.read_only:
            raise NvmlError(NvmlFailure.NO_PERMISSION, f"{what}: backend opened read-only")

    def set_mig_mode(self, index: int, enabled: bool) -> None:
        what = f"set MIG mode of GPU {index}"
        self._writable(what)
        mode = pynvml.NVML_DEVICE_MIG_ENABLE if enabled else pynvml.NVML_DEVICE_MIG_DISABLE
        status = _call(what, pynvml.nvmlDeviceSetMigMode, self._handle(index), mode)
        if status != pynvml.NVML_SUCCESS:
            raise NvmlError(_failure(int(status)), what)
        self._models.pop(index, None)

    def set_exclusive_process(self, index: int, exclusive: bool) -> None:
        what = f"set compute mode of GPU {index}"
        self._writable(what)
        mode = (
            pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS
            if exclusive
            else pynvml.NVML_COMPUTEMODE_DEFAULT
        )
        _call(what, pynvml.nvmlDeviceSetComputeMode, self._handle(index), mode)

    def apply(self, step: Step) -> None:
        what = f"{type(step).__name__} {step.instance} on GPU {step.gpu}"
        self._writable(what)
        profile = self.model(step.gpu).require_profile(step.instance.profile)
        if isinstance(step, CreateGpuInstance):
            spot = pynvml.c_nvmlGpuInstancePlacement_t()
            spot.start, spot.size = step.instance.placement.start, step.instance.placement.size
            _call(
                what,
                pynvml.nvmlDeviceCreateGpuInstanceWithPlacement,
                self._handle(step.gpu),
                profile.profile_id,
                ctypes.byref(spot),
            )
            return
        gi = next((h for i, h, _ in self._gpu_instances(step.gpu) if i == step.instance), None)
        if gi is None:
            raise NvmlError(NvmlFailure.NOT_FOUND, what)
        if isinstance(step, CreateComputeInstance):
            ci_profile = self._full_compute_profile(gi, profile.compute_slices, what)
            _call(what, pynvml.nvmlGpuInstanceCreateComputeInstance, gi, ci_profile)
        elif isinstance(step, DestroyComputeInstance):
            cis = self._compute_instances(gi)
            if not cis:
                raise NvmlError(NvmlFailure.NOT_FOUND, what)
            _call(what, pynvml.nvmlComputeInstanceDestroy, cis[0][0])
        elif isinstance(step, DestroyGpuInstance):
            _call(what, pynvml.nvmlGpuInstanceDestroy, gi)

    def _full_compute_profile(self, gi: Any, slices: int, what: str) -> int:
        """The compute-instance profile ID that fills the GPU instance (what `-cgi ... -C` makes)."""
        for raw in _compute_profiles(gi):
            if int(raw.sliceCount) == slices:
                return int(raw.id)
        raise NvmlError(NvmlFailure.NOT_SUPPORTED, f"{what}: no {slices}-slice compute profile")
