"""Tenants' ResourceClaims against the node agent's DRA readers, on a real API server with RBAC.

The tenant is impersonated (`kubectl --as`) with a namespaced Role only: ResourceClaims and
pods in its namespace. What it writes reaches the node agent through the claim list and
watch (`PoolClient`, the sink's view of which devices are allocated) and the kubelet plugin's
claim read (`ClaimReader`):

- a claim whose opaque configuration nests thousands of levels deep, which the API server
  stores and Python's `json` cannot walk: the list, the watch and the read still answer, with
  that claim's deep value cut (`gpupart.core.api.jsontext`); the other claims count, and the
  node publishes its pool after an agent restart, with the claim still there;
- what the API server refuses a tenant before any of our readers sees it: an `adminAccess`
  claim in a namespace without Kubernetes' admin-access label (which only an admin can set),
  a ResourceSlice of its own (a pool for any node), and a claim's status (an allocation of
  its own making, or another pod in `reservedFor`).
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Generator
from typing import Any

import pytest
from kubernetes import client

from gpupart.core.api.jsontext import TOO_DEEP
from gpupart.core.api.spec import Interface, Mode
from gpupart.core.api.wire import NodeReport
from gpupart.core.dra import names
from gpupart.core.node.devices import OfferedGpu
from gpupart.watch import Listed
from gpupart_plugin.agent import Offer
from gpupart_plugin.dra.kubelet.claims import ClaimReader
from gpupart_plugin.dra.publisher import PoolClient
from gpupart_plugin.dra.sink import DraSink
from gpupart_plugin.simgpu import SimulatedGpus
from gpupart_testsupport.cluster import ControlPlane
from gpupart_testsupport.polling import wait_for

pytestmark = pytest.mark.e2e

WHOLE_GPU_CLASS = "gpu.gpupart.io"
DEPTH = 4_000
"""Deeper than Python's `json` walks (about 1,000), within the API's 10 KiB of parameters."""


@pytest.fixture(scope="module")
def cp(dra_kwok_plane: ControlPlane) -> ControlPlane:
    return dra_kwok_plane


@pytest.fixture
def tenant_ns(cp: ControlPlane) -> Generator[str, None, None]:
    """A namespace where user `tenant-<ns>` may write ResourceClaims and pods, nothing more."""
    ns = f"tenant-{uuid.uuid4().hex[:6]}"
    api = cp.api_client()
    core, rbac = client.CoreV1Api(api), client.RbacAuthorizationV1Api(api)
    core.create_namespace({"metadata": {"name": ns}})
    verbs = ["create", "get", "list", "watch", "patch", "update", "delete"]
    rbac.create_namespaced_role(
        ns,
        {
            "metadata": {"name": "tenant"},
            "rules": [
                {"apiGroups": [""], "resources": ["pods"], "verbs": verbs},
                {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims"], "verbs": verbs},
            ],
        },
    )
    rbac.create_namespaced_role_binding(
        ns,
        {
            "metadata": {"name": "tenant"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "tenant"},
            "subjects": [
                {"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": f"tenant-{ns}"}
            ],
        },
    )
    try:
        yield ns
    finally:
        core.delete_namespace(ns)
        api.close()


def _as_tenant(cp: ControlPlane, ns: str, *args: str, input: str | None = None) -> str:
    return cp.kubectl("--as", f"tenant-{ns}", "-n", ns, *args, input=input).stdout


def _deep_claim(ns: str, name: str) -> str:
    """A claim of our profile class whose opaque parameters (ours) nest `DEPTH` lists deep."""
    body = {
        "apiVersion": names.API_VERSION,
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": ns},
        "spec": {
            "devices": {
                "requests": [{"name": "dev", "exactly": {"deviceClassName": WHOLE_GPU_CLASS}}],
                "config": [{"opaque": {"driver": names.DRIVER, "parameters": {"x": "DEEP"}}}],
            }
        },
    }
    return json.dumps(body).replace('"DEEP"', "[" * DEPTH + "]" * DEPTH)


def _cut(value: Any) -> bool:
    """Whether `value` holds TOO_DEEP somewhere along its first items."""
    while isinstance(value, list | dict):
        value = value[0] if isinstance(value, list) else next(iter(value.values()))
    return value == TOO_DEEP


def test_a_claim_nested_deeper_than_json_walks_affects_only_itself(
    cp: ControlPlane, tenant_ns: str
) -> None:
    ns = tenant_ns
    _as_tenant(cp, ns, "create", "-f", "-", input=_deep_claim(ns, "deep"))
    api = cp.api_client()
    core, resource = client.CoreV1Api(api), client.ResourceV1Api(api)
    node = f"deep-{uuid.uuid4().hex[:6]}"
    core.create_node({"metadata": {"name": node}})
    # a claim of this node's pool, allocated as the scheduler would write it
    held = resource.create_namespaced_resource_claim(
        ns,
        {
            "metadata": {"name": "good"},
            "spec": {
                "devices": {
                    "requests": [{"name": "dev", "exactly": {"deviceClassName": WHOLE_GPU_CLASS}}]
                }
            },
        },
    )
    held.status = {
        "allocation": {
            "devices": {
                "results": [
                    {"request": "dev", "driver": names.DRIVER, "pool": node, "device": "gpu-0"}
                ]
            }
        }
    }
    resource.replace_namespaced_resource_claim_status("good", ns, held)
    pool = PoolClient(api, node)
    stop = threading.Event()
    try:
        listed = {
            c["metadata"]["name"]: c for c in pool.list_claims() if c["metadata"]["namespace"] == ns
        }
        assert set(listed) == {"deep", "good"}
        assert _cut(listed["deep"]["spec"]["devices"]["config"][0]["opaque"]["parameters"])

        # the node agent restarted: its sink lists the claims and publishes its pool
        sim = SimulatedGpus(["H100-SXM5-80GB"], node=node, mig_enabled=[False])
        (info,) = sim.gpus()
        view = OfferedGpu(
            0, info.uuid, "H100-SXM5-80GB", info.memory_mib, 0, 0, Mode.NONE,
            interface=Interface.DRA, pci_bus_id=info.pci_bus_id,
        )  # fmt: skip
        sink = DraSink(PoolClient(api, node), sim.model)
        assert sink.claim_use().holders(0).names == (f"{ns}/good",)
        sink.offer(Offer((view,), frozenset(), NodeReport((), ())))
        wait_for(
            lambda: resource.list_resource_slice(field_selector=f"spec.nodeName={node}").items,
            timeout=30,
            what="the pool published with the deep claim present",
        )

        # the watch: its list, then the tenant's change of the deep claim as an event
        seen: list[Any] = []

        def follow() -> None:
            for item in pool.watch_claims(stop, relist_s=30):
                seen.append(item)

        watcher = threading.Thread(target=follow, daemon=True)
        watcher.start()
        wait_for(lambda: any(isinstance(i, Listed) for i in seen), timeout=30, what="the list")
        _as_tenant(cp, ns, "label", "resourceclaim", "deep", "touched=yes")
        wait_for(
            lambda: [
                i
                for i in seen
                if not isinstance(i, Listed)
                and i.object["metadata"].get("labels", {}).get("touched") == "yes"
            ],
            timeout=30,
            what="the deep claim's change as a watch event",
        )
        changed = next(
            i for i in seen if not isinstance(i, Listed) and i.object["metadata"]["name"] == "deep"
        )
        assert _cut(changed.object["spec"]["devices"]["config"][0]["opaque"]["parameters"])

        # the kubelet plugin's read of the claim by name
        read = ClaimReader(api, node).claim(ns, "deep")
        assert isinstance(read, dict) and read["metadata"]["name"] == "deep"
    finally:
        stop.set()
        core.delete_node(node)
        api.close()


def test_the_api_refuses_a_tenant_admin_access_slices_and_claim_status(
    cp: ControlPlane, tenant_ns: str
) -> None:
    ns = tenant_ns
    admin_claim = {
        "apiVersion": names.API_VERSION,
        "kind": "ResourceClaim",
        "metadata": {"name": "watch-all", "namespace": ns},
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": "dev",
                        "exactly": {"deviceClassName": WHOLE_GPU_CLASS, "adminAccess": True},
                    }
                ]
            }
        },
    }
    refused = cp.kubectl(
        "--as", f"tenant-{ns}", "-n", ns, "create", "-f", "-",
        input=json.dumps(admin_claim), check=False,
    )  # fmt: skip
    assert refused.returncode != 0
    assert "admin-access" in refused.stderr, refused.stderr

    node_pool = {
        "apiVersion": names.API_VERSION,
        "kind": "ResourceSlice",
        "metadata": {"name": f"forged-{ns}"},
        "spec": {
            "driver": names.DRIVER,
            "nodeName": "any-node",
            "pool": {"name": "any-node", "generation": 99, "resourceSliceCount": 1},
            "devices": [{"name": "gpu-0"}],
        },
    }
    refused = cp.kubectl(
        "--as", f"tenant-{ns}", "create", "-f", "-", input=json.dumps(node_pool), check=False
    )
    assert refused.returncode != 0 and "forbidden" in refused.stderr.lower(), refused.stderr

    _as_tenant(
        cp,
        ns,
        "create",
        "-f",
        "-",
        input=json.dumps(
            {
                **admin_claim,
                "metadata": {"name": "mine", "namespace": ns},
                "spec": {
                    "devices": {
                        "requests": [
                            {"name": "dev", "exactly": {"deviceClassName": WHOLE_GPU_CLASS}}
                        ]
                    }
                },
            }
        ),
    )
    status = {
        "status": {
            "allocation": {
                "devices": {
                    "results": [
                        {"request": "dev", "driver": names.DRIVER, "pool": "n", "device": "gpu-0"}
                    ]
                }
            }
        }
    }
    refused = cp.kubectl(
        "--as", f"tenant-{ns}", "-n", ns, "patch", "resourceclaim", "mine",
        "--subresource=status", "--type=merge", "-p", json.dumps(status), check=False,
    )  # fmt: skip
    assert refused.returncode != 0 and "forbidden" in refused.stderr.lower(), refused.stderr
