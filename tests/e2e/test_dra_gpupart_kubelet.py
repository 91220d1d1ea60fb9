"""Our DRA kubelet plugin on the real kubelet: a claim prepared by `gpupart node --dra`, the container's CDI.

The node agent (simulated GPUs) runs beside a real kubelet (`dra_node`) with `--dra`: it
registers in the node's plugins_registry and writes each claim's CDI spec to the node's CDI
directory, where the fake runtime resolves it. The real kube-scheduler allocates and
kube-controller-manager makes the claims from templates. The desired annotation and the pool
are stand-ins (`gpupart_testsupport.dra.start_gpupart_dra` says which and why).
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from gpupart.core.dra import names
from gpupart.core.dra.prepare import CDI_KIND
from gpupart_testsupport.cluster import ControlPlane
from gpupart_testsupport.dra import (
    GPUPART_GPU_CLASS,
    GROUP,
    PREPARE,
    VERSION,
    claim_pod,
    claim_template,
    grpc_seconds,
    install_gpupart_device_classes,
    start_gpupart_dra,
)
from gpupart_testsupport.dra import pod_claim_name as claim_of
from gpupart_testsupport.kubelet import KubeletNode
from gpupart_testsupport.polling import wait_for
from gpupart_testsupport.stack import Stack

pytestmark = pytest.mark.e2e

WAIT_S = 90


@dataclass
class Agent:
    stack: Stack
    gpu_uuid: str
    """GPU 0's UUID, as the agent's inventory says."""


@pytest.fixture(scope="module")
def agent(
    dra_control_plane: ControlPlane, dra_node: KubeletNode, tmp_path_factory: pytest.TempPathFactory
) -> Generator[Agent]:
    """`gpupart node --dra` for the module's node, GPU 0 on DRA, its pool published."""
    install_gpupart_device_classes(dra_control_plane)
    api = dra_control_plane.api_client()
    stack = Stack(dra_control_plane, api, Path(tmp_path_factory.mktemp("dra-agent")))
    try:
        (uuid,) = start_gpupart_dra(stack, dra_node, 1)
        yield Agent(stack, uuid)
    except BaseException:
        print(stack.tails())
        raise
    finally:
        stack.stop()
        api.close()


def test_a_whole_gpu_claim_is_prepared_and_its_container_gets_exactly_that_gpu(
    dra_node: KubeletNode, agent: Agent, dra_namespace: str
) -> None:
    api = agent.stack.api_client
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    ns, node = dra_namespace, dra_node
    custom.create_namespaced_custom_object(
        GROUP, VERSION, ns, "resourceclaimtemplates", claim_template("whole", GPUPART_GPU_CLASS)
    )
    core.create_namespaced_pod(ns, claim_pod("app", "whole", node.name, containers=2))

    def running() -> dict[str, Any] | None:
        pod = api.sanitize_for_serialization(core.read_namespaced_pod("app", ns))
        return pod if pod["status"].get("phase") == "Running" else None

    pod = wait_for(
        running, WAIT_S, "pod app Running", detail=lambda: f"{agent.stack.tails()}\n{node.tails()}"
    )
    claim = custom.get_namespaced_custom_object(
        GROUP, VERSION, ns, "resourceclaims", claim_of(pod) or ""
    )
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    assert (result["driver"], result["pool"], result["device"]) == (
        names.DRIVER,
        node.name,
        "gpu-0",
    )
    uid = claim["metadata"]["uid"]
    spec_file = None
    for container in ("app-0", "app-1"):
        got = node.container(ns, "app", container)
        assert got is not None, container
        (cdi_id,) = got["cdiDevices"]
        assert cdi_id.startswith(f"{CDI_KIND}=") and uid in cdi_id, got
        assert not got["cdi"]["unresolved"], got["cdi"]
        spec_file = got["cdi"]["specs"][cdi_id]
        assert spec_file.startswith(f"{node.cdi_dir}/") and uid in spec_file, spec_file
        # What the container got from our spec: exactly the allocated GPU.
        assert got["cdi"]["env"]["NVIDIA_VISIBLE_DEVICES"] == agent.gpu_uuid, got["cdi"]
        assert got["env"]["NVIDIA_VISIBLE_DEVICES"] == agent.gpu_uuid, got["env"]
        assert "/dev/nvidia0" in got["devices"], got["devices"]
    assert grpc_seconds(node, names.DRIVER, PREPARE)[0] >= 1

    # Deleting the pod unprepares the claim: its spec is gone from the node's CDI directory.
    core.delete_namespaced_pod("app", ns, grace_period_seconds=0)
    assert spec_file is not None
    wait_for(
        lambda: not Path(spec_file).exists(),
        WAIT_S,
        "the claim's CDI spec removed at unprepare",
        detail=agent.stack.tails,
    )
