"""Pod objects read in one place: key, GPU and CPU requests, shared containers, priority, node constraint, phase.

Every component reads pods through these functions (parsing at the edge): a reader that can
refuse raises InvalidInput naming the field, so one bad pod affects only itself; the `find_`
readers answer None where a field is absent or unreadable. What a pod's request means for
scheduling, dynamic MIG or admission is decided in those rooms, from the values read here.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from gpupart.core.api.resources import (
    GPU,
    GPU_COMPUTE,
    GPU_MEMORY,
    GPU_SHARED,
    MAX_SANE_MIB,
    MIG_PREFIX,
    GpuRequest,
    check_profile_name,
    find_mig_profile,
    parse_cpu_quantity,
    parse_quantity,
    whole,
)
from gpupart.core.api.selectors import NodeConstraint, parse_node_constraint, string_map
from gpupart.core.errors import InvalidInput

TERMINAL_PHASES = frozenset({"Succeeded", "Failed"})
"""Pod phases after which the kubelet never allocates again."""


def pod_key(pod: Mapping[str, Any]) -> str:
    meta = pod.get("metadata") or {}
    return f"{meta.get('namespace') or 'default'}/{meta.get('name') or '?'}"


def pod_namespace(pod: Mapping[str, Any]) -> str:
    """`metadata.namespace`, "default" when unset (as the API server defaults it)."""
    meta = pod.get("metadata") or {}
    return str(meta.get("namespace") or "default")


def pod_uid(pod: Mapping[str, Any]) -> str:
    """`metadata.uid` ("" when unset)."""
    meta = pod.get("metadata") or {}
    return str(meta.get("uid") or "")


def pod_node_name(pod: Mapping[str, Any]) -> str:
    """`spec.nodeName`: the node the pod is bound to ("" while it is not)."""
    spec = pod.get("spec") or {}
    return str(spec.get("nodeName") or "")


def pod_scheduler_name(pod: Mapping[str, Any]) -> str:
    """`spec.schedulerName` ("" when unset; the API server defaults it to default-scheduler)."""
    spec = pod.get("spec") or {}
    return str(spec.get("schedulerName") or "")


def pod_phase(pod: Mapping[str, Any]) -> str:
    """`status.phase` ("" when unset or status is not a mapping)."""
    status = pod.get("status")
    return str(status.get("phase") or "") if isinstance(status, Mapping) else ""


def pod_deleting(pod: Mapping[str, Any]) -> bool:
    """Whether the pod has a deletion timestamp (the kubelet admits it no more)."""
    meta = pod.get("metadata") or {}
    return meta.get("deletionTimestamp") is not None


def pod_annotations(pod: Mapping[str, Any], *, where: str = "pod") -> Mapping[str, Any]:
    """`metadata.annotations` ({} when unset); InvalidInput when it is not a mapping."""
    meta = pod.get("metadata") or {}
    annotations = meta.get("annotations") or {}
    if not isinstance(annotations, Mapping):
        raise InvalidInput(f"{where}.metadata.annotations", "must be a mapping")
    return annotations


def pod_priority(pod: Mapping[str, Any], *, where: str = "Pod") -> int:
    """`spec.priority` (0 when unset); InvalidInput when it is not an integer."""
    spec = pod.get("spec") or {}
    priority = spec.get("priority") or 0
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise InvalidInput(f"{where}.spec.priority", f"must be an integer, got {priority!r}")
    return priority


def pod_labels(pod: Mapping[str, Any], *, where: str = "Pod") -> dict[str, str]:
    """`metadata.labels`; InvalidInput when it is not a map of strings."""
    meta = pod.get("metadata") or {}
    return string_map(meta.get("labels"), f"{where}.metadata.labels")


def find_condition(pod: Mapping[str, Any], kind: str) -> Mapping[str, Any] | None:
    """The pod's `status.conditions` entry of type `kind` (e.g. PodScheduled); None when absent."""
    status = pod.get("status")
    conditions = status.get("conditions") if isinstance(status, Mapping) else None
    for condition in conditions if isinstance(conditions, list) else ():
        if isinstance(condition, Mapping) and condition.get("type") == kind:
            return condition
    return None


def parse_pod_request(pod: Mapping[str, Any], *, where: str = "pod") -> GpuRequest:
    """One typed request from a pod object (or its spec); malformed quantities raise InvalidInput.

    Effective amount per resource, kube-scheduler's rule (`resource.PodRequests`): app
    containers and sidecars (init containers with `restartPolicy: Always`, which keep running
    beside the app) add up; an ordinary init container counts with the sidecars started before
    it; the larger of the two wins. Extended resources use limits, falling back to requests.
    """
    spec = pod.get("spec", pod)
    if not isinstance(spec, Mapping):
        raise InvalidInput(f"{where}.spec", "must be a mapping")
    totals = _sum_containers(spec.get("containers") or [], f"{where}.spec.containers")
    init_where = f"{where}.spec.initContainers"
    init_containers = spec.get("initContainers") or []
    sidecars: dict[str, Fraction] = {}
    init: dict[str, tuple[Fraction, str]] = {}
    for position, (name, (amount, place)) in _each_of(init_containers, init_where):
        container = init_containers[position]
        if container.get("restartPolicy") == "Always":
            sidecars[name] = sidecars.get(name, Fraction(0)) + amount
            totals[name] = totals.get(name, (Fraction(0), place))[0] + amount, place
            running = sidecars[name]
        else:
            running = sidecars.get(name, Fraction(0)) + amount
        if running > init.get(name, (Fraction(-1), ""))[0]:
            init[name] = running, place
    for name, (amount, place) in init.items():
        if amount > totals.get(name, (Fraction(0), ""))[0]:
            totals[name] = amount, place
    return _request_from_totals(totals, where)


def _sum_containers(containers: object, where: str) -> dict[str, tuple[Fraction, str]]:
    totals: dict[str, tuple[Fraction, str]] = {}
    for _, (name, (amount, place)) in _each_of(containers, where):
        before = totals.get(name, (Fraction(0), place))[0]
        totals[name] = before + amount, place
    return totals


def _each_of(
    containers: object, where: str
) -> Iterable[tuple[int, tuple[str, tuple[Fraction, str]]]]:
    """(container position, (resource, (amount, field path))) for each GPU resource asked."""
    if not isinstance(containers, list):
        raise InvalidInput(where, "must be a list")
    for position, container in enumerate(containers):
        for item in container_amounts(container, f"{where}[{position}].resources"):
            yield position, item


def container_amounts(container: object, place: str) -> Iterable[tuple[str, tuple[Fraction, str]]]:
    """(resource, (amount, field path)) for each GPU resource one container asks for.

    Limits, falling back to requests; the two must agree where both are given.
    """
    resources = (container.get("resources") or {}) if isinstance(container, Mapping) else None
    if not isinstance(resources, Mapping):
        raise InvalidInput(place, "must be a mapping")
    limits = resources.get("limits") or {}
    requests = resources.get("requests") or {}
    for part, amounts in (("limits", limits), ("requests", requests)):
        if not isinstance(amounts, Mapping) or not all(isinstance(k, str) for k in amounts):
            raise InvalidInput(f"{place}.{part}", "must map resource names to quantities")
    for name in sorted({*limits, *requests}):
        if not _is_gpu_resource(name):
            continue
        limit, request = limits.get(name), requests.get(name)
        field = name if len(name) <= 80 else f"{name[:80]}…"  # a path, never 100 KB
        if (
            limit is not None
            and request is not None
            and parse_quantity(limit, where=f"{place}.limits.{field}")
            != parse_quantity(request, where=f"{place}.requests.{field}")
        ):
            raise InvalidInput(
                place,
                f"{field}: requests ({str(request):.40}) and limits ({str(limit):.40}) differ",
            )
        text = limit if limit is not None else request
        part = "limits" if limit is not None else "requests"
        yield (
            name,
            (parse_quantity(text, where=f"{place}.{part}.{field}"), f"{place}.{part}.{field}"),
        )


def _is_gpu_resource(name: str) -> bool:
    return name in (GPU, GPU_SHARED, GPU_MEMORY, GPU_COMPUTE) or name.startswith(MIG_PREFIX)


def _request_from_totals(totals: Mapping[str, tuple[Fraction, str]], where: str) -> GpuRequest:
    counts = {name: whole(amount, place, amount) for name, (amount, place) in totals.items()}
    mig = []
    for name, count in sorted(counts.items()):
        profile = find_mig_profile(name)
        if profile is not None and count:
            check_profile_name(profile, where=totals[name][1])
            mig.append((profile, count))
    request = GpuRequest(
        whole_gpus=counts.get(GPU, 0),
        mig=tuple(mig),
        shared=counts.get(GPU_SHARED, 0),
        memory_mib=counts.get(GPU_MEMORY, 0),
        compute_percent=counts.get(GPU_COMPUTE, 0),
    )
    kinds = [
        k
        for k, n in (
            ("nvidia.com/gpu", request.whole_gpus),
            ("MIG", len(mig)),
            (GPU_SHARED, request.shared),
        )
        if n
    ]
    if len(kinds) > 1:
        raise InvalidInput(
            where, f"asks for {' and '.join(kinds)} at once; a pod takes one kind of GPU"
        )
    if (request.memory_mib or request.compute_percent) and not request.shared:
        raise InvalidInput(where, f"{GPU_MEMORY} and {GPU_COMPUTE} need {GPU_SHARED}")
    if request.memory_mib > MAX_SANE_MIB:
        raise InvalidInput(
            totals[GPU_MEMORY][1],
            f"{GPU_MEMORY} is in MiB; {request.memory_mib} MiB is more than any GPU has "
            "(write 10240 for 10 GiB, not 10Gi)",
        )
    if request.compute_percent > 100:
        raise InvalidInput(totals[GPU_COMPUTE][1], f"{GPU_COMPUTE} is a percentage, at most 100")
    return request


@dataclass(frozen=True, slots=True)
class SharedContainer:
    """One container that asks for shared-GPU replicas (client slots), with its own limits (0 = the GPU's default)."""

    name: str
    replicas: int
    memory_mib: int = 0
    compute_percent: int = 0
    init: bool = False


def shared_containers(pod: Mapping[str, Any], *, where: str = "pod") -> tuple[SharedContainer, ...]:
    """The containers of a pod that ask for `nvidia.com/gpu.shared`, init containers first.

    That is the kubelet's Allocate order. A container's `gpupart.io/gpu-memory` and
    `gpupart.io/gpu-compute` are its own limits; on a container that asks for no slot they
    would reach no GPU, so they are refused.
    """
    spec = pod.get("spec", pod)
    if not isinstance(spec, Mapping):
        raise InvalidInput(f"{where}.spec", "must be a mapping")
    found = []
    for key, init in (("initContainers", True), ("containers", False)):
        containers = spec.get(key) or []
        if not isinstance(containers, list):
            raise InvalidInput(f"{where}.spec.{key}", "must be a list")
        for position, container in enumerate(containers):
            place = f"{where}.spec.{key}[{position}].resources"
            amounts = {
                name: whole(amount, path, amount)
                for name, (amount, path) in container_amounts(container, place)
            }
            slots, memory, compute = (
                amounts.get(n, 0) for n in (GPU_SHARED, GPU_MEMORY, GPU_COMPUTE)
            )
            if not slots:
                if memory or compute:
                    raise InvalidInput(
                        f"{place}.limits",
                        f"{GPU_MEMORY} and {GPU_COMPUTE} need {GPU_SHARED} in the same container",
                    )
                continue
            found.append(
                SharedContainer(str(container.get("name") or ""), slots, memory, compute, init)
            )
    return tuple(found)


def mentions_shared(spec: Mapping[str, Any]) -> bool:
    """Whether any container's resources name `nvidia.com/gpu.shared`, however malformed the rest."""
    for key in ("initContainers", "containers"):
        containers = spec.get(key)
        for container in containers if isinstance(containers, list) else ():
            resources = container.get("resources") if isinstance(container, Mapping) else None
            for part in ("limits", "requests"):
                amounts = resources.get(part) if isinstance(resources, Mapping) else None
                if isinstance(amounts, Mapping) and GPU_SHARED in amounts:
                    return True
    return False


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
        total += parse_cpu_quantity(overhead["cpu"], f"{where}.spec.overhead.cpu")
    return math.ceil(total * 1000)


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
            return parse_cpu_quantity(amounts["cpu"], f"{where}.{part}.cpu")
    return Fraction(0)


def node_constraint(pod: Mapping[str, Any]) -> NodeConstraint:
    """The nodes the pod may run on by their labels (and names, for matchFields), as
    kube-scheduler's NodeAffinity filter reads `spec.nodeSelector` and the required node
    affinity; InvalidInput names a field that is not even the right shape."""
    spec = pod.get("spec") or {}
    if not isinstance(spec, Mapping):
        raise InvalidInput("Pod.spec", "must be an object")
    return parse_node_constraint(spec, "Pod.spec")
