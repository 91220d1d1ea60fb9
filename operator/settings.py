"""The operator's configuration: read once from flags and GPUPART_OPERATOR_* variables, validated, frozen."""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass

from gpupart.core.errors import InvalidInput
from gpupart.settings import (
    KUBECONFIG,
    Setting,
    SettingsTable,
    boolean,
    integer,
    number,
    optional_integer,
    optional_text,
    text,
)

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
    drift_timer_seconds: float = 60.0
    """Every GpuPartition re-checks all nodes this often even without events (`--resync-seconds`)."""
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
    verbose: bool = False
    """Log every pass and kopf's debug chatter."""
    demand_idle_seconds: float = 0.5
    """Dynamic MIG: plan once pending pods have been quiet this long ..."""
    demand_max_seconds: float = 5.0
    """... or once the first of a burst has waited this long."""
    reservation_ttl_seconds: float = 120.0
    """A slice reserved for a pod is free again if the pod is not bound within this time."""
    plan_retry_seconds: float = 5.0
    """A node whose agent could not apply a plan is planned again after this long."""

    def __post_init__(self) -> None:
        for name, flag in (
            ("drift_timer_seconds", "--resync-seconds"),
            ("release_retry_seconds", "--release-retry-seconds"),
            ("release_timeout_seconds", "--release-timeout-seconds"),
            ("demand_max_seconds", "--demand-max-seconds"),
            ("reservation_ttl_seconds", "--reservation-ttl-seconds"),
            ("plan_retry_seconds", "--plan-retry-seconds"),
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{flag} must be > 0, got {getattr(self, name)}")
        if not 0 <= self.demand_idle_seconds <= self.demand_max_seconds:
            raise ValueError(
                f"demand_idle_seconds must be between 0 and demand_max_seconds "
                f"({self.demand_max_seconds}), got {self.demand_idle_seconds}"
            )
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


def priority(value: str) -> int:
    """An integer, or `auto`: a random one, because equal-priority kopf peers all freeze."""
    if value == "auto":
        return random.SystemRandom().randint(1, 1_000_000)
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"expected an integer or 'auto', got {value!r}") from None


PEERING = Setting(
    "--peering",
    optional_text,
    "",
    "kopf ClusterKopfPeering name: replicas elect one active peer",
    metavar="NAME",
)
STANDALONE = Setting(
    "--standalone",
    boolean,
    "false",
    "run without peering (the default when --peering is not given; wins over --peering)",
    boolean=True,
)
PRIORITY = Setting(
    "--priority",
    priority,
    "auto",
    "peering priority, or 'auto' for a random one so that equal replicas never tie",
)
BIND_ADDRESS = Setting(
    "--bind-address",
    text,
    LOOPBACK,
    "listen address of /healthz and /metrics (a Deployment sets all interfaces)",
)
LIVENESS = Setting(
    "--liveness",
    optional_integer,
    "",
    "serve kopf's /healthz on this port",
    env=("GPUPART_OPERATOR_LIVENESS_PORT",),
    metavar="PORT",
)
METRICS_PORT = Setting(
    "--metrics-port",
    optional_integer,
    "",
    "serve Prometheus /metrics on this port",
    metavar="PORT",
)
DRIFT_TIMER = Setting(
    "--resync-seconds", number, "60", "drift timer: full re-check interval per GpuPartition"
)
DEBOUNCE = Setting(
    "--debounce-seconds",
    number,
    "0.2",
    "a burst of watch events within this window becomes one reconcile pass",
)
RELEASE_RETRY = Setting(
    "--release-retry-seconds",
    number,
    "5",
    "how often a deletion re-checks whether nodes have dropped the partition",
)
RELEASE_TIMEOUT = Setting(
    "--release-timeout-seconds",
    number,
    "120",
    "how long a GpuPartition's deletion waits for nodes to drop it before it completes "
    "with a Warning naming them",
)
EVENT_NAMESPACE = Setting(
    "--event-namespace",
    text,
    DEFAULT_EVENT_NAMESPACE,
    "namespace of the Events written about GpuPartitions",
)
WRITE_WORKERS = Setting("--write-workers", integer, "16", "parallel API writes within one pass")
INSTANCE = Setting(
    "--instance",
    text,
    "gpupart-operator",
    "reportingInstance of the Events this replica writes (the pod name in a Deployment)",
    env=("POD_NAME", "HOSTNAME"),
)
VERBOSE = Setting("--verbose", boolean, "false", "log every pass and kopf's chatter", boolean=True)
DEMAND_IDLE = Setting(
    "--demand-idle-seconds",
    number,
    "0.5",
    "dynamic MIG: plan once pods waiting for a MIG slice have been quiet this long",
)
DEMAND_MAX = Setting(
    "--demand-max-seconds",
    number,
    "5",
    "dynamic MIG: plan at the latest this long after the first pod of a burst",
)
RESERVATION_TTL = Setting(
    "--reservation-ttl-seconds",
    number,
    "120",
    "dynamic MIG: a slice reserved for a pod is free again if the pod is not bound by then",
)
PLAN_RETRY = Setting(
    "--plan-retry-seconds",
    number,
    "5",
    "dynamic MIG: a node whose agent could not apply a plan is planned again after this",
)

SETTINGS = SettingsTable(
    "GPUPART_OPERATOR_",
    (
        PEERING, STANDALONE, PRIORITY, KUBECONFIG, BIND_ADDRESS, LIVENESS, METRICS_PORT, DRIFT_TIMER,
        DEBOUNCE, RELEASE_RETRY, RELEASE_TIMEOUT, EVENT_NAMESPACE, WRITE_WORKERS, INSTANCE,
        VERBOSE, DEMAND_IDLE, DEMAND_MAX, RESERVATION_TTL, PLAN_RETRY,
    ),
)  # fmt: skip
"""Every flag of `gpupart operator`; each falls back to a GPUPART_OPERATOR_* variable."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    SETTINGS.add_arguments(parser)


def from_args(args: argparse.Namespace) -> OperatorSettings:
    """The frozen settings; InvalidInput names the flag or variable of a bad value."""
    read = SETTINGS.reader(args)
    try:
        return OperatorSettings(
            kubeconfig=read(KUBECONFIG),
            peering=None if read(STANDALONE) else read(PEERING),
            priority=read(PRIORITY),
            bind_address=read(BIND_ADDRESS),
            liveness_port=read(LIVENESS),
            metrics_port=read(METRICS_PORT),
            drift_timer_seconds=read(DRIFT_TIMER),
            debounce_seconds=read(DEBOUNCE),
            release_retry_seconds=read(RELEASE_RETRY),
            release_timeout_seconds=read(RELEASE_TIMEOUT),
            event_namespace=read(EVENT_NAMESPACE),
            write_workers=read(WRITE_WORKERS),
            instance=read(INSTANCE),
            verbose=read(VERBOSE),
            demand_idle_seconds=read(DEMAND_IDLE),
            demand_max_seconds=read(DEMAND_MAX),
            reservation_ttl_seconds=read(RESERVATION_TTL),
            plan_retry_seconds=read(PLAN_RETRY),
        )
    except ValueError as error:  # a range the settings refuse; the message names the setting
        raise InvalidInput("", str(error)) from None
