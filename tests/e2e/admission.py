"""The chart's admission policies as the API server applies them: refusals, impersonation, waiting."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from gpupart_testsupport.cluster import ControlPlane
from gpupart_testsupport.polling import wait_for

NODE_NAME_EXTRA = "authentication.kubernetes.io/node-name"
# Header names cannot hold "/": the API server lowercases the part after the prefix and
# percent-decodes it (k8s.io/apiserver endpoints/filters/impersonation, unescapeExtraKey).
NODE_NAME_HEADER = "Impersonate-Extra-authentication.kubernetes.io%2Fnode-name"
POLICY_TIMEOUT_S = 60.0
"""Bound on how long the API server's policy informers may take to pick a change up."""


def service_account(namespace: str, name: str) -> str:
    return f"system:serviceaccount:{namespace}:{name}"


def impersonating(cp: ControlPlane, user: str, *, node: str | None = None) -> Any:
    """An ApiClient acting as `user` (the admin impersonates it), with the node-name extra of a
    node-bound service-account token when `node` is given."""
    api = cp.api_client()
    api.set_default_header("Impersonate-User", user)
    if node is not None:
        api.set_default_header(NODE_NAME_HEADER, node)
    return api


def with_token(cp: ControlPlane, token: str) -> Any:
    """An ApiClient that authenticates with this bearer token."""
    api = cp.api_client()
    api.configuration.api_key = {"authorization": f"Bearer {token}"}
    return api


def refusal(call: Callable[[], object]) -> tuple[str, str] | None:
    """(policy, message) when an admission policy refuses `call`; None when it passes or
    something else (RBAC, validation, a missing object) refuses it."""
    try:
        call()
    except ApiException as error:
        message = str(json.loads(error.body or "{}").get("message", ""))
        marker = "ValidatingAdmissionPolicy '"
        if error.status == 403 and marker in message:
            policy = message.split(marker, 1)[1].split("'", 1)[0]
            return policy, message
        return None
    return None


def refused_by(policy: str | tuple[str, ...], call: Callable[[], object]) -> str:
    """The message with which `policy` (or one of several that all refuse it: the API server
    reports one, in no fixed order) refuses `call`; the test fails if it is not refused."""
    found = refusal(call)
    assert found is not None, f"expected {policy} to refuse the request; no policy refused it"
    assert found[0] in ((policy,) if isinstance(policy, str) else policy), found[1]
    return found[1]


def admin_probes(api: Any, namespace: str) -> dict[str, Callable[[], object]]:
    """policy suffix -> a server-side dry run the admin makes that the policy refuses."""
    core = client.CoreV1Api(api)

    def pod(meta: Mapping[str, Any], spec: Mapping[str, Any]) -> Callable[[], object]:
        body = {
            "metadata": {"name": "gpupart-policy-probe", **meta},
            "spec": {"containers": [{"name": "main", "image": "none", **spec}]},
        }
        if "nodeName" in meta:
            body["spec"]["nodeName"] = body["metadata"].pop("nodeName")
        return lambda: core.create_namespaced_pod(namespace, body, dry_run="All")

    gpu = {"resources": {"limits": {"nvidia.com/gpu": "1"}}}
    return {
        "annotation-owners": pod({"annotations": {"gpupart.io/assignment": "{}"}}, {}),
        "gpu-pods-scheduled": pod({"nodeName": "gpupart-policy-probe"}, gpu),
    }


def wait_enforced(probes: Mapping[str, Callable[[], object]], prefix: str) -> None:
    """Until each policy `<prefix>-<name>` refuses its probe (the API server loads new policies
    asynchronously)."""
    for name, probe in probes.items():
        policy = f"{prefix}-{name}"
        wait_for(
            lambda probe=probe, policy=policy: (
                (found := refusal(probe)) is not None and found[0] == policy
            ),
            POLICY_TIMEOUT_S,
            f"policy {policy} to be enforced",
        )


def wait_lifted(probes: Mapping[str, Callable[[], object]]) -> None:
    """Until no policy refuses any probe (after uninstall: later tests write gpupart.io/
    annotations as the admin)."""
    for name, probe in probes.items():
        wait_for(
            lambda probe=probe: refusal(probe) is None,
            POLICY_TIMEOUT_S,
            f"the {name} policy to be lifted",
        )
