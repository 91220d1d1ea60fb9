"""The operator's configuration: read once from flags and environment, validated, frozen, passed down."""

from __future__ import annotations

import argparse
import os
import random
from dataclasses import dataclass

LOOPBACK = "127.0.0.1"
DEFAULT_EVENT_NAMESPACE = "default"
"""Events about cluster-scoped objects go here, as Kubernetes does for Nodes."""


@dataclass(frozen=True, slots=True)
class OperatorSettings:
    kubeconfig: str | None = None
    """Path to a kubeconfig; None: in-cluster service account, else $KUBECONFIG or ~/.kube/config."""
    peering: str | None = None
    """ClusterKopfPeering object name; None runs standalone (one replica, or tests)."""
    priority: int = 0
    """kopf peering priority: the highest live peer acts, the others pause."""
    bind_address: str = LOOPBACK
    """Address of the /healthz and /metrics listeners (a Deployment sets all interfaces)."""
    liveness_port: int | None = None
    metrics_port: int | None = None
    resync_seconds: float = 60.0
    """Drift timer: every GpuPartition re-checks all nodes this often even without events."""
    debounce_seconds: float = 0.2
    """A burst of watch events within this window becomes one reconcile pass."""
    release_retry_seconds: float = 5.0
    """How often deletion re-checks whether nodes have dropped the partition."""
    release_timeout_seconds: float = 120.0
    """How long deletion waits for nodes that still apply the partition; past it, the deletion
    completes with a Warning naming the nodes that did not confirm (an agent that is gone)."""
    event_namespace: str = DEFAULT_EVENT_NAMESPACE
    write_workers: int = 16
    """Parallel API writes within one pass (1,000 node patches must finish in seconds)."""
    instance: str = "gpupart-operator"
    """reportingInstance of the Events this replica writes (the pod name in a Deployment)."""

    def __post_init__(self) -> None:
        for name in ("resync_seconds", "release_retry_seconds", "release_timeout_seconds"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.debounce_seconds < 0:
            raise ValueError(f"debounce_seconds must be ≥ 0, got {self.debounce_seconds}")
        if self.write_workers < 1:
            raise ValueError(f"write_workers must be ≥ 1, got {self.write_workers}")
        for name in ("liveness_port", "metrics_port"):
            port = getattr(self, name)
            if port is not None and not 0 < port < 65536:
                raise ValueError(f"{name} must be a TCP port, got {port}")

    @property
    def standalone(self) -> bool:
        return self.peering is None

    @property
    def liveness_endpoint(self) -> str | None:
        if self.liveness_port is None:
            return None
        return f"http://{self.bind_address}:{self.liveness_port}/healthz"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `gpupart operator`; each falls back to a GPUPART_OPERATOR_* variable."""

    def env(name: str, default: str | None = None) -> str | None:
        return os.environ.get(f"GPUPART_OPERATOR_{name}", default)

    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--peering",
        metavar="NAME",
        default=env("PEERING"),
        help="kopf ClusterKopfPeering name: replicas elect one active peer (env GPUPART_OPERATOR_PEERING)",
    )
    mode.add_argument(
        "--standalone",
        action="store_true",
        help="run without peering (the default when --peering is not given)",
    )
    parser.add_argument(
        "--priority",
        default=env("PRIORITY", "auto"),
        help="peering priority, or 'auto' for a random one so that equal replicas never tie "
        "(env GPUPART_OPERATOR_PRIORITY; default auto)",
    )
    parser.add_argument("--kubeconfig", default=os.environ.get("KUBECONFIG"))
    parser.add_argument(
        "--bind-address",
        default=env("BIND_ADDRESS", LOOPBACK),
        help="listen address of /healthz and /metrics (default 127.0.0.1)",
    )
    parser.add_argument(
        "--liveness",
        type=int,
        metavar="PORT",
        default=_int(env("LIVENESS_PORT")),
        help="serve kopf's /healthz on this port",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        default=_int(env("METRICS_PORT")),
        help="serve Prometheus /metrics on this port",
    )
    parser.add_argument(
        "--resync-seconds",
        type=float,
        default=float(env("RESYNC_SECONDS", "60") or 60),
        help="drift timer: full re-check interval per GpuPartition (default 60)",
    )
    parser.add_argument(
        "--release-timeout-seconds",
        type=float,
        default=float(env("RELEASE_TIMEOUT_SECONDS", "120") or 120),
        help="how long a GpuPartition's deletion waits for nodes to drop it before it completes "
        "with a Warning naming them (env GPUPART_OPERATOR_RELEASE_TIMEOUT_SECONDS; default 120)",
    )
    parser.add_argument(
        "--event-namespace",
        default=env("EVENT_NAMESPACE", DEFAULT_EVENT_NAMESPACE),
        help="namespace of the Events written about GpuPartitions (default 'default')",
    )


def _int(text: str | None) -> int | None:
    return int(text) if text else None


def from_args(args: argparse.Namespace) -> OperatorSettings:
    priority_text = str(args.priority)
    if priority_text == "auto":
        # Equal-priority kopf peers all freeze; a random priority makes one replica win.
        priority = random.SystemRandom().randint(1, 1_000_000)
    else:
        try:
            priority = int(priority_text)
        except ValueError:
            raise ValueError(
                f"--priority must be an integer or 'auto', got {priority_text!r}"
            ) from None
    return OperatorSettings(
        kubeconfig=args.kubeconfig or None,
        peering=None if args.standalone else (args.peering or None),
        priority=priority,
        bind_address=args.bind_address,
        liveness_port=args.liveness,
        metrics_port=args.metrics_port,
        resync_seconds=args.resync_seconds,
        release_timeout_seconds=args.release_timeout_seconds,
        event_namespace=args.event_namespace,
        instance=os.environ.get("POD_NAME") or os.environ.get("HOSTNAME") or "gpupart-operator",
    )
