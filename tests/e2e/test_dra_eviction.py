"""A faulty GPU's DRA pods evicted by the real controller and placed again on a healthy GPU.

The node agent (`gpupart node --dra`, two simulated whole A100s) runs with
`--dra-taint-effect=NoExecute` beside a real kubelet; kube-controller-manager runs its
device-taint-eviction controller, kube-scheduler allocates. A ReplicaSet of one pod claims a
whole GPU through a template. An Xid 79 (the GPU fell off the bus) on the pod's GPU taints
that GPU's device NoExecute in its slice; the controller evicts the pod, the ReplicaSet makes
another, and the scheduler gives its claim the healthy GPU, where it runs. Once the faulty GPU
has been quiet for the agent's clean window the taint is gone and its device is allocatable
again.
"""

from __future__ import annotations

from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from gpupart.core.dra import names
from gpupart_testsupport.cluster import ControlPlane
from gpupart_testsupport.dra import (
    GPUPART_GPU_CLASS,
    GROUP,
    VERSION,
    claim_pod,
    claim_template,
    install_gpupart_device_classes,
    pod_claim_name,
    start_gpupart_dra,
)
from gpupart_testsupport.kubelet import KubeletNode
from gpupart_testsupport.polling import wait_for
from gpupart_testsupport.stack import Stack

pytestmark = pytest.mark.e2e

WAIT_S = 120
RECOVERY_S = 8
"""The agent's clean window after an Xid: the taint goes once the GPU is quiet this long."""


@pytest.fixture(scope="module")
def stack(
    dra_control_plane: ControlPlane, dra_node: KubeletNode, tmp_path_factory: pytest.TempPathFactory
) -> Generator[Stack, None, None]:
    install_gpupart_device_classes(dra_control_plane)
    api = dra_control_plane.api_client()
    stack = Stack(dra_control_plane, api, Path(tmp_path_factory.mktemp("dra-eviction")))
    try:
        start_gpupart_dra(stack, dra_node, 2, recovery_s=RECOVERY_S, taint_effect="NoExecute")
        yield stack
    except BaseException:
        print(stack.tails())
        raise
    finally:
        stack.stop()
        api.close()


def _device_of(api: Any, ns: str, pod: Any) -> str:
    """The device the pod's claim was allocated."""
    claim = client.CustomObjectsApi(api).get_namespaced_custom_object(
        GROUP, VERSION, ns, "resourceclaims", pod_claim_name(api.sanitize_for_serialization(pod))
    )
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    return str(result["device"])


def test_an_xid_evicts_the_gpus_pod_and_its_replacement_runs_on_the_healthy_gpu(
    stack: Stack, dra_node: KubeletNode, dra_namespace: str
) -> None:
    api = stack.api_client
    core, apps = client.CoreV1Api(api), client.AppsV1Api(api)
    custom = client.CustomObjectsApi(api)
    ns, node = dra_namespace, dra_node.name
    custom.create_namespaced_custom_object(
        GROUP, VERSION, ns, "resourceclaimtemplates", claim_template("gpu", GPUPART_GPU_CLASS)
    )
    template = claim_pod("trainer", "gpu", node)
    apps.create_namespaced_replica_set(
        ns,
        {
            "metadata": {"name": "trainer"},
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": {"app": "trainer"}},
                "template": {"metadata": {"labels": {"app": "trainer"}}, "spec": template["spec"]},
            },
        },
    )

    def running() -> list[Any]:
        pods = core.list_namespaced_pod(ns, label_selector="app=trainer").items
        return [
            p for p in pods if p.status.phase == "Running" and p.metadata.deletion_timestamp is None
        ]

    def slices() -> list[Any]:
        found = client.ResourceV1Api(api).list_resource_slice(
            field_selector=f"spec.nodeName={node}"
        )
        return list(found.items)

    def taint_of(device: str) -> Any:
        for s in slices():
            for d in s.spec.devices or []:
                if d.name == device and d.taints:
                    return d.taints[0]
        return None

    (first,) = wait_for(running, WAIT_S, "the ReplicaSet's pod Running")
    faulty = _device_of(api, ns, first)
    healthy = "gpu-1" if faulty == "gpu-0" else "gpu-0"
    stack.inject_faults(node, {"xid": 79, "gpu": int(faulty.removeprefix("gpu-"))})
    taint = wait_for(lambda: taint_of(faulty), WAIT_S, f"{faulty} tainted after the Xid")
    assert (taint.key, taint.value, taint.effect) == (names.TAINT_UNHEALTHY, "xid-79", "NoExecute")
    assert taint_of(healthy) is None

    def replaced() -> Any:
        now = running()
        return now[0] if now and now[0].metadata.uid != first.metadata.uid else None

    second = wait_for(
        replaced,
        WAIT_S,
        "the evicted pod replaced and Running",
        detail=lambda: str([(p.metadata.name, p.status.phase) for p in running()]),
    )
    assert _device_of(api, ns, second) == healthy
    # the evicted pod is gone, not left Running on the faulty GPU
    wait_for(
        lambda: all(
            p.metadata.uid != first.metadata.uid
            for p in core.list_namespaced_pod(ns, label_selector="app=trainer").items
        ),
        WAIT_S,
        "the evicted pod deleted",
    )
    stack.inject_faults(node)  # nothing more raised: the clean window runs from the last Xid
    wait_for(lambda: taint_of(faulty) is None, WAIT_S + RECOVERY_S, f"{faulty}'s taint cleared")
    # allocatable again: a second pod of the same template gets the once-faulty GPU
    core.create_namespaced_pod(ns, claim_pod("after", "gpu", node))
    after = wait_for(
        lambda: (p := core.read_namespaced_pod("after", ns)).status.phase == "Running" and p,
        WAIT_S,
        "pod after Running",
    )
    assert _device_of(api, ns, after) == faulty
    apps.delete_namespaced_replica_set("trainer", ns)
