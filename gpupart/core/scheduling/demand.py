"""What a pod means for scheduling: a pending pod's PodDemand, a bound pod's Tenant, anti-affinity terms.

The pod's fields are read in `gpupart.core.api.pods` (InvalidInput names the field, so one bad
pod affects only itself). Every match (node affinity, label selectors, namespaces) is
`gpupart.core.api.selectors`'.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gpupart.core.api.pods import (
    parse_pod_request,
    pod_cpu_milli,
    pod_key,
    pod_labels,
    pod_namespace,
    pod_priority,
    shared_containers,
)
from gpupart.core.api.resources import GpuRequest
from gpupart.core.api.selectors import (
    AffinityTerm,
    NamespaceLabels,
    object_list,
    optional_object,
    parse_pod_affinity_term,
)
from gpupart.core.errors import InvalidInput
from gpupart.core.scheduling.views import Tenant


@dataclass(frozen=True, slots=True)
class AntiAffinityTerm:
    """One podAntiAffinity term of the pod, its namespaces resolved, applied at GPU level."""

    term: AffinityTerm
    required: bool

    def matches(self, tenant: Tenant) -> bool:
        return self.term.matches(tenant.namespace, dict(tenant.labels))


@dataclass(frozen=True, slots=True)
class PodDemand:
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


def parse_demand(
    pod: Mapping[str, Any],
    *,
    anti_affinity_label: str,
    namespace_labels: NamespaceLabels | None = None,
) -> PodDemand:
    """A PodDemand from a Pod object; InvalidInput says which field is wrong.

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
    priority = pod_priority(pod, where="Pod")
    labels = pod_labels(pod, where="Pod")
    namespace = pod_namespace(pod)
    return PodDemand(
        pod=pod_key(pod),
        namespace=namespace,
        request=request,
        priority=priority,
        group=labels.get(anti_affinity_label, "") if anti_affinity_label else "",
        terms=_anti_affinity_terms(spec.get("affinity"), namespace, namespace_labels),
        cpu_milli=pod_cpu_milli(pod, where="Pod"),
        client_memory_mib=max((c.memory_mib for c in clients), default=0),
        client_compute_percent=max((c.compute_percent for c in clients), default=0),
    )


def tenant_of(pod: Mapping[str, Any], request: GpuRequest) -> Tenant:
    """A Tenant from a bound Pod object (labels kept for anti-affinity)."""
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    labels = meta.get("labels") or {}
    priority = spec.get("priority") or 0
    return Tenant(
        pod=pod_key(pod),
        namespace=pod_namespace(pod),
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


def matches(
    tenant: Tenant, demand: PodDemand, anti_affinity_label: str, *, required_only: bool
) -> bool:
    """Whether `tenant` is one the pod should not share with (group label or its own terms)."""
    if not required_only and demand.group and tenant.label(anti_affinity_label) == demand.group:
        return True
    return any(term.matches(tenant) for term in demand.terms if term.required or not required_only)


def must_avoid(tenant: Tenant, demand: PodDemand, anti_affinity_label: str) -> bool:
    """Whether a required podAntiAffinity term of the pod matches `tenant` (no shared GPU)."""
    return matches(tenant, demand, anti_affinity_label, required_only=True)


def node_conflict(tenants: Iterable[Tenant], demand: PodDemand, anti_affinity_label: str) -> bool:
    return any(matches(t, demand, anti_affinity_label, required_only=False) for t in tenants)
