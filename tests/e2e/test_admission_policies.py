"""Admission policies in a real API server: tenants forge no annotation, GPU pods go through the scheduler.

Each node agent writes only its own Node and the pods bound to it, and only its own fields.
The chart is installed with `node.writeAs=serviceAccount`, where the agent writes as its own
account and this policy is the wall; with the default (`node`: it writes as its node, which the
API server itself confines) tests/e2e/test_node_agent_rights.py tries the same attacks.

The release is installed with `helm install`; requests are made as an impersonated tenant (a
user with only a namespaced Role on pods), as the components' service accounts (the node
agent's with the node name a bound token carries) and with a real bound token from the
TokenRequest API. No chart pod runs (no controller-manager): the test checks what the API
server accepts and stores.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Generator
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from gpupart.core.api.wire import ALLOCATION_CONDITION
from gpupart.core.dra.names import DRIVER
from gpupart_extender.kube import ApiBinder
from gpupart_testsupport.chart import IMAGE_FLAGS
from gpupart_testsupport.cluster import REPO, ControlPlane
from gpupart_testsupport.polling import wait_for

from .admission import (
    NODE_NAME_EXTRA,
    admin_probes,
    impersonating,
    refusal,
    refused_by,
    service_account,
    wait_enforced,
    wait_lifted,
    with_token,
)

pytestmark = pytest.mark.e2e

CHART = REPO / "charts" / "gpupart"
RELEASE = "gpupart-vap"  # the fullname too: it contains the chart's name
NAMESPACE = "gpupart-vap-e2e"
TENANT = "vap-tenant"  # the user, and its namespace
NODE_A, NODE_B = "vap-node-a", "vap-node-b"
OWNERS = f"{RELEASE}-annotation-owners"
SCHEDULED = f"{RELEASE}-gpu-pods-scheduled"
AGENT_POLICY = f"{RELEASE}-node-agent"
AGENT = service_account(NAMESPACE, f"{RELEASE}-node")
OPERATOR = service_account(NAMESPACE, f"{RELEASE}-operator")
SCHEDULER = service_account(NAMESPACE, f"{RELEASE}-scheduler")  # the extender's sidecar
ASSIGNMENT, ALLOCATION = "gpupart.io/assignment", "gpupart.io/allocation"
RECORD = ALLOCATION_CONDITION


@pytest.fixture(scope="module")
def cp(k8s_control_plane: ControlPlane) -> Generator[ControlPlane, None, None]:
    """The chart installed (default values: dedicated scheduler), its policies enforced; two
    Nodes; a tenant with pods create/get/list/patch/delete in its own namespace only."""
    cp = k8s_control_plane
    api = cp.api_client()
    core = client.CoreV1Api(api)
    rbac = client.RbacAuthorizationV1Api(api)
    cp.helm(
        "install", RELEASE, str(CHART), *IMAGE_FLAGS, "-n", NAMESPACE, "--create-namespace",
        "--set", "node.writeAs=serviceAccount",
    )  # fmt: skip
    probes = admin_probes(api, "default")
    try:
        for node in (NODE_A, NODE_B):
            core.create_node(
                {
                    "metadata": {"name": node, "labels": {"kubernetes.io/hostname": node}},
                    "status": {
                        "capacity": {"cpu": "8", "nvidia.com/gpu.shared": "4"},
                        "allocatable": {"cpu": "8", "nvidia.com/gpu.shared": "4"},
                    },
                }
            )
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
        agent = client.CoreV1Api(impersonating(cp, AGENT))
        probes_with_agent = {
            **probes,
            "node-agent": lambda: agent.patch_node(NODE_A, _annotate({"x": "y"}), dry_run="All"),
        }
        wait_enforced(probes_with_agent, RELEASE)
        yield cp
    finally:
        core.delete_collection_namespaced_pod(TENANT, grace_period_seconds=0)
        core.delete_collection_namespaced_pod(NAMESPACE, grace_period_seconds=0)
        for node in (NODE_A, NODE_B):
            core.delete_node(node)
        cp.helm("uninstall", RELEASE, "-n", NAMESPACE, "--timeout", "60s", check=False)
        # Later modules write gpupart.io/ annotations as the admin.
        wait_lifted(probes)
        api.close()


def _annotate(annotations: dict[str, str | None]) -> dict[str, Any]:
    return {"metadata": {"annotations": annotations}}


def _core(cp: ControlPlane, user: str | None = None, node: str | None = None) -> client.CoreV1Api:
    return client.CoreV1Api(cp.api_client() if user is None else impersonating(cp, user, node=node))


def _pod(
    name: str,
    *,
    annotations: dict[str, str] | None = None,
    node: str | None = None,
    limits: dict[str, str] | None = None,
    requests: dict[str, str] | None = None,
    init: bool = False,
) -> dict[str, Any]:
    resources: dict[str, Any] = {}
    if limits:
        resources["limits"] = limits
    if requests:
        resources["requests"] = requests
    container = {"name": "main", "image": "gpupart/sleep:0", "resources": resources}
    spec: dict[str, Any] = {"containers": [{"name": "main", "image": "gpupart/sleep:0"}]}
    if init:
        spec["initContainers"] = [{**container, "name": "init"}]
    else:
        spec["containers"] = [container]
    if node:
        spec["nodeName"] = node
    spec["terminationGracePeriodSeconds"] = 0
    return {"metadata": {"name": name, "annotations": annotations or {}}, "spec": spec}


def _bind(
    cp: ControlPlane,
    user: str | None,
    name: str,
    node: str,
    annotations: dict[str, str] | None = None,
) -> None:
    """POST pods/NAME/binding as `user` (None: the admin) through the extender's own binder."""
    api = cp.api_client() if user is None else impersonating(cp, user)
    try:
        ApiBinder(api).bind(TENANT, name, "", node, annotations or {})
    finally:
        api.close()


def _bind_legacy(
    cp: ControlPlane, user: str | None, name: str, node: str, annotations: dict[str, str]
) -> None:
    """POST the namespaced `bindings` resource, which also copies its annotations onto the pod."""
    body = {
        "metadata": {"name": name, "annotations": annotations},
        "target": {"apiVersion": "v1", "kind": "Node", "name": node},
    }
    # The answer is a Status, which the generated method cannot decode as a Binding.
    _core(cp, user).create_namespaced_binding(TENANT, body, _preload_content=False)


def _tenant_pod(cp: ControlPlane, name: str, **kwargs: Any) -> str:
    """A pending pod the tenant made (no annotations, no node)."""
    _core(cp, TENANT).create_namespaced_pod(TENANT, _pod(name, **kwargs))
    return name


def _bound_pod(cp: ControlPlane, name: str, node: str) -> str:
    """A tenant's shared-GPU pod, bound by the extender (the scheduler's account) with an
    assignment, as gpupart-scheduler does."""
    _tenant_pod(cp, name, limits={"nvidia.com/gpu.shared": "1", "gpupart.io/gpu-memory": "1024"})
    _bind(cp, SCHEDULER, name, node, {ASSIGNMENT: '{"gpu": 0}'})
    return name


# -- tenants ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "owner"),
    [
        (
            ASSIGNMENT,
            f"only the gpupart extender writes it, in the Binding that places the pod ({SCHEDULER})",
        ),
        # Where the allocation record was before ADR 034: now nobody's, like any other key.
        (ALLOCATION, "no gpupart component writes this key"),
        ("gpupart.io/anything", "no gpupart component writes this key"),
    ],
)
def test_a_tenant_cannot_create_a_pod_with_a_gpupart_annotation(
    cp: ControlPlane, key: str, owner: str
) -> None:
    tenant = _core(cp, TENANT)
    name = f"forged-{key.rsplit('/', 1)[1]}"
    forged = _pod(name, annotations={key: '{"node": "vap-node-a", "gpu": 0, "memoryMiB": 81920}'})
    message = refused_by(OWNERS, lambda: tenant.create_namespaced_pod(TENANT, forged))
    assert f"{key} on Pod {TENANT}/{name}: set at creation by {TENANT}, but {owner}" in message
    with pytest.raises(ApiException) as gone:
        tenant.read_namespaced_pod(name, TENANT)
    assert gone.value.status == 404


def test_a_tenant_cannot_add_change_or_remove_a_gpupart_annotation(cp: ControlPlane) -> None:
    tenant = _core(cp, TENANT)
    name = _tenant_pod(cp, "patched")
    for key, owner in ((ASSIGNMENT, SCHEDULER), (ALLOCATION, "no gpupart component")):
        message = refused_by(
            OWNERS,
            lambda key=key: tenant.patch_namespaced_pod(name, TENANT, _annotate({key: "{}"})),
        )
        assert f"{key} on Pod {TENANT}/{name}: added by {TENANT}" in message
        assert owner in message
    # Its own annotations and labels are the tenant's.
    tenant.patch_namespaced_pod(
        name, TENANT, {"metadata": {"annotations": {"team": "a"}, "labels": {"app": "x"}}}
    )
    assert tenant.read_namespaced_pod(name, TENANT).metadata.annotations == {"team": "a"}
    bound = _bound_pod(cp, "assigned", NODE_A)
    for value, verb in (('{"gpu": 1}', "changed"), (None, "removed")):
        message = refused_by(
            OWNERS,
            lambda value=value: tenant.patch_namespaced_pod(
                bound, TENANT, _annotate({ASSIGNMENT: value})
            ),
        )
        assert f"{ASSIGNMENT} on Pod {TENANT}/{bound}: {verb} by {TENANT}" in message
    assert tenant.read_namespaced_pod(bound, TENANT).metadata.annotations == {
        ASSIGNMENT: '{"gpu": 0}'
    }


@pytest.mark.parametrize(
    ("kwargs", "asks"),
    [
        ({"limits": {"nvidia.com/gpu": "1"}}, "nvidia.com/gpu (container main)"),
        # A map's keys come in no fixed order: either way round.
        (
            {"limits": {"nvidia.com/gpu.shared": "1", "gpupart.io/gpu-memory": "1"}},
            (
                "gpupart.io/gpu-memory, nvidia.com/gpu.shared (container main)",
                "nvidia.com/gpu.shared, gpupart.io/gpu-memory (container main)",
            ),
        ),
        # Extended resources must be in limits (validation refuses requests alone): named once.
        (
            {
                "requests": {"gpupart.io/gpu-compute": "1"},
                "limits": {"gpupart.io/gpu-compute": "1"},
            },
            "gpupart.io/gpu-compute (container main)",
        ),
        (
            {"limits": {"nvidia.com/mig-1g.10gb": "1"}, "init": True},
            "nvidia.com/mig-1g.10gb (container init)",
        ),
    ],
)
def test_a_gpu_pod_with_a_preset_node_name_is_refused(
    cp: ControlPlane, kwargs: dict[str, Any], asks: str | tuple[str, ...]
) -> None:
    pod = _pod("placed-by-hand", node=NODE_A, **kwargs)
    message = refused_by(SCHEDULED, lambda: _core(cp, TENANT).create_namespaced_pod(TENANT, pod))
    head = f"Pod {TENANT}/placed-by-hand sets spec.nodeName={NODE_A} and asks for "
    assert any(head + one in message for one in ((asks,) if isinstance(asks, str) else asks)), (
        message
    )
    assert "set schedulerName: gpupart-scheduler instead" in message


def test_a_cpu_pod_with_a_preset_node_name_is_still_allowed(cp: ControlPlane) -> None:
    tenant = _core(cp, TENANT)
    tenant.create_namespaced_pod(TENANT, _pod("cpu-by-hand", node=NODE_A, limits={"cpu": "1"}))
    assert tenant.read_namespaced_pod("cpu-by-hand", TENANT).spec.node_name == NODE_A


def test_mirror_pods_of_kubelets_are_exempt(cp: ControlPlane) -> None:
    pod = _pod("static-gpu", node=NODE_A, limits={"nvidia.com/gpu": "1"})
    pod.update(apiVersion="v1", kind="Pod")
    pod["metadata"]["namespace"] = TENANT
    # A mirror pod as the kubelet makes it (NodeRestriction lets a node create no other kind):
    # the mirror annotation, and its Node as the one owner.
    node_uid = _core(cp).read_node(NODE_A).metadata.uid
    pod["metadata"]["annotations"] = {"kubernetes.io/config.mirror": "hash"}
    pod["metadata"]["ownerReferences"] = [
        {"apiVersion": "v1", "kind": "Node", "name": NODE_A, "uid": node_uid, "controller": True}
    ]
    # As a kubelet (the Node authorizer's group system:nodes); a dry run asks admission and
    # stores nothing.
    created = cp.kubectl(
        "create", "-f", "-", "--dry-run=server", "-o", "name",
        f"--as=system:node:{NODE_A}", "--as-group=system:nodes",
        input=json.dumps(pod),
    )  # fmt: skip
    assert created.stdout.strip() == "pod/static-gpu"
    refused = cp.kubectl(
        "create", "-f", "-", "--dry-run=server", "-o", "name", "--as=someone", "--as-group=system:masters",
        input=json.dumps(pod), check=False,
    )  # fmt: skip
    assert refused.returncode != 0 and SCHEDULED in refused.stderr


# -- the Binding ------------------------------------------------------------------------------


def test_only_the_extender_binds_with_an_assignment(cp: ControlPlane) -> None:
    name = _tenant_pod(cp, "to-bind", limits={"nvidia.com/gpu.shared": "1"})
    forged = {ASSIGNMENT: '{"gpu": 0}'}
    # The tenant has no pods/binding at all; the admin has, but does not own the key.
    with pytest.raises(ApiException) as rbac:
        _bind(cp, TENANT, name, NODE_A, forged)
    assert rbac.value.status == 403
    assert 'cannot create resource "pods/binding"' in json.loads(rbac.value.body)["message"]
    message = refused_by(OWNERS, lambda: _bind(cp, None, name, NODE_A, forged))
    assert f"{ASSIGNMENT} on the Binding of Pod {TENANT}/{name}: added by admin" in message
    assert SCHEDULER in message
    message = refused_by(OWNERS, lambda: _bind_legacy(cp, None, name, NODE_A, forged))
    assert f"{ASSIGNMENT} on the Binding of Pod {TENANT}/{name}: added by admin" in message
    # Nor may the extender carry the node agent's record in a Binding.
    message = refused_by(OWNERS, lambda: _bind(cp, SCHEDULER, name, NODE_A, {ALLOCATION: "[]"}))
    assert f"{ALLOCATION} on the Binding of Pod {TENANT}/{name}: added by {SCHEDULER}" in message
    assert _core(cp).read_namespaced_pod(name, TENANT).spec.node_name is None
    _bind(cp, SCHEDULER, name, NODE_A, forged)
    pod = _core(cp).read_namespaced_pod(name, TENANT)
    assert pod.spec.node_name == NODE_A and pod.metadata.annotations == forged


def test_a_binding_without_gpupart_annotations_is_anyones(cp: ControlPlane) -> None:
    name = _tenant_pod(cp, "plain-bind", limits={"cpu": "1"})
    _bind(cp, None, name, NODE_B)  # the default scheduler's way
    assert _core(cp).read_namespaced_pod(name, TENANT).spec.node_name == NODE_B


# -- the operator ------------------------------------------------------------------------------


def test_the_operator_alone_writes_the_desired_layout_and_the_mig_plan(cp: ControlPlane) -> None:
    operator = _core(cp, OPERATOR)
    operator.patch_node(
        NODE_B, _annotate({"gpupart.io/desired": "[]", "gpupart.io/mig-plan": "{}"})
    )
    annotations = _core(cp).read_node(NODE_B).metadata.annotations
    assert annotations["gpupart.io/desired"] == "[]" and annotations["gpupart.io/mig-plan"] == "{}"
    message = refused_by(
        OWNERS, lambda: operator.patch_node(NODE_B, _annotate({"gpupart.io/state": "{}"}))
    )
    assert (
        f"gpupart.io/state on Node {NODE_B}: added by {OPERATOR}, but only the gpupart node agent"
        in message
    )
    message = refused_by(
        OWNERS, lambda: _core(cp).patch_node(NODE_B, _annotate({"gpupart.io/desired": None}))
    )
    assert (
        f"gpupart.io/desired on Node {NODE_B}: removed by admin, but only the gpupart operator"
        in message
    )
    # The node agent of that very node may not write the operator's keys either (both the
    # owners' and the agent's policies refuse; the API server reports one of them).
    agent = _core(cp, AGENT, NODE_B)
    found = refusal(lambda: agent.patch_node(NODE_B, _annotate({"gpupart.io/desired": "x"})))
    assert found is not None and found[0] in (OWNERS, AGENT_POLICY)
    assert "gpupart.io/desired" in found[1]
    assert _core(cp).read_node(NODE_B).metadata.annotations["gpupart.io/desired"] == "[]"


# -- the node agent ------------------------------------------------------------------------------


def test_the_node_agent_writes_its_own_nodes_report_and_gpu_capacity(cp: ControlPlane) -> None:
    agent = _core(cp, AGENT, NODE_A)
    agent.patch_node(
        NODE_A, _annotate({"gpupart.io/state": '{"v": 1}', "gpupart.io/inventory": "{}"})
    )
    agent.patch_node_status(
        NODE_A,
        {"status": {"capacity": {"nvidia.com/gpu.shared": "8", "gpupart.io/gpu-memory": "81920"},
                    "allocatable": {"nvidia.com/gpu.shared": "8", "nvidia.com/mig-1g.10gb": "7"}}},
    )  # fmt: skip
    node = _core(cp).read_node(NODE_A)
    assert node.metadata.annotations["gpupart.io/state"] == '{"v": 1}'
    assert node.status.capacity["nvidia.com/gpu.shared"] == "8"
    assert node.status.allocatable["nvidia.com/mig-1g.10gb"] == "7"
    assert node.status.capacity["cpu"] == "8"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda agent: agent.patch_node(NODE_B, _annotate({"gpupart.io/state": "{}"})),
            f"the gpupart node agent of node {NODE_A} may change only Node {NODE_A}, not Node {NODE_B}",
        ),
        (
            lambda agent: agent.patch_node(NODE_A, _annotate({"gpupart.io/mig-plan": "{}"})),
            "gpupart.io/mig-plan",  # the operator's: both policies refuse
        ),
        (
            lambda agent: agent.patch_node(NODE_A, _annotate({"note": "x"})),
            "changes metadata.annotations[note]",
        ),
        (
            lambda agent: agent.patch_node(
                NODE_A, {"metadata": {"labels": {"nvidia.com/gpu.present": "false"}}}
            ),
            "changes metadata.labels",
        ),
        (
            lambda agent: agent.patch_node(NODE_A, {"spec": {"unschedulable": True}}),
            "changes spec",
        ),
        (
            lambda agent: agent.patch_node_status(NODE_A, {"status": {"capacity": {"cpu": "64"}}}),
            "this request changes status capacity[cpu]",
        ),
        (
            lambda agent: agent.patch_node_status(
                NODE_A, {"status": {"conditions": [{"type": "Ready", "status": "False"}]}}
            ),
            "this request changes status conditions",
        ),
        (
            lambda agent: agent.delete_node(NODE_A),
            None,  # RBAC: the agent has no delete
        ),
    ],
    ids=[
        "another-node",
        "operator-key",
        "other-annotation",
        "label",
        "spec",
        "cpu-capacity",
        "conditions",
        "delete",
    ],
)
def test_the_node_agent_may_change_nothing_else_on_nodes(
    cp: ControlPlane, change: Any, message: str | None
) -> None:
    agent = _core(cp, AGENT, NODE_A)
    before = _core(cp).read_node(NODE_A).to_dict(), _core(cp).read_node(NODE_B).to_dict()
    if message is None:
        with pytest.raises(ApiException) as denied:
            change(agent)
        assert denied.value.status == 403
    else:
        assert message in refused_by((AGENT_POLICY, OWNERS), lambda: change(agent))
    after = _core(cp).read_node(NODE_A).to_dict(), _core(cp).read_node(NODE_B).to_dict()
    assert [n["metadata"]["resource_version"] for n in after] == [
        n["metadata"]["resource_version"] for n in before
    ]


def _record(given: str = "[]") -> dict[str, Any]:
    """A pods/status patch setting the allocation record (its message: `given`)."""
    condition = {"type": RECORD, "status": "True", "reason": "Allocated", "message": given}
    return {"status": {"conditions": [condition]}}


def _patch_status(core: client.CoreV1Api, name: str, namespace: str, body: Any) -> Any:
    return core.patch_namespaced_pod_status(
        name, namespace, body, _content_type="application/strategic-merge-patch+json"
    )


def test_the_node_agent_records_allocations_of_its_own_nodes_pods_only(cp: ControlPlane) -> None:
    name = _bound_pod(cp, "served", NODE_A)
    mine, other = _core(cp, AGENT, NODE_A), _core(cp, AGENT, NODE_B)
    message = refused_by(AGENT_POLICY, lambda: _patch_status(other, name, TENANT, _record()))
    assert (
        f"may change only pods bound to node {NODE_B}; Pod {TENANT}/{name} is bound to node {NODE_A}"
        in message
    )
    _patch_status(mine, name, TENANT, _record('[{"container": "main"}]'))
    pod = _core(cp).read_namespaced_pod(name, TENANT)
    (record,) = [c for c in pod.status.conditions if c.type == RECORD]
    assert record.message == '[{"container": "main"}]'
    pending = _tenant_pod(cp, "not-yet-bound")
    message = refused_by(AGENT_POLICY, lambda: _patch_status(mine, pending, TENANT, _record()))
    assert f"Pod {TENANT}/{pending} is not bound to a node" in message


def test_the_node_agent_cannot_change_a_pods_spec_or_its_other_metadata(cp: ControlPlane) -> None:
    # A kube-system pod on the agent's own node: the attack the issue describes.
    system_pod = _pod("kube-proxy-x", node=NODE_A, limits={"cpu": "100m"})
    _core(cp).create_namespaced_pod("kube-system", system_pod)
    try:
        agent = _core(cp, AGENT, NODE_A)
        image = {"spec": {"containers": [{"name": "main", "image": "attacker/evil:1"}]}}
        with pytest.raises(ApiException) as denied:  # RBAC: no pod writes but pods/status
            agent.patch_namespaced_pod("kube-proxy-x", "kube-system", image)
        assert denied.value.status == 403
        # pods/status can change metadata too: the policy refuses all but the record.
        for patch, changed in (
            ({"metadata": {"labels": {"app": "x"}}}, "metadata.labels"),
            (_annotate({"note": "x"}), "metadata.annotations[note]"),
            (_annotate({ASSIGNMENT: '{"gpu": 1}'}), ASSIGNMENT),  # the extender's: both refuse
            ({"metadata": {"finalizers": ["example.com/hold"]}}, "metadata.finalizers"),
            ({"status": {"conditions": [{"type": "Ready", "status": "False"}]}}, "conditions"),
        ):
            message = refused_by(
                (AGENT_POLICY, OWNERS),
                lambda patch=patch: _patch_status(agent, "kube-proxy-x", "kube-system", patch),
            )
            assert changed in message
        message = refused_by(
            AGENT_POLICY,
            lambda: _patch_status(
                agent, "kube-proxy-x", "kube-system", {"metadata": {"labels": {"app": "x"}}}
            ),
        )
        assert f"may change on a pod only its {RECORD} status condition" in message
        pod = _core(cp).read_namespaced_pod("kube-proxy-x", "kube-system")
        assert pod.spec.containers[0].image == "gpupart/sleep:0" and not pod.metadata.labels
    finally:
        _core(cp).delete_namespaced_pod("kube-proxy-x", "kube-system", grace_period_seconds=0)


def test_the_node_agent_creates_events_about_pods_and_its_own_node_only(cp: ControlPlane) -> None:
    agent = _core(cp, AGENT, NODE_A)

    def event(kind: str, name: str, namespace: str | None = None) -> dict[str, Any]:
        return {
            "metadata": {"generateName": "gpupart-"},
            "involvedObject": {"kind": kind, "name": name, "namespace": namespace},
            "reason": "AllocateRefused",
            "message": "no verified assignment",
            "type": "Warning",
        }

    agent.create_namespaced_event(TENANT, event("Pod", "served", TENANT))
    agent.create_namespaced_event("default", event("Node", NODE_A))
    message = refused_by(
        AGENT_POLICY, lambda: agent.create_namespaced_event("default", event("Node", NODE_B))
    )
    assert (
        f"may create Events only about pods and Node {NODE_A}, not about Node {NODE_B}" in message
    )
    message = refused_by(
        AGENT_POLICY,
        lambda: agent.create_namespaced_event(NAMESPACE, event("Secret", "x", NAMESPACE)),
    )
    assert "not about Secret x" in message


def test_the_node_agent_without_its_node_name_is_refused(cp: ControlPlane) -> None:
    agent = _core(cp, AGENT)
    message = refused_by(
        AGENT_POLICY, lambda: agent.patch_node(NODE_A, _annotate({"gpupart.io/state": "{}"}))
    )
    assert f"{AGENT} sent a request without its node name (user extra {NODE_NAME_EXTRA}" in message


def test_a_bound_token_names_the_pods_node_and_confines_the_agent(cp: ControlPlane) -> None:
    """The TokenRequest API, as the kubelet asks it for a DaemonSet pod's projected token."""
    account = f"{RELEASE}-node"
    agent_pod = _pod("agent-on-a", node=NODE_A)
    agent_pod["spec"]["serviceAccountName"] = account
    _core(cp).create_namespaced_pod(NAMESPACE, agent_pod)
    token = cp.kubectl(
        "create", "token", account, "-n", NAMESPACE,
        "--bound-object-kind", "Pod", "--bound-object-name", "agent-on-a",
    ).stdout.strip()  # fmt: skip
    who = json.loads(cp.kubectl("auth", "whoami", f"--token={token}", "-o", "json").stdout)
    user = who["status"]["userInfo"]
    assert user["username"] == AGENT
    assert user["extra"][NODE_NAME_EXTRA] == [NODE_A]
    api = with_token(cp, token)
    try:
        agent = client.CoreV1Api(api)
        agent.patch_node(NODE_A, _annotate({"gpupart.io/inventory": '{"by": "token"}'}))
        assert (
            _core(cp).read_node(NODE_A).metadata.annotations["gpupart.io/inventory"]
            == '{"by": "token"}'
        )
        message = refused_by(
            AGENT_POLICY,
            lambda: agent.patch_node(NODE_B, _annotate({"gpupart.io/inventory": "{}"})),
        )
        assert f"may change only Node {NODE_A}, not Node {NODE_B}" in message
    finally:
        api.close()
    # A token bound to nothing (or to a pod on no node) carries no node name.
    loose = cp.kubectl("create", "token", account, "-n", NAMESPACE).stdout.strip()
    api = with_token(cp, loose)
    try:
        message = refused_by(
            AGENT_POLICY,
            lambda: client.CoreV1Api(api).patch_node(
                NODE_A, _annotate({"gpupart.io/inventory": "{}"})
            ),
        )
        assert "without its node name" in message
    finally:
        api.close()


# -- the node agent's ResourceSlices (DRA) -----------------------------------------------------


def _slice(name: str, node: str, *, driver: str = "gpu.gpupart.io", pool: str = "") -> Any:
    return client.V1ResourceSlice.model_validate(
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {"name": name},
            "spec": {
                "driver": driver,
                "nodeName": node,
                "pool": {"name": pool or node, "generation": 0, "resourceSliceCount": 1},
                "devices": [{"name": "gpu-0"}],
            },
        }
    )


def _slices(cp: ControlPlane, user: str | None = None, node: str | None = None) -> Any:
    return client.ResourceV1Api(
        cp.api_client() if user is None else impersonating(cp, user, node=node)
    )


def test_the_node_agent_writes_only_its_own_nodes_pool_of_our_driver(cp: ControlPlane) -> None:
    """The agent of node A creates, updates and deletes slices of A's pool; it cannot write a
    slice of node B, of another driver, or of B's pool name (which would make B's pool
    incomplete), nor move or delete B's slice; nothing it was refused is stored."""
    admin, agent = _slices(cp), _slices(cp, AGENT, NODE_A)
    mine = agent.create_resource_slice(_slice("vap-a-gpupart-gpu-00", NODE_A))
    mine.spec.pool.generation = 1
    agent.replace_resource_slice(mine.metadata.name, mine)
    admin.create_resource_slice(_slice("vap-b-gpupart-gpu-00", NODE_B))
    moved = admin.read_resource_slice("vap-b-gpupart-gpu-00")
    moved.spec.pool.generation = 7  # B's pool made incomplete at a generation of its own
    try:
        cases = {
            "another node": lambda: agent.create_resource_slice(_slice("x-b", NODE_B)),
            "another driver": lambda: agent.create_resource_slice(
                _slice("x-nv", NODE_A, driver="gpu.nvidia.com")
            ),
            "another pool": lambda: agent.create_resource_slice(
                _slice("x-pool", NODE_A, pool=NODE_B)
            ),
            "B's slice changed": lambda: agent.replace_resource_slice(moved.metadata.name, moved),
            "B's slice deleted": lambda: agent.delete_resource_slice("vap-b-gpupart-gpu-00"),
        }
        for what, attack in cases.items():
            message = refused_by(AGENT_POLICY, attack)
            assert f"the gpupart node agent of node {NODE_A} may " in message, what
            assert f"whose nodeName and pool are {NODE_A}" in message, what
        assert "has driver gpu.nvidia.com, nodeName vap-node-a" in refused_by(
            AGENT_POLICY, cases["another driver"]
        )
        names = {s.metadata.name for s in admin.list_resource_slice().items}
        assert {"x-b", "x-nv", "x-pool"}.isdisjoint(names)
        kept = admin.read_resource_slice("vap-b-gpupart-gpu-00")
        assert kept.spec.node_name == NODE_B and kept.spec.pool.generation == 0
        agent.delete_resource_slice(mine.metadata.name)
        assert mine.metadata.name not in {
            s.metadata.name for s in admin.list_resource_slice().items
        }
        # The agent's account without a node name writes no slice either.
        nameless = _slices(cp, AGENT)
        assert "without its node name" in refused_by(
            AGENT_POLICY, lambda: nameless.create_resource_slice(_slice("x-none", NODE_A))
        )
    finally:
        for name in ("vap-a-gpupart-gpu-00", "vap-b-gpupart-gpu-00"):
            with contextlib.suppress(ApiException):
                admin.delete_resource_slice(name)


def test_the_node_agent_reads_claims_but_cannot_write_them(cp: ControlPlane) -> None:
    agent = _slices(cp, AGENT, NODE_A)
    agent.list_resource_claim_for_all_namespaces()
    with pytest.raises(ApiException) as denied:
        agent.delete_collection_namespaced_resource_claim(TENANT)
    assert denied.value.status == 403  # RBAC: read only


def test_a_claim_of_a_shared_gpu_is_reserved_for_one_pod_only(cp: ControlPlane) -> None:
    """The scheduler counts a shared claim's consumedCapacity once and the kubelet prepares a
    claim once a node: a second pod in its `reservedFor` is refused, whoever writes it (here
    the admin, as the scheduler would); a whole GPU's claim may serve several pods."""
    resource = _slices(cp)

    def allocated(name: str, device: str) -> Any:
        claim = resource.create_namespaced_resource_claim(
            TENANT,
            {
                "metadata": {"name": name},
                "spec": {
                    "devices": {"requests": [{"name": "dev", "exactly": {"deviceClassName": "x"}}]}
                },
            },
        )
        claim.status = {
            "allocation": {
                "devices": {
                    "results": [
                        {"request": "dev", "driver": DRIVER, "pool": NODE_A, "device": device}
                    ]
                }
            },
            "reservedFor": [{"resource": "pods", "name": "p1", "uid": "u1"}],
        }
        return resource.replace_namespaced_resource_claim_status(name, TENANT, claim)

    shared, whole = allocated("vap-shared", "gpu-0-shared"), allocated("vap-whole", "gpu-1")
    two = [
        {"resource": "pods", "name": "p1", "uid": "u1"},
        {"resource": "pods", "name": "p2", "uid": "u2"},
    ]

    def refused() -> str | None:
        shared.status.reserved_for = two
        try:
            resource.replace_namespaced_resource_claim_status(
                "vap-shared", TENANT, shared, dry_run="All"
            )
        except ApiException as error:
            return str(error.body)
        return None  # not enforced yet: the policy is new to the API server

    message = wait_for(refused, 60, "the shared-claims policy enforced")
    assert "serves one pod" in message and "p1, p2" in message, message
    whole.status.reserved_for = two
    assert (
        len(
            resource.replace_namespaced_resource_claim_status(
                "vap-whole", TENANT, whole
            ).status.reserved_for
        )
        == 2
    )
    for name in ("vap-shared", "vap-whole"):
        resource.delete_namespaced_resource_claim(name, TENANT)
