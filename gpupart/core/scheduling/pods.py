"""Kubernetes pods read for scheduling: a pending pod's Demand, a bound pod's Tenant, CPU requests, anti-affinity terms.

Parsing at the edge: every reader raises InvalidInput naming the field, so one bad pod affects
only itself. Every match (node affinity, label selectors, namespaces) is `gpupart.core.api.selectors`'.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from gpupart.core.api.resources import GpuRequest, parse_pod_request, parse_quantity
from gpupart.core.api.selectors import (
    AffinityTerm,
    NamespaceLabels,
    NodeConstraint,
    object_list,
    optional_object,
    parse_node_constraint,
    parse_pod_affinity_term,
    string_map,
)
from gpupart.core.errors import InvalidInput
from gpupart.core.node.admission import shared_containers
from gpupart.core.scheduling.views import Tenant


@dataclass(frozen=True, slots=True)
class AntiAffinityTerm:
    """One podAntiAffinity term of the pod, its namespaces resolved, applied at GPU level."""

    term: AffinityTerm
    required: bool

    def matches(self, tenant: Tenant) -> bool:
        return self.term.matches(tenant.namespace, dict(tenant.labels))


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
    client_memory_mib: int = 0
    """Shared GPUs: the most memory one of its containers asks for. Each container is its own
    MPS client, held to the GPU's per-client ceiling (`GpuView.client_memory_mib`)."""
    client_compute_percent: int = 0
    """Shared GPUs: the most compute one of its containers asks for."""


def pod_key(pod: Mapping[str, Any]) -> str:
    meta = pod.get("metadata") or {}
    return f"{meta.get('namespace') or 'default'}/{meta.get('name') or '?'}"


def parse_demand(
    pod: Mapping[str, Any], *, group_label: str, namespace_labels: NamespaceLabels | None = None
) -> Demand:
    """A Demand from a Pod object; InvalidInput says which field is wrong.

    `namespace_labels` (name -> labels of every Namespace known) resolves the anti-affinity
    terms' namespaceSelectors as kube-scheduler does; a namespace missing from it is never
    selected by its labels (None: no namespace is known).
    """
    if not isinstance(pod, Mapping):
        raise InvalidInput("Pod", "must be a Pod object")
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    if not isinstance(meta, Mapping) or not isinstance(spec, Mapping):
        raise InvalidInput("Pod", "metadata and spec must be objects")
    request = parse_pod_request(pod, where="Pod")
    # Each container's limits must reach its GPU (shared_containers refuses them elsewhere).
    clients = shared_containers(pod, where="Pod") if request.shared else ()
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
        terms=_anti_affinity_terms(spec.get("affinity"), namespace, namespace_labels),
        cpu_milli=pod_cpu_milli(pod, where="Pod"),
        client_memory_mib=max((c.memory_mib for c in clients), default=0),
        client_compute_percent=max((c.compute_percent for c in clients), default=0),
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
    return string_map(raw, where)


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


def _anti_affinity_terms(
    affinity: object, namespace: str, namespace_labels: NamespaceLabels | None
) -> tuple[AntiAffinityTerm, ...]:
    where = "Pod.spec.affinity"
    anti = optional_object(
        optional_object(affinity, where).get("podAntiAffinity"), f"{where}.podAntiAffinity"
    )
    where = f"{where}.podAntiAffinity"
    terms = []
    required = object_list(
        anti.get("requiredDuringSchedulingIgnoredDuringExecution"),
        f"{where}.requiredDuringSchedulingIgnoredDuringExecution",
    )
    preferred = object_list(
        anti.get("preferredDuringSchedulingIgnoredDuringExecution"),
        f"{where}.preferredDuringSchedulingIgnoredDuringExecution",
    )
    for n, raw in enumerate(required):
        at = f"{where}.requiredDuringSchedulingIgnoredDuringExecution[{n}]"
        term = parse_pod_affinity_term(raw, namespace, at)
        terms.append(AntiAffinityTerm(term.resolve(namespace_labels), True))
    for n, raw in enumerate(preferred):
        at = f"{where}.preferredDuringSchedulingIgnoredDuringExecution[{n}].podAffinityTerm"
        inner = raw.get("podAffinityTerm") if isinstance(raw, Mapping) else None
        term = parse_pod_affinity_term(inner, namespace, at)
        terms.append(AntiAffinityTerm(term.resolve(namespace_labels), False))
    return tuple(terms)


def node_constraint(pod: Mapping[str, Any]) -> NodeConstraint:
    """The nodes the pod may run on by their labels (and names, for matchFields), as
    kube-scheduler's NodeAffinity filter reads `spec.nodeSelector` and the required node
    affinity; InvalidInput names a field that is not even the right shape."""
    spec = pod.get("spec") or {}
    if not isinstance(spec, Mapping):
        raise InvalidInput("Pod.spec", "must be an object")
    return parse_node_constraint(spec, "Pod.spec")


def matches(tenant: Tenant, demand: Demand, group_label: str, *, required_only: bool) -> bool:
    """Whether `tenant` is one the pod should not share with (group label or its own terms)."""
    if not required_only and demand.group and tenant.label(group_label) == demand.group:
        return True
    return any(term.matches(tenant) for term in demand.terms if term.required or not required_only)


def must_avoid(tenant: Tenant, demand: Demand, group_label: str) -> bool:
    """Whether a required podAntiAffinity term of the pod matches `tenant` (no shared GPU)."""
    return matches(tenant, demand, group_label, required_only=True)


def node_conflict(tenants: Iterable[Tenant], demand: Demand, group_label: str) -> bool:
    return any(matches(t, demand, group_label, required_only=False) for t in tenants)
