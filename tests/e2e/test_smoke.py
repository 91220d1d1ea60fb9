"""Smoke tests against the real programs: version, the GpuPartition CRD and its CEL rules, scheduling."""

from __future__ import annotations

import collections
import json
import time
from typing import Any

import pytest
import yaml

from gpupart_testsupport.cluster import (
    MIG_1G,
    REPO,
    ControlPlane,
    create_nodes,
    expected_k8s_version,
    gpu_node,
    mig_labels,
    parallel,
    pod_manifest,
    wait_for,
    wait_for_condition,
)

pytestmark = pytest.mark.e2e

CRD_FILE = REPO / "charts" / "gpupart" / "crds" / "gpupartition.yaml"


def test_version_is_stamped(k8s_control_plane: ControlPlane) -> None:
    """/version reports the pinned release, not the unstamped v0.0.0-master."""
    out = json.loads(k8s_control_plane.kubectl("get", "--raw", "/version").stdout)
    assert out["gitVersion"] == expected_k8s_version()
    helm = k8s_control_plane.helm("version", "--short").stdout
    assert helm.startswith("v"), helm


# --- the GpuPartition CRD -------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpupartition_crd(k8s_control_plane: ControlPlane) -> None:
    """Apply the chart's CRD with kubectl and wait until the API server serves it."""
    k8s_control_plane.kubectl("apply", "-f", str(CRD_FILE))
    k8s_control_plane.kubectl(
        "wait",
        "--for=condition=Established",
        "--timeout=60s",
        "crd/gpupartitions.gpupart.io",
    )

    # Established can come a moment before discovery lists the kind; wait for that too.
    def served() -> bool:
        res = k8s_control_plane.kubectl("get", "gpup", check=False)
        return res.returncode == 0

    wait_for(served, 30, "gpupartitions in discovery")


def gp(name: str, spec: dict[str, Any]) -> str:
    """A GpuPartition manifest as YAML text."""
    return yaml.safe_dump(
        {
            "apiVersion": "gpupart.io/v1alpha1",
            "kind": "GpuPartition",
            "metadata": {"name": name},
            "spec": spec,
        }
    )


H100 = {"matchLabels": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}}


@pytest.mark.usefixtures("gpupartition_crd")
def test_valid_gpupartitions_are_accepted_with_defaults(k8s_control_plane: ControlPlane) -> None:
    """One object per mode is stored; defaults are filled in; the printer columns show."""
    specs = {
        "e2e-mig": {
            "nodeSelector": H100,
            "gpus": [0, 1],
            "mode": "MIG",
            "mig": {"devices": {"1g.10gb": 4, "3g.40gb": 1, "1g.10gb+me": 0}},
        },
        "e2e-mps": {
            "nodeSelector": {
                "matchExpressions": [
                    {
                        "key": "nvidia.com/gpu.product",
                        "operator": "In",
                        "values": ["NVIDIA-A100-SXM4-80GB"],
                    }
                ]
            },
            "mode": "MPS",
            "mps": {"maxClients": 16, "defaultMemory": "10Gi", "defaultComputePercent": 25},
        },
        "e2e-ts": {
            "nodeSelector": {},
            "mode": "TimeSlicing",
            "timeSlicing": {"replicas": 4},
            "disruption": "Never",
            "priority": 10,
        },
        "e2e-none": {"nodeSelector": H100, "mode": "None"},
    }
    cp = k8s_control_plane
    cp.kubectl("apply", "-f", "-", input="---\n".join(gp(n, s) for n, s in specs.items()))
    try:
        got = json.loads(cp.kubectl("get", "gpup", "e2e-mig", "-o", "json").stdout)
        assert got["spec"]["disruption"] == "WhenIdle"
        assert got["spec"]["priority"] == 0
        assert got["spec"]["interface"] == "devicePlugin"
        assert got["spec"]["mig"]["devices"] == {"1g.10gb": 4, "3g.40gb": 1, "1g.10gb+me": 0}
        table = cp.kubectl("get", "gpupartitions").stdout
        header = table.splitlines()[0].split()
        assert header[:2] == ["NAME", "MODE"] and "AGE" in header, table
        assert {"e2e-mig", "e2e-mps", "e2e-ts", "e2e-none"} <= {
            line.split()[0] for line in table.splitlines()[1:]
        }
    finally:
        cp.kubectl("delete", "gpup", *specs, "--ignore-not-found")


# Each malformed object and the words the API server must answer with.
BAD = {
    "dra-with-warm": (
        {
            "nodeSelector": H100,
            "mode": "MIG",
            "interface": "dra",
            "mig": {"dynamic": {"warm": {"1g.10gb": 1}}},
        },
        "spec.mig.dynamic.warm is kept by the operator's MIG plans",
    ),  # fmt: skip
    "mig-without-block": ({"nodeSelector": H100, "mode": "MIG"}, "mode MIG requires spec.mig"),
    "mig-with-mps-block": (
        {
            "nodeSelector": H100,
            "mode": "MIG",
            "mig": {"devices": {"1g.10gb": 7}},
            "mps": {"maxClients": 4},
        },
        "spec.mps is set but mode is MIG; spec.mps is allowed only with mode MPS",
    ),
    "none-with-timeslicing": (
        {"mode": "None", "timeSlicing": {"replicas": 2}},
        "spec.timeSlicing is set but mode is None",
    ),
    "empty-mig-devices": (
        {"mode": "MIG", "mig": {"devices": {}}},
        "spec.mig.devices must name at least one MIG profile",
    ),
    "bad-profile-name": (
        {"mode": "MIG", "mig": {"devices": {"1g.10gb": 2, "big-slice": 1}}},
        "spec.mig.devices keys must be MIG profile names of at most 32 characters",
    ),
    "duplicate-gpus": (
        {"mode": "TimeSlicing", "gpus": [0, 1, 0], "timeSlicing": {"replicas": 2}},
        "spec.gpus[2]: Duplicate value: 0",
    ),
    "negative-count": (
        {"mode": "MIG", "mig": {"devices": {"1g.10gb": -1}}},
        "should be greater than or equal to 0",
    ),
    "unknown-mode": ({"mode": "Exclusive"}, 'Unsupported value: "Exclusive"'),
    "mps-too-many-clients": (
        {"mode": "MPS", "mps": {"maxClients": 64}},
        "should be less than or equal to 48",
    ),
    "mps-bad-memory": (
        {"mode": "MPS", "mps": {"maxClients": 4, "defaultMemory": "lots"}},
        "spec.mps.defaultMemory must be a memory quantity from 1Mi (per client) to 16Ti",
    ),
    "selector-in-without-values": (
        {
            "mode": "None",
            "nodeSelector": {
                "matchExpressions": [{"key": "nvidia.com/gpu.product", "operator": "In"}]
            },
        },
        "operator In needs at least one value",
    ),
}


@pytest.mark.usefixtures("gpupartition_crd")
@pytest.mark.parametrize("case", sorted(BAD))
def test_malformed_gpupartition_is_refused(k8s_control_plane: ControlPlane, case: str) -> None:
    """The real API server refuses the object at admission and says what is wrong."""
    spec, message = BAD[case]
    name = f"bad-{case}"
    res = k8s_control_plane.kubectl("create", "-f", "-", input=gp(name, spec), check=False)
    assert res.returncode != 0, f"{case} was accepted:\n{res.stdout}"
    assert "is invalid" in res.stderr, res.stderr
    assert message in res.stderr, res.stderr
    gone = k8s_control_plane.kubectl("get", "gpup", name, check=False)
    assert gone.returncode != 0 and "NotFound" in gone.stderr


# --- scheduling MIG pods with the real kube-scheduler ---------------------------------------

N_GPU_NODES = 100
N_PLAIN_NODES = 10
N_PODS = 500
MIG_PER_NODE = 7


def test_500_mig_pods_land_only_where_there_is_capacity(k8s_api: Any) -> None:
    """500 pods asking for a MIG slice are bound by kube-scheduler and run on kwok nodes.

    100 nodes offer 7 slices each (700 in all) and 10 nodes offer none: every pod must run,
    none on a node without the resource, and no node may hold more than it offers.
    """
    from kubernetes import client

    core = client.CoreV1Api(k8s_api)
    run = f"smoke{int(time.time()) % 100000}"
    ns = f"e2e-{run}"
    # Every node of this test carries the run label and every pod selects it, so nodes that
    # other e2e tests create cannot take these pods; the 10 plain nodes are still candidates.
    mine = {"gpupart.io/e2e-run": run}
    gpu_nodes = [f"{run}-gpu-{i:03d}" for i in range(N_GPU_NODES)]
    plain_nodes = [f"{run}-cpu-{i:02d}" for i in range(N_PLAIN_NODES)]
    all_nodes = set(gpu_nodes) | set(plain_nodes)
    core.create_namespace({"metadata": {"name": ns}})
    try:
        create_nodes(
            k8s_api,
            [gpu_node(n, {MIG_1G: MIG_PER_NODE}, {**mig_labels(), **mine}) for n in gpu_nodes]
            + [gpu_node(n, labels=mine) for n in plain_nodes],
        )

        def nodes_ready() -> bool:
            items = core.list_node(label_selector=f"gpupart.io/e2e-run={run}").items
            ready = {
                n.metadata.name
                for n in items
                if any(c.type == "Ready" and c.status == "True" for c in n.status.conditions or [])
            }
            return all_nodes <= ready

        wait_for(nodes_ready, 60, f"{len(all_nodes)} kwok nodes to be Ready")
        # kwok must have kept the capacity the nodes were created with.
        sample = core.read_node(gpu_nodes[0])
        assert sample.status.allocatable[MIG_1G] == str(MIG_PER_NODE)
        assert sample.metadata.labels["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"

        started = time.monotonic()
        parallel(
            lambda i: core.create_namespaced_pod(
                ns, pod_manifest(f"mig-{i:03d}", {MIG_1G: 1, "cpu": "100m"}, {"run": run}, mine)
            ),
            range(N_PODS),
        )

        def all_running() -> list[Any] | None:
            pods = core.list_namespaced_pod(ns, label_selector=f"run={run}").items
            running = [p for p in pods if p.status.phase == "Running" and p.spec.node_name]
            return pods if len(running) == N_PODS else None

        pods = wait_for(all_running, 240, f"{N_PODS} pods to be bound and Running", interval=1)
        print(f"\n{N_PODS} pods bound and Running in {time.monotonic() - started:.1f}s")

        per_node = collections.Counter(p.spec.node_name for p in pods)
        on_plain = set(per_node) & set(plain_nodes)
        assert not on_plain, f"MIG pods landed on nodes without MIG capacity: {sorted(on_plain)}"
        assert set(per_node) <= set(gpu_nodes)
        assert max(per_node.values()) <= MIG_PER_NODE, per_node.most_common(3)
        assert sum(per_node.values()) == N_PODS

        # A pod asking for more slices than any node has stays Pending; the scheduler says why.
        core.create_namespaced_pod(
            ns, pod_manifest("too-big", {MIG_1G: MIG_PER_NODE + 1}, node_selector=mine)
        )
        pod = wait_for_condition(
            lambda: core.read_namespaced_pod("too-big", ns).to_dict(), "PodScheduled", "False"
        )
        cond = next(c for c in pod["status"]["conditions"] if c["type"] == "PodScheduled")
        assert cond["reason"] == "Unschedulable"
        assert f"Insufficient {MIG_1G}" in cond["message"], cond["message"]
    finally:
        # Leave nothing for later tests: kwok's pod-delete stage finishes deleting bound pods
        # (there is no kubelet), then the nodes go. No namespace controller runs, so the
        # namespace itself would only ever reach Terminating; it stays, empty.
        core.delete_collection_namespaced_pod(ns, grace_period_seconds=0)
        wait_for(
            lambda: not core.list_namespaced_pod(ns).items, 120, "pods to be deleted", interval=1
        )
        core.delete_collection_node(label_selector=f"gpupart.io/e2e-run={run}")
