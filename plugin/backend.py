"""The NVML backend interface the node agent talks to (real NVML or a simulated GPU), and its error vocabulary."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from gpupart.core.errors import GpupartError
from gpupart.core.mig.catalogue import GpuModel
from gpupart.core.mig.planning import Step
from gpupart.core.node.devices import OfferedMigDevice, XidEvent


class NvmlFailure(StrEnum):
    """NVML return codes the agent acts on; everything else is OTHER."""

    IN_USE = "InUse"
    NOT_SUPPORTED = "NotSupported"
    INSUFFICIENT_RESOURCES = "InsufficientResources"
    NOT_FOUND = "NotFound"
    NO_PERMISSION = "NoPermission"
    RESET_REQUIRED = "ResetRequired"
    GPU_LOST = "GpuIsLost"
    OTHER = "Other"


class NvmlError(GpupartError):
    """An NVML call failed; `kind` says how, the message says what was attempted."""

    def __init__(self, kind: NvmlFailure, message: str) -> None:
        super().__init__(f"{message}: NVML {kind.value}")
        self.kind = kind


@dataclass(frozen=True, slots=True)
class GpuInfo:
    """A physical GPU as NVML reports it."""

    index: int
    uuid: str
    name: str
    memory_mib: int
    minor: int
    numa_node: int | None
    mig_capable: bool
    mig_enabled: bool
    mig_pending: bool
    """A MIG mode change waits for a GPU reset (pending mode differs from current)."""
    pci_bus_id: str = ""
    """The PCI address (`0000:3b:00.0`), lower case as `resource.kubernetes.io/pciBusID`
    wants it; empty when NVML did not say."""


@dataclass(frozen=True, slots=True)
class GpuInstanceRecord:
    """A GPU instance read from NVML: its compute instances and its MIG device (usable with one)."""

    device: OfferedMigDevice
    compute_instances: int


@dataclass(frozen=True, slots=True)
class GpuProcess:
    pid: int
    gpu_instance_id: int | None = None
    """None when the process runs on the whole GPU (MIG disabled)."""


class GpuBackend(Protocol):
    """What the agent needs from NVML; every failure is an NvmlError."""

    def gpus(self) -> tuple[GpuInfo, ...]: ...
    def indices(self) -> tuple[int, ...]:
        """The GPUs' indices, without reading each GPU."""
        ...

    def gpu(self, index: int) -> GpuInfo | None:
        """One GPU as `gpus` gives it, read alone (None: the node has no GPU of that index):
        a DRA prepare reads only its claim's GPUs."""
        ...

    def model(self, index: int) -> GpuModel: ...
    def set_mig_mode(self, index: int, enabled: bool) -> None: ...
    def instances(self, index: int) -> tuple[GpuInstanceRecord, ...]: ...
    def apply(self, step: Step) -> None: ...
    def processes(self, index: int) -> tuple[GpuProcess, ...]: ...
    def set_exclusive_process(self, index: int, exclusive: bool) -> None: ...
    def wait_xid(self, timeout_s: float) -> XidEvent | None: ...
    def responsive(self, uuid: str) -> bool: ...
