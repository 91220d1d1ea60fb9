"""A node agent's token in a real API server does no more than its own node's work, with or without the policies.

The chart is installed twice (default values, so the agent writes as its node: ADR 034), once
with `admissionPolicies.enabled=false`. Each time a real bound token is made for the agent's
service account with the TokenRequest API, as the kubelet makes it for a DaemonSet pod on node
A; with it, as the agent's own account and as node A (constrained impersonation of the node
its pod runs on), the test tries what a compromised agent would:
- change a pod of another node: its spec (an image), its metadata and its status, and the
  allocation record the extender's gate reads;
- write another Node (its report, a label, its capacity);
- act as another node;
- sign an assignment (it cannot read the extender's private key, and its DaemonSet mounts
  none) or put one on a pod of another node;
- take a reservation of another node (its `gpupart.io/mig-plan`, the operator's).
Each is refused in both installs, and nothing the agent was refused is stored. Its own work
(its Node's report and capacity, the record on its own node's pod, its pool's slices, Events)
still goes through: the walls hold without stopping the agent.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Generator
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from gpupart.core.api.wire import ALLOCATION_CONDITION
from gpupart_testsupport.chart import IMAGE_FLAGS
from gpupart_testsupport.cluster import REPO, ControlPlane

from .admission import NODE_NAME_EXTRA, admin_probes, wait_enforced, wait_lifted, with_token

pytestmark = pytest.mark.e2e

CHART = REPO / "charts" / "gpupart"
NAMESPACE = "gpupart-rights-e2e"
NODE_A, NODE_B = "rights-node-a", "rights-node-b"
WORKLOADS = "rights-workloads"


@pytest.fixture(scope="module", params=["policies", "no-policies"])
def install(
    request: pytest.FixtureRequest, k8s_control_plane: ControlPlane
) -> Generator[str, None, None]:
    """The chart installed with or without its admission policies; two Nodes; a pod on each."""
    cp = k8s_control_plane
    release = f"gpupart-rights-{request.param}"  # the fullname too: it holds the chart's name
    policies = request.param == "policies"
    api = cp.api_client()
    core = client.CoreV1Api(api)
    probes = admin_probes(api, "default")
    cp.helm(
        "install", release, str(CHART), *IMAGE_FLAGS, "-n", NAMESPACE, "--create-namespace",
        "--set", f"admissionPolicies.enabled={str(policies).lower()}",
    )  # fmt: skip
    try:
        for node in (NODE_A, NODE_B):
            core.create_node(
                {
                    "metadata": {"name": node, "labels": {"kubernetes.io/hostname": node}},
                    "status": {"capacity": {"cpu": "8"}, "allocatable": {"cpu": "8"}},
                }
            )
        with contextlib.suppress(ApiException):  # made by the first install, kept
            core.create_namespace({"metadata": {"name": WORKLOADS}})
        for node in (NODE_A, NODE_B):
            core.create_namespaced_pod(WORKLOADS, _pod(f"on-{node}", node))
        if policies:
            wait_enforced(probes, release)
        yield release
    finally:
        for namespace in (WORKLOADS, NAMESPACE):
            with contextlib.suppress(ApiException):
                core.delete_collection_namespaced_pod(namespace, grace_period_seconds=0)
        for node in (NODE_A, NODE_B):
            with contextlib.suppress(ApiException):
                core.delete_node(node)
        cp.helm("uninstall", release, "-n", NAMESPACE, "--timeout", "60s", check=False)
        if policies:
            wait_lifted(probes)
        api.close()


def _pod(name: str, node: str, account: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "nodeName": node,
        "containers": [{"name": "main", "image": "gpupart/sleep:0"}],
        "terminationGracePeriodSeconds": 0,
    }
    if account:
        spec["serviceAccountName"] = account
    return {"metadata": {"name": name}, "spec": spec}


class Agent:
    """The agent's bound token: as its own account (`own`) and as its node (`node`)."""

    def __init__(self, cp: ControlPlane, release: str) -> None:
        account = f"{release}-node"
        pod = f"{release}-node-on-a"
        client.CoreV1Api(cp.api_client()).create_namespaced_pod(
            NAMESPACE, _pod(pod, NODE_A, account)
        )
        token = cp.kubectl(
            "create", "token", account, "-n", NAMESPACE,
            "--bound-object-kind", "Pod", "--bound-object-name", pod,
        ).stdout.strip()  # fmt: skip
        who = json.loads(cp.kubectl("auth", "whoami", f"--token={token}", "-o", "json").stdout)
        assert who["status"]["userInfo"]["extra"][NODE_NAME_EXTRA] == [NODE_A]
        self.apis = [with_token(cp, token) for _ in range(3)]
        own, as_a, as_b = self.apis
        as_a.set_default_header("Impersonate-User", f"system:node:{NODE_A}")
        as_b.set_default_header("Impersonate-User", f"system:node:{NODE_B}")
        self.own, self.node, self.other_node = (client.CoreV1Api(a) for a in self.apis)
        self.slices = client.ResourceV1Api(as_a)

    def close(self) -> None:
        for api in self.apis:
            api.close()


@pytest.fixture(scope="module")
def agent(k8s_control_plane: ControlPlane, install: str) -> Generator[Agent, None, None]:
    agent = Agent(k8s_control_plane, install)
    try:
        yield agent
    finally:
        agent.close()


def _status(core: client.CoreV1Api, name: str, body: Any) -> Any:
    return core.patch_namespaced_pod_status(
        name, WORKLOADS, body, _content_type="application/strategic-merge-patch+json"
    )


def _refused(call: Callable[[], object]) -> str:
    """The API server's message refusing `call` (403); the test fails if it is accepted."""
    with pytest.raises(ApiException) as refused:
        call()
    assert refused.value.status == 403, refused.value
    return str(json.loads(refused.value.body or "{}").get("message", ""))


def _unchanged(cp: ControlPlane) -> Callable[[], None]:
    """A check that no Node and no workload pod changed since this call."""
    core = client.CoreV1Api(cp.api_client())

    def versions() -> list[str]:
        nodes = [core.read_node(n).metadata.resource_version for n in (NODE_A, NODE_B)]
        pods = [p.metadata.resource_version for p in core.list_namespaced_pod(WORKLOADS).items]
        return nodes + pods

    before = versions()

    def check() -> None:
        assert versions() == before, "an object changed though every write was refused"

    return check


RECORD = {
    "status": {
        "conditions": [
            {
                "type": ALLOCATION_CONDITION,
                "status": "True",
                "reason": "Allocated",
                "message": '{"containers": []}',
            }
        ]
    }
}


def test_a_pod_of_another_node_is_out_of_reach(
    k8s_control_plane: ControlPlane, agent: Agent
) -> None:
    check = _unchanged(k8s_control_plane)
    theirs = f"on-{NODE_B}"
    image = {"spec": {"containers": [{"name": "main", "image": "attacker/evil:1"}]}}
    labels = {"metadata": {"labels": {"app": "x"}, "annotations": {"note": "x"}}}
    for core in (agent.own, agent.node):
        _refused(lambda core=core: core.patch_namespaced_pod(theirs, WORKLOADS, image))
        _refused(lambda core=core: core.patch_namespaced_pod(theirs, WORKLOADS, labels))
    # pods/status changes metadata too: as its account RBAC refuses it, as node A NodeRestriction.
    _refused(lambda: _status(agent.own, theirs, labels))
    message = _refused(lambda: _status(agent.node, theirs, labels))
    assert (
        f'node "{NODE_A}" can only update pod status for pods with spec.nodeName set to itself'
        in message
    )
    _refused(lambda: _status(agent.node, theirs, RECORD))
    _refused(lambda: agent.node.delete_namespaced_pod(theirs, WORKLOADS))
    check()


def test_another_node_is_out_of_reach(k8s_control_plane: ControlPlane, agent: Agent) -> None:
    check = _unchanged(k8s_control_plane)
    report = {"metadata": {"annotations": {"gpupart.io/inventory": "{}"}}}
    label = {"metadata": {"labels": {"nvidia.com/gpu.present": "false"}}}
    capacity = {"status": {"capacity": {"gpupart.io/gpu-memory": "999999"}}}
    for core in (agent.own, agent.node):
        _refused(lambda core=core: core.patch_node(NODE_B, report))
        _refused(lambda core=core: core.patch_node(NODE_B, label))
        _refused(lambda core=core: core.patch_node_status(NODE_B, capacity))
    assert f'node "{NODE_A}" is not allowed to modify node "{NODE_B}"' in _refused(
        lambda: agent.node.patch_node(NODE_B, report)
    )
    # Nor may it act as node B (associated-node is all its account may impersonate).
    _refused(lambda: agent.other_node.patch_node(NODE_B, report))
    # Its own account writes nothing on its own Node either: only as its node.
    _refused(lambda: agent.own.patch_node(NODE_A, report))
    check()


def test_no_assignment_and_no_reservation_of_another_node(
    k8s_control_plane: ControlPlane, agent: Agent
) -> None:
    check = _unchanged(k8s_control_plane)
    assignment = {
        "metadata": {
            "annotations": {
                "gpupart.io/assignment": json.dumps({"node": NODE_B, "gpu": 0, "memoryMiB": 81920})
            }
        }
    }
    _refused(lambda: _status(agent.node, f"on-{NODE_B}", assignment))
    _refused(lambda: agent.own.patch_namespaced_pod(f"on-{NODE_B}", WORKLOADS, assignment))
    plan = {"metadata": {"annotations": {"gpupart.io/mig-plan": '{"id": "taken"}'}}}
    for core in (agent.own, agent.node, agent.other_node):
        _refused(lambda core=core: core.patch_node(NODE_B, plan))
    check()


def test_it_holds_no_key_that_signs_an_assignment(
    k8s_control_plane: ControlPlane, install: str, agent: Agent
) -> None:
    """An assignment another node's agent believes needs the extender's private key: the
    agent's token cannot read it, and its DaemonSet mounts no Secret (the agents verify with
    the public keys the extender publishes in a ConfigMap, which they may only read)."""
    key = f"{install}-assignment-key"
    for core in (agent.own, agent.node):
        _refused(lambda core=core: core.read_namespaced_secret(key, NAMESPACE))
        _refused(lambda core=core: core.list_namespaced_secret(NAMESPACE))
    daemonset = client.AppsV1Api(k8s_control_plane.api_client()).read_namespaced_daemon_set(
        f"{install}-node", NAMESPACE
    )
    volumes = daemonset.spec.template.spec.volumes or []
    assert [v.name for v in volumes if v.secret is not None] == [], volumes
    public = f"{install}-assignment-public-keys"
    agent.own.read_namespaced_config_map(public, NAMESPACE)  # its one read there
    _refused(
        lambda: agent.own.patch_namespaced_config_map(public, NAMESPACE, {"data": {"keys.pem": ""}})
    )


def test_its_own_work_goes_through(k8s_control_plane: ControlPlane, agent: Agent) -> None:
    """What the agent does each pass, as node A: its report and capacity, the record on its
    own node's pod, an Event, a slice of its pool."""
    admin = client.CoreV1Api(k8s_control_plane.api_client())
    agent.node.patch_node(
        NODE_A, {"metadata": {"annotations": {"gpupart.io/state": '{"by": "a"}'}}}
    )
    agent.node.patch_node_status(
        NODE_A,
        {
            "status": {
                "capacity": {"gpupart.io/gpu-memory": "81920"},
                "allocatable": {"gpupart.io/gpu-memory": "81920"},
            }
        },
    )
    _status(agent.node, f"on-{NODE_A}", RECORD)
    node = admin.read_node(NODE_A)
    assert node.metadata.annotations["gpupart.io/state"] == '{"by": "a"}'
    assert node.status.capacity["gpupart.io/gpu-memory"] == "81920"
    pod = admin.read_namespaced_pod(f"on-{NODE_A}", WORKLOADS)
    assert [c.type for c in pod.status.conditions or [] if c.type == ALLOCATION_CONDITION] == [
        ALLOCATION_CONDITION
    ]
    agent.node.create_namespaced_event(
        WORKLOADS,
        {
            "metadata": {"generateName": "gpupart-"},
            "involvedObject": {"kind": "Pod", "name": f"on-{NODE_A}", "namespace": WORKLOADS},
            "reason": "SharedGpuAllocateRefused",
            "message": "no verified assignment",
            "type": "Warning",
        },
    )
    body = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": f"{NODE_A}-gpu.gpupart.io-0"},
        "spec": {
            "driver": "gpu.gpupart.io",
            "nodeName": NODE_A,
            "pool": {"name": NODE_A, "generation": 0, "resourceSliceCount": 1},
            "devices": [{"name": "gpu-0"}],
        },
    }
    made = agent.slices.create_resource_slice(client.V1ResourceSlice.model_validate(body))
    try:
        theirs = {
            **body,
            "metadata": {"name": f"{NODE_B}-gpu.gpupart.io-0"},
            "spec": {
                **body["spec"],
                "nodeName": NODE_B,
                "pool": {**body["spec"]["pool"], "name": NODE_B},
            },
        }
        _refused(
            lambda: agent.slices.create_resource_slice(
                client.V1ResourceSlice.model_validate(theirs)
            )
        )
    finally:
        agent.slices.delete_resource_slice(made.metadata.name)
