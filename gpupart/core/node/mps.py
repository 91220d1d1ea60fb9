"""CUDA MPS arithmetic: per-GPU daemon defaults, control commands, and the environment a client container gets."""

from __future__ import annotations

from dataclasses import dataclass

from gpupart.core.api.spec import GpuConfig, MpsSettings
from gpupart.core.errors import InvalidInput

PIPE_ENV = "CUDA_MPS_PIPE_DIRECTORY"
LOG_ENV = "CUDA_MPS_LOG_DIRECTORY"
MEMORY_ENV = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
THREADS_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
CONTAINER_PIPE_DIRECTORY = "/var/run/gpupart/mps"
"""Where a client container sees its GPU's pipe directory."""


@dataclass(frozen=True, slots=True)
class MpsLimits:
    """What one GPU's MPS daemon enforces by default for each client."""

    max_clients: int
    """The GPU's replicas. The field names are the keys of the node agent's marker file for the
    daemon, so they stay as written on disk (MPS's own word, "clients")."""
    memory_mib: int
    compute_percent: int


def mps_limits(config: GpuConfig, gpu_memory_mib: int) -> MpsLimits:
    """Defaults: the partition's figures, else an even share of memory and SMs per client.

    The same on both interfaces: they are what the daemon enforces on every client, whatever
    its environment says. Through DRA they are also the most one claim's `consumedCapacity`
    may be (the shared device's `validRange.max`, ADR 033), and each claim's containers get
    their own amounts as client limits below them.
    """
    replicas = config.replicas
    if replicas < 1:
        raise InvalidInput("mps.maxClients", "must be at least 1")
    settings = config.mps or MpsSettings()
    memory = settings.default_memory_mib or gpu_memory_mib // replicas
    compute = settings.default_compute_percent or max(1, 100 // replicas)
    if memory > gpu_memory_mib:
        raise InvalidInput(
            "mps.defaultMemory", f"{memory} MiB is more than the GPU's {gpu_memory_mib} MiB"
        )
    return MpsLimits(replicas, max(1, memory), min(100, compute))


def daemon_commands(limits: MpsLimits) -> tuple[str, ...]:
    """Control commands for a daemon that sees exactly one GPU (ordinal 0: CUDA_VISIBLE_DEVICES is its UUID)."""
    return (
        f"set_default_active_thread_percentage {limits.compute_percent}",
        f"set_default_device_pinned_mem_limit 0 {limits.memory_mib}M",
    )


def client_limits(
    request_memory_mib: int,
    request_compute_percent: int,
    *,
    defaults: MpsLimits,
    gpu_memory_mib: int,
) -> tuple[int, int]:
    """(MiB, percent) for one client: its own request where given, else the GPU's defaults.

    The daemon's defaults are ceilings (a client's environment can only lower them), so a
    request above one is refused rather than served less than it asked."""
    memory = request_memory_mib or defaults.memory_mib
    compute = request_compute_percent or defaults.compute_percent
    if memory > gpu_memory_mib:
        raise InvalidInput(
            "gpupart.io/gpu-memory", f"{memory} MiB asked, the GPU has {gpu_memory_mib} MiB"
        )
    if memory > defaults.memory_mib:
        raise InvalidInput(
            "gpupart.io/gpu-memory",
            f"{memory} MiB asked, MPS lets one client hold at most {defaults.memory_mib} MiB "
            "on this GPU (the partition's mps.defaultMemory, else an even share)",
        )
    if not 1 <= compute <= 100:
        raise InvalidInput("gpupart.io/gpu-compute", f"{compute} is not a percentage of 1-100")
    if compute > defaults.compute_percent:
        raise InvalidInput(
            "gpupart.io/gpu-compute",
            f"{compute}% asked, MPS lets one client use at most {defaults.compute_percent}% "
            "of this GPU (the partition's mps.defaultComputePercent, else an even share)",
        )
    return memory, compute


def client_env(gpu_uuid: str, memory_mib: int, compute_percent: int) -> dict[str, str]:
    """The MPS variables a client container gets (the pipe directory is mounted at a fixed path)."""
    return {
        PIPE_ENV: CONTAINER_PIPE_DIRECTORY,
        MEMORY_ENV: f"{gpu_uuid}={memory_mib}M",
        THREADS_ENV: str(compute_percent),
    }
