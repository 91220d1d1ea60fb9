"""Kubernetes objects the tests build: Nodes with a GPU inventory, Pods with GPU requests, the assignment key."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from gpupart.core.api.provenance import private_pem, public_pem, sign
from gpupart.core.api.spec import Mode
from gpupart.core.api.wire import (
    ASSIGNMENT_ANNOTATION,
    INVENTORY_ANNOTATION,
    MIG_PLAN_ANNOTATION,
    Inventory,
    InventoryGpu,
    MigDevice,
    MigPlan,
    MigReservation,
    PodAssignment,
    encode_assignment,
    encode_inventory,
    encode_mig_plan,
)
from gpupart.core.mig.layout import MigInstance, Placement
from gpupart.signing import PrivateKeys, PublicKeys

H100 = "NVIDIA H100 80GB HBM3"
H100_MIB = 81559
SCHEDULER = "gpupart-scheduler"
"""The scheduler name the extender binds for by default (setting scheduler_names)."""

KEY = b"gpupart-extender-tests-key-00001"
"""The raw Ed25519 private key (32 bytes) the extender signs with in these tests (conftest's
`key_file` holds it in PEM)."""
KEYS = PrivateKeys((KEY,))
"""The extender's keys of these tests: they sign, and verify with KEY's public key."""
PUBLIC = PublicKeys(KEYS.public_raw())
"""KEY's public key alone: what a node agent holds."""


def keys() -> PrivateKeys:
    """The `KeySource` of the cache and service in these tests."""
    return KEYS


def write_key_file(path: Path, *keys: bytes) -> Path:
    """The extender's key file as the chart's Secret holds it: each raw 32-byte private key
    in PEM (PKCS#8), the first signs (default: KEY)."""
    # A new file swapped in (a new inode), as the kubelet updates a Secret volume.
    fresh = path.with_name(path.name + ".new")
    fresh.write_text("".join(private_pem(k) for k in keys or (KEY,)))
    fresh.chmod(0o600)
    fresh.replace(path)
    return path


def write_public_key_file(path: Path, *keys: bytes) -> Path:
    """A node agent's key file: the PEM public keys of raw private keys (default: KEY)."""
    path.write_text("".join(public_pem(raw) for raw in PrivateKeys(keys or (KEY,)).public_raw()))
    return path


def signed(assignment: PodAssignment, pod_uid: str) -> PodAssignment:
    """`assignment` as the extender writes it for pod `pod_uid`: with the UID, signed."""
    return sign(replace(assignment, pod_uid=pod_uid), KEYS)


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
) -> MigReservation:
    """A slice reservation of a MIG plan for `pod` (namespace/name)."""
    return MigReservation(
        pod, f"uid-{pod}", gpu, MigInstance(Placement(start, size), profile), expires
    )


def node(
    name: str,
    gpus: list[InventoryGpu] | None,
    *,
    cpu: str | None = None,
    serial: bool = False,
    reservations: list[MigReservation] | None = None,
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
    scheduler: str = SCHEDULER,
) -> dict[str, Any]:
    """A Pod; `assignment` is signed for the pod's UID as the extender would (unless it
    already carries a signature: a forged one is written as given)."""
    res = {k: str(v) for k, v in resources.items()}
    spec: dict[str, Any] = {
        "schedulerName": scheduler,
        "containers": [
            {"name": "main", "image": "x", "resources": {"limits": res, "requests": res}}
        ],
    }
    if node:
        spec["nodeName"] = node
    if priority is not None:
        spec["priority"] = priority
    if affinity is not None:
        spec["affinity"] = affinity
    annotations = {}
    uid = f"uid-{namespace}-{name}"
    if assignment is not None:
        if not assignment.signature:
            assignment = signed(assignment, uid)
        annotations[ASSIGNMENT_ANNOTATION] = encode_assignment(assignment)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": uid,
            "labels": labels or {},
            "annotations": annotations,
        },
        "spec": spec,
        "status": {"phase": phase if node else "Pending"},
    }


def namespace(name: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    """A Namespace with `labels` and the name label the API server adds to every namespace."""
    return {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {
            "name": name,
            "labels": {"kubernetes.io/metadata.name": name, **(labels or {})},
            "resourceVersion": "1",
        },
    }


def shared(memory: int = 0, compute: int = 0) -> dict[str, str | int]:
    res: dict[str, str | int] = {"nvidia.com/gpu.shared": 1}
    if memory:
        res["gpupart.io/gpu-memory"] = memory
    if compute:
        res["gpupart.io/gpu-compute"] = compute
    return res
