"""The chart's MutatingAdmissionPolicy in a real API server: GPU pods get the gpupart scheduler, tenants escape nothing.

The release is installed with `helm install` (default values: scheduler.mode=dedicated) into
the session's kube-apiserver v1.36, which serves admissionregistration.k8s.io/v1
MutatingAdmissionPolicy and has the admission plugin on by default. Pods are created as an
impersonated tenant (a Role on pods in its own namespace only). No chart pod runs: the test
checks what the API server stores. We test that:
- a pod asking for a shared GPU, a MIG slice, a whole GPU, or a GPU in an init container only,
  that names no scheduler (or `default-scheduler`, which the API server defaults to) is stored
  with `spec.schedulerName: gpupart-scheduler`;
- a pod asking for no GPU, one that names another scheduler, and one with `spec.nodeName` are
  not mutated, and the validating policies still judge the mutated pod: a GPU pod with
  `spec.nodeName`, or with a `gpupart.io/` annotation, is refused as before;
- the policy acts at creation only (an update of the pod leaves its scheduler as stored);
- the tenant cannot read, change or delete the policy or its binding.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import pytest
from kubernetes import client

from gpupart_testsupport.chart import IMAGE_FLAGS
from gpupart_testsupport.cluster import REPO, ControlPlane
from gpupart_testsupport.cluster import wait_for as wait

from .admission import admin_probes, impersonating, refused_by, wait_enforced, wait_lifted

pytestmark = pytest.mark.e2e

CHART = REPO / "charts" / "gpupart"
RELEASE = "gpupart-map"  # the fullname too: it contains the chart's name
NAMESPACE = "gpupart-map-e2e"
TENANT = "map-tenant"  # the user, and its namespace
POLICY = f"{RELEASE}-scheduler-name"
OURS = "gpupart-scheduler"


def _pod(name: str, limits: dict[str, str] | None = None, **spec: Any) -> dict[str, Any]:
    container: dict[str, Any] = {"name": "main", "image": "none"}
    if limits:
        container["resources"] = {"limits": limits}
    return {"metadata": {"name": name}, "spec": {"containers": [container], **spec}}


@pytest.fixture(scope="module")
def cp(k8s_control_plane: ControlPlane) -> Generator[ControlPlane, None, None]:
    """The chart installed, its policies in force; a tenant with pods create/get/patch/delete
    in its own namespace."""
    cp = k8s_control_plane
    api = cp.api_client()
    core = client.CoreV1Api(api)
    rbac = client.RbacAuthorizationV1Api(api)
    cp.helm("install", RELEASE, str(CHART), *IMAGE_FLAGS, "-n", NAMESPACE, "--create-namespace")
    probes = admin_probes(api, "default")
    try:
        core.create_namespace({"metadata": {"name": TENANT}})
        rbac.create_namespaced_role(
            TENANT,
            {
                "metadata": {"name": "pods"},
                "rules": [
                    {
                        "apiGroups": [""],
                        "resources": ["pods"],
                        "verbs": ["create", "get", "list", "patch", "delete"],
                    }
                ],
            },
        )
        rbac.create_namespaced_role_binding(
            TENANT,
            {
                "metadata": {"name": "pods"},
                "roleRef": {
                    "apiGroup": "rbac.authorization.k8s.io",
                    "kind": "Role",
                    "name": "pods",
                },
                "subjects": [
                    {"kind": "User", "name": TENANT, "apiGroup": "rbac.authorization.k8s.io"}
                ],
            },
        )
        wait_enforced(probes, RELEASE)
        probe = _pod("probe", {"nvidia.com/gpu.shared": "1"})
        wait(
            lambda: (
                core.create_namespaced_pod("default", probe, dry_run="All").spec.scheduler_name
                == OURS
            ),
            60,
            f"policy {POLICY} to be in force",
        )
        yield cp
    finally:
        core.delete_collection_namespaced_pod(TENANT, grace_period_seconds=0)
        cp.helm("uninstall", RELEASE, "-n", NAMESPACE, "--timeout", "60s", check=False)
        wait_lifted(probes)
        probe = _pod("probe", {"nvidia.com/gpu.shared": "1"})
        wait(
            lambda: (
                core.create_namespaced_pod("default", probe, dry_run="All").spec.scheduler_name
                == "default-scheduler"
            ),
            60,
            f"policy {POLICY} to be lifted",
        )
        api.close()


@pytest.fixture(scope="module")
def tenant(cp: ControlPlane) -> Generator[Any, None, None]:
    api = impersonating(cp, TENANT)
    yield client.CoreV1Api(api)
    api.close()


@pytest.mark.parametrize(
    ("name", "pod"),
    [
        ("shared", _pod("shared", {"nvidia.com/gpu.shared": "1", "gpupart.io/gpu-memory": "1000"})),
        ("mig", _pod("mig", {"nvidia.com/mig-1g.10gb": "1"})),
        ("whole", _pod("whole", {"nvidia.com/gpu": "1"})),
        (
            "defaulted",
            _pod("defaulted", {"nvidia.com/gpu": "1"}, schedulerName="default-scheduler"),
        ),
        (
            "init-only",
            {
                "metadata": {"name": "init-only"},
                "spec": {
                    "initContainers": [
                        {
                            "name": "warm",
                            "image": "none",
                            "resources": {"limits": {"nvidia.com/mig-1g.10gb": "1"}},
                        }
                    ],
                    "containers": [{"name": "main", "image": "none"}],
                },
            },
        ),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_a_gpu_pod_that_names_no_scheduler_gets_the_gpupart_scheduler(
    tenant: Any, name: str, pod: dict[str, Any]
) -> None:
    created = tenant.create_namespaced_pod(TENANT, pod)
    assert created.spec.scheduler_name == OURS, name
    stored = tenant.read_namespaced_pod(name, TENANT)
    assert stored.spec.scheduler_name == OURS, name
    # Creation only: an update leaves the scheduler as stored (the field is immutable anyway).
    patched = tenant.patch_namespaced_pod(name, TENANT, {"metadata": {"labels": {"x": "y"}}})
    assert patched.spec.scheduler_name == OURS


@pytest.mark.parametrize(
    ("name", "pod", "scheduler"),
    [
        ("cpu-only", _pod("cpu-only", {"cpu": "1"}), "default-scheduler"),
        (
            "other-scheduler",
            _pod("other-scheduler", {"nvidia.com/gpu": "1"}, schedulerName="my-scheduler"),
            "my-scheduler",
        ),
    ],
    ids=["cpu-only", "other-scheduler"],
)
def test_pods_without_a_gpu_or_with_a_scheduler_of_their_own_are_left_alone(
    tenant: Any, name: str, pod: dict[str, Any], scheduler: str
) -> None:
    created = tenant.create_namespaced_pod(TENANT, pod, dry_run="All")
    assert created.spec.scheduler_name == scheduler, name


def test_the_validating_policies_still_judge_the_mutated_pod(tenant: Any) -> None:
    """The mutation adds a scheduler and nothing else: a GPU pod that presets its node, or
    carries a gpupart.io/ annotation, is refused as it was without the mutating policy."""
    preset = _pod("preset", {"nvidia.com/gpu.shared": "1"}, nodeName="some-node")
    message = refused_by(
        f"{RELEASE}-gpu-pods-scheduled",
        lambda: tenant.create_namespaced_pod(TENANT, preset, dry_run="All"),
    )
    assert "sets spec.nodeName=some-node" in message, message
    forged = _pod("forged", {"nvidia.com/gpu.shared": "1"})
    forged["metadata"]["annotations"] = {"gpupart.io/assignment": "{}"}
    message = refused_by(
        f"{RELEASE}-annotation-owners",
        lambda: tenant.create_namespaced_pod(TENANT, forged, dry_run="All"),
    )
    assert f"gpupart.io/assignment on Pod {TENANT}/forged: set at creation" in message, message


def _request(api: Any, method: str, path: str) -> int:
    """The HTTP status of one request through `api` (no body)."""
    verb, url, headers, body, _ = api.param_serialize(
        method=method,
        resource_path=path,
        header_params={"Accept": "application/json"},
        auth_settings=["BearerToken"],
    )
    response = api.call_api(verb, url, header_params=headers, body=body)
    response.read()
    return int(response.status)


def test_the_tenant_cannot_touch_the_policy(cp: ControlPlane) -> None:
    base = "/apis/admissionregistration.k8s.io/v1"
    paths = (
        f"{base}/mutatingadmissionpolicies/{POLICY}",
        f"{base}/mutatingadmissionpolicybindings/{POLICY}",
    )
    tenant = impersonating(cp, TENANT)
    admin = cp.api_client()
    try:
        for path in paths:
            for method in ("GET", "DELETE"):
                assert _request(tenant, method, path) == 403, (method, path)
            assert _request(admin, "GET", path) == 200, path  # still there
    finally:
        tenant.close()
        admin.close()
