"""Our DRA kubelet plugin through restarts and refusals on the real kubelet: nothing leaked, nothing made twice.

The node agent (`gpupart node --dra`, simulated GPUs) serves a real kubelet (`dra_node`),
with the real kube-scheduler and kube-controller-manager, as in test_dra_gpupart_kubelet.py.
The node has four simulated A100s: 0 and 1 whole, 2 dynamic MIG (an instance lives as long
as its claim is prepared), 3 MPS. Each GPU instance create takes the simulator 5 s, so a
test can kill the agent while NVML makes one. What the GPUs hold is read from the simulated
GPUs' state file (what NVML would answer), what each container got from the fake runtime's
record, what the plugin prepared from its checkpoint.

We test these aspects:
- a kubelet restart under running pods on a whole GPU, a dynamic MIG instance and MPS: the
  plugin registers again, the kubelet's startup wipe of the node's slices is answered by
  republishing them, no container is created again (same container IDs and CDI devices),
  every MIG instance is the one it was (same UUID) and none is made twice; a new claim is
  then prepared (the kubelet's one NodePrepareResources: it prepares only before it creates
  a sandbox), and the restarted kubelet unprepares the claims prepared before it (from its
  own checkpoint): deleting the pods destroys their instances and removes their specs;
- the agent killed (SIGKILL) while NVML creates a claim's MIG instance: started again, the
  kubelet's retry makes exactly one instance at the allocated placement, once, and the pod
  runs on it; a pod running on the same GPU throughout keeps its container and instance;
  deleting the pods destroys both instances;
- one NodePrepareResources batch of two claims (one pod) where one claim's opaque
  configuration for our driver is malformed: the pod stays Pending with our reason in its
  FailedPrepareDynamicResources event, the batch's other claim is prepared once however often
  the kubelet retries, a pod created alongside runs, and deleting the pod releases both;
- one claim with a device of ours and one of the reference driver (dra-example-driver): the
  kubelet sends the claim to both, our plugin prepares (and checkpoints, and writes in its CDI
  spec) only its own device, and the container gets one CDI device of each.
A claim without our pod in `reservedFor`, or with no device of ours, never reaches a plugin
through the real kubelet (it checks `reservedFor` itself and calls only the drivers of the
claim's results): test_dra_prepare.py sends those over gRPC.
"""

from __future__ import annotations

import json
from collections.abc import Generator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from gpupart.core.api.spec import GpuConfig, Interface, Mode, MpsSettings
from gpupart.core.dra import names
from gpupart.core.dra.prepare import CDI_KIND, CONFIG_API_VERSION, CONFIG_KIND
from gpupart.core.mig.catalogue import require_gpu_model
from gpupart.core.mig.layout import MigInstance, Placement
from gpupart_testsupport.cluster import ControlPlane
from gpupart_testsupport.dra import (
    EXAMPLE_CDI_KIND,
    EXAMPLE_DRIVER,
    GPUPART_GPU_CLASS,
    GROUP,
    PREPARE,
    VERSION,
    WHOLE_DRA,
    ExampleDriver,
    claim_pod,
    claim_template,
    device_class,
    grpc_seconds,
    install_gpupart_device_classes,
    kubelet_metrics,
    metric_sum,
    pod_claim_name,
    start_gpupart_dra,
)
from gpupart_testsupport.kubelet import KubeletNode
from gpupart_testsupport.polling import wait_for
from gpupart_testsupport.stack import Stack

pytestmark = pytest.mark.e2e

WAIT_S = 120
A100 = require_gpu_model("A100-SXM4-80GB")
MIG_GPU = 2
CONFIGS = (
    WHOLE_DRA,
    WHOLE_DRA,
    GpuConfig(Mode.MIG, dynamic=True, interface=Interface.DRA),
    GpuConfig(Mode.MPS, mps=MpsSettings(), replicas=8, interface=Interface.DRA),
)
CREATE_S = 5.0
"""The simulator's time for one GPU instance create: the window in which the agent is killed."""
MIG_CLASS = "mig-1g10gb.gpupart.io"


@dataclass
class Agent:
    """The module's node agent and what its simulated GPUs and its plugin hold."""

    stack: Stack
    node: KubeletNode
    uuids: list[str]

    @property
    def proc_name(self) -> str:
        return f"node-{self.node.name}"

    def gpu_state(self) -> dict[str, Any]:
        """The simulated GPUs' state file (`--simulate-state`): what NVML holds."""
        state = self.stack.work / f"simgpu-{self.node.name}.json"
        return json.loads(state.read_text())  # type: ignore[no-any-return]

    def mig_instances(self) -> dict[MigInstance, str]:
        """The MIG GPU's instances now, with their UUIDs."""
        gpu = self.gpu_state()["gpus"][MIG_GPU]
        return {
            MigInstance(Placement(i["start"], i["size"]), i["profile"]): i["uuid"]
            for i in gpu["instances"]
        }

    def compute_instances(self) -> dict[MigInstance, int]:
        """The MIG GPU's instances now, with their compute instance counts (1: whole, 0: half-built)."""
        gpu = self.gpu_state()["gpus"][MIG_GPU]
        return {
            MigInstance(Placement(i["start"], i["size"]), i["profile"]): i["compute_instances"]
            for i in gpu["instances"]
        }

    def created(self) -> int:
        """How many GPU instances the simulated GPUs have ever created."""
        return int(self.gpu_state()["created"])

    def checkpoint(self) -> dict[str, bool]:
        """The plugin's checkpoint: each claim uid it holds, and whether it is complete."""
        path = self.stack.work / f"state-{self.node.name}" / "dra-checkpoint.json"
        if not path.exists():
            return {}
        return {c["uid"]: c["complete"] for c in json.loads(path.read_text())["claims"]}

    def log(self) -> str:
        """The agent's log, every run of it."""
        (proc,) = [p for p in self.stack.processes if p.name == self.proc_name]
        return proc.log.read_text(errors="replace")

    def kill(self) -> None:
        """SIGKILL, as a crash or an OOM kill: no cleanup, its sockets left behind."""
        (proc,) = [p for p in self.stack.processes if p.name == self.proc_name]
        proc.popen.kill()
        proc.popen.wait(30)

    def cdi_spec(self, claim_uid: str) -> Path:
        return self.node.cdi_dir / f"k8s.gpu.gpupart.io-claim_{claim_uid}.json"

    def tails(self) -> str:
        return f"{self.stack.tails()}\n{self.node.tails()}"


@pytest.fixture(scope="module")
def agent(
    dra_control_plane: ControlPlane, dra_node: KubeletNode, tmp_path_factory: pytest.TempPathFactory
) -> Generator[Agent]:
    """`gpupart node --dra` for the module's node, its GPUs as CONFIGS, its pool published."""
    install_gpupart_device_classes(dra_control_plane)
    api = dra_control_plane.api_client()
    stack = Stack(dra_control_plane, api, Path(tmp_path_factory.mktemp("dra-restarts")))
    try:
        uuids = start_gpupart_dra(stack, dra_node, len(CONFIGS), configs=CONFIGS, create_s=CREATE_S)
        yield Agent(stack, dra_node, uuids)
    except BaseException:
        print(stack.tails())
        raise
    finally:
        stack.stop()
        api.close()


# ---- reads ----


def _pod(api: Any, ns: str, pod: str) -> dict[str, Any]:
    found: dict[str, Any] = api.sanitize_for_serialization(
        client.CoreV1Api(api).read_namespaced_pod(pod, ns)
    )
    return found


def _running(api: Any, ns: str, pod: str) -> dict[str, Any] | None:
    found = _pod(api, ns, pod)
    return found if found["status"].get("phase") == "Running" else None


def _claim(api: Any, ns: str, pod: dict[str, Any], name: str = "gpu") -> dict[str, Any]:
    """The ResourceClaim made for the pod's claim `name`."""
    claim: dict[str, Any] = client.CustomObjectsApi(api).get_namespaced_custom_object(
        GROUP, VERSION, ns, "resourceclaims", pod_claim_name(pod, name) or ""
    )
    return claim


def _device(claim: dict[str, Any]) -> str:
    """The one device allocated to the claim."""
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    assert (result["driver"], result["request"]) == (names.DRIVER, "gpu"), result
    return result["device"]  # type: ignore[no-any-return]


def placement_of(device: str) -> MigInstance:
    """The placement a dynamic MIG device of the MIG GPU names (docs/dra.md)."""
    (found,) = [
        MigInstance(Placement(start, p.memory_slices), p.name)
        for p in A100.profiles
        for start in p.starts
        if names.mig_device_name(MIG_GPU, p.name, start) == device
    ]
    return found


def _containers(pod: dict[str, Any]) -> dict[str, tuple[str, int]]:
    """Each container's runtime ID and restart count, as the kubelet reports them."""
    return {
        s["name"]: (s.get("containerID"), s.get("restartCount"))
        for s in pod["status"].get("containerStatuses") or []
    }


def _records(node: KubeletNode, ns: str, pod: str) -> list[tuple[str, list[str]]]:
    """Every CreateContainer the runtime saw for the pod: (container, CDI devices)."""
    return [
        (c["container"], c["cdiDevices"])
        for c in node.created()
        if (c["namespace"], c["pod"]) == (ns, pod)
    ]


def _our_slices(api: Any, node: str) -> dict[str, tuple[str, frozenset[str]]]:
    """The node's slices of our driver: name -> (uid, its device names)."""
    listed = client.CustomObjectsApi(api).list_cluster_custom_object(
        GROUP, VERSION, "resourceslices", field_selector=f"spec.nodeName={node}"
    )["items"]
    return {
        s["metadata"]["name"]: (
            s["metadata"]["uid"],
            frozenset(d["name"] for d in s["spec"].get("devices") or ()),
        )
        for s in listed
        if s["spec"].get("driver") == names.DRIVER
    }


def _pod_syncs(node: KubeletNode) -> float:
    """How many pod syncs the kubelet's pod workers finished in its current run."""
    return metric_sum(kubelet_metrics(node), "kubelet_pod_worker_duration_seconds_count")


def _events(api: Any, ns: str, pod: str, reason: str) -> list[str]:
    core = client.CoreV1Api(api)
    found = core.list_namespaced_event(ns, field_selector=f"involvedObject.name={pod}")
    return [e.message or "" for e in found.items if e.reason == reason]


def _templates(api: Any, ns: str, *templates: dict[str, Any]) -> None:
    custom = client.CustomObjectsApi(api)
    for template in templates:
        custom.create_namespaced_custom_object(
            GROUP, VERSION, ns, "resourceclaimtemplates", template
        )


def _delete_pods(api: Any, ns: str, *pods: str) -> None:
    core = client.CoreV1Api(api)
    for pod in pods:
        core.delete_namespaced_pod(pod, ns, grace_period_seconds=0)


# ---- the tests ----


def test_a_kubelet_restart_keeps_running_pods_and_their_instances_and_registers_again(
    dra_node: KubeletNode, agent: Agent, dra_namespace: str
) -> None:
    api = agent.stack.api_client
    core = client.CoreV1Api(api)
    ns, node = dra_namespace, dra_node
    _templates(
        api,
        ns,
        claim_template("whole", GPUPART_GPU_CLASS),
        claim_template("mig", MIG_CLASS),
        claim_template("mps", "shared.gpupart.io", capacity={names.MEMORY: "10Gi"}),
    )
    pods = ("whole", "mig", "mps")
    for pod in pods:
        core.create_namespaced_pod(ns, claim_pod(pod, pod, node.name))
    running = {
        p: wait_for(
            lambda p=p: _running(api, ns, p), WAIT_S, f"pod {p} Running", detail=agent.tails
        )
        for p in pods
    }
    claims = {p: _claim(api, ns, running[p]) for p in pods}
    uids = {p: c["metadata"]["uid"] for p, c in claims.items()}
    wanted = placement_of(_device(claims["mig"]))
    instances = agent.mig_instances()
    assert list(instances) == [wanted], instances
    containers = {p: _containers(running[p]) for p in pods}
    records = {p: _records(node, ns, p) for p in pods}
    assert all(len(r) == 1 and r[0][1] for r in records.values()), records
    created = agent.created()
    slices = _our_slices(api, node.name)
    devices = {name: found for name, (_, found) in slices.items()}
    registrations = agent.log().count("Registered DRA plugin")

    node.stop_kubelet()
    node.start_kubelet()

    # The new kubelet found the registration socket and accepted the plugin again.
    wait_for(
        lambda: (
            agent.log().count("Registered DRA plugin") > registrations
            and f'driverName="{names.DRIVER}"' in node.kubelet_log()
        ),
        WAIT_S,
        "the plugin registered with the restarted kubelet",
        detail=lambda: f"{agent.tails()}\n{node.kubelet_log()[-3000:]}",
    )

    # Its startup wipe of the node's slices, answered by the agent's publisher: every slice
    # is a new object (a new uid), with the same devices.
    def republished() -> bool:
        now = _our_slices(api, node.name)
        fresh = not {uid for uid, _ in now.values()} & {uid for uid, _ in slices.values()}
        return fresh and {name: found for name, (_, found) in now.items()} == devices

    wait_for(
        republished,
        WAIT_S,
        "the node's slices wiped by the kubelet and published again",
        detail=lambda: f"{_our_slices(api, node.name)}\n{agent.tails()}",
    )

    # A new claim, prepared through the new kubelet's connection.
    core.create_namespaced_pod(ns, claim_pod("after", "mig", node.name))
    after = wait_for(
        lambda: _running(api, ns, "after"), WAIT_S, "pod after Running", detail=agent.tails
    )
    # By now the kubelet synced each pod more than once (its syncFrequency is 5 s): one that
    # wanted to re-create a container or sandbox would have.
    wait_for(
        lambda: _pod_syncs(node) >= 3 * (len(pods) + 1),
        WAIT_S,
        "the restarted kubelet's pod workers through every pod a few times",
    )
    # It prepares only before it creates a sandbox: one call, the new pod's.
    assert grpc_seconds(node, names.DRIVER, PREPARE)[0] == 1
    for pod in pods:
        again = _pod(api, ns, pod)
        assert again["status"]["phase"] == "Running", (pod, again["status"])
        assert _containers(again) == containers[pod], pod
        assert _records(node, ns, pod) == records[pod], pod  # no container created again
    # The instance is the one it was (same UUID); only the new claim's was made.
    new_place = placement_of(_device(_claim(api, ns, after)))
    assert new_place != wanted
    now = agent.mig_instances()
    assert set(now) == {wanted, new_place}, now
    assert now[wanted] == instances[wanted]
    assert agent.created() == created + 1
    assert all(agent.checkpoint().get(uid) is True for uid in uids.values())

    # The restarted kubelet unprepares the claims it prepared before (its own checkpoint).
    _delete_pods(api, ns, *pods, "after")
    wait_for(
        lambda: agent.mig_instances() == {},
        WAIT_S,
        "the MIG instances destroyed at unprepare",
        detail=lambda: f"{agent.mig_instances()}\n{agent.tails()}",
    )
    wait_for(
        lambda: not any(agent.cdi_spec(uid).exists() for uid in uids.values()),
        WAIT_S,
        "every claim's CDI spec removed",
        detail=agent.tails,
    )
    assert not set(uids.values()) & set(agent.checkpoint())


def test_an_agent_killed_mid_create_makes_the_instance_once_and_keeps_running_pods(
    dra_node: KubeletNode, agent: Agent, dra_namespace: str
) -> None:
    api = agent.stack.api_client
    core = client.CoreV1Api(api)
    ns, node = dra_namespace, dra_node
    assert agent.mig_instances() == {}
    _templates(api, ns, claim_template("mig", MIG_CLASS))
    # A pod already running on an instance of the same GPU when the agent dies.
    core.create_namespaced_pod(ns, claim_pod("steady", "mig", node.name))
    steady = wait_for(
        lambda: _running(api, ns, "steady"), WAIT_S, "pod steady Running", detail=agent.tails
    )
    steady_uid = _claim(api, ns, steady)["metadata"]["uid"]
    steady_at = placement_of(_device(_claim(api, ns, steady)))
    steady_uuid = agent.mig_instances()[steady_at]
    steady_records = _records(node, ns, "steady")
    created = agent.created()
    core.create_namespaced_pod(ns, claim_pod("slow", "mig", node.name))

    def claim_uid() -> str | None:
        pod = _pod(api, ns, "slow")
        return _claim(api, ns, pod)["metadata"]["uid"] if pod_claim_name(pod) else None

    uid = wait_for(claim_uid, WAIT_S, "the pod's claim made")
    # The plugin writes the claim's entry before it asks NVML for the instance (CREATE_S).
    wait_for(
        lambda: agent.checkpoint().get(uid) is False,
        WAIT_S,
        "the claim's write-ahead entry (its instance being made)",
        detail=agent.tails,
    )
    agent.kill()
    assert agent.checkpoint().get(uid) is False, "the kill came after the prepare finished"
    wanted = placement_of(_device(_claim(api, ns, _pod(api, ns, "slow"))))
    # Killed inside NVML's create: nothing, or the GPU instance without its compute instance,
    # and only at the allocated placement.
    assert set(agent.compute_instances()) - {steady_at} <= {wanted}, agent.compute_instances()
    agent.stack.restart_agent(node.name)

    pod = wait_for(
        lambda: _running(api, ns, "slow"),
        3 * WAIT_S,
        "pod slow Running after the agent's restart",
        detail=agent.tails,
    )
    assert _device(_claim(api, ns, pod)) == names.mig_device_name(
        MIG_GPU, wanted.profile, wanted.placement.start
    )
    # Exactly the two claims' instances, each whole, each where allocated; the new one made once.
    assert agent.compute_instances() == {steady_at: 1, wanted: 1}
    assert agent.created() == created + 1
    assert agent.checkpoint() == {steady_uid: True, uid: True}
    got = node.container(ns, "slow", "app-0")
    assert got is not None and not got["cdi"]["unresolved"], got
    assert got["env"]["NVIDIA_VISIBLE_DEVICES"] == agent.mig_instances()[wanted], got["env"]
    # The pod that ran through it all: the same container on the same instance.
    assert _containers(_pod(api, ns, "steady")) == _containers(steady)
    assert _records(node, ns, "steady") == steady_records
    assert agent.mig_instances()[steady_at] == steady_uuid

    # The restarted agent releases both, the one it prepared and the one its checkpoint names.
    _delete_pods(api, ns, "slow", "steady")
    wait_for(
        lambda: (
            agent.mig_instances() == {}
            and not any(agent.cdi_spec(u).exists() for u in (uid, steady_uid))
        ),
        WAIT_S,
        "both claims' MIG instances destroyed and their specs removed at unprepare",
        detail=lambda: f"{agent.mig_instances()}\n{agent.tails()}",
    )
    assert agent.checkpoint() == {}


def test_a_malformed_opaque_config_fails_only_its_claim_of_the_batch(
    dra_node: KubeletNode, agent: Agent, dra_namespace: str
) -> None:
    api = agent.stack.api_client
    core = client.CoreV1Api(api)
    ns, node = dra_namespace, dra_node
    assert agent.mig_instances() == {}
    bad = claim_template("bad", GPUPART_GPU_CLASS)
    bad["spec"]["spec"]["devices"]["config"] = [
        {
            "requests": ["gpu"],
            "opaque": {
                "driver": names.DRIVER,
                # A tenant's knob that the claim config does not have (ADR 026).
                "parameters": {
                    "apiVersion": CONFIG_API_VERSION,
                    "kind": CONFIG_KIND,
                    "sharing": "MPS",
                },
            },
        }
    ]
    _templates(
        api, ns, bad, claim_template("mig", MIG_CLASS),
        claim_template("whole", GPUPART_GPU_CLASS),
    )  # fmt: skip
    # One pod, two claims of our driver: the kubelet sends both in one NodePrepareResources.
    mixed = claim_pod("mixed", "mig", node.name)
    mixed["spec"]["resourceClaims"].append({"name": "bad", "resourceClaimTemplateName": "bad"})
    mixed["spec"]["containers"][0]["resources"]["claims"].append({"name": "bad"})
    created, prepares = agent.created(), grpc_seconds(node, names.DRIVER, PREPARE)[0]
    core.create_namespaced_pod(ns, mixed)
    core.create_namespaced_pod(ns, claim_pod("beside", "whole", node.name))

    def refused() -> str | None:
        found = _events(api, ns, "mixed", "FailedPrepareDynamicResources")
        return next((m for m in found if "unknown field" in m), None)

    message = wait_for(
        refused,
        WAIT_S,
        "FailedPrepareDynamicResources with our reason on pod mixed",
        detail=agent.tails,
    )
    pod = _pod(api, ns, "mixed")
    good, wrong = _claim(api, ns, pod), _claim(api, ns, pod, "bad")
    assert f"claim {ns}/{wrong['metadata']['name']}:" in message, message
    assert "parameters.sharing: unknown field" in message, message
    wait_for(lambda: _running(api, ns, "beside"), WAIT_S, "pod beside Running", detail=agent.tails)
    # The kubelet retries the batch; the good claim is prepared once, its instance made once.
    wait_for(
        lambda: grpc_seconds(node, names.DRIVER, PREPARE)[0] >= prepares + 3,
        3 * WAIT_S,
        "the kubelet's retries of pod mixed's batch",
        detail=agent.tails,
    )
    held = agent.checkpoint()
    assert held.get(good["metadata"]["uid"]) is True, held
    assert wrong["metadata"]["uid"] not in held, held
    assert agent.compute_instances() == {placement_of(_device(good)): 1}
    assert agent.created() == created + 1
    assert agent.cdi_spec(good["metadata"]["uid"]).exists()
    assert _pod(api, ns, "mixed")["status"]["phase"] == "Pending"
    assert _records(node, ns, "mixed") == []  # no container, no sandbox

    # The kubelet unprepares both claims of a pod that never ran: the good one's instance goes.
    _delete_pods(api, ns, "mixed", "beside")
    wait_for(
        lambda: (
            agent.mig_instances() == {} and not agent.cdi_spec(good["metadata"]["uid"]).exists()
        ),
        WAIT_S,
        "the prepared claim of the failed batch released when its pod left",
        detail=lambda: f"{agent.mig_instances()}\n{agent.tails()}",
    )
    assert good["metadata"]["uid"] not in agent.checkpoint()


def test_a_claim_with_another_drivers_device_too_is_prepared_by_each_driver_for_its_own(
    dra_control_plane: ControlPlane, dra_node: KubeletNode, agent: Agent, dra_namespace: str
) -> None:
    api = agent.stack.api_client
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    ns, node = dra_namespace, dra_node
    try:
        custom.create_cluster_custom_object(
            GROUP, VERSION, "deviceclasses", device_class(EXAMPLE_DRIVER, EXAMPLE_DRIVER)
        )
    except client.ApiException as e:
        if e.status != 409:  # another module of the session made it
            raise
    example = ExampleDriver(node, dra_control_plane.kubeconfig, devices=2)
    example.start()
    try:
        # One claim, two requests: the kubelet sends it to both drivers, each prepares its own.
        template = claim_template("both", GPUPART_GPU_CLASS)
        requests = template["spec"]["spec"]["devices"]["requests"]
        requests.append(
            {
                "name": "other",
                "exactly": {"deviceClassName": EXAMPLE_DRIVER, "allocationMode": "ExactCount"},
            }
        )
        _templates(api, ns, template)
        body = claim_pod("both", "both", node.name)
        body["spec"]["containers"][0]["resources"]["claims"] = [
            {"name": "gpu", "request": "gpu"},
            {"name": "gpu", "request": "other"},
        ]
        core.create_namespaced_pod(ns, body)
        pod = wait_for(
            lambda: _running(api, ns, "both"),
            WAIT_S,
            "pod both Running",
            detail=lambda: f"{agent.tails()}\n{example.tail()}",
        )
        claim = _claim(api, ns, pod)
        uid = claim["metadata"]["uid"]
        results = claim["status"]["allocation"]["devices"]["results"]
        assert sorted(r["driver"] for r in results) == [EXAMPLE_DRIVER, names.DRIVER], results
        (ours,) = [r["device"] for r in results if r["driver"] == names.DRIVER]
        got = node.container(ns, "both", "app-0")
        assert got is not None and not got["cdi"]["unresolved"], got
        ids = got["cdiDevices"]
        assert [i for i in ids if i.startswith(f"{CDI_KIND}=")] == [f"{CDI_KIND}={uid}-gpu"], ids
        assert any(i.startswith(f"{EXAMPLE_CDI_KIND}={uid}") for i in ids), ids
        # Our spec and checkpoint hold our device only; the container sees our GPU.
        spec = json.loads(agent.cdi_spec(uid).read_text())
        assert [d["name"] for d in spec["devices"]] == [f"{uid}-gpu"], spec
        assert got["cdi"]["env"]["NVIDIA_VISIBLE_DEVICES"] == agent.uuids[int(ours[-1])]
        assert agent.checkpoint() == {uid: True}

        _delete_pods(api, ns, "both")
        wait_for(
            lambda: not agent.cdi_spec(uid).exists() and uid not in agent.checkpoint(),
            WAIT_S,
            "our part of the claim unprepared",
            detail=agent.tails,
        )
    finally:
        example.stop()
