"""Kubernetes objects for the extender tests: Nodes with a GPU inventory, Pods with GPU requests."""

from __future__ import annotations

from typing import Any

from gpupart.core.api.spec import Mode
from gpupart.core.api.wire import (
    ASSIGNMENT_ANNOTATION,
    INVENTORY_ANNOTATION,
    MIG_PLAN_ANNOTATION,
    Inventory,
    InventoryGpu,
    MigDevice,
    MigPlan,
    PodAssignment,
    SliceReservation,
    encode_assignment,
    encode_inventory,
    encode_mig_plan,
)
from gpupart.core.mig.layout import MigInstance, Placement

H100 = "NVIDIA H100 80GB HBM3"
H100_MIB = 81559


def shared_gpu(
    index: int, *, mode: Mode = Mode.MPS, memory: int = H100_MIB, clients: int = 16
) -> InventoryGpu:
    return InventoryGpu(index, f"GPU-{index:04d}", H100, memory, mode, (), clients)


def whole_gpu(index: int) -> InventoryGpu:
    return InventoryGpu(index, f"GPU-{index:04d}", H100, H100_MIB, Mode.NONE)


def mig_gpu(index: int, profiles: list[tuple[str, int, int]]) -> InventoryGpu:
    """profiles: (profile, start, size) of each MIG device."""
    devices = tuple(
        MigDevice(f"MIG-{index}-{n}", MigInstance(Placement(start, size), profile))
        for n, (profile, start, size) in enumerate(profiles)
    )
    return InventoryGpu(index, f"GPU-{index:04d}", H100, H100_MIB, Mode.MIG, devices)


def reserve(
    pod: str, gpu: int, profile: str, start: int, size: int, *, expires: float = 2e9
) -> SliceReservation:
    """A slice reservation of a MIG plan for `pod` (namespace/name)."""
    return SliceReservation(
        pod, f"uid-{pod}", gpu, MigInstance(Placement(start, size), profile), expires
    )


def node(
    name: str,
    gpus: list[InventoryGpu] | None,
    *,
    cpu: str | None = None,
    serial: bool = False,
    reservations: list[SliceReservation] | None = None,
    plan: str | None = None,
) -> dict[str, Any]:
    """A Node with the node agent's inventory; `cpu`: its `status.allocatable.cpu` (absent: None);
    `serial`: its device plugin admits one shared-GPU pod at a time, as gpupart's does;
    `reservations`: the operator's MIG plan holds those slices; `plan`: the plan's text as is."""
    annotations = (
        {}
        if gpus is None
        else {INVENTORY_ANNOTATION: encode_inventory(Inventory(tuple(gpus), serial))}
    )
    if reservations is not None:
        plan = encode_mig_plan(MigPlan("plan-1", (), tuple(reservations)))
    if plan is not None:
        annotations[MIG_PLAN_ANNOTATION] = plan
    obj: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "annotations": annotations, "resourceVersion": "1"},
    }
    if cpu is not None:
        obj["status"] = {"allocatable": {"cpu": cpu, "memory": "256Gi", "pods": "110"}}
    return obj


def pod(
    name: str,
    resources: dict[str, str | int],
    *,
    namespace: str = "team-a",
    node: str | None = None,
    labels: dict[str, str] | None = None,
    priority: int | None = None,
    assignment: PodAssignment | None = None,
    phase: str = "Running",
    affinity: dict[str, Any] | None = None,
) -> dict[str, Any]:
    res = {k: str(v) for k, v in resources.items()}
    spec: dict[str, Any] = {
        "containers": [
            {"name": "main", "image": "x", "resources": {"limits": res, "requests": res}}
        ]
    }
    if node:
        spec["nodeName"] = node
    if priority is not None:
        spec["priority"] = priority
    if affinity is not None:
        spec["affinity"] = affinity
    annotations = {}
    if assignment is not None:
        annotations[ASSIGNMENT_ANNOTATION] = encode_assignment(assignment)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": f"uid-{namespace}-{name}",
            "labels": labels or {},
            "annotations": annotations,
        },
        "spec": spec,
        "status": {"phase": phase if node else "Pending"},
    }


def shared(memory: int = 0, compute: int = 0) -> dict[str, str | int]:
    res: dict[str, str | int] = {"nvidia.com/gpu.shared": 1}
    if memory:
        res["gpupart.io/gpu-memory"] = memory
    if compute:
        res["gpupart.io/gpu-compute"] = compute
    return res


class FakeBinder:
    """Records the API writes a bind would make; `fail` makes the next bind raise."""

    def __init__(self) -> None:
        self.annotations: list[tuple[str, str, str, dict[str, str]]] = []
        self.bindings: list[tuple[str, str, str, str]] = []
        self.fail: Exception | None = None

    def bind(self, namespace: str, name: str, uid: str, node: str, annotations: Any) -> None:
        if self.fail is not None:
            raise self.fail
        if annotations:
            self.annotations.append((namespace, name, uid, dict(annotations)))
        self.bindings.append((namespace, name, uid, node))


def args(p: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """ExtenderArgs as kube-scheduler sends them with nodeCacheCapable: true."""
    return {"Pod": p, "Nodes": None, "NodeNames": names}
