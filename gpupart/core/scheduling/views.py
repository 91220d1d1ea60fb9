"""Node views for scheduling: one node's GPUs and the pods holding them, built from the inventory, and anonymised.

`assemble_node` builds a `NodeView` from the node agent's inventory and the node's pods;
`anonymous` blanks its identity so nodes in the same state share verdicts (memo keys).
A view also carries the operator's live MIG reservations (docs/adr-013-dynamic-mig-plans.md)
that name a MIG device of its inventory: `evaluate` counts them as taken for every other pod.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from gpupart.core.api.resources import GpuRequest
from gpupart.core.api.spec import Mode
from gpupart.core.api.wire import (
    InventoryGpu,
    MigReservation,
    PodAssignment,
)
from gpupart.core.mig.layout import MigInstance


@dataclass(frozen=True, slots=True, order=True)
class Tenant:
    """A pod that holds GPU capacity on a node (bound, or assumed by the extender)."""

    pod: str
    """namespace/name"""
    namespace: str
    labels: tuple[tuple[str, str], ...] = ()
    priority: int = 0
    count: int = 1
    """Whole GPUs or MIG devices held; shared pods: client slots."""
    profile: str = ""
    """MIG profile, for MIG tenants."""
    memory_mib: int = 0
    compute_percent: int = 0

    def label(self, key: str) -> str:
        for k, v in self.labels:
            if k == key:
                return v
        return ""


@dataclass(frozen=True, slots=True)
class GpuView:
    """One GPU of a node as the node agent reported it, with the shared pods assigned to it."""

    index: int
    uuid: str
    product: str
    memory_mib: int
    mode: Mode
    replicas: int = 0
    mig_profiles: tuple[str, ...] = ()
    """MIG profiles of the GPU's MIG devices."""
    tenants: tuple[Tenant, ...] = ()
    used_memory_mib: int = 0
    used_compute_percent: int = 0
    used_replicas: int = 0
    client_memory_mib: int = 0
    """MPS: the most memory one client may hold (`InventoryGpu.client_memory_mib`); 0: no limit."""
    client_compute_percent: int = 0
    """MPS: the most compute one client may use (`InventoryGpu.client_compute_percent`)."""

    def holds_client(self, memory_mib: int, compute_percent: int) -> bool:
        """Whether one client (container) of this size is within the GPU's MPS ceilings."""
        return not (
            (self.client_memory_mib and memory_mib > self.client_memory_mib)
            or (self.client_compute_percent and compute_percent > self.client_compute_percent)
        )

    @property
    def free_memory_mib(self) -> int:
        return max(0, self.memory_mib - self.used_memory_mib)

    @property
    def contention(self) -> float:
        """The busiest of memory, compute and client slots, as a share in [0, 1]."""
        parts = [self.used_compute_percent / 100.0]
        if self.memory_mib:
            parts.append(self.used_memory_mib / self.memory_mib)
        if self.replicas:
            parts.append(self.used_replicas / self.replicas)
        return min(1.0, max(parts))


@dataclass(frozen=True, slots=True)
class NodeView:
    """Everything the extender knows about one node's GPUs: inventory plus the pods using them."""

    name: str
    gpus: tuple[GpuView, ...] = ()
    whole_tenants: tuple[Tenant, ...] = ()
    mig_tenants: tuple[Tenant, ...] = ()
    unplaced_tenants: tuple[Tenant, ...] = ()
    """Shared-GPU pods on the node without an assignment the extender can read (GPU unknown)."""
    cpu_milli: int | None = None
    """Allocatable CPU in millicores (`Node.status.allocatable.cpu`); None: unknown."""
    cpu_used_milli: int = 0
    """CPU requests of the pods on the node (bound or assumed), GPU pods or not."""
    problem: str = ""
    """Set when the inventory is missing or unreadable: the node can take no GPU pod."""
    reserved: tuple[MigReservation, ...] = ()
    """Live MIG reservations, each naming a distinct MIG device of the inventory (one whose
    instance does not exist yet is not here: it takes nothing), by GPU and instance."""
    plan_problem: str = ""
    """Set when the node's MIG plan is unreadable: the node takes no MIG pod (others it may)."""
    version: int = field(default=0, compare=False)
    """Bumped by the cache on every change; memo keys use it."""


@dataclass(frozen=True, slots=True)
class PlacedPod:
    """A pod bound (or assumed) on a node, as the node view needs it."""

    tenant: Tenant
    request: GpuRequest
    """Empty for a pod that holds only CPU."""
    assignment: PodAssignment | None = None
    cpu_milli: int = 0
    """The pod's CPU request (`pod_cpu_milli`); counted against the node's allocatable CPU."""


def assemble_node(
    name: str,
    inventory: tuple[InventoryGpu, ...] | None,
    pods: Iterable[PlacedPod],
    *,
    cpu_milli: int | None = None,
    problem: str = "",
    version: int = 0,
    reservations: Iterable[MigReservation] = (),
    plan_problem: str = "",
) -> NodeView:
    """A node view from the node agent's inventory, the node's allocatable CPU and its pods.

    `reservations`: the live ones (not expired, their pod not bound anywhere; the caller knows
    the clock and the cluster); each is kept when it names a MIG device of the inventory by GPU
    index, placement and profile, the first one only where two name the same device.
    """
    if inventory is None:
        return NodeView(name, problem=problem or "no GPU inventory", version=version)
    by_gpu: dict[int, list[Tenant]] = {}
    whole: list[Tenant] = []
    mig: list[Tenant] = []
    unplaced: list[Tenant] = []
    shared_indices = {g.index for g in inventory if g.mode.is_shared}
    cpu_used = 0
    for placed in pods:
        request, tenant = placed.request, placed.tenant
        cpu_used += placed.cpu_milli
        if request.whole_gpus:
            whole.append(tenant)
        elif request.mig:
            for profile, count in request.mig:
                mig.append(_replace_mig(tenant, profile, count))
        elif request.shared:
            gpu = placed.assignment.gpu if placed.assignment is not None else -1
            if gpu in shared_indices:
                by_gpu.setdefault(gpu, []).append(tenant)
            else:
                unplaced.append(tenant)
    gpus = []
    for g in sorted(inventory, key=lambda g: g.index):
        tenants = tuple(by_gpu.get(g.index, ()))
        gpus.append(
            GpuView(
                index=g.index,
                uuid=g.uuid,
                product=g.product,
                memory_mib=g.memory_mib,
                mode=g.mode,
                replicas=g.replicas,
                mig_profiles=tuple(d.instance.profile for d in g.mig_devices),
                tenants=tenants,
                used_memory_mib=sum(t.memory_mib for t in tenants),
                used_compute_percent=sum(t.compute_percent for t in tenants),
                used_replicas=sum(t.count for t in tenants),
                client_memory_mib=g.client_memory_mib,
                client_compute_percent=g.client_compute_percent,
            )
        )
    return NodeView(
        name,
        tuple(gpus),
        tuple(whole),
        tuple(mig),
        tuple(unplaced),
        cpu_milli=cpu_milli,
        cpu_used_milli=cpu_used,
        problem=problem,
        reserved=_matching(inventory, reservations),
        plan_problem=plan_problem,
        version=version,
    )


def _matching(
    inventory: tuple[InventoryGpu, ...], reservations: Iterable[MigReservation]
) -> tuple[MigReservation, ...]:
    """The reservations that name a MIG device of the inventory, one per device, in order."""
    devices = {
        (g.index, d.instance) for g in inventory if g.mode is Mode.MIG for d in g.mig_devices
    }
    kept: dict[tuple[int, MigInstance], MigReservation] = {}
    for r in reservations:
        where = (r.gpu, r.instance)
        if where in devices and where not in kept:
            kept[where] = r
    return tuple(kept[k] for k in sorted(kept))


def anonymous(node: NodeView) -> NodeView:
    """The node without its identity: a key for verdicts shared by nodes in the same state.

    Name, version, GPU UUIDs and the tenants' pod names are blanked and tenants put in a
    canonical order; what `evaluate` decides on (inventory, usage, tenants' namespaces, labels
    and requests, allocatable and requested CPU, which devices are reserved) is kept. The
    reservations' pods are blanked too: the verdict is shared only by pods that hold no
    reservation on the node (for them every reservation is another pod's); the extender
    evaluates a pod on the nodes where it holds one afresh (`memo`, own views). Two nodes with equal anonymous views
    get the same `Fit` for every demand, and the same `NoFit` up to the node name heading the
    reason, except where a reason lists the pods in the way (in use, anti-affinity) by name.
    """
    return NodeView(
        "",
        tuple(
            GpuView(
                g.index,
                "",
                g.product,
                g.memory_mib,
                g.mode,
                g.replicas,
                g.mig_profiles,
                _anonymous_tenants(g.tenants),
                g.used_memory_mib,
                g.used_compute_percent,
                g.used_replicas,
                g.client_memory_mib,
                g.client_compute_percent,
            )
            for g in node.gpus
        ),
        _anonymous_tenants(node.whole_tenants),
        _anonymous_tenants(node.mig_tenants),
        _anonymous_tenants(node.unplaced_tenants),
        cpu_milli=node.cpu_milli,
        cpu_used_milli=node.cpu_used_milli,
        problem=node.problem,
        reserved=tuple(MigReservation("", "", r.gpu, r.instance, 0.0) for r in node.reserved),
        plan_problem=node.plan_problem,
    )


def _anonymous_tenants(tenants: tuple[Tenant, ...]) -> tuple[Tenant, ...]:
    """The tenants without their pod names, in a canonical order (for state signatures)."""
    # The constructor, not dataclasses.replace: this runs for every tenant at every watch
    # event on its node (docs/extender.md, State ids).
    return tuple(
        sorted(
            Tenant(
                "",
                t.namespace,
                t.labels,
                t.priority,
                t.count,
                t.profile,
                t.memory_mib,
                t.compute_percent,
            )
            for t in tenants
        )
    )


def _replace_mig(tenant: Tenant, profile: str, count: int) -> Tenant:
    return replace(tenant, count=count, profile=profile, memory_mib=0, compute_percent=0)
