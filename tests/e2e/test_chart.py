"""`helm install` into the real API server, RBAC checked with `kubectl auth can-i`, uninstall keeps only the CRDs.

No container images exist here, and the control plane runs no controller-manager, so no chart
pod ever runs: the test checks what the API server accepts and stores.
"""

from __future__ import annotations

import json
from collections.abc import Generator
from typing import Any

import pytest
import yaml

from .cluster import REPO, ControlPlane

pytestmark = pytest.mark.e2e

CHART = REPO / "charts" / "gpupart"
RELEASE = "gpupart"
NAMESPACE = "gpupart-chart-e2e"
CRDS = ("gpupartitions.gpupart.io", "clusterkopfpeerings.kopf.dev")


def _ref(obj: dict[str, Any]) -> list[str]:
    """kubectl get arguments for one rendered object."""
    kind = obj["kind"]
    group = obj["apiVersion"].split("/")[0] if "/" in obj["apiVersion"] else ""
    resource = f"{kind.lower()}.{group}" if group else kind.lower()
    args = [resource, obj["metadata"]["name"]]
    if obj["metadata"].get("namespace"):
        args += ["-n", obj["metadata"]["namespace"]]
    return args


@pytest.fixture(scope="module")
def installed(k8s_control_plane: ControlPlane) -> Generator[list[dict[str, Any]], None, None]:
    """The release installed with default values; its manifest's objects."""
    cp = k8s_control_plane
    cp.helm(
        "install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--create-namespace",
        "--timeout", "60s",
    )  # fmt: skip
    try:
        manifest = cp.helm("get", "manifest", RELEASE, "--namespace", NAMESPACE).stdout
        yield [doc for doc in yaml.safe_load_all(manifest) if doc]
    finally:
        cp.helm("uninstall", RELEASE, "--namespace", NAMESPACE, "--timeout", "60s", check=False)


def test_install_creates_every_object_and_the_crds(
    k8s_control_plane: ControlPlane, installed: list[dict[str, Any]]
) -> None:
    kinds = {o["kind"] for o in installed}
    assert {
        "Deployment",
        "DaemonSet",
        "Service",
        "ClusterRole",
        "ClusterRoleBinding",
        "ServiceAccount",
        "PodDisruptionBudget",
        "ConfigMap",
        "ClusterKopfPeering",
    } <= kinds
    for obj in installed:
        k8s_control_plane.kubectl("get", *_ref(obj), "-o", "name")
    for crd in CRDS:
        k8s_control_plane.kubectl("get", "crd", crd, "-o", "name")
    status = json.loads(
        k8s_control_plane.helm("status", RELEASE, "-n", NAMESPACE, "-o", "json").stdout
    )
    assert status["info"]["status"] == "deployed"


def test_the_example_partitions_are_accepted_by_the_installed_crd(
    k8s_control_plane: ControlPlane, installed: list[dict[str, Any]]
) -> None:
    assert installed
    for path in sorted((CHART / "examples").glob("*.yaml")):
        k8s_control_plane.kubectl("apply", "--dry-run=server", "-f", str(path))


@pytest.mark.parametrize(
    ("component", "allowed", "denied"),
    [
        (
            "node",
            [
                "patch nodes",
                "patch nodes --subresource=status",
                "watch nodes",
                "list pods",
                "watch pods",
                "patch pods",
            ],
            ["delete nodes", "delete pods", "get secrets", "create pods --subresource=binding"],
        ),
        (
            "extender",
            [
                "watch nodes",
                "watch pods",
                "create pods --subresource=binding",  # carries the assignment annotation
                "watch poddisruptionbudgets.policy",
            ],
            [
                "patch nodes",
                "patch pods",
                "delete pods",
                "get secrets",
                "create pods",
                "patch poddisruptionbudgets.policy",
            ],
        ),
        (
            "operator",
            [
                "patch nodes",
                "patch gpupartitions.gpupart.io",
                "patch gpupartitions.gpupart.io --subresource=status",
                "create events",
                "patch clusterkopfpeerings.kopf.dev",
                "watch pods",  # dynamic MIG's demand
            ],
            ["delete gpupartitions.gpupart.io", "patch pods", "get secrets", "delete nodes"],
        ),
        (
            "scheduler",
            [
                "create pods --subresource=binding",
                "watch nodes",
                "get leases.coordination.k8s.io/gpupart-scheduler",
            ],
            [
                "patch nodes",
                "get secrets",
                "update leases.coordination.k8s.io/kube-controller-manager",
            ],
        ),
    ],
)
def test_service_accounts_can_do_what_their_component_needs_and_no_more(
    k8s_control_plane: ControlPlane,
    installed: list[dict[str, Any]],
    component: str,
    allowed: list[str],
    denied: list[str],
) -> None:
    (account,) = [
        o["metadata"]["name"]
        for o in installed
        if o["kind"] == "ServiceAccount" and o["metadata"]["name"].endswith(f"-{component}")
    ]
    who = f"--as=system:serviceaccount:{NAMESPACE}:{account}"
    for action, expected in [(a, "yes") for a in allowed] + [(d, "no") for d in denied]:
        result = k8s_control_plane.kubectl(
            "auth", "can-i", *action.split(), who, "-n", NAMESPACE, check=False
        )
        assert result.stdout.strip() == expected, f"{component} {action}: {result.stdout}"


def test_uninstall_removes_everything_but_the_crds(k8s_control_plane: ControlPlane) -> None:
    cp = k8s_control_plane
    release = f"{RELEASE}-uninstall"
    cp.helm("install", release, str(CHART), "--namespace", NAMESPACE, "--create-namespace")
    manifest = cp.helm("get", "manifest", release, "--namespace", NAMESPACE).stdout
    objects = [doc for doc in yaml.safe_load_all(manifest) if doc]
    assert len(objects) > 20
    cp.helm("uninstall", release, "--namespace", NAMESPACE, "--timeout", "60s")
    for obj in objects:
        result = cp.kubectl("get", *_ref(obj), "-o", "name", check=False)
        assert result.returncode != 0 and "NotFound" in result.stderr, (
            f"left behind: {obj['kind']}/{obj['metadata']['name']}"
        )
    for crd in CRDS:
        cp.kubectl("get", "crd", crd, "-o", "name")
    listed = cp.helm("list", "--namespace", NAMESPACE, "-o", "json").stdout
    assert release not in {r["name"] for r in json.loads(listed)}
