"""Tenants' forgeries against the node agent on a real kubelet, with no admission policy installed.

The chart's admission policies refuse these pods at the API server (tests/e2e/test_admission_policies.py);
here none is installed, so the node agent's own checks are all that stands in the way
(docs/adr-015-tenant-proof-admission.md). The tenant is impersonated with a namespaced Role
only: pods create, get, list, patch, delete in its namespace. Real etcd, kube-apiserver with
RBAC, gpupart-scheduler with the extender, a real kubelet v1.36 with simulated MPS GPUs; what a
container got is read from the runtime's record of its CreateContainer.

We test these aspects:
- a pod through the scheduler with a pre-set `gpupart.io/allocation` annotation (where the
  record was before ADR 034) claiming the whole GPU gets exactly its own small limits, and the
  tenant cannot write the record where it is now (the pod's `gpupart.io/SharedGpuAllocated`
  status condition, the extender's gate): pods/status is not its to write;
- a CPU-only pod with spec.nodeName preset and a forged record naming every slot answers
  nobody's Allocate: the next tenant's pod gets its own GPU and limits;
- pods with spec.nodeName preset asking for slots, with no assignment, an unsigned one claiming
  the whole GPU, or a genuine one copied from another pod, are refused at Allocate with the
  reason as an Event, are never given a device, and leave the running pods' limits as they
  were; the node keeps admitting shared pods afterwards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator
from typing import Any

import pytest
from kubernetes import client

from gpupart.core.api.wire import (
    ASSIGNMENT_ANNOTATION,
    GivenContainer,
    PodAssignment,
    allocation_condition,
    decode_assignment,
    encode_allocation,
    encode_assignment,
)
from gpupart_plugin.kube import ALLOCATE_REFUSED
from gpupart_testsupport.cluster import ControlPlane
from gpupart_testsupport.stack import Stack

from .test_kubelet import MEMORY, SHARED, Node

pytestmark = pytest.mark.e2e

COMPUTE = "gpupart.io/gpu-compute"
GPU_MIB = 81920
OLD_RECORD = "gpupart.io/allocation"
"""Where the allocation record was before ADR 034 (an annotation, which tenants write)."""


@pytest.fixture
def tenant(
    k8s_control_plane: ControlPlane, namespace: str
) -> Generator[client.CoreV1Api, None, None]:
    """A client that acts as user `tenant-<ns>`, allowed pods in `namespace` only."""
    admin = client.RbacAuthorizationV1Api(k8s_control_plane.api_client())
    user = f"tenant-{namespace}"
    admin.create_namespaced_role(
        namespace,
        {
            "metadata": {"name": "tenant"},
            "rules": [
                {
                    "apiGroups": [""],
                    "resources": ["pods"],
                    "verbs": ["create", "get", "list", "watch", "patch", "update", "delete"],
                }
            ],
        },
    )
    admin.create_namespaced_role_binding(
        namespace,
        {
            "metadata": {"name": "tenant"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "tenant"},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}],
        },
    )
    api = k8s_control_plane.api_client()
    api.set_default_header("Impersonate-User", user)
    try:
        yield client.CoreV1Api(api)
    finally:
        api.close()


def _pod(
    name: str,
    limits: dict[str, str],
    *,
    node: str = "",
    notes: dict[str, str] | None = None,
    scenario: str = "tenant",
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "terminationGracePeriodSeconds": 0,
        "containers": [
            {"name": "app-0", "image": "gpupart/cuda:0", "resources": {"limits": limits}}
        ],
    }
    if node:
        spec["nodeName"] = node  # preset: no scheduler, no extender
    else:
        spec["schedulerName"] = "gpupart-scheduler"
        spec["nodeSelector"] = {"gpupart.io/e2e-kubelet": scenario}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "annotations": notes or {}},
        "spec": spec,
    }


def _shared(memory: int, compute: int) -> dict[str, str]:
    return {SHARED: "1", MEMORY: str(memory), COMPUTE: str(compute)}


def test_forged_records_and_assignments_are_never_served(
    stack: Stack, namespace: str, tenant: client.CoreV1Api
) -> None:
    node = Node(
        stack, "tenant", "2xA100-SXM4-80GB:mig-off", {"mode": "MPS", "mps": {"maxClients": 4}}
    )
    core = node.core
    try:
        node.until(lambda: node.allocatable(SHARED) == 8, 90, "8 client slots")
        gpu0, gpu1 = sorted(node.inventory(), key=lambda uuid: node.inventory()[uuid])[:2]
        slots = [f"{g}::{i}" for g in (gpu0, gpu1) for i in range(4)]

        def assignment(name: str) -> str:
            return str(
                core.read_namespaced_pod(name, namespace).metadata.annotations[
                    ASSIGNMENT_ANNOTATION
                ]
            )

        def served(name: str, memory: int, compute: int) -> dict[str, str]:
            """The pod runs, and its container got exactly its own GPU and limits."""
            node.running(namespace, name)
            env: dict[str, str] = node.env(namespace, name, "app-0")["env"]
            gpu = decode_assignment(assignment(name)).gpu_uuid
            assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"{gpu}={memory}M", (name, env)
            assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == str(compute), (name, env)
            return env

        # A victim, served first, through the scheduler.
        tenant.create_namespaced_pod(namespace, _pod("victim", _shared(20000, 20)))
        victim_env = served("victim", 20000, 20)

        # 1. Through the scheduler, asking 1 MiB / 1 %, with a record that claims the whole GPU.
        whole_given = (GivenContainer("app-0", tuple(slots), gpu0, GPU_MIB, 100),)
        whole = encode_allocation(whole_given)
        tenant.create_namespaced_pod(
            namespace, _pod("greedy", _shared(1, 1), notes={OLD_RECORD: whole})
        )
        served("greedy", 1, 1)
        with pytest.raises(client.ApiException) as refused:
            tenant.patch_namespaced_pod_status(
                "greedy",
                namespace,
                {
                    "status": {
                        "conditions": [allocation_condition(whole_given, "2026-01-01T00:00:00Z")]
                    }
                },
                _content_type="application/strategic-merge-patch+json",
            )
        assert refused.value.status == 403, refused.value

        # 2. A CPU-only pod on the node with a record naming every slot: it answers nobody.
        tenant.create_namespaced_pod(
            namespace, _pod("squatter", {}, node=node.name, notes={OLD_RECORD: whole})
        )
        node.running(namespace, "squatter")
        tenant.create_namespaced_pod(namespace, _pod("next", _shared(15000, 15)))
        served("next", 15000, 15)

        # 3. Pods on the node with no, an unsigned, or a copied genuine assignment: refused.
        copied = assignment("victim")
        unsigned = encode_assignment(PodAssignment(node.name, 1, gpu1, GPU_MIB, 100))
        forged = {
            "bare": {},
            "unsigned": {ASSIGNMENT_ANNOTATION: unsigned},
            "copied": {ASSIGNMENT_ANNOTATION: copied},
        }
        for name, notes in forged.items():
            tenant.create_namespaced_pod(
                namespace, _pod(name, _shared(1, 1), node=node.name, notes=notes)
            )

        def failed(name: str) -> bool:
            return core.read_namespaced_pod(name, namespace).status.phase == "Failed"

        for name in forged:
            node.until(lambda name=name: failed(name), 90, f"{name} refused by the kubelet")
            assert node.real.container(namespace, name, "app-0") is None, f"{name} got a container"

        def reasons(name: str) -> list[str]:
            events = core.list_namespaced_event(
                namespace, field_selector=f"involvedObject.name={name}"
            ).items
            return [e.message for e in events if e.reason == ALLOCATE_REFUSED]

        for name, says in (
            ("bare", "has no gpupart.io/assignment"),
            ("unsigned", "carries no signature"),
            ("copied", "made for pod UID"),
        ):
            node.until(
                lambda name=name, says=says: any(says in m for m in reasons(name)),
                30,
                f"{name}'s Event: {says}",
            )

        # The running pods kept their limits (no new container), and the node still admits.
        assert node.env(namespace, "victim", "app-0")["env"] == victim_env
        tenant.create_namespaced_pod(namespace, _pod("after", _shared(10000, 10)))
        served("after", 10000, 10)
    finally:
        with contextlib.suppress(client.ApiException):
            core.delete_collection_namespaced_pod(namespace, grace_period_seconds=0)
        node.remove()
        stack.stop_real_node(node.name)
