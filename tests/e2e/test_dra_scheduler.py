"""DRA against the real kube-scheduler: our pool documents, the chart's DeviceClasses, first fit as predicted.

Its own control plane with kube-controller-manager (the resourceclaim controller turns
templates into claims and releases them). kwok nodes; each test gets its own node and pool,
so that what one test allocates never changes another's answer.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Generator, Mapping, Sequence
from typing import Any

import pytest
import yaml
from kubernetes import client

from gpupart.core.api.spec import Mode
from gpupart.core.dra import names
from gpupart.core.dra.allocator import DeviceRequest, first_fit
from gpupart.core.dra.devices import DraGpu, GpuFacts, Order, gpu_devices
from gpupart.core.dra.order import core_choice
from gpupart.core.dra.pool import Slice, keep_choices, pool_slices, publish_plan
from gpupart.core.dra.read import SliceView, read_claims, read_slices
from gpupart.core.mig.catalogue import require_gpu_model
from gpupart.core.mig.layout import MigInstance, Placement
from gpupart.core.node.devices import OfferedGpu, OfferedMigDevice
from gpupart_testsupport.cluster import REPO, ControlPlane, condition, create_nodes, gpu_node
from gpupart_testsupport.polling import wait_for

CHART = REPO / "charts" / "gpupart"
EXAMPLES = CHART / "examples" / "dra"
H100 = require_gpu_model("H100-SXM5-80GB")
GROUP, VERSION = "resource.k8s.io", "v1"
WAIT_S = 60


@pytest.fixture(scope="module")
def cp(dra_kwok_plane: ControlPlane) -> ControlPlane:
    """The module's own control plane with kube-controller-manager and our DeviceClasses."""
    return dra_kwok_plane


@pytest.fixture
def api(cp: ControlPlane) -> Generator[Any, None, None]:
    api_client = cp.api_client()
    yield api_client
    api_client.close()


@pytest.fixture
def namespace(cp: ControlPlane, api: Any) -> str:
    name = f"dra-{uuid.uuid4().hex[:6]}"
    client.CoreV1Api(api).create_namespace({"metadata": {"name": name}})
    cp.wait_namespace_ready(name)
    return name


def offered(index: int, mode: Mode, **kw: Any) -> OfferedGpu:
    return OfferedGpu(
        index, f"GPU-{uuid.uuid4()}", "NVIDIA H100 80GB HBM3", H100.memory_mib, index, 0, mode, **kw
    )


FACTS = GpuFacts(pci_bus_id="0000:18:00.0", driver_version="570.86.05")


def make_node(api: Any, gpus: Sequence[DraGpu]) -> tuple[str, list[Slice]]:
    """A kwok node with no GPU in its capacity, and our pool for it posted as ResourceSlices."""
    name = f"dra-{uuid.uuid4().hex[:8]}"
    create_nodes(api, [gpu_node(name)])
    node = client.CoreV1Api(api).read_node(name)
    docs = list(pool_slices(name, node.metadata.uid, [gpu_devices(g) for g in gpus]))
    custom = client.CustomObjectsApi(api)
    for doc in docs:
        custom.create_cluster_custom_object(GROUP, VERSION, "resourceslices", doc)
    return name, docs


def slices_of(api: Any, node: str) -> list[SliceView]:
    found = client.CustomObjectsApi(api).list_cluster_custom_object(
        GROUP, VERSION, "resourceslices"
    )
    reading = read_slices(found["items"])
    assert not reading.skipped, reading.skipped
    return [s for s in reading.items if s.pool == node]


def dynamic_node(api: Any, gpus: int = 1) -> tuple[str, list[Slice]]:
    return make_node(
        api, [DraGpu(offered(i, Mode.MIG), H100, dynamic=True, facts=FACTS) for i in range(gpus)]
    )


def claim_pod(namespace: str, name: str, node: str, template: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": node},
            "terminationGracePeriodSeconds": 0,
            "resourceClaims": [{"name": "dev", "resourceClaimTemplateName": template}],
            "containers": [
                {
                    "name": "main",
                    "image": "gpupart/sleep:0",
                    "resources": {"claims": [{"name": "dev"}]},
                }
            ],
        },
    }


def template(
    api: Any,
    namespace: str,
    name: str,
    device_class: str,
    capacity: Mapping[str, str] | None = None,
    selector: str = "",
) -> None:
    """A ResourceClaimTemplate of one request `dev` of `device_class`."""
    exactly: dict[str, Any] = {"deviceClassName": device_class}
    if selector:
        exactly["selectors"] = [{"cel": {"expression": selector}}]
    if capacity:
        exactly["capacity"] = {"requests": dict(capacity)}
    body = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"spec": {"devices": {"requests": [{"name": "dev", "exactly": exactly}]}}},
    }
    client.CustomObjectsApi(api).create_namespaced_custom_object(
        GROUP, VERSION, namespace, "resourceclaimtemplates", body
    )


def scheduled(api: Any, namespace: str, pod: str) -> dict[str, Any]:
    core = client.CoreV1Api(api)

    def check() -> dict[str, Any] | None:
        found = api.sanitize_for_serialization(core.read_namespaced_pod(pod, namespace))
        return found if found["spec"].get("nodeName") else None

    return wait_for(check, WAIT_S, f"pod {namespace}/{pod} bound")


def unschedulable(api: Any, namespace: str, pod: str) -> dict[str, Any]:
    core = client.CoreV1Api(api)

    def check() -> dict[str, Any] | None:
        found = api.sanitize_for_serialization(core.read_namespaced_pod(pod, namespace))
        c = condition(found, "PodScheduled")
        return found if c is not None and c.get("reason") == "Unschedulable" else None

    found = wait_for(check, WAIT_S, f"pod {namespace}/{pod} unschedulable")
    assert not found["spec"].get("nodeName")
    return found


def claims(api: Any, namespace: str) -> list[dict[str, Any]]:
    found = client.CustomObjectsApi(api).list_namespaced_custom_object(
        GROUP, VERSION, namespace, "resourceclaims"
    )
    return list(found["items"])


def allocated_device(api: Any, namespace: str, pod: str) -> str:
    """The device the scheduler gave the pod's one claim (polled: the allocation precedes the bind)."""

    def check() -> str | None:
        for claim in claims(api, namespace):
            owners = claim["metadata"].get("ownerReferences") or []
            if any(o["name"] == pod for o in owners):
                results = (
                    ((claim.get("status") or {}).get("allocation") or {})
                    .get("devices", {})
                    .get("results", [])
                )
                if results:
                    (result,) = results
                    assert result["driver"] == names.DRIVER
                    return str(result["device"])
        return None

    return wait_for(check, WAIT_S, f"an allocated claim for {pod}")


def create(api: Any, manifest: Mapping[str, Any]) -> None:
    client.CoreV1Api(api).create_namespaced_pod(manifest["metadata"]["namespace"], manifest)


def delete_and_release(api: Any, namespace: str, pod: str) -> None:
    """Delete the pod and wait until its claims are gone (the devices are free again)."""
    client.CoreV1Api(api).delete_namespaced_pod(pod, namespace, grace_period_seconds=0)

    def check() -> bool:
        return not any(
            any(o["name"] == pod for o in c["metadata"].get("ownerReferences") or [])
            for c in claims(api, namespace)
        )

    wait_for(check, WAIT_S, f"the claims of {pod} released")


def test_the_api_server_accepts_every_pool_document_we_build(api: Any) -> None:
    """Every mode, and more than 8 dynamic GPUs (two counters slices); read back unchanged."""
    migs = (
        OfferedMigDevice("MIG-a", MigInstance(Placement(0, 4), "3g.40gb"), 1, 0),
        OfferedMigDevice("MIG-b", MigInstance(Placement(4, 1), "1g.10gb"), 2, 0),
    )
    gpus = [DraGpu(offered(i, Mode.MIG), H100, dynamic=True, facts=FACTS) for i in range(9)]
    gpus += [
        DraGpu(offered(9, Mode.MIG, mig=migs), H100, facts=FACTS),
        DraGpu(offered(10, Mode.MPS, replicas=4), H100, facts=FACTS),
        DraGpu(offered(11, Mode.TIME_SLICING, replicas=3), H100),
        DraGpu(offered(12, Mode.NONE), H100, facts=FACTS),
        DraGpu(
            offered(13, Mode.MIG),
            H100,
            dynamic=True,
            foreign=(MigInstance(Placement(0, 4), "4g.40gb"),),
        ),
    ]
    node, docs = make_node(api, gpus)
    back = slices_of(api, node)
    assert len(back) == len(docs) and len([d for d in docs if "sharedCounters" in d["spec"]]) == 2
    assert publish_plan(back, docs).empty  # what the server kept is what we wrote


def test_claims_from_templates_are_allocated_in_the_cores_order(api: Any, namespace: str) -> None:
    node, _ = dynamic_node(api)
    template(api, namespace, "one-1g", "mig-1g10gb.gpupart.io")
    create(api, claim_pod(namespace, "first", node, "one-1g"))
    scheduled(api, namespace, "first")
    expected = core_choice(H100, (), "1g.10gb")
    assert expected is not None
    assert allocated_device(api, namespace, "first") == names.mig_device_name(
        0, "1g.10gb", expected.placement.start
    )
    # The next one is where the core's first-fit model says, counters and all.
    request = DeviceRequest("dev", ((names.TYPE, names.TYPE_MIG), (names.PROFILE, "1g.10gb")))
    predicted = first_fit(
        slices_of(api, node), read_claims(claims(api, namespace)).items, [request]
    )
    assert predicted is not None
    create(api, claim_pod(namespace, "second", node, "one-1g"))
    scheduled(api, namespace, "second")
    assert allocated_device(api, namespace, "second") == predicted[0].device


def test_a_reorder_after_an_allocation_is_one_update_at_most_and_keeps_the_order_law(
    api: Any, namespace: str
) -> None:
    """Republished with the first placement in use, as the agent does (`keep_choices`: only a
    slice whose next pick changes is re-ordered, one at most), the pool keeps its generation and
    the scheduler's second pick is again the core's choice beside the first."""
    view = offered(0, Mode.MIG)
    node, _ = make_node(api, [DraGpu(view, H100, dynamic=True, facts=FACTS)])
    template(api, namespace, "one-1g", "mig-1g10gb.gpupart.io")
    create(api, claim_pod(namespace, "first", node, "one-1g"))
    first = core_choice(H100, (), "1g.10gb")
    assert first is not None
    assert allocated_device(api, namespace, "first") == names.mig_device_name(
        0, "1g.10gb", first.placement.start
    )
    uid = client.CoreV1Api(api).read_node(node).metadata.uid
    held = DraGpu(view, H100, dynamic=True, in_use=(first,), facts=FACTS)
    before = slices_of(api, node)
    allocated = read_claims(claims(api, namespace)).items
    wanted = keep_choices(before, pool_slices(node, uid, [gpu_devices(held)]), allocated)
    planned = publish_plan(before, wanted)
    assert len(planned.updates) <= 1 and not planned.bumps and not planned.creates
    custom = client.CustomObjectsApi(api)
    versions = {s.name: s.resource_version for s in before}
    for doc in planned.updates:
        name = doc["metadata"]["name"]
        body = {**doc, "metadata": {**doc["metadata"], "resourceVersion": versions[name]}}
        custom.replace_cluster_custom_object(GROUP, VERSION, "resourceslices", name, body)
    after = slices_of(api, node)
    assert {s.generation for s in after} == {s.generation for s in before}
    assert publish_plan(after, keep_choices(after, wanted, allocated)).empty
    second = core_choice(H100, (first,), "1g.10gb")
    assert second is not None
    create(api, claim_pod(namespace, "second", node, "one-1g"))
    assert allocated_device(api, namespace, "second") == names.mig_device_name(
        0, "1g.10gb", second.placement.start
    )


def test_in_nvidia_order_the_scheduler_takes_the_lowest_start(api: Any, namespace: str) -> None:
    """The lever is real: the same devices in lexicographic order put the first 1g at slot 0."""
    gpu = DraGpu(offered(0, Mode.MIG), H100, dynamic=True, facts=FACTS)
    name = f"dra-{uuid.uuid4().hex[:8]}"
    create_nodes(api, [gpu_node(name)])
    uid = client.CoreV1Api(api).read_node(name).metadata.uid
    for doc in pool_slices(name, uid, [gpu_devices(gpu, order=Order.NVIDIA)]):
        client.CustomObjectsApi(api).create_cluster_custom_object(
            GROUP, VERSION, "resourceslices", doc
        )
    template(api, namespace, "one-1g", "mig-1g10gb.gpupart.io")
    create(api, claim_pod(namespace, "first", name, "one-1g"))
    scheduled(api, namespace, "first")
    assert allocated_device(api, namespace, "first") == names.mig_device_name(0, "1g.10gb", 0)


def test_a_pod_asking_the_device_plugins_resource_name_gets_a_dra_claim(
    api: Any, namespace: str
) -> None:
    node, _ = dynamic_node(api)
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "legacy", "namespace": namespace},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": node},
            "terminationGracePeriodSeconds": 0,
            "containers": [
                {
                    "name": "main",
                    "image": "gpupart/sleep:0",
                    "resources": {"limits": {"nvidia.com/mig-1g.10gb": "1"}},
                }
            ],
        },
    }
    create(api, pod)
    found = scheduled(api, namespace, "legacy")
    assert found["spec"]["nodeName"] == node
    device = allocated_device(api, namespace, "legacy")
    assert device.startswith("gpu-0-mig-1g10gb-")
    (claim,) = claims(api, namespace)
    assert (
        claim["metadata"]["annotations"]["resource.kubernetes.io/extended-resource-claim"] == "true"
    )


def test_the_full_size_placement_and_the_others_exclude_each_other_through_counters(
    api: Any, namespace: str
) -> None:
    """A dynamic GPU offers no whole-GPU device (ADR 030): its 7g.80gb placement, which takes
    every counter, is the whole-GPU instance."""
    node, _ = dynamic_node(api)
    template(api, namespace, "whole", "gpu.gpupart.io")
    template(api, namespace, "full", "mig-7g80gb.gpupart.io")
    template(api, namespace, "one-1g", "mig-1g10gb.gpupart.io")
    create(api, claim_pod(namespace, "whole", node, "whole"))
    unschedulable(api, namespace, "whole")
    create(api, claim_pod(namespace, "full", node, "full"))
    scheduled(api, namespace, "full")
    assert allocated_device(api, namespace, "full") == names.mig_device_name(0, "7g.80gb", 0)
    create(api, claim_pod(namespace, "small", node, "one-1g"))
    unschedulable(api, namespace, "small")
    delete_and_release(api, namespace, "full")
    scheduled(api, namespace, "small")  # the scheduler retries once the counters are free
    create(api, claim_pod(namespace, "full-again", node, "full"))
    unschedulable(api, namespace, "full-again")


def test_the_eighth_1g_on_a_gpu_is_refused(api: Any, namespace: str) -> None:
    node, _ = dynamic_node(api)
    template(api, namespace, "one-1g", "mig-1g10gb.gpupart.io")
    for k in range(7):
        create(api, claim_pod(namespace, f"p{k}", node, "one-1g"))
    devices = {allocated_device(api, namespace, f"p{k}") for k in range(7)}
    assert devices == {names.mig_device_name(0, "1g.10gb", s) for s in range(7)}
    create(api, claim_pod(namespace, "p7", node, "one-1g"))
    unschedulable(api, namespace, "p7")


def test_shared_memory_over_commit_is_refused_by_the_scheduler(
    api: Any, cp: ControlPlane, namespace: str
) -> None:
    node, _ = make_node(api, [DraGpu(offered(0, Mode.MPS, replicas=4), H100, facts=FACTS)])
    # The example's template: 10Gi and 25 % each, so compute runs out at the fifth.
    examples = [
        d for d in yaml.safe_load_all((EXAMPLES / "shared.yaml").read_text()) if d["kind"] != "Pod"
    ]
    cp.kubectl(
        "apply",
        "-n",
        namespace,
        "-f",
        "-",
        input=json.dumps({"apiVersion": "v1", "kind": "List", "items": examples}),
    )
    for k in range(4):
        create(api, claim_pod(namespace, f"s{k}", node, "shared-10gi"))
        scheduled(api, namespace, f"s{k}")
    create(api, claim_pod(namespace, "s4", node, "shared-10gi"))
    unschedulable(api, namespace, "s4")
    # Memory alone: 81559 MiB hold two 40000Mi shares, not three.
    other, _ = make_node(api, [DraGpu(offered(0, Mode.MPS, replicas=4), H100)])
    template(api, namespace, "big", "shared.gpupart.io", {"memory": "40000Mi", "compute": "1"})
    for k in range(2):
        create(api, claim_pod(namespace, f"b{k}", other, "big"))
        scheduled(api, namespace, f"b{k}")
    create(api, claim_pod(namespace, "b2", other, "big"))
    unschedulable(api, namespace, "b2")
    shares = [
        c
        for c in read_claims(claims(api, namespace)).items
        if any(r.pool == other for r in c.results)
    ]
    assert len(shares) == 2 and all(r.share_id for c in shares for r in c.results)


def test_first_available_falls_back_to_two_2g(api: Any, cp: ControlPlane, namespace: str) -> None:
    """1g.10gb at slots 1 and 6 block both 3g.40gb placements but leave 2g.20gb at 2 and 4."""
    node, _ = dynamic_node(api)
    domain = f'device.attributes["{names.DRIVER}"]'
    for slot in (1, 6):
        template(
            api,
            namespace,
            f"at-{slot}",
            "mig-1g10gb.gpupart.io",
            selector=f"{domain}.{names.PLACEMENT_START} == {slot}",
        )
        create(api, claim_pod(namespace, f"at-{slot}", node, f"at-{slot}"))
        scheduled(api, namespace, f"at-{slot}")
    examples = [
        d
        for d in yaml.safe_load_all((EXAMPLES / "mig.yaml").read_text())
        if d["kind"] == "ResourceClaim"
    ]
    cp.kubectl(
        "apply",
        "-n",
        namespace,
        "-f",
        "-",
        input=json.dumps({"apiVersion": "v1", "kind": "List", "items": examples}),
    )
    pod = claim_pod(namespace, "fallback", node, "unused")
    pod["spec"]["resourceClaims"] = [{"name": "dev", "resourceClaimName": "train-3g-or-2x2g"}]
    create(api, pod)
    scheduled(api, namespace, "fallback")

    def allocation() -> list[dict[str, Any]] | None:
        claim = next(
            c for c in claims(api, namespace) if c["metadata"]["name"] == "train-3g-or-2x2g"
        )
        return (
            ((claim.get("status") or {}).get("allocation") or {}).get("devices", {}).get("results")
        )

    results = wait_for(allocation, WAIT_S, "the firstAvailable claim allocated")
    assert sorted((r["request"], r["device"]) for r in results) == [
        ("mig/two-2g", "gpu-0-mig-2g20gb-2"),
        ("mig/two-2g", "gpu-0-mig-2g20gb-4"),
    ]
