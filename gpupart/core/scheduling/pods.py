"""Kubernetes pods read for scheduling: a pending pod's Demand, a bound pod's Tenant, CPU requests, anti-affinity terms.

Parsing at the edge: every reader raises InvalidInput naming the field, so one bad pod affects
only itself.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from gpupart.core.api.resources import GpuRequest, parse_pod_request, parse_quantity
from gpupart.core.api.spec import LabelRequirement, NodeSelector
from gpupart.core.errors import InvalidInput
from gpupart.core.node.admission import shared_containers
from gpupart.core.scheduling.views import Tenant

_MAX_TERMS = 64
"""Terms and expressions per term a node affinity may have here (Kubernetes allows fewer in practice)."""


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


@dataclass(frozen=True, slots=True)
class NodeConstraint:
    """The nodes a pod may run on by their labels: `spec.nodeSelector` and the required node
    affinity (its terms ORed, each term's expressions ANDed); empty allows every node."""

    selector: tuple[tuple[str, str], ...] = ()
    terms: tuple[NodeSelector, ...] = ()

    def allows(self, labels: Mapping[str, str]) -> bool:
        if any(labels.get(key) != value for key, value in self.selector):
            return False
        return not self.terms or any(term.matches(labels) for term in self.terms)


_NODE_OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt")


def node_constraint(pod: Mapping[str, Any]) -> NodeConstraint:
    """The pod's NodeConstraint; InvalidInput names the field. A term that also matches fields
    (`matchFields`, e.g. a DaemonSet pod's node name) is read by its expressions only."""
    spec = pod.get("spec") or {}
    if not isinstance(spec, Mapping):
        raise InvalidInput("Pod.spec", "must be an object")
    selector = _labels(spec.get("nodeSelector"), "Pod.spec.nodeSelector")
    where = "Pod.spec.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
    affinity = spec.get("affinity") or {}
    node_affinity = affinity.get("nodeAffinity") if isinstance(affinity, Mapping) else None
    required = (
        node_affinity.get("requiredDuringSchedulingIgnoredDuringExecution")
        if isinstance(node_affinity, Mapping)
        else None
    )
    terms: list[NodeSelector] = []
    if required is not None:
        raw_terms = required.get("nodeSelectorTerms") if isinstance(required, Mapping) else None
        if not isinstance(raw_terms, list) or len(raw_terms) > _MAX_TERMS:
            raise InvalidInput(
                f"{where}.nodeSelectorTerms", f"must be a list of at most {_MAX_TERMS}"
            )
        for t, term in enumerate(raw_terms):
            place = f"{where}.nodeSelectorTerms[{t}]"
            if not isinstance(term, Mapping):
                raise InvalidInput(place, "must be an object")
            expressions = term.get("matchExpressions") or []
            if not isinstance(expressions, list) or len(expressions) > _MAX_TERMS:
                raise InvalidInput(
                    f"{place}.matchExpressions", f"must be a list of at most {_MAX_TERMS}"
                )
            requirements = []
            for e, expr in enumerate(expressions):
                at = f"{place}.matchExpressions[{e}]"
                operator = expr.get("operator") if isinstance(expr, Mapping) else None
                if operator not in _NODE_OPERATORS:
                    raise InvalidInput(f"{at}.operator", f"unknown operator {operator!r}")
                values = expr.get("values") or []
                if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
                    raise InvalidInput(f"{at}.values", "must be a list of strings")
                requirements.append(
                    LabelRequirement(str(expr.get("key", "")), operator, tuple(values))
                )
            terms.append(NodeSelector((), tuple(requirements)))
    return NodeConstraint(tuple(sorted(selector.items())), tuple(terms))


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
