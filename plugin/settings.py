"""Node agent settings: read once from flags (falling back to environment variables), validated, frozen."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

from gpupart.core.errors import InvalidInput
from gpupart.core.node.devices import DEFAULT_IGNORED_XIDS


@dataclass(frozen=True, slots=True)
class SimulatedGpu:
    product: str
    mig_enabled: bool = True
    """The MIG mode the GPU starts in (as a real GPU keeps it across driver reloads)."""


MIG_SUFFIXES = {"mig-on": True, "mig-off": False}
"""`--simulate` product suffixes (`A100-SXM4-80GB:mig-off`) for the initial MIG mode."""


@dataclass(frozen=True, slots=True)
class NodeSettings:
    node_name: str
    """This node's name (env NODE_NAME from the downward API)."""
    plugin_dir: Path
    """Kubelet device-plugin directory; our sockets go here."""
    kubelet_socket: Path
    pod_resources_socket: Path
    mps_root: Path
    """Host directory for MPS pipe, log and shm directories (hostPath mounted at the same path)."""
    mps_control: tuple[str, ...]
    simulate: tuple[SimulatedGpu, ...]
    """Simulated GPUs (e.g. 8 × H200-141GB) instead of NVML; empty for real GPUs."""
    simulate_auto_reset: bool
    """Simulated GPUs only: a pending MIG mode change takes effect on the next pass once idle."""
    ignored_xids: frozenset[int]
    recovery_s: float
    resync_s: float
    metrics_address: str
    metrics_port: int
    cdi: bool
    once: bool


_FLAGS: tuple[tuple[str, str, str, str], ...] = (
    # flag, environment variable, default, help
    ("--node-name", "NODE_NAME", "", "this node's name (required)"),
    (
        "--plugin-dir",
        "GPUPART_PLUGIN_DIR",
        "/var/lib/kubelet/device-plugins",
        "kubelet device-plugin directory",
    ),
    (
        "--kubelet-socket",
        "KUBELET_SOCKET",
        "",
        "kubelet registration socket (default: <plugin-dir>/kubelet.sock)",
    ),
    (
        "--pod-resources-socket",
        "GPUPART_POD_RESOURCES_SOCKET",
        "/var/lib/kubelet/pod-resources/kubelet.sock",
        "kubelet PodResources socket",
    ),
    (
        "--mps-root",
        "GPUPART_MPS_ROOT",
        "/run/gpupart/mps",
        "host directory for MPS pipe/log/shm directories",
    ),
    ("--mps-control", "GPUPART_MPS_CONTROL", "nvidia-cuda-mps-control", "MPS control command"),
    (
        "--simulate",
        "GPUPART_SIMULATE",
        "",
        "simulated GPUs instead of NVML, e.g. 8xH200-141GB or A100-SXM4-80GB,A30; a suffix "
        ":mig-off (or :mig-on, the default) sets the MIG mode they start in",
    ),
    (
        "--simulate-auto-reset",
        "GPUPART_SIMULATE_AUTO_RESET",
        "false",
        "simulated GPUs only: reset an idle GPU with a pending MIG mode change before each "
        "pass, as an administrator would, so the change takes effect",
    ),
    (
        "--ignored-xids",
        "GPUPART_IGNORED_XIDS",
        ",".join(map(str, sorted(DEFAULT_IGNORED_XIDS))),
        "Xids that do not make a device unhealthy",
    ),
    (
        "--recovery-seconds",
        "GPUPART_RECOVERY_SECONDS",
        "60",
        "quiet time before a recovered GPU's devices are Healthy again",
    ),
    (
        "--resync-seconds",
        "GPUPART_RESYNC_SECONDS",
        "60",
        "reconcile at least this often, even without a change",
    ),
    (
        "--metrics-address",
        "GPUPART_METRICS_ADDRESS",
        "0.0.0.0",
        "address for /metrics and /healthz",
    ),
    ("--metrics-port", "GPUPART_METRICS_PORT", "9402", "port for /metrics and /healthz (0: off)"),
    (
        "--cdi",
        "GPUPART_CDI",
        "true",
        "also return CDI device names nvidia.com/gpu=<uuid> from Allocate",
    ),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    for flag, env, default, help_text in _FLAGS:
        described = f"{help_text} [env {env}, default {default!r}]"
        if flag in _BOOLEAN_FLAGS:
            # A bare boolean flag means true; `--flag=false` still works.
            parser.add_argument(flag, default=None, nargs="?", const="true", help=described)
        else:
            parser.add_argument(flag, default=None, help=described)
    parser.add_argument("--once", action="store_true", help="run one reconcile pass and exit")


_BOOLEAN_FLAGS = frozenset({"--cdi", "--simulate-auto-reset"})


def _truth(text: str) -> bool:
    return text.strip().lower() in ("1", "true", "yes")


def simulated_gpus(text: str) -> tuple[SimulatedGpu, ...]:
    """`8xH200-141GB`, `A100-SXM4-80GB:mig-off,2xA30`: one entry per GPU, in order."""
    gpus: list[SimulatedGpu] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        spec, _, suffix = part.partition(":")
        if suffix and suffix not in MIG_SUFFIXES:
            raise InvalidInput(
                "--simulate",
                f"{part!r}: unknown suffix {suffix!r} (known: {', '.join(MIG_SUFFIXES)})",
            )
        mig = MIG_SUFFIXES.get(suffix, True)
        count, sep, product = spec.partition("x")
        if sep and count.isdigit():
            gpus += [SimulatedGpu(product, mig)] * int(count)
        else:
            gpus.append(SimulatedGpu(spec, mig))
    return tuple(gpus)


def from_args(args: argparse.Namespace) -> NodeSettings:
    def value(flag: str) -> str:
        _, env, default, _ = next(f for f in _FLAGS if f[0] == flag)
        given = getattr(args, flag[2:].replace("-", "_"), None)
        return str(given if given is not None else os.environ.get(env, default))

    node = value("--node-name")
    if not node:
        raise InvalidInput("--node-name", "is required (or env NODE_NAME)")
    plugin_dir = Path(value("--plugin-dir"))
    try:
        xids = frozenset(int(x) for x in value("--ignored-xids").split(",") if x.strip())
        numbers = [float(value(f)) for f in ("--recovery-seconds", "--resync-seconds")]
        port = int(value("--metrics-port"))
    except ValueError as error:
        raise InvalidInput("flags", f"expected numbers: {error}") from None
    simulate = simulated_gpus(value("--simulate"))
    auto_reset = _truth(value("--simulate-auto-reset"))
    if auto_reset and not simulate:
        raise InvalidInput(
            "--simulate-auto-reset", "works only with --simulate (real GPUs are reset by an admin)"
        )
    return NodeSettings(
        node_name=node,
        plugin_dir=plugin_dir,
        kubelet_socket=Path(value("--kubelet-socket") or plugin_dir / "kubelet.sock"),
        pod_resources_socket=Path(value("--pod-resources-socket")),
        mps_root=Path(value("--mps-root")),
        mps_control=tuple(value("--mps-control").split()),
        simulate=simulate,
        simulate_auto_reset=auto_reset,
        ignored_xids=xids,
        recovery_s=numbers[0],
        resync_s=numbers[1],
        metrics_address=value("--metrics-address"),
        metrics_port=port,
        cdi=_truth(value("--cdi")),
        once=bool(getattr(args, "once", False)),
    )
