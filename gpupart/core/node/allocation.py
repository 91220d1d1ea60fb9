"""What a container gets from Allocate: environment, device nodes, mounts and CDI names, as plain data."""

from __future__ import annotations

import posixpath
from collections.abc import Sequence
from dataclasses import dataclass

from gpupart.core.api.spec import Mode
from gpupart.core.errors import InvalidInput
from gpupart.core.node.devices import Device, OfferedGpu
from gpupart.core.node.mps import CONTAINER_PIPE_DIRECTORY, client_env

VISIBLE_DEVICES_ENV = "NVIDIA_VISIBLE_DEVICES"
CDI_KIND = "nvidia.com/gpu"
CONTROL_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")
"""Device nodes every CUDA container needs besides its GPU's own."""


@dataclass(frozen=True, slots=True)
class DeviceNode:
    path: str
    permissions: str = "rw"


@dataclass(frozen=True, slots=True)
class HostMount:
    container_path: str
    host_path: str
    read_only: bool = False


@dataclass(frozen=True, slots=True)
class ContainerAllocation:
    envs: tuple[tuple[str, str], ...]
    devices: tuple[DeviceNode, ...] = ()
    mounts: tuple[HostMount, ...] = ()
    cdi_devices: tuple[str, ...] = ()


def _gpu_nodes(gpus: Sequence[OfferedGpu], caps: Sequence[int]) -> tuple[DeviceNode, ...]:
    paths = [*CONTROL_NODES]
    paths += sorted({f"/dev/nvidia{g.minor}" for g in gpus})
    paths += [f"/dev/nvidia-caps/nvidia-cap{m}" for m in sorted(set(caps))]
    return tuple(DeviceNode(p) for p in paths)


def exclusive_allocation(devices: Sequence[Device], *, cdi: bool = True) -> ContainerAllocation:
    """MIG devices or whole GPUs: the UUIDs, the parent GPUs' nodes and the MIG capability nodes."""
    if any(d.gpu.mode.is_shared for d in devices):
        raise InvalidInput("devices_ids", "shared slots are allocated through the assigned pod")
    uuids = [d.mig.uuid if d.mig is not None else d.gpu.uuid for d in devices]
    if any(not u for u in uuids):
        raise InvalidInput("devices_ids", "a MIG device has no UUID yet (being created)")
    caps = [m for d in devices if d.mig is not None for m in d.mig.cap_minors]
    return ContainerAllocation(
        envs=((VISIBLE_DEVICES_ENV, ",".join(uuids)),),
        devices=_gpu_nodes([d.gpu for d in devices], caps),
        cdi_devices=tuple(f"{CDI_KIND}={u}" for u in uuids) if cdi else (),
    )


def gpu_view_allocation(gpu: OfferedGpu) -> ContainerAllocation:
    """A shared GPU seen whole, with no share of it and no MPS client: a DRA admin access,
    for monitoring (NVML sees the GPU; MPS's clients are the ones its daemon serves)."""
    return ContainerAllocation(
        envs=((VISIBLE_DEVICES_ENV, gpu.uuid),), devices=_gpu_nodes([gpu], ())
    )


def shared_allocation(
    gpu: OfferedGpu, *, memory_mib: int, compute_percent: int, cdi: bool = True
) -> ContainerAllocation:
    """One client of a shared GPU; on MPS with the pipe directory, shm and the client's limits."""
    envs = {VISIBLE_DEVICES_ENV: gpu.uuid}
    mounts: tuple[HostMount, ...] = ()
    if gpu.mode is Mode.MPS:
        if not gpu.mps_pipe_directory:
            raise InvalidInput("devices_ids", f"GPU {gpu.uuid} has no running MPS daemon")
        envs.update(client_env(gpu.uuid, memory_mib, compute_percent))
        root = posixpath.dirname(posixpath.dirname(gpu.mps_pipe_directory))
        mounts = (
            HostMount(CONTAINER_PIPE_DIRECTORY, gpu.mps_pipe_directory),
            HostMount("/dev/shm", posixpath.join(root, "shm")),
        )
    return ContainerAllocation(
        envs=tuple(sorted(envs.items())),
        devices=_gpu_nodes([gpu], ()),
        mounts=mounts,
        cdi_devices=(f"{CDI_KIND}={gpu.uuid}",) if cdi else (),
    )
