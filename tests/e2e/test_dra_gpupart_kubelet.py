"""Our DRA kubelet plugin on the real kubelet: a claim prepared by `gpupart node --dra`, the container's CDI.

The node agent (simulated GPUs) runs beside a real kubelet (`dra_node`) with `--dra`: it
registers in the node's plugins_registry and writes each claim's CDI spec to the node's CDI
directory, where the fake runtime resolves it. The real kube-scheduler allocates and
kube-controller-manager makes the claims from templates. The desired annotation is written
as the operator writes it (`gpupart_testsupport.dra.start_gpupart_dra`), the pool is the agent's.

The module's node has four simulated A100s: 0 and 1 whole, 2 dynamic MIG (no warm mix: an
instance lives as long as its claim is prepared), 3 MPS. The simulated GPUs' state file (what
NVML would answer) says which MIG instances exist.
"""

from __future__ import annotations

import json
from collections.abc import Generator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from gpupart.core.api.resources import parse_quantity
from gpupart.core.api.spec import GpuConfig, Interface, Mode, MpsSettings
from gpupart.core.dra import names
from gpupart.core.dra.prepare import CDI_KIND
from gpupart.core.mig.catalogue import require_gpu_model
from gpupart.core.mig.layout import MigInstance, Placement
from gpupart.core.node.mps import MEMORY_ENV, THREADS_ENV
from gpupart_testsupport.cluster import ControlPlane
from gpupart_testsupport.dra import (
    GPUPART_GPU_CLASS,
    GROUP,
    PREPARE,
    VERSION,
    WHOLE_DRA,
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
A100 = require_gpu_model("A100-SXM4-80GB")
MIG_GPU, MPS_GPU = 2, 3
CONFIGS = (
    WHOLE_DRA,
    WHOLE_DRA,
    GpuConfig(Mode.MIG, dynamic=True, interface=Interface.DRA),
    GpuConfig(Mode.MPS, mps=MpsSettings(), replicas=8, interface=Interface.DRA),
)
RECOVERY_S = 10
"""The agent's clean window after an Xid."""


@dataclass
class Agent:
    stack: Stack
    uuids: list[str]
    """Each GPU's UUID by index, as the agent's inventory says."""
    state_file: Path
    """The simulated GPUs' state (`--simulate-state`): what NVML holds."""

    def mig_instances(self, index: int) -> dict[MigInstance, str]:
        """The MIG instances GPU `index` holds now, with their UUIDs."""
        gpu = json.loads(self.state_file.read_text())["gpus"][index]
        return {
            MigInstance(Placement(i["start"], i["size"]), i["profile"]): i["uuid"]
            for i in gpu["instances"]
        }


def placement_of(device: str) -> MigInstance:
    """The placement a dynamic MIG device of the MIG GPU names (docs/dra.md)."""
    (found,) = [
        MigInstance(Placement(start, p.memory_slices), p.name)
        for p in A100.profiles
        for start in p.starts
        if names.mig_device_name(MIG_GPU, p.name, start) == device
    ]
    return found


@pytest.fixture(scope="module")
def agent(
    dra_control_plane: ControlPlane, dra_node: KubeletNode, tmp_path_factory: pytest.TempPathFactory
) -> Generator[Agent]:
    """`gpupart node --dra` for the module's node, its four GPUs as CONFIGS, its pool published."""
    install_gpupart_device_classes(dra_control_plane)
    api = dra_control_plane.api_client()
    stack = Stack(dra_control_plane, api, Path(tmp_path_factory.mktemp("dra-agent")))
    try:
        uuids = start_gpupart_dra(
            stack, dra_node, len(CONFIGS), configs=CONFIGS, recovery_s=RECOVERY_S
        )
        yield Agent(stack, uuids, stack.work / f"simgpu-{dra_node.name}.json")
    except BaseException:
        print(stack.tails())
        raise
    finally:
        stack.stop()
        api.close()


def _running(api: Any, ns: str, pod: str) -> dict[str, Any] | None:
    found: dict[str, Any] = api.sanitize_for_serialization(
        client.CoreV1Api(api).read_namespaced_pod(pod, ns)
    )
    return found if found["status"].get("phase") == "Running" else None


def _allocated(api: Any, ns: str, pod: dict[str, Any]) -> dict[str, Any]:
    """The one device result of the pod's claim."""
    claim = client.CustomObjectsApi(api).get_namespaced_custom_object(
        GROUP, VERSION, ns, "resourceclaims", claim_of(pod) or ""
    )
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    return result  # type: ignore[no-any-return]


def test_a_whole_gpu_claim_is_prepared_and_its_container_gets_exactly_that_gpu(
    dra_node: KubeletNode, agent: Agent, dra_namespace: str
) -> None:
    api = agent.stack.api_client
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    ns, node = dra_namespace, dra_node
    custom.create_namespaced_custom_object(
        GROUP,
        VERSION,
        ns,
        "resourceclaimtemplates",
        claim_template("whole", GPUPART_GPU_CLASS),
    )
    core.create_namespaced_pod(ns, claim_pod("app", "whole", node.name, containers=2))

    pod = wait_for(
        lambda: _running(api, ns, "app"),
        WAIT_S,
        "pod app Running",
        detail=lambda: f"{agent.stack.tails()}\n{node.tails()}",
    )
    claim = custom.get_namespaced_custom_object(
        GROUP, VERSION, ns, "resourceclaims", claim_of(pod) or ""
    )
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    assert (result["driver"], result["pool"]) == (names.DRIVER, node.name)
    index = {"gpu-0": 0, "gpu-1": 1}[result["device"]]
    uuid = agent.uuids[index]
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
        assert got["cdi"]["env"]["NVIDIA_VISIBLE_DEVICES"] == uuid, got["cdi"]
        assert got["env"]["NVIDIA_VISIBLE_DEVICES"] == uuid, got["env"]
        assert f"/dev/nvidia{index}" in got["devices"], got["devices"]
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


def test_a_dynamic_mig_claim_makes_exactly_the_allocated_instance_and_deleting_the_pod_destroys_it(
    dra_node: KubeletNode, agent: Agent, dra_namespace: str
) -> None:
    api = agent.stack.api_client
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    ns, node = dra_namespace, dra_node
    assert agent.mig_instances(MIG_GPU) == {}
    custom.create_namespaced_custom_object(
        GROUP, VERSION, ns, "resourceclaimtemplates", claim_template("mig", "mig-1g10gb.gpupart.io")
    )
    core.create_namespaced_pod(ns, claim_pod("mig", "mig", node.name))
    pod = wait_for(
        lambda: _running(api, ns, "mig"),
        WAIT_S,
        "pod mig Running",
        detail=lambda: f"{agent.stack.tails()}\n{node.tails()}",
    )
    result = _allocated(api, ns, pod)
    assert (result["driver"], result["pool"]) == (names.DRIVER, node.name)
    wanted = placement_of(result["device"])
    assert wanted.profile == "1g.10gb"
    # The GPU holds one instance, exactly at the allocated placement.
    made = agent.mig_instances(MIG_GPU)
    assert list(made) == [wanted], made
    got = node.container(ns, "mig", "app-0")
    assert got is not None
    assert not got["cdi"]["unresolved"], got["cdi"]
    assert got["cdi"]["env"]["NVIDIA_VISIBLE_DEVICES"] == made[wanted], got["cdi"]
    assert got["env"]["NVIDIA_VISIBLE_DEVICES"] == made[wanted], got["env"]

    core.delete_namespaced_pod("mig", ns, grace_period_seconds=0)
    wait_for(
        lambda: agent.mig_instances(MIG_GPU) == {},
        WAIT_S,
        "the claim's MIG instance destroyed at unprepare",
        detail=lambda: f"{agent.mig_instances(MIG_GPU)}\n{agent.stack.tails()}",
    )


BURST = (
    [("whole", GPUPART_GPU_CLASS, (), None)] * 2
    + [("mig1g", "mig-1g10gb.gpupart.io", (), None)] * 3
    + [("mig2g", "mig-2g20gb.gpupart.io", (), None)]
    + [("mps", "shared.gpupart.io", (), {names.MEMORY: "5Gi"})] * 8
)
"""Every whole GPU, 5 of the dynamic GPU's 7 compute slices, the MPS GPU's 8 clients."""


def _mismatch(agent: Agent, got: dict[str, Any] | None, result: dict[str, Any]) -> str | None:
    """Why the container's record is not exactly its claim's device and limits, or None."""
    if got is None or got["cdi"]["unresolved"]:
        return f"no container or unresolved CDI: {got}"
    env, device = got["env"], result["device"]
    if device in ("gpu-0", "gpu-1"):
        want = {"NVIDIA_VISIBLE_DEVICES": agent.uuids[int(device[-1])]}
    elif device == names.shared_device_name(MPS_GPU):
        uuid, consumed = agent.uuids[MPS_GPU], result.get("consumedCapacity") or {}
        memory = parse_quantity(consumed.get(names.MEMORY), where="memory") / (1 << 20)
        compute = parse_quantity(consumed.get(names.COMPUTE), where="compute")
        if memory != 5 * 1024 or compute.denominator != 1 or memory.denominator != 1:
            return f"{device}: consumed {consumed}"
        want = {
            "NVIDIA_VISIBLE_DEVICES": uuid,
            MEMORY_ENV: f"{uuid}={int(memory)}M",
            THREADS_ENV: str(int(compute)),
        }
    else:
        mig = agent.mig_instances(MIG_GPU).get(placement_of(device))
        want = {"NVIDIA_VISIBLE_DEVICES": str(mig)}
    wrong = {k: (env.get(k), v) for k, v in want.items() if env.get(k) != v}
    return f"{device}: {wrong}" if wrong else None


def test_a_burst_of_mixed_claims_gives_each_container_exactly_its_device_and_limits(
    dra_node: KubeletNode, agent: Agent, dra_namespace: str
) -> None:
    api = agent.stack.api_client
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    ns, node = dra_namespace, dra_node
    for name, device_class, selectors, capacity in {b[0]: b for b in BURST}.values():
        template = claim_template(name, device_class, selectors=selectors, capacity=capacity)
        custom.create_namespaced_custom_object(
            GROUP, VERSION, ns, "resourceclaimtemplates", template
        )
    pods = [f"burst-{i}" for i in range(len(BURST))]
    for pod, (template, *_) in zip(pods, BURST, strict=True):
        core.create_namespaced_pod(ns, claim_pod(pod, template, node.name))

    def all_running() -> list[dict[str, Any]] | None:
        found = [_running(api, ns, p) for p in pods]
        return found if all(found) else None  # type: ignore[return-value]

    def pending() -> str:
        phases = {p: core.read_namespaced_pod(p, ns).status.phase for p in pods}
        return f"{phases}\n{agent.stack.tails()}\n{node.tails()}"

    running = wait_for(all_running, 3 * WAIT_S, "every burst pod Running", detail=pending)
    results = [_allocated(api, ns, pod) for pod in running]
    devices = [r["device"] for r in results]
    exclusive = [d for d in devices if d != names.shared_device_name(MPS_GPU)]
    assert len(set(exclusive)) == len(exclusive), devices
    made = agent.mig_instances(MIG_GPU)
    assert sorted(made) == sorted(placement_of(d) for d in devices if "-mig-" in d), made
    mismatches = [
        m
        for pod, result in zip(pods, results, strict=True)
        if (m := _mismatch(agent, node.container(ns, pod, "app-0"), result)) is not None
    ]
    assert mismatches == []

    for pod in pods:
        core.delete_namespaced_pod(pod, ns, grace_period_seconds=0)
    wait_for(
        lambda: agent.mig_instances(MIG_GPU) == {},
        WAIT_S,
        "the burst's MIG instances destroyed",
        detail=lambda: f"{agent.mig_instances(MIG_GPU)}\n{agent.stack.tails()}",
    )


def test_a_failed_compute_instance_create_shows_on_the_pod_leaves_no_instance_and_clears(
    dra_node: KubeletNode, agent: Agent, dra_namespace: str
) -> None:
    api = agent.stack.api_client
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    ns, node = dra_namespace, dra_node
    # Every compute instance create fails until cleared (the kubelet retries the prepare).
    fault = {"operation": "CreateComputeInstance", "kind": "InsufficientResources", "times": 10**6}
    agent.stack.inject_faults(node.name, fault)
    try:
        custom.create_namespaced_custom_object(
            GROUP,
            VERSION,
            ns,
            "resourceclaimtemplates",
            claim_template("mig", "mig-1g10gb.gpupart.io"),
        )
        core.create_namespaced_pod(ns, claim_pod("faulty", "mig", node.name))

        def refused() -> str | None:
            events = core.list_namespaced_event(ns, field_selector="involvedObject.name=faulty")
            return next(
                (
                    e.message
                    for e in events.items
                    if e.reason == "FailedPrepareDynamicResources"
                    and "could not create its MIG instance" in (e.message or "")
                ),
                None,
            )

        message = wait_for(
            refused,
            WAIT_S,
            "FailedPrepareDynamicResources with our reason on pod faulty",
            detail=lambda: f"{agent.stack.tails()}\n{node.tails()}",
        )
        assert "CreateComputeInstance" in message and "InsufficientResources" in message, message
        # The GPU instance made before the failing call was rolled back.
        wait_for(
            lambda: agent.mig_instances(MIG_GPU) == {},
            WAIT_S,
            "no MIG instance left after the failed create",
            detail=lambda: f"{agent.mig_instances(MIG_GPU)}",
        )
        assert core.read_namespaced_pod("faulty", ns).status.phase == "Pending"
    finally:
        agent.stack.inject_faults(node.name)

    pod = wait_for(
        lambda: _running(api, ns, "faulty"),
        3 * WAIT_S,
        "pod faulty Running once the fault is cleared",
        detail=lambda: f"{agent.stack.tails()}\n{node.tails()}",
    )
    wanted = placement_of(_allocated(api, ns, pod)["device"])
    made = agent.mig_instances(MIG_GPU)
    assert list(made) == [wanted], made
    got = node.container(ns, "faulty", "app-0")
    assert got is not None and got["env"]["NVIDIA_VISIBLE_DEVICES"] == made[wanted], got
    core.delete_namespaced_pod("faulty", ns, grace_period_seconds=0)
    wait_for(
        lambda: agent.mig_instances(MIG_GPU) == {},
        WAIT_S,
        "the claim's MIG instance destroyed at unprepare",
        detail=agent.stack.tails,
    )


def test_an_xid_on_the_allocated_gpu_shows_unhealthy_on_the_container_and_clears(
    dra_node: KubeletNode, agent: Agent, dra_namespace: str
) -> None:
    """The pod's GPU 1 and the free GPU 0 get an Xid each: the container says Unhealthy, both
    devices are tainted in their slices (one update each, no new generation), a new claim is
    not given the tainted GPU 0, and after the clean window the taints are gone, the container
    is Healthy and the new claim gets GPU 0."""
    import time  # here, not at the top: this test is the only part of the module ADR 028 adds
    from datetime import datetime

    api = agent.stack.api_client
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    ns, node = dra_namespace, dra_node
    gpu_1 = (f'device.attributes["{names.DRIVER}"].{names.INDEX} == 1',)
    gpu_0 = (f'device.attributes["{names.DRIVER}"].{names.INDEX} == 0',)
    custom.create_namespaced_custom_object(
        GROUP, VERSION, ns, "resourceclaimtemplates",
        claim_template("gpu1", GPUPART_GPU_CLASS, selectors=gpu_1),
    )  # fmt: skip
    custom.create_namespaced_custom_object(
        GROUP, VERSION, ns, "resourceclaimtemplates",
        claim_template("gpu0", GPUPART_GPU_CLASS, selectors=gpu_0),
    )  # fmt: skip
    core.create_namespaced_pod(ns, claim_pod("xid", "gpu1", node.name))
    pod = wait_for(
        lambda: _running(api, ns, "xid"),
        WAIT_S,
        "pod xid Running",
        detail=lambda: f"{agent.stack.tails()}\n{node.tails()}",
    )
    assert _allocated(api, ns, pod)["device"] == "gpu-1"
    got = node.container(ns, "xid", "app-0")
    assert got is not None
    # The kubelet names a DRA device by the CDI ID the container got (kubelet 1.36).
    (resource,) = got["cdiDevices"]

    def health() -> str | None:
        """What the kubelet says of the container's device (from our health stream)."""
        found = _running(api, ns, "xid") or {}
        for status in (found.get("status") or {}).get("containerStatuses") or []:
            for allocated in status.get("allocatedResourcesStatus") or []:
                if allocated.get("name") != "claim:gpu":
                    continue
                for r in allocated.get("resources") or []:
                    if r.get("resourceID") == resource:
                        return r.get("health")  # type: ignore[no-any-return]
        return None

    def seen(want: str) -> Any:
        return lambda: health() == want

    def statuses() -> str:
        found = _running(api, ns, "xid") or {}
        return str((found.get("status") or {}).get("containerStatuses"))

    def slices() -> dict[str, dict[str, Any]]:
        """The pool's slices by name, as the API holds them."""
        listed = custom.list_cluster_custom_object(
            GROUP, VERSION, "resourceslices",
            field_selector=f"spec.nodeName={node.name},spec.driver={names.DRIVER}",
        )  # fmt: skip
        return {s["metadata"]["name"]: s for s in listed["items"]}

    def taints() -> dict[str, list[dict[str, Any]]]:
        """Every tainted device of the pool, with its taints."""
        return {
            d["name"]: d["taints"]
            for s in slices().values()
            for d in s["spec"].get("devices") or []
            if d.get("taints")
        }

    def holders(device: str) -> list[str]:
        """The allocated claims of our driver that hold `device` of this node's pool."""
        claims = custom.list_cluster_custom_object(GROUP, VERSION, "resourceclaims")["items"]
        return [
            f"{c['metadata']['namespace']}/{c['metadata']['name']}"
            for c in claims
            for r in ((c.get("status") or {}).get("allocation") or {})
            .get("devices", {})
            .get("results", [])
            if (r["driver"], r["pool"], r["device"]) == (names.DRIVER, node.name, device)
        ]

    def taint_of(device: str) -> dict[str, Any] | None:
        """The device's one taint; None when it has none."""
        found = taints().get(device)
        if found is None:
            return None
        (taint,) = found
        return taint

    wait_for(seen("Healthy"), WAIT_S, "the container's GPU Healthy", detail=statuses)
    # GPU 0 must be free (earlier tests' pods may still be leaving): its taint alone keeps
    # the new claim off it below.
    wait_for(
        lambda: not holders("gpu-0"),
        WAIT_S,
        "no claim holding gpu-0",
        detail=lambda: str(holders("gpu-0")),
    )
    assert taints() == {}
    before = slices()
    (generation,) = {s["spec"]["pool"]["generation"] for s in before.values()}
    started = int(time.time())
    agent.stack.inject_faults(node.name, {"xid": 79, "gpu": 1})  # fell off the bus: fatal
    taint = wait_for(
        lambda: taint_of("gpu-1"),
        WAIT_S,
        "gpu-1 tainted in its slice after the Xid",
        detail=lambda: f"{taints()}\n{agent.stack.tails()}",
    )
    assert taint["key"] == "gpu.gpupart.io/unhealthy" and taint["value"] == "xid-79", taint
    assert taint["effect"] == "NoSchedule", taint  # the running pod is not evicted
    added = datetime.fromisoformat(taint["timeAdded"]).timestamp()
    assert started - 1 <= added <= time.time(), taint
    wait_for(
        seen("Unhealthy"),
        WAIT_S,
        "the container's GPU Unhealthy after the Xid",
        detail=lambda: f"{health()}\n{agent.stack.tails()}",
    )
    # The free GPU 0: an Xid there taints it too, and a new claim is not given it.
    agent.stack.inject_faults(node.name, {"xid": 79, "gpu": 0})
    wait_for(lambda: taint_of("gpu-0"), WAIT_S, "gpu-0 tainted", detail=lambda: f"{taints()}")
    core.create_namespaced_pod(ns, claim_pod("after", "gpu0", node.name))

    def unschedulable() -> str | None:
        # GPU 0 keeps failing while the scheduler tries, however slow it is: each look raises
        # its Xid again (the faults file is rewritten), and the clean window runs from the last.
        agent.stack.inject_faults(node.name, {"xid": 79, "gpu": 0})
        found = core.read_namespaced_pod("after", ns)
        for condition in found.status.conditions or []:
            if condition.type == "PodScheduled" and condition.reason == "Unschedulable":
                return condition.message or ""
        return None

    message = wait_for(
        unschedulable,
        WAIT_S,
        "pod after unschedulable while gpu-0 is tainted",
        detail=lambda: f"{taints()}\n{holders('gpu-0')}",
    )
    assert "cannot allocate all claims" in message, message
    assert holders("gpu-0") == [], "the tainted gpu-0 was allocated"
    assert taint_of("gpu-0") is not None, "gpu-0's taint cleared before the scheduler tried"
    during = slices()
    assert {s["spec"]["pool"]["generation"] for s in during.values()} == {generation}
    assert set(taints()) <= {"gpu-0", "gpu-1"}  # only the faulty GPUs' devices
    # The clean window: no restart needed.
    wait_for(
        lambda: taints() == {},
        WAIT_S + 3 * RECOVERY_S,
        "the taints gone after the clean window",
        detail=lambda: f"{taints()}\n{agent.stack.tails()}",
    )
    wait_for(
        seen("Healthy"),
        WAIT_S + RECOVERY_S,
        "the container's GPU Healthy after the clean window",
        detail=lambda: f"{health()}\n{agent.stack.tails()}",
    )
    after = wait_for(
        lambda: _running(api, ns, "after"),
        WAIT_S,
        "pod after Running on gpu-0 once its taint is gone",
        detail=lambda: f"{taints()}\n{agent.stack.tails()}\n{node.tails()}",
    )
    assert _allocated(api, ns, after)["device"] == "gpu-0"
    now = slices()
    assert set(now) == set(before)
    assert {s["spec"]["pool"]["generation"] for s in now.values()} == {generation}
    # The slices of the healthy GPUs' devices (MIG_GPU's profiles, MPS_GPU's shared device)
    # were not written while the faulty ones were tainted and cleared.
    faulty = {"gpu-0", "gpu-1"}
    untouched = [
        name
        for name, s in before.items()
        if not faulty & {d["name"] for d in s["spec"].get("devices") or []}
    ]
    assert any(names.mig_slice_part("1g.10gb", 1, 1) in n for n in untouched), untouched
    for name in untouched:
        assert (
            now[name]["metadata"]["resourceVersion"] == before[name]["metadata"]["resourceVersion"]
        ), name
    core.delete_namespaced_pod("xid", ns, grace_period_seconds=0)
    core.delete_namespaced_pod("after", ns, grace_period_seconds=0)
