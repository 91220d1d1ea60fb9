"""A whole GPU through DRA on a node with a dynamic MIG GPU, on the real kubelet: only the whole GPU offers one.

A GPU in MIG mode publishes no whole-GPU device (docs/adr-030-whole-gpu-of-a-mig-gpu.md), so
the real kube-scheduler never gives a whole-GPU claim the dynamic GPU, where prepare could not
serve it: the claim runs on a whole GPU, or pends while none is free. The dynamic GPU's answer
to "all of it" is its full-size placement (7g.80gb on an A100-80GB), which takes every counter.

The module's node runs `gpupart node --dra` (simulated A100s, the real kubelet, the real
kube-scheduler and kube-controller-manager) with GPU 0 whole and GPU 1 dynamic MIG without a
warm mix. The simulated GPUs' state file (what NVML would answer) says which instances exist.
"""

from __future__ import annotations

import json
from collections.abc import Generator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from gpupart.core.api.spec import GpuConfig, Interface, Mode
from gpupart.core.dra import names
from gpupart.core.mig.catalogue import require_gpu_model
from gpupart.core.mig.layout import MigInstance, Placement
from gpupart_testsupport.cluster import ControlPlane, condition
from gpupart_testsupport.dra import (
    GPUPART_GPU_CLASS,
    GROUP,
    VERSION,
    WHOLE_DRA,
    claim_pod,
    claim_template,
    install_gpupart_device_classes,
    start_gpupart_dra,
)
from gpupart_testsupport.dra import pod_claim_name as claim_of
from gpupart_testsupport.kubelet import KubeletNode
from gpupart_testsupport.polling import wait_for
from gpupart_testsupport.stack import Stack

pytestmark = pytest.mark.e2e

WAIT_S = 90
A100 = require_gpu_model("A100-SXM4-80GB")
WHOLE_GPU, MIG_GPU = 0, 1
CONFIGS = (WHOLE_DRA, GpuConfig(Mode.MIG, dynamic=True, interface=Interface.DRA))
FULL = A100.require_profile("7g.80gb")
FULL_CLASS, SMALL_CLASS = "mig-7g80gb.gpupart.io", "mig-1g10gb.gpupart.io"


@dataclass
class Agent:
    stack: Stack
    uuids: list[str]
    """Each GPU's UUID by index, as the agent's inventory says."""
    state_file: Path
    """The simulated GPUs' state (`--simulate-state`): what NVML holds."""

    def mig_instances(self, index: int) -> dict[MigInstance, str]:
        """The MIG instances GPU `index` holds now, with their UUIDs."""
        if not self.state_file.exists():
            return {}  # the simulated GPUs never changed: no instance
        gpu = json.loads(self.state_file.read_text())["gpus"][index]
        return {
            MigInstance(Placement(i["start"], i["size"]), i["profile"]): i["uuid"]
            for i in gpu["instances"]
        }


@pytest.fixture(scope="module")
def agent(
    dra_control_plane: ControlPlane, dra_node: KubeletNode, tmp_path_factory: pytest.TempPathFactory
) -> Generator[Agent]:
    """`gpupart node --dra` for the module's node, its two GPUs as CONFIGS, its pool published."""
    install_gpupart_device_classes(dra_control_plane)
    api = dra_control_plane.api_client()
    stack = Stack(dra_control_plane, api, Path(tmp_path_factory.mktemp("dra-whole-agent")))
    try:
        uuids = start_gpupart_dra(stack, dra_node, len(CONFIGS), configs=CONFIGS)
        yield Agent(stack, uuids, stack.work / f"simgpu-{dra_node.name}.json")
    except BaseException:
        print(stack.tails())
        raise
    finally:
        stack.stop()
        api.close()


def _pod(api: Any, ns: str, name: str) -> dict[str, Any]:
    found: dict[str, Any] = api.sanitize_for_serialization(
        client.CoreV1Api(api).read_namespaced_pod(name, ns)
    )
    return found


def _running(api: Any, ns: str, name: str) -> dict[str, Any] | None:
    found = _pod(api, ns, name)
    return found if found["status"].get("phase") == "Running" else None


def _unschedulable(api: Any, ns: str, name: str) -> dict[str, Any] | None:
    found = _pod(api, ns, name)
    scheduled = condition(found, "PodScheduled") or {}
    return found if scheduled.get("reason") == "Unschedulable" else None


def _device(api: Any, ns: str, pod: dict[str, Any]) -> str:
    """The one device the pod's claim was allocated (ours, from this node's pool)."""
    claim = client.CustomObjectsApi(api).get_namespaced_custom_object(
        GROUP, VERSION, ns, "resourceclaims", claim_of(pod) or ""
    )
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    assert result["driver"] == names.DRIVER, result
    return str(result["device"])


def _placement(device: str) -> MigInstance:
    """The placement a dynamic MIG device of the MIG GPU names (docs/dra.md)."""
    (found,) = [
        MigInstance(Placement(start, p.memory_slices), p.name)
        for p in A100.profiles
        for start in p.starts
        if names.mig_device_name(MIG_GPU, p.name, start) == device
    ]
    return found


def _templates(api: Any, ns: str) -> None:
    custom = client.CustomObjectsApi(api)
    for name, device_class in (
        ("whole", GPUPART_GPU_CLASS),
        ("full", FULL_CLASS),
        ("small", SMALL_CLASS),
    ):
        custom.create_namespaced_custom_object(
            GROUP, VERSION, ns, "resourceclaimtemplates", claim_template(name, device_class)
        )


def test_the_dynamic_gpu_publishes_placements_only_and_the_whole_gpu_its_device(
    dra_node: KubeletNode, agent: Agent
) -> None:
    listed = client.CustomObjectsApi(agent.stack.api_client).list_cluster_custom_object(
        GROUP, VERSION, "resourceslices", field_selector=f"spec.nodeName={dra_node.name}"
    )["items"]
    devices = [
        d
        for s in listed
        if s["spec"].get("driver") == names.DRIVER
        for d in s["spec"].get("devices") or ()  # a counters-only slice has none
    ]
    by_gpu: dict[int, list[dict[str, Any]]] = {}
    for d in devices:
        # A device's name starts with its GPU's (`gpu-<i>`, docs/dra.md).
        by_gpu.setdefault(int(d["name"].split("-")[1]), []).append(d)
    whole = by_gpu[WHOLE_GPU]
    assert [(d["name"], d["attributes"][names.TYPE]["string"]) for d in whole] == [
        (names.gpu_device_name(WHOLE_GPU), names.TYPE_GPU)
    ]
    dynamic = by_gpu[MIG_GPU]
    placements = {_placement(d["name"]) for d in dynamic}
    assert placements == {
        MigInstance(Placement(s, p.memory_slices), p.name) for p in A100.profiles for s in p.starts
    }
    assert all(d["attributes"][names.TYPE]["string"] == names.TYPE_MIG for d in dynamic)
    assert names.gpu_device_name(MIG_GPU) not in {d["name"] for d in devices}


def test_a_whole_gpu_claim_runs_on_the_whole_gpu_and_the_next_pends_rather_than_take_the_mig_gpu(
    dra_node: KubeletNode, agent: Agent, dra_namespace: str
) -> None:
    api, ns, node = agent.stack.api_client, dra_namespace, dra_node
    core = client.CoreV1Api(api)
    _templates(api, ns)

    def tails() -> str:
        return f"{agent.stack.tails()}\n{node.tails()}"

    core.create_namespaced_pod(ns, claim_pod("first", "whole", node.name))
    pod = wait_for(lambda: _running(api, ns, "first"), WAIT_S, "pod first Running", detail=tails)
    assert _device(api, ns, pod) == names.gpu_device_name(WHOLE_GPU)
    got = node.container(ns, "first", "app-0")
    assert got is not None
    assert not got["cdi"]["unresolved"], got["cdi"]
    assert got["env"]["NVIDIA_VISIBLE_DEVICES"] == agent.uuids[WHOLE_GPU], got["env"]

    # The only whole-GPU device is taken: the next claim waits, and the idle dynamic GPU
    # (which once published one that prepare refused) is never given to it.
    core.create_namespaced_pod(ns, claim_pod("second", "whole", node.name))
    waiting = wait_for(
        lambda: _unschedulable(api, ns, "second"), WAIT_S, "pod second Unschedulable"
    )
    assert not waiting["spec"].get("nodeName")
    assert agent.mig_instances(MIG_GPU) == {}

    core.delete_namespaced_pod("first", ns, grace_period_seconds=0)
    pod = wait_for(
        lambda: _running(api, ns, "second"), WAIT_S, "pod second Running once first left",
        detail=tails,
    )  # fmt: skip
    assert _device(api, ns, pod) == names.gpu_device_name(WHOLE_GPU)
    core.delete_namespaced_pod("second", ns, grace_period_seconds=0)


def test_the_full_size_instance_holds_the_mig_gpu_and_a_small_claim_runs_after_it(
    dra_node: KubeletNode, agent: Agent, dra_namespace: str
) -> None:
    api, ns, node = agent.stack.api_client, dra_namespace, dra_node
    core = client.CoreV1Api(api)
    _templates(api, ns)

    def tails() -> str:
        return f"{agent.stack.tails()}\n{node.tails()}"

    wait_for(lambda: agent.mig_instances(MIG_GPU) == {}, WAIT_S, "no instance on the MIG GPU")
    core.create_namespaced_pod(ns, claim_pod("full", "full", node.name))
    pod = wait_for(lambda: _running(api, ns, "full"), WAIT_S, "pod full Running", detail=tails)
    wanted = _placement(_device(api, ns, pod))
    assert wanted == MigInstance(Placement(0, FULL.memory_slices), FULL.name)
    made = agent.mig_instances(MIG_GPU)
    assert list(made) == [wanted], made
    got = node.container(ns, "full", "app-0")
    assert got is not None
    assert got["env"]["NVIDIA_VISIBLE_DEVICES"] == made[wanted], got["env"]

    # Its counters are all taken: a 1g.10gb claim on that GPU pends meanwhile.
    core.create_namespaced_pod(ns, claim_pod("small", "small", node.name))
    wait_for(lambda: _unschedulable(api, ns, "small"), WAIT_S, "pod small Unschedulable")

    core.delete_namespaced_pod("full", ns, grace_period_seconds=0)
    pod = wait_for(
        lambda: _running(api, ns, "small"), WAIT_S, "pod small Running once full left",
        detail=tails,
    )  # fmt: skip
    small = _placement(_device(api, ns, pod))
    assert small.profile == "1g.10gb"
    made = agent.mig_instances(MIG_GPU)
    assert list(made) == [small], made
    got = node.container(ns, "small", "app-0")
    assert got is not None
    assert got["env"]["NVIDIA_VISIBLE_DEVICES"] == made[small], got["env"]
    core.delete_namespaced_pod("small", ns, grace_period_seconds=0)
    wait_for(
        lambda: agent.mig_instances(MIG_GPU) == {},
        WAIT_S,
        "the small claim's instance destroyed at unprepare",
        detail=tails,
    )
