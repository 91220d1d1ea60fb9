"""Node agent settings: read once from flags (falling back to environment variables), validated, frozen."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

from gpupart.core.devices import DEFAULT_IGNORED_XIDS
from gpupart.core.errors import InvalidInput


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
    simulate: tuple[str, ...]
    """Simulated GPU products (e.g. 8 × H200-141GB) instead of NVML; empty for real GPUs."""
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
        "simulated GPUs instead of NVML, e.g. 8xH200-141GB or A100-SXM4-80GB,A30",
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
        parser.add_argument(
            flag, default=None, help=f"{help_text} [env {env}, default {default!r}]"
        )
    parser.add_argument("--once", action="store_true", help="run one reconcile pass and exit")


def _products(text: str) -> tuple[str, ...]:
    products: list[str] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        count, sep, product = part.partition("x")
        if sep and count.isdigit():
            products += [product] * int(count)
        else:
            products.append(part)
    return tuple(products)


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
    return NodeSettings(
        node_name=node,
        plugin_dir=plugin_dir,
        kubelet_socket=Path(value("--kubelet-socket") or plugin_dir / "kubelet.sock"),
        pod_resources_socket=Path(value("--pod-resources-socket")),
        mps_root=Path(value("--mps-root")),
        mps_control=tuple(value("--mps-control").split()),
        simulate=_products(value("--simulate")),
        ignored_xids=xids,
        recovery_s=numbers[0],
        resync_s=numbers[1],
        metrics_address=value("--metrics-address"),
        metrics_port=port,
        cdi=value("--cdi").lower() in ("1", "true", "yes"),
        once=bool(getattr(args, "once", False)),
    )
