"""Extender scheduling terms: which GPUs of a node can take a pod, why not, and how good a fit is (pure).

The scheduler extender calls `evaluate(node, demand, config=..., model=...)` once per candidate
node; the answer is a `Fit` (a 0-10 score and the GPU a shared pod gets) or a `NoFit` (a reason a
person can read, and whether preemption could help). Nothing here does I/O, reads the clock or
logs: node views and demands are built from API objects by the extender and passed in.

Terms, each in [0, 1] and weighted by `Weights` (formulas in docs/extender.md):
- memory headroom (`headroom_term`): capacity left after placing, per GPU, binpack or spread;
- priority (`priority_term`): high priority wants low contention, low priority packs;
- anti-affinity (`anti_affinity_term`): pods with the same group label avoid a GPU (or a node);
- fragmentation (`fragmentation_term`): the simulator's default policy (`scoring.DEFAULT_POLICY`,
  gpupart: FGD's expected fragmentation plus GPU share stranded without CPU) against the observed
  mix, scored by `gpupart.core.scheduling.scoring.score_placement` on the node's free GPU shares and CPU.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from fractions import Fraction
from itertools import chain, repeat
from typing import Any

from gpupart.core.api.resources import GpuRequest, parse_pod_request, parse_quantity
from gpupart.core.api.spec import LabelRequirement, Mode, NodeSelector
from gpupart.core.api.wire import InventoryGpu, PodAssignment
from gpupart.core.errors import InvalidInput
from gpupart.core.node.admission import shared_containers
from gpupart.core.scheduling.scoring import (
    DEFAULT_POLICY,
    MILLI,
    FragmentationModel,
    NodeState,
    Policy,
    Request,
    score_placement,
    typical_pods,
)

MAX_SCORE = 10
"""kube-scheduler's MaxExtenderPriority; scores are 0..MAX_SCORE."""
SHARED_MODES = (Mode.MPS, Mode.TIME_SLICING)
UNLIMITED = 1 << 62
"""Room used in fragmentation states for memory, and for CPU on nodes whose CPU is unknown."""
_NAMES_IN_REASON = 3
"""A reason lists at most this many pods, then "and N more"."""


class Strategy(StrEnum):
    BINPACK = "binpack"
    SPREAD = "spread"


class AffinityScope(StrEnum):
    GPU = "gpu"
    NODE = "node"


class FailureKind(StrEnum):
    """Why a node was filtered out, as a closed set (the metrics label)."""

    NO_INVENTORY = "no_inventory"
    NO_SUCH_RESOURCE = "no_such_resource"
    TOO_SMALL = "too_small"
    IN_USE = "in_use"
    ANTI_AFFINITY = "anti_affinity"
    UNKNOWN_NODE = "unknown_node"


class Conflict(StrEnum):
    """How close the nearest pod of the same group (or matching an anti-affinity term) sits."""

    NONE = "none"
    NODE = "node"
    """On the node, on another GPU."""
    MAYBE_GPU = "maybe_gpu"
    """On the node, and the device plugin (not the extender) picks the GPU: it may be the same."""
    GPU = "gpu"


@dataclass(frozen=True, slots=True)
class Weights:
    headroom: float = 1.0
    priority: float = 1.0
    anti_affinity: float = 2.0
    fragmentation: float = 2.0


@dataclass(frozen=True, slots=True)
class ScoringConfig:
    weights: Weights = Weights()
    strategy: Strategy = Strategy.BINPACK
    reserve_fraction: float = 0.15
    """Per GPU, keep this share of the pod's memory request free for peaks while another GPU fits."""
    anti_affinity_scope: AffinityScope = AffinityScope.GPU
    high_priority: int = 1000
    """`spec.priority` at and above which a pod gets the least contended GPU."""
    low_priority: int = 0
    """`spec.priority` at and below which a pod packs tightest."""
    group_label: str = "app"
    """Pods with the same value of this label avoid sharing a GPU ("" turns the term off)."""


@dataclass(frozen=True, slots=True, order=True)
class Tenant:
    """A pod that holds GPU capacity on a node (bound, or assumed by the extender)."""

    pod: str
    """namespace/name"""
    namespace: str
    labels: tuple[tuple[str, str], ...] = ()
    priority: int = 0
    count: int = 1
    """Whole GPUs or MIG slices held; shared pods: client slots."""
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
    max_clients: int = 0
    slices: tuple[str, ...] = ()
    """MIG profiles of the GPU's MIG devices."""
    tenants: tuple[Tenant, ...] = ()
    used_memory_mib: int = 0
    used_compute_percent: int = 0
    used_slots: int = 0

    @property
    def free_memory_mib(self) -> int:
        return max(0, self.memory_mib - self.used_memory_mib)

    @property
    def contention(self) -> float:
        """The busiest of memory, compute and client slots, as a share in [0, 1]."""
        parts = [self.used_compute_percent / 100.0]
        if self.memory_mib:
            parts.append(self.used_memory_mib / self.memory_mib)
        if self.max_clients:
            parts.append(self.used_slots / self.max_clients)
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
    version: int = field(default=0, compare=False)
    """Bumped by the cache on every change; memo keys use it."""


@dataclass(frozen=True, slots=True)
class AntiAffinityTerm:
    """One podAntiAffinity term of the pod, applied at GPU level."""

    selector: NodeSelector
    namespaces: tuple[str, ...]
    """Namespaces whose pods the term looks at; ("*",) for all."""
    required: bool

    def matches(self, tenant: Tenant) -> bool:
        if "*" not in self.namespaces and tenant.namespace not in self.namespaces:
            return False
        return self.selector.matches(dict(tenant.labels))


@dataclass(frozen=True, slots=True)
class Demand:
    """What one pending pod asks for, and what scoring needs to know about it (hashable)."""

    pod: str
    namespace: str
    request: GpuRequest
    priority: int = 0
    group: str = ""
    """Value of the configured anti-affinity label ("" if the pod has none)."""
    terms: tuple[AntiAffinityTerm, ...] = ()
    cpu_milli: int = 0
    """The pod's CPU request in millicores, summed as kube-scheduler does (`pod_cpu_milli`)."""


@dataclass(frozen=True, slots=True)
class Terms:
    headroom: float
    priority: float
    anti_affinity: float
    fragmentation: float
    eats_reserve: bool = False


@dataclass(frozen=True, slots=True)
class Fit:
    score: int
    gpu: int | None
    """The GPU index a shared-GPU pod gets; None for MIG and whole GPUs (the device plugin picks)."""
    terms: Terms


@dataclass(frozen=True, slots=True)
class NoFit:
    reason: str
    """In full: the node, what it has, and the pods in the way ("node-7: 2 GPUs, no free ...")."""
    summary: str
    """Without the node or pod names ("node(s) had no free 3g.40gb MIG slice"): the same text for
    every node failing the same way, so kube-scheduler's "0/N nodes are available" message counts
    them under one reason instead of growing by a line per node."""
    kind: FailureKind
    unresolvable: bool
    """True when preemption cannot help (FailedAndUnresolvableNodes)."""
    shortfall: int = 0
    """How far from fitting, in thousandths of the request (the closest GPU's missing memory,
    slots or compute; the missing slices or whole GPUs): the extender shows the nodes closest
    to fitting in full. 0 when only anti-affinity is in the way."""


Verdict = Fit | NoFit


# --- building demands and node views --------------------------------------------------------


def pod_key(pod: Mapping[str, Any]) -> str:
    meta = pod.get("metadata") or {}
    return f"{meta.get('namespace') or 'default'}/{meta.get('name') or '?'}"


def parse_demand(pod: Mapping[str, Any], *, group_label: str) -> Demand:
    """A Demand from a Pod object; InvalidInput says which field is wrong."""
    if not isinstance(pod, Mapping):
        raise InvalidInput("Pod", "must be a Pod object")
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    if not isinstance(meta, Mapping) or not isinstance(spec, Mapping):
        raise InvalidInput("Pod", "metadata and spec must be objects")
    request = parse_pod_request(pod, where="Pod")
    if request.shared:
        shared_containers(pod, where="Pod")  # each container's limits must reach its GPU
    priority = spec.get("priority") or 0
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise InvalidInput("Pod.spec.priority", f"must be an integer, got {priority!r}")
    labels = _labels(meta.get("labels"), "Pod.metadata.labels")
    namespace = str(meta.get("namespace") or "default")
    return Demand(
        pod=pod_key(pod),
        namespace=namespace,
        request=request,
        priority=priority,
        group=labels.get(group_label, "") if group_label else "",
        terms=_anti_affinity_terms(spec.get("affinity"), namespace),
        cpu_milli=pod_cpu_milli(pod, where="Pod"),
    )


def pod_cpu_milli(pod: Mapping[str, Any], *, where: str = "pod") -> int:
    """The pod's CPU request in millicores (rounded up), as kube-scheduler counts it on a node.

    Per container `requests.cpu`, else `limits.cpu` (the API server defaults the request to the
    limit); regular containers and sidecars (init containers with `restartPolicy: Always`) add
    up, an ordinary init container counts with the sidecars started before it, the larger of
    the two wins, then `spec.overhead.cpu` is added (k8s `resource.PodRequests`). A malformed
    quantity raises InvalidInput.
    """
    spec = pod.get("spec", pod)
    if not isinstance(spec, Mapping):
        raise InvalidInput(f"{where}.spec", "must be a mapping")
    total = Fraction(0)
    for n, container in enumerate(_containers(spec, "containers", where)):
        total += _container_cpu(container, f"{where}.spec.containers[{n}].resources")
    sidecars = Fraction(0)
    init = Fraction(0)
    for n, container in enumerate(_containers(spec, "initContainers", where)):
        cpu = _container_cpu(container, f"{where}.spec.initContainers[{n}].resources")
        if container.get("restartPolicy") == "Always":
            total += cpu
            sidecars += cpu
            init = max(init, sidecars)
        else:
            init = max(init, sidecars + cpu)
    total = max(total, init)
    overhead = spec.get("overhead")
    if isinstance(overhead, Mapping) and overhead.get("cpu") is not None:
        total += _cpu_quantity(overhead["cpu"], f"{where}.spec.overhead.cpu")
    return math.ceil(total * 1000)


def node_cpu_milli(node: Mapping[str, Any]) -> int | None:
    """A Node's allocatable CPU in millicores (rounded down); None when absent or unreadable."""
    status = node.get("status")
    allocatable = status.get("allocatable") if isinstance(status, Mapping) else None
    if not isinstance(allocatable, Mapping) or allocatable.get("cpu") is None:
        return None
    try:
        return math.floor(_cpu_quantity(allocatable["cpu"], "Node.status.allocatable.cpu") * 1000)
    except InvalidInput:
        return None


def _containers(spec: Mapping[str, Any], key: str, where: str) -> list[Mapping[str, Any]]:
    containers = spec.get(key) or []
    if not isinstance(containers, list) or not all(isinstance(c, Mapping) for c in containers):
        raise InvalidInput(f"{where}.spec.{key}", "must be a list of containers")
    return containers


def _container_cpu(container: Mapping[str, Any], where: str) -> Fraction:
    resources = container.get("resources") or {}
    if not isinstance(resources, Mapping):
        raise InvalidInput(where, "must be a mapping")
    for part in ("requests", "limits"):
        amounts = resources.get(part) or {}
        if not isinstance(amounts, Mapping):
            raise InvalidInput(f"{where}.{part}", "must be a mapping")
        if amounts.get("cpu") is not None:
            return _cpu_quantity(amounts["cpu"], f"{where}.{part}.cpu")
    return Fraction(0)


MAX_CPU_CORES = 1_000_000
"""More CPU than any node has: a larger figure is refused, never counted."""


def _cpu_quantity(text: object, where: str) -> Fraction:
    value = parse_quantity(text, where=where)
    if value < 0:
        raise InvalidInput(where, f"must not be negative, got {str(text)[:40]!r}")
    if value > MAX_CPU_CORES:
        raise InvalidInput(where, f"{str(text)[:40]!r} is more CPU than any node has")
    return value


def _labels(raw: object, where: str) -> dict[str, str]:
    if raw is None:
        return {}
    if not isinstance(raw, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in raw.items()
    ):
        raise InvalidInput(where, "must map strings to strings")
    return dict(raw)


def tenant_of(pod: Mapping[str, Any], request: GpuRequest) -> Tenant:
    """A Tenant from a bound Pod object (labels kept for anti-affinity)."""
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    labels = meta.get("labels") or {}
    priority = spec.get("priority") or 0
    return Tenant(
        pod=pod_key(pod),
        namespace=str(meta.get("namespace") or "default"),
        labels=tuple(sorted((str(k), str(v)) for k, v in labels.items())),
        priority=priority if isinstance(priority, int) else 0,
        count=request.whole_gpus or request.shared or 1,
        memory_mib=request.memory_mib,
        compute_percent=request.compute_percent,
    )


def _anti_affinity_terms(affinity: object, namespace: str) -> tuple[AntiAffinityTerm, ...]:
    if not isinstance(affinity, Mapping):
        return ()
    anti = affinity.get("podAntiAffinity")
    if not isinstance(anti, Mapping):
        return ()
    where = "Pod.spec.affinity.podAntiAffinity"
    terms = []
    required = anti.get("requiredDuringSchedulingIgnoredDuringExecution") or []
    preferred = anti.get("preferredDuringSchedulingIgnoredDuringExecution") or []
    if not isinstance(required, list) or not isinstance(preferred, list):
        raise InvalidInput(where, "terms must be lists")
    for n, raw in enumerate(required):
        terms.append(_term(raw, namespace, True, f"{where}.required[{n}]"))
    for n, raw in enumerate(preferred):
        inner = raw.get("podAffinityTerm") if isinstance(raw, Mapping) else None
        terms.append(_term(inner, namespace, False, f"{where}.preferred[{n}].podAffinityTerm"))
    return tuple(terms)


def _term(raw: object, namespace: str, required: bool, where: str) -> AntiAffinityTerm:
    if not isinstance(raw, Mapping):
        raise InvalidInput(where, "must be a PodAffinityTerm object")
    selector = parse_label_selector(raw.get("labelSelector") or {}, f"{where}.labelSelector")
    namespaces = raw.get("namespaces") or []
    if not isinstance(namespaces, list):
        raise InvalidInput(f"{where}.namespaces", "must be a list")
    if raw.get("namespaceSelector") == {}:
        namespaces = ["*"]  # an empty namespaceSelector selects every namespace
    return AntiAffinityTerm(selector, tuple(str(n) for n in namespaces) or (namespace,), required)


def parse_label_selector(selector: object, where: str) -> NodeSelector:
    """A metav1.LabelSelector (matchLabels, matchExpressions); InvalidInput names the field."""
    if not isinstance(selector, Mapping):
        raise InvalidInput(where, "must be an object")
    match_labels = _labels(selector.get("matchLabels"), f"{where}.matchLabels")
    raw_expressions = selector.get("matchExpressions") or []
    if not isinstance(raw_expressions, list):
        raise InvalidInput(f"{where}.matchExpressions", "must be a list")
    expressions = []
    for m, expr in enumerate(raw_expressions):
        place = f"{where}.matchExpressions[{m}]"
        if not isinstance(expr, Mapping):
            raise InvalidInput(place, "must be an object")
        operator = expr.get("operator")
        if operator not in ("In", "NotIn", "Exists", "DoesNotExist"):
            raise InvalidInput(f"{place}.operator", f"unknown operator {operator!r}")
        values = expr.get("values") or []
        if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
            raise InvalidInput(f"{place}.values", "must be a list of strings")
        expressions.append(LabelRequirement(str(expr.get("key", "")), operator, tuple(values)))
    return NodeSelector(tuple(sorted(match_labels.items())), tuple(expressions))


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
) -> NodeView:
    """A node view from the node agent's inventory, the node's allocatable CPU and its pods."""
    if inventory is None:
        return NodeView(name, problem=problem or "no GPU inventory", version=version)
    by_gpu: dict[int, list[Tenant]] = {}
    whole: list[Tenant] = []
    mig: list[Tenant] = []
    unplaced: list[Tenant] = []
    shared_indices = {g.index for g in inventory if g.mode in SHARED_MODES}
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
                max_clients=g.max_clients,
                slices=tuple(d.instance.profile for d in g.mig_devices),
                tenants=tenants,
                used_memory_mib=sum(t.memory_mib for t in tenants),
                used_compute_percent=sum(t.compute_percent for t in tenants),
                used_slots=sum(t.count for t in tenants),
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
        version=version,
    )


POD_NAMING_KINDS = frozenset({FailureKind.IN_USE, FailureKind.ANTI_AFFINITY})
"""NoFit kinds whose reasons name the pods in the way (the other reasons name only the node)."""


def anonymous(node: NodeView) -> NodeView:
    """The node without its identity: a key for verdicts shared by nodes in the same state.

    Name, version, GPU UUIDs and the tenants' pod names are blanked and tenants put in a
    canonical order; what `evaluate` decides on (inventory, usage, tenants' namespaces, labels
    and requests, allocatable and requested CPU) is kept. Two nodes with equal anonymous views
    get the same `Fit` for every demand, and the same `NoFit` up to the node name heading the
    reason, except for kinds in `POD_NAMING_KINDS`, whose reasons list pods by name.
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
                g.max_clients,
                g.slices,
                _anonymous_tenants(g.tenants),
                g.used_memory_mib,
                g.used_compute_percent,
                g.used_slots,
            )
            for g in node.gpus
        ),
        _anonymous_tenants(node.whole_tenants),
        _anonymous_tenants(node.mig_tenants),
        _anonymous_tenants(node.unplaced_tenants),
        cpu_milli=node.cpu_milli,
        cpu_used_milli=node.cpu_used_milli,
        problem=node.problem,
    )


def _anonymous_tenants(tenants: tuple[Tenant, ...]) -> tuple[Tenant, ...]:
    """The tenants without their pod names, in a canonical order (for state signatures)."""
    # The constructor, not dataclasses.replace: this runs for every tenant at every watch
    # event on its node, and replace() costs ten times as much.
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


# --- the terms ---------------------------------------------------------------------------------


def headroom_term(left_after: float, capacity: float, strategy: Strategy) -> float:
    """Share of capacity left after placing: binpack scores 1 - share, spread scores share."""
    if capacity <= 0:
        return 0.0
    share = min(1.0, max(0.0, left_after / capacity))
    return 1.0 - share if strategy is Strategy.BINPACK else share


def priority_level(priority: int, config: ScoringConfig) -> float:
    """`spec.priority` mapped linearly to [0, 1] between the low and high marks."""
    span = config.high_priority - config.low_priority
    if span <= 0:
        return 1.0 if priority >= config.high_priority else 0.0
    return min(1.0, max(0.0, (priority - config.low_priority) / span))


def priority_term(priority: int, contention: float, config: ScoringConfig) -> float:
    """h * (1 - c) + (1 - h) * c: high priority (h=1) wants low contention c, low priority packs."""
    level = priority_level(priority, config)
    c = min(1.0, max(0.0, contention))
    return level * (1.0 - c) + (1.0 - level) * c


def anti_affinity_term(conflict: Conflict, scope: AffinityScope) -> float:
    """1 with no same-group pod near; 0 when one shares the GPU (or the node, with scope node)."""
    if conflict is Conflict.GPU:
        return 0.0
    if conflict is Conflict.MAYBE_GPU:
        return 0.0 if scope is AffinityScope.NODE else 0.5
    if conflict is Conflict.NODE:
        return 0.0 if scope is AffinityScope.NODE else 1.0
    return 1.0


def fragmentation_term(
    model: FragmentationModel,
    state: NodeState,
    request: Request,
    gpus: tuple[int, ...],
    *,
    policy: Policy = DEFAULT_POLICY,
) -> float:
    """The simulator's policy score for placing `request` on `gpus`, divided by 100 (in [0, 1]).

    `scoring.score_placement`: for gpupart int(sigmoid((C_before - C_after) / 1000) * 100) with
    node cost C = F + S (FGD's expected fragmentation plus GPU share stranded without CPU), the
    number `scoring.score_node` gives the same placement. 1 = the placement lowers the cost most.
    """
    return score_placement(policy, state, request, gpus, model=model) / 100.0


def combine(terms: Terms, weights: Weights) -> int:
    """Weighted mean of the terms scaled to 0..10; a placement eating the reserve scores at most 1."""
    total = weights.headroom + weights.priority + weights.anti_affinity + weights.fragmentation
    if total <= 0:
        return 0
    mean = _weighted_sum(terms, weights) / total
    score = min(MAX_SCORE, max(0, round(mean * MAX_SCORE)))
    return min(score, 1) if terms.eats_reserve else score


def _weighted_sum(terms: Terms, weights: Weights) -> float:
    return (
        weights.headroom * terms.headroom
        + weights.priority * terms.priority
        + weights.anti_affinity * terms.anti_affinity
        + weights.fragmentation * terms.fragmentation
    )


# --- GPU shares (the simulator's unit) -----------------------------------------------------------


def share_milli(memory_mib: int, compute_percent: int, gpu: GpuView, slots: int = 1) -> int:
    """A shared pod's GPU share in thousandths: the larger of its memory and compute shares.

    A pod that asks neither memory nor compute holds one client slot: 1000 / maxClients.
    """
    milli = compute_percent * 10
    if memory_mib and gpu.memory_mib:
        milli = max(milli, math.ceil(MILLI * memory_mib / gpu.memory_mib))
    if milli == 0:
        milli = math.ceil(MILLI * slots / gpu.max_clients) if gpu.max_clients else MILLI
    return min(MILLI, milli)


def node_state(node: NodeView) -> NodeState:
    """The node as the simulator's policy sees it: free CPU and free thousandths of each non-MIG GPU.

    Free CPU is allocatable minus the pods' requests (millicores), as in the simulator; a node
    without allocatable CPU gets UNLIMITED, which turns the stranded-share term off (S = 0, FGD).
    Memory is UNLIMITED (GPU memory is in the shares). Whole GPUs in use are counted from the
    lowest index, as the simulator does (the device plugin picks which one, and fragmentation
    depends only on the multiset of free shares).
    """
    used_whole = sum(t.count for t in node.whole_tenants)
    left = []
    product = ""
    for gpu in node.gpus:
        if gpu.mode is Mode.MIG:
            continue
        product = product or gpu.product
        if gpu.mode in SHARED_MODES:
            used = sum(
                share_milli(t.memory_mib, t.compute_percent, gpu, t.count) for t in gpu.tenants
            )
            left.append(max(0, MILLI - used))
        elif used_whole > 0:
            used_whole -= 1
            left.append(0)
        else:
            left.append(MILLI)
    cpu_left = UNLIMITED if node.cpu_milli is None else max(0, node.cpu_milli - node.cpu_used_milli)
    return NodeState(cpu_left, UNLIMITED, tuple(left), product)


Shape = tuple[int, int, int]
"""A GPU pod in the observed mix: (GPU count, milli per GPU, CPU millicores)."""


def fragmentation_model(shapes: Iterable[Shape]) -> FragmentationModel:
    """The simulator's FragmentationModel over an observed mix of pod shapes.

    Shapes go through `scoring.typical_pods`, so the extender's typical pods are chosen exactly
    as the simulator chooses them (most frequent shapes covering 95 % of pods, a pod without a
    CPU request counted as 100m), and `cpu_per_gpu` is the mix's CPU per GPU share.
    """
    return fragmentation_model_of(Counter(shapes))


def fragmentation_model_of(mix: Mapping[Shape, int]) -> FragmentationModel:
    """`fragmentation_model` from shape counts (one scoring Request per shape, `count` times)."""
    pods = chain.from_iterable(
        repeat(Request(cpu, 0, num, milli), count)
        for (num, milli, cpu), count in sorted(mix.items())
        if count > 0
    )
    return FragmentationModel.of(typical_pods(pods))


def demand_shape(request: GpuRequest, gpu: GpuView | None, cpu_milli: int = 0) -> Shape | None:
    """(GPU count, milli per GPU, CPU) of a request for the fragmentation mix; None for MIG."""
    if request.whole_gpus:
        return (request.whole_gpus, MILLI, cpu_milli)
    if request.shared and gpu is not None:
        milli = share_milli(request.memory_mib, request.compute_percent, gpu, request.shared)
        return (1, milli, cpu_milli)
    return None


# --- evaluating one node for one pod -----------------------------------------------------------


def evaluate(
    node: NodeView, demand: Demand, *, config: ScoringConfig, model: FragmentationModel
) -> Verdict:
    """Whether `node` can take `demand`, and how well; reasons name the node and the blockers."""
    if node.problem:
        return NoFit(
            f"{node.name}: {node.problem}",
            "node(s) had no GPU inventory from the gpupart node agent",
            FailureKind.NO_INVENTORY,
            True,
        )
    request = demand.request
    if request.mig:
        return _evaluate_mig(node, demand, config)
    if request.whole_gpus:
        return _evaluate_whole(node, demand, config, model)
    if request.shared:
        return _evaluate_shared(node, demand, config, model)
    # Not a GPU pod: nothing to decide here (kube-scheduler only sends pods we manage).
    return Fit(MAX_SCORE // 2, None, Terms(0.5, 0.5, 1.0, 0.5))


def _gpus_text(node: NodeView) -> str:
    n = len(node.gpus)
    return f"{n} GPU" if n == 1 else f"{n} GPUs"


def _modes_text(node: NodeView) -> str:
    return ", ".join(sorted({str(g.mode) for g in node.gpus})) or "no GPUs"


def _pods_text(tenants: Iterable[Tenant]) -> str:
    names = sorted({t.pod for t in tenants})
    if not names:
        return "no pod the extender knows of"
    shown = ", ".join(names[:_NAMES_IN_REASON])
    more = len(names) - _NAMES_IN_REASON
    return f"{shown}, and {more} more" if more > 0 else shown


def _matches(tenant: Tenant, demand: Demand, group_label: str, *, required_only: bool) -> bool:
    """Whether `tenant` is one the pod should not share with (group label or its own terms)."""
    if not required_only and demand.group and tenant.label(group_label) == demand.group:
        return True
    return any(term.matches(tenant) for term in demand.terms if term.required or not required_only)


def must_avoid(tenant: Tenant, demand: Demand, group_label: str) -> bool:
    """Whether a required podAntiAffinity term of the pod matches `tenant` (no shared GPU)."""
    return _matches(tenant, demand, group_label, required_only=True)


def _node_conflict(tenants: Iterable[Tenant], demand: Demand, group_label: str) -> bool:
    return any(_matches(t, demand, group_label, required_only=False) for t in tenants)


def _evaluate_mig(node: NodeView, demand: Demand, config: ScoringConfig) -> Verdict:
    offered: Counter[str] = Counter()
    for gpu in node.gpus:
        if gpu.mode is Mode.MIG:
            offered.update(gpu.slices)
    used: Counter[str] = Counter()
    for t in node.mig_tenants:
        used[t.profile] += t.count
    left_after = 0
    capacity = 0
    for profile, count in demand.request.mig:
        total = offered[profile]
        if total == 0:
            here = ", ".join(f"{p}×{n}" for p, n in sorted(offered.items())) or "none"
            return NoFit(
                f"{node.name}: {_gpus_text(node)}, none with a {profile} slice "
                f"(MIG slices here: {here})",
                f"node(s) had no {profile} MIG slice",
                FailureKind.NO_SUCH_RESOURCE,
                True,
            )
        if total < count:
            return NoFit(
                f"{node.name}: {_gpus_text(node)}, needs {count} {profile} slices, "
                f"the node has {total}",
                f"node(s) had fewer than {count} {profile} MIG slices",
                FailureKind.TOO_SMALL,
                True,
            )
        free = total - used[profile]
        if free < count:
            holders = [t for t in node.mig_tenants if t.profile == profile]
            if free <= 0:
                what = f"no free {profile} slice (all {total} in use by {_pods_text(holders)})"
            else:
                what = (
                    f"{free} free {profile} slice{'s' if free > 1 else ''} of {total}, "
                    f"needs {count} (in use by {_pods_text(holders)})"
                )
            short = (
                f"no free {profile} MIG slice"
                if count == 1
                else (f"fewer than {count} free {profile} MIG slices")
            )
            return NoFit(
                f"{node.name}: {_gpus_text(node)}, {what}",
                f"node(s) had {short}",
                FailureKind.IN_USE,
                False,
                _thousandths(count - max(free, 0), count),
            )
        left_after += free - count
        capacity += total
    all_slices = sum(offered.values())
    contention = sum(used.values()) / all_slices if all_slices else 0.0
    mine = node.mig_tenants
    # The device plugin picks the slice, so a same-group pod on the node may share our GPU.
    conflict = (
        Conflict.MAYBE_GPU if _node_conflict(mine, demand, config.group_label) else Conflict.NONE
    )
    if conflict is Conflict.NONE and _node_conflict(
        (*node.whole_tenants, *_shared_tenants(node)), demand, config.group_label
    ):
        conflict = Conflict.NODE
    terms = Terms(
        headroom=headroom_term(left_after, capacity, config.strategy),
        priority=priority_term(demand.priority, contention, config),
        anti_affinity=anti_affinity_term(conflict, config.anti_affinity_scope),
        fragmentation=0.5,  # the policy's model is about GPU shares; MIG slices are fixed
    )
    return Fit(combine(terms, config.weights), None, terms)


def _shared_tenants(node: NodeView) -> tuple[Tenant, ...]:
    return tuple(t for gpu in node.gpus for t in gpu.tenants) + node.unplaced_tenants


def _evaluate_whole(
    node: NodeView, demand: Demand, config: ScoringConfig, model: FragmentationModel
) -> Verdict:
    count = demand.request.whole_gpus
    total = sum(1 for gpu in node.gpus if gpu.mode is Mode.NONE)
    if total == 0:
        return NoFit(
            f"{node.name}: {_gpus_text(node)}, none offered whole (modes: {_modes_text(node)})",
            "node(s) had no GPU offered whole",
            FailureKind.NO_SUCH_RESOURCE,
            True,
        )
    if total < count:
        return NoFit(
            f"{node.name}: needs {count} whole GPUs, the node offers {total}",
            f"node(s) had fewer than {count} GPUs offered whole",
            FailureKind.TOO_SMALL,
            True,
        )
    used = sum(t.count for t in node.whole_tenants)
    free = total - used
    if free < count:
        return NoFit(
            f"{node.name}: {_gpus_text(node)}, needs {count} whole GPU{'s' if count > 1 else ''}, "
            f"{max(free, 0)} free (in use by {_pods_text(node.whole_tenants)})",
            "node(s) had no free whole GPU"
            if count == 1
            else f"node(s) had fewer than {count} whole GPUs free",
            FailureKind.IN_USE,
            False,
            _thousandths(count - max(free, 0), count),
        )
    conflict = Conflict.NONE
    if _node_conflict(
        (*node.whole_tenants, *node.mig_tenants, *_shared_tenants(node)), demand, config.group_label
    ):
        conflict = Conflict.NODE
    state = node_state(node)
    gpus = tuple(i for i, share in enumerate(state.gpu_left) if share == MILLI)[:count]
    terms = Terms(
        headroom=headroom_term(free - count, total, config.strategy),
        priority=priority_term(demand.priority, used / total, config),
        anti_affinity=anti_affinity_term(conflict, config.anti_affinity_scope),
        fragmentation=fragmentation_term(
            model, state, Request(demand.cpu_milli, 0, count, MILLI), gpus
        ),
    )
    return Fit(combine(terms, config.weights), None, terms)


def _thousandths(missing: int, wanted: int) -> int:
    return min(1000, -(-1000 * max(missing, 0) // wanted)) if wanted > 0 else 0


def _gpu_shortfall(gpu: GpuView, request: GpuRequest) -> int:
    """How much of the request this shared GPU lacks, in thousandths (its scarcest dimension)."""
    lacks = [0]
    if gpu.max_clients:
        lacks.append(
            _thousandths(gpu.used_slots + request.shared - gpu.max_clients, request.shared)
        )
    if request.memory_mib:
        lacks.append(_thousandths(request.memory_mib - gpu.free_memory_mib, request.memory_mib))
    if request.compute_percent:
        free = 100 - gpu.used_compute_percent
        lacks.append(_thousandths(request.compute_percent - free, request.compute_percent))
    return max(lacks)


def _gpu_blocker(gpu: GpuView, demand: Demand, group_label: str) -> tuple[str, bool] | None:
    """Why this shared GPU cannot take the pod (text, unresolvable), or None if it can."""
    request = demand.request
    if gpu.max_clients and request.shared > gpu.max_clients:
        return f"GPU {gpu.index}: {gpu.max_clients} client slots, needs {request.shared}", True
    if request.memory_mib > gpu.memory_mib:
        return f"GPU {gpu.index}: {gpu.memory_mib} MiB in all", True
    if gpu.max_clients and gpu.used_slots + request.shared > gpu.max_clients:
        return (
            f"GPU {gpu.index}: all {gpu.max_clients} client slots taken "
            f"(by {_pods_text(gpu.tenants)})",
            False,
        )
    if request.memory_mib and gpu.free_memory_mib < request.memory_mib:
        return (
            f"GPU {gpu.index}: {gpu.free_memory_mib} of {gpu.memory_mib} MiB free "
            f"(used by {_pods_text(gpu.tenants)})",
            False,
        )
    if request.compute_percent and gpu.used_compute_percent + request.compute_percent > 100:
        return (
            f"GPU {gpu.index}: {100 - gpu.used_compute_percent}% compute free "
            f"(used by {_pods_text(gpu.tenants)})",
            False,
        )
    if not demand.terms:
        return None
    blockers = [t for t in gpu.tenants if _matches(t, demand, group_label, required_only=True)]
    if blockers:
        return (
            f"GPU {gpu.index}: required podAntiAffinity with {_pods_text(blockers)}",
            False,
        )
    return None


def _evaluate_shared(
    node: NodeView, demand: Demand, config: ScoringConfig, model: FragmentationModel
) -> Verdict:
    request = demand.request
    shared = [gpu for gpu in node.gpus if gpu.mode in SHARED_MODES]
    if not shared:
        return NoFit(
            f"{node.name}: {_gpus_text(node)}, none shared by MPS or time-slicing "
            f"(modes: {_modes_text(node)})",
            "node(s) had no GPU shared by MPS or time-slicing",
            FailureKind.NO_SUCH_RESOURCE,
            True,
        )
    fitting: list[GpuView] = []
    blocked: list[str] = []
    all_unresolvable = True
    anti_affinity_only = True
    for gpu in shared:
        blocker = _gpu_blocker(gpu, demand, config.group_label)
        if blocker is None:
            fitting.append(gpu)
        else:
            blocked.append(blocker[0])
            all_unresolvable = all_unresolvable and blocker[1]
            anti_affinity_only = anti_affinity_only and "podAntiAffinity" in blocker[0]
    unplaced_memory = sum(t.memory_mib for t in node.unplaced_tenants)
    # Pods whose GPU we cannot read still use memory somewhere on this node.
    room = sum(g.free_memory_mib for g in shared) - unplaced_memory
    if fitting and unplaced_memory and room < request.memory_mib:
        fitting = []
        blocked.append(
            f"{unplaced_memory} MiB used by pods without a GPU assignment "
            f"({_pods_text(node.unplaced_tenants)})"
        )
        all_unresolvable = anti_affinity_only = False
    if not fitting:
        need = _need_text(request)
        kind = (
            FailureKind.ANTI_AFFINITY
            if anti_affinity_only
            else (FailureKind.TOO_SMALL if all_unresolvable else FailureKind.IN_USE)
        )
        shortfall = min(_gpu_shortfall(gpu, request) for gpu in shared)
        if unplaced_memory and request.memory_mib:
            shortfall = max(shortfall, _thousandths(request.memory_mib - room, request.memory_mib))
        return NoFit(
            f"{node.name}: {_gpus_text(node)}, no shared GPU with {need} ({'; '.join(blocked)})",
            f"node(s) had no shared GPU with {need}{_WHY_SHARED[kind]}",
            kind,
            all_unresolvable,
            shortfall,
        )
    reserve = math.ceil(config.reserve_fraction * request.memory_mib)
    comfortable = [g for g in fitting if g.free_memory_mib - request.memory_mib >= reserve]
    eats_reserve = not comfortable
    state = node_state(node)
    positions = {
        gpu.index: n for n, gpu in enumerate(g for g in node.gpus if g.mode is not Mode.MIG)
    }
    # Which GPUs hold a pod the new one should avoid, computed once per GPU (not per pair).
    label = config.group_label
    aware = bool(demand.terms) or bool(demand.group and label)
    near = {g.index for g in shared if aware and _node_conflict(g.tenants, demand, label)}
    elsewhere = aware and _node_conflict(
        (*node.unplaced_tenants, *node.whole_tenants, *node.mig_tenants), demand, label
    )
    seen: set[tuple[int, int, float, Conflict, int, int]] = set()
    best: Fit | None = None
    for gpu in comfortable or fitting:
        if request.memory_mib:
            left, capacity = gpu.free_memory_mib - request.memory_mib, gpu.memory_mib
        elif request.compute_percent:
            left, capacity = 100 - gpu.used_compute_percent - request.compute_percent, 100
        else:
            cap = gpu.max_clients or 1
            left, capacity = cap - gpu.used_slots - request.shared, cap
        if gpu.index in near:
            conflict = Conflict.GPU
        elif elsewhere or len(near) > 0:
            conflict = Conflict.NODE
        else:
            conflict = Conflict.NONE
        milli = share_milli(request.memory_mib, request.compute_percent, gpu, request.shared)
        position = positions[gpu.index]
        contention = gpu.contention
        # A GPU equal to an earlier one in everything the terms look at scores the same, and
        # ties go to the lower index: skip it.
        key = (left, capacity, contention, conflict, milli, state.gpu_left[position])
        if key in seen:
            continue
        seen.add(key)
        terms = Terms(
            headroom=headroom_term(left, capacity, config.strategy),
            priority=priority_term(demand.priority, contention, config),
            anti_affinity=anti_affinity_term(conflict, config.anti_affinity_scope),
            fragmentation=fragmentation_term(
                model, state, Request(demand.cpu_milli, 0, 1, milli), (position,)
            ),
            eats_reserve=eats_reserve,
        )
        fit = Fit(combine(terms, config.weights), gpu.index, terms)
        if best is None or _rank(fit, config.weights) > _rank(best, config.weights):
            best = fit
    assert best is not None  # `fitting` is not empty
    return best


def _rank(fit: Fit, weights: Weights) -> float:
    """Ties in the 0-10 score are broken by the unrounded mean (lowest GPU index wins the rest)."""
    return fit.score + 1e-3 * _weighted_sum(fit.terms, weights)


_WHY_SHARED = {
    FailureKind.IN_USE: " (in use)",
    FailureKind.TOO_SMALL: " (too small)",
    FailureKind.ANTI_AFFINITY: " away from pods it must not share with (podAntiAffinity)",
}


def _need_text(request: GpuRequest) -> str:
    parts = []
    if request.memory_mib:
        parts.append(f"{request.memory_mib} MiB free")
    if request.compute_percent:
        parts.append(f"{request.compute_percent}% compute")
    parts.append(f"{request.shared} client slot{'s' if request.shared > 1 else ''}")
    return " and ".join(parts)
