"""The node agent's ResourceSlice publisher on a real kubelet, with the real kube-scheduler allocating.

Its own control plane with kube-controller-manager (claims released when their pod goes) and
the chart's DeviceClasses; one real-kubelet node (tests/support/kubelet.py) served by
`gpupart node --simulate` with two H100s. The desired annotation is written as the operator
writes it (`encode_desired`). One scenario, in order, because each step starts from the last:

- both GPUs on the device plugin: `nvidia.com/gpu` for the whole one, no slice;
- both moved to DRA (GPU 0 dynamic MIG, GPU 1 whole): the pool appears with the pool rules
  (names, one generation, the slice count, nodeName, an ownerReference to the Node, at most 64
  devices with counters a slice) and the device plugin no longer advertises GPU 1;
- a kubelet restart wipes the node's slices; the agent publishes them again;
- an agent restart writes nothing (same objects, same generation);
- a claim allocated by kube-scheduler re-orders GPU 0's slice: one update of that slice only,
  the pool's generation kept, and the device allocated is the first placement of its profile
  in the order published before;
- moved back to the device plugin: GPU 1 at once, GPU 0 only once no claim holds it; then the
  pool is gone.

And the sink alone against the API server: a malformed claim, an unreachable API server and a
slice deleted by someone else each affect only themselves; a change offered while
kube-apiserver restarts is published, whole, once it is back.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import uuid
from collections.abc import Generator
from typing import Any

import pytest
from kubernetes import client

from gpupart.core.api.spec import GpuConfig, Interface, Mode
from gpupart.core.api.wire import (
    DESIRED_ANNOTATION,
    STATE_ANNOTATION,
    DesiredGroup,
    GpuState,
    NodeReport,
    decode_inventory,
    decode_report,
    encode_desired,
)
from gpupart.core.dra import names
from gpupart.core.dra.allocator import DeviceRequest, first_fit
from gpupart.core.dra.claims import gpu_index
from gpupart.core.dra.order import node_choice
from gpupart.core.dra.read import SliceView, read_claims, read_slices
from gpupart.core.errors import GpupartError
from gpupart.core.mig.catalogue import require_gpu_model
from gpupart.core.mig.layout import MigInstance, Placement
from gpupart.core.node.devices import OfferedGpu
from gpupart_plugin.agent import Offer
from gpupart_plugin.dra.publisher import PoolClient
from gpupart_plugin.dra.sink import DraSink
from gpupart_plugin.podresources import PodResourcesClient
from gpupart_plugin.simgpu import SimulatedGpus
from gpupart_testsupport.cluster import REPO, ControlPlane
from gpupart_testsupport.polling import wait_for
from gpupart_testsupport.stack import Stack

pytestmark = pytest.mark.e2e

CHART = REPO / "charts" / "gpupart"
NODE = "real-dra-pub"
H100 = require_gpu_model("H100-SXM5-80GB")
WAIT_S = 90
GPU = "nvidia.com/gpu"


@pytest.fixture(scope="module")
def cp(dra_kwok_plane: ControlPlane) -> ControlPlane:
    """The module's own control plane with kube-controller-manager and our DeviceClasses."""
    return dra_kwok_plane


@pytest.fixture(scope="module")
def stack(
    cp: ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> Generator[Stack, None, None]:
    """No operator, extender or second scheduler: the node and its agent only."""
    api = cp.api_client()
    stack = Stack(cp, api, tmp_path_factory.mktemp("drapub"))
    try:
        yield stack
    except BaseException:
        print(stack.tails())
        raise
    finally:
        stack.stop()
        api.close()


def desired(gpu0: GpuConfig, gpu1: GpuConfig) -> str:
    return encode_desired(
        (DesiredGroup("dyn", 1, (0,), gpu0), DesiredGroup("whole", 1, (1,), gpu1))
    )


DYNAMIC_DP = GpuConfig(Mode.MIG, (), dynamic=True)
DYNAMIC_DRA = GpuConfig(Mode.MIG, (), dynamic=True, interface=Interface.DRA)
WHOLE_DP = GpuConfig(Mode.NONE)
WHOLE_DRA = GpuConfig(Mode.NONE, interface=Interface.DRA)


class Pool:
    """Reads of the node, its pool and its agent."""

    def __init__(self, stack: Stack, node: str = NODE) -> None:
        self.stack = stack
        self.node = node
        self.core = client.CoreV1Api(stack.api_client)
        self.resource = client.ResourceV1Api(stack.api_client)
        self.custom = client.CustomObjectsApi(stack.api_client)

    def until(self, check: Any, what: str, timeout: float = WAIT_S) -> Any:
        return wait_for(check, timeout, what, interval=0.3, detail=self.stack.tails)

    def want(self, text: str) -> None:
        self.core.patch_node(NODE, {"metadata": {"annotations": {DESIRED_ANNOTATION: text}}})

    def raw(self) -> list[dict[str, Any]]:
        found = self.custom.list_cluster_custom_object(
            "resource.k8s.io", "v1", "resourceslices", field_selector=f"spec.nodeName={self.node}"
        )
        return list(found["items"])

    def slices(self) -> dict[str, SliceView]:
        reading = read_slices(self.raw())
        assert not reading.skipped, reading.skipped
        return {s.name: s for s in reading.items}

    def allocatable(self, resource: str) -> str | None:
        return (self.core.read_node(NODE).status.allocatable or {}).get(resource)

    def report(self) -> Any:
        annotations = self.core.read_node(NODE).metadata.annotations or {}
        return decode_report(annotations[STATE_ANNOTATION])

    def ready(self) -> bool:
        conditions = self.core.read_node(NODE).status.conditions or []
        taints = self.core.read_node(NODE).spec.taints or []
        return not taints and any(c.type == "Ready" and c.status == "True" for c in conditions)

    def passes(self) -> int:
        """Passes the running agent reported since it started (its log)."""
        (proc,) = [p for p in self.stack.processes if p.name == f"node-{NODE}"]
        run = proc.log.read_text(errors="replace").rsplit("\n=== ", 1)[-1]
        return run.count("Reconciled node")


def pool_is_whole(slices: dict[str, SliceView], node_uid: str, raw: list[dict[str, Any]]) -> None:
    """The pool rules on what the API server holds."""
    assert len({s.generation for s in slices.values()}) == 1, slices
    assert all(s.slice_count == len(slices) for s in slices.values())
    assert all(s.pool == NODE and s.node == NODE for s in slices.values())
    for doc in raw:
        (owner,) = doc["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["name"], owner["uid"]) == ("Node", NODE, node_uid)
    for s in slices.values():
        limit = names.MAX_DEVICES_WITH_COUNTERS if any(d.consumes for d in s.devices) else 128
        assert len(s.devices) <= limit
        assert not (s.devices and s.counter_sets)  # a slice holds devices or counters


def test_the_pool_follows_the_interface_the_kubelet_and_the_scheduler(
    cp: ControlPlane, stack: Stack
) -> None:
    pool = Pool(stack)
    core = pool.core
    stack.start_real_node(NODE, "H100-SXM5-80GB,H100-SXM5-80GB:mig-off", {}, auto_reset=True)
    pool.until(lambda: core.read_node(NODE), "the kubelet to register the Node")
    node_uid = core.read_node(NODE).metadata.uid
    pool.want(desired(DYNAMIC_DP, WHOLE_DP))
    pool.until(lambda: pool.allocatable(GPU) == "1", "the device plugin to serve GPU 1")
    assert pool.slices() == {}

    # -- to DRA: the pool appears, the device plugin lets GPU 1 go --------------------------
    pool.want(desired(DYNAMIC_DRA, WHOLE_DRA))
    part = f"{NODE}-gpupart-"
    # the counters, one slice per MIG profile of GPU 0 across the node, the whole GPU 1 (ADR 032)
    profile_parts = {
        p.name: f"{part}{names.mig_slice_part(p.name, p.memory_slices, p.compute_slices)}"
        for p in H100.profiles
    }
    wanted = {f"{part}counters-0", f"{part}whole", *profile_parts.values()}
    pool.until(lambda: set(pool.slices()) == wanted, "the pool's slices")
    pool.until(lambda: pool.allocatable(GPU) in (None, "0"), "GPU 1 gone from the device plugin")
    slices = pool.slices()
    pool_is_whole(slices, node_uid, pool.raw())
    whole = slices[f"{part}whole"].devices
    assert [d.name for d in whole] == ["gpu-1"]
    assert whole[0].attribute(names.PCI_BUS_ID) == "0000:19:00.0"
    dynamic = [d for name in profile_parts.values() for d in slices[name].devices]
    # Every placement, and no whole-GPU device on a GPU in MIG mode (ADR 030).
    assert len(dynamic) > 10 and all(d.attribute(names.TYPE) == names.TYPE_MIG for d in dynamic)
    assert not any(r.startswith("nvidia.com/mig-") for r in core.read_node(NODE).status.capacity)
    pool.until(
        lambda: all(g.state is GpuState.APPLIED for g in pool.report().gpus), "both GPUs Applied"
    )

    # -- a kubelet restart wipes the node's slices; they are published again ----------------
    before = {d["metadata"]["name"]: d["metadata"]["uid"] for d in pool.raw()}
    real = stack.real_nodes[NODE]
    real.stop_kubelet()
    real.start_kubelet()

    def republished() -> bool:
        now = {d["metadata"]["name"]: d["metadata"]["uid"] for d in pool.raw()}
        return set(now) == wanted and not set(now.values()) & set(before.values())

    pool.until(republished, "every slice deleted by the kubelet and published again")
    pool_is_whole(pool.slices(), node_uid, pool.raw())

    # -- an agent restart writes nothing ---------------------------------------------------
    settled = pool.until(
        lambda: (lambda a: a if a == pool.raw() else None)(pool.raw()), "the pool to settle"
    )
    versions = {d["metadata"]["name"]: d["metadata"]["resourceVersion"] for d in settled}
    stack.restart_agent(NODE)
    pool.until(lambda: pool.passes() >= 1, "a pass of the restarted agent")
    after = {d["metadata"]["name"]: d["metadata"]["resourceVersion"] for d in pool.raw()}
    assert after == versions

    # -- a claim allocated by kube-scheduler: the next 1g pick is the core's choice beside it, at
    # -- most one slice re-ordered, the same generation
    pool.until(pool.ready, "the Node Ready and untainted after the kubelet's restart")
    namespace = f"drapub-{uuid.uuid4().hex[:6]}"
    core.create_namespace({"metadata": {"name": namespace}})
    cp.wait_namespace_ready(namespace)
    one_g = profile_parts["1g.10gb"]
    first_1g = pool.slices()[one_g].devices[0].name
    generations = {d["metadata"]["name"]: d["metadata"]["generation"] for d in pool.raw()}
    (generation,) = {s.generation for s in pool.slices().values()}
    pool.custom.create_namespaced_custom_object(
        "resource.k8s.io", "v1", namespace, "resourceclaims",
        {
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": "one-1g"},
            "spec": {"devices": {"requests": [
                {"name": "dev", "exactly": {"deviceClassName": "mig-1g10gb.gpupart.io"}}
            ]}},
        },
    )  # fmt: skip
    core.create_namespaced_pod(
        namespace,
        {
            "metadata": {"name": "uses-1g"},
            "spec": {
                "nodeSelector": {"kubernetes.io/hostname": NODE},
                "terminationGracePeriodSeconds": 0,
                "resourceClaims": [{"name": "dev", "resourceClaimName": "one-1g"}],
                "containers": [
                    {"name": "main", "image": "gpupart/sleep:0",
                     "resources": {"claims": [{"name": "dev"}]}}
                ],
            },
        },
    )  # fmt: skip

    def allocated() -> str | None:
        claim = pool.custom.get_namespaced_custom_object(
            "resource.k8s.io", "v1", namespace, "resourceclaims", "one-1g"
        )
        results = ((claim.get("status") or {}).get("allocation") or {}).get("devices", {})
        return results.get("results", [{}])[0].get("device") if results else None

    device = pool.until(allocated, "the scheduler to allocate the claim")
    assert device == first_1g
    held = next(d for d in pool.slices()[one_g].devices if d.name == device)
    start = held.attribute(names.PLACEMENT_START)
    assert isinstance(start, int)
    expected = node_choice([(0, H100, (MigInstance(Placement(start, 1), "1g.10gb"),))], "1g.10gb")
    assert expected is not None
    request = DeviceRequest("dev", ((names.TYPE, names.TYPE_MIG), (names.PROFILE, "1g.10gb")))

    def next_pick() -> str | None:
        listed = pool.custom.list_namespaced_custom_object(
            "resource.k8s.io", "v1", namespace, "resourceclaims"
        )
        got = first_fit(list(pool.slices().values()), read_claims(listed["items"]).items, [request])
        return got[0].device if got else None

    pool.until(
        lambda: next_pick() == names.mig_device_name(0, "1g.10gb", expected[1].placement.start),
        "the next 1g pick the core's choice beside the claim",
    )
    now = {d["metadata"]["name"]: d["metadata"]["generation"] for d in pool.raw()}
    written = [k for k in now if now[k] != generations[k]]
    assert len(written) <= 1 and all(now[k] == generations[k] + 1 for k in written), written
    assert {s.generation for s in pool.slices().values()} == {generation}

    # -- back to the device plugin: GPU 1 at once, GPU 0 once its claim is gone ---------------
    pool.want(desired(DYNAMIC_DP, WHOLE_DP))
    pool.until(lambda: pool.allocatable(GPU) == "1", "GPU 1 back on the device plugin")
    pool.until(lambda: f"{part}whole" not in pool.slices(), "GPU 1's slice removed")
    held = pool.until(
        lambda: (g := pool.report().gpus[0]).state is GpuState.PENDING and g,
        "GPU 0 waiting for its claim",
    )
    assert f"claims {namespace}/one-1g" in held.message
    core.delete_namespaced_pod("uses-1g", namespace, grace_period_seconds=0)
    pool.custom.delete_namespaced_custom_object(
        "resource.k8s.io", "v1", namespace, "resourceclaims", "one-1g"
    )
    pool.until(lambda: pool.slices() == {}, "the whole pool removed")
    pool.until(
        lambda: all(g.state is GpuState.APPLIED for g in pool.report().gpus), "both GPUs Applied"
    )


def test_a_bad_claim_or_an_unreachable_api_server_affects_only_itself(
    cp: ControlPlane, caplog: pytest.LogCaptureFixture
) -> None:
    """The sink against the real API server, without a kubelet: a malformed claim is skipped
    with its reason and the good one counts; a publish that cannot reach the API server is
    logged, never raised; a slice deleted by someone else is published again."""
    api = cp.api_client()
    core, resource = client.CoreV1Api(api), client.ResourceV1Api(api)
    node = f"drapub-{uuid.uuid4().hex[:6]}"
    core.create_node({"metadata": {"name": node}})
    sim = SimulatedGpus(["H100-SXM5-80GB"], node=node, mig_enabled=[False])
    (info,) = sim.gpus()
    view = OfferedGpu(
        0, info.uuid, "H100-SXM5-80GB", info.memory_mib, 0, 0, Mode.NONE,
        interface=Interface.DRA, pci_bus_id=info.pci_bus_id,
    )  # fmt: skip
    offer = Offer((view,), frozenset(), NodeReport((), ()))
    sink = DraSink(PoolClient(api, node), sim.model)
    good = {
        "metadata": {"name": "good", "namespace": "ns", "uid": "u1"},
        "status": {"allocation": {"devices": {"results": [
            {"request": "dev", "driver": names.DRIVER, "pool": node, "device": "gpu-0"}
        ]}}},
    }  # fmt: skip
    bad = {
        "metadata": {"name": "bad", "namespace": "ns", "uid": "u2"},
        "status": {"allocation": {"devices": {"results": "all of them"}}},
    }
    caplog.set_level(logging.INFO)
    sink.claims_listed((bad, good))
    assert sink.claim_use().holders(0).names == ("ns/good",)
    (skipped,) = [r for r in caplog.records if r.getMessage() == "Skipped unreadable ResourceClaim"]
    assert "ResourceClaim ns/bad.status.allocation.devices.results: must be a list" in str(
        skipped.kv["err"]
    )
    try:
        sink.offer(offer)
        name = f"{node}-gpupart-whole"
        (published,) = resource.list_resource_slice(field_selector=f"spec.nodeName={node}").items
        assert published.metadata.name == name and published.spec.devices[0].name == "gpu-0"

        unreachable = client.Configuration()
        unreachable.host = "http://127.0.0.1:9"
        down = DraSink(PoolClient(client.ApiClient(unreachable), node, timeout_s=2), sim.model)
        down.offer(offer)  # logged, not raised
        (failed,) = [
            r for r in caplog.records if r.getMessage() == "Failed to publish ResourceSlices"
        ]
        assert "ResourceSlices of node" in str(failed.kv["err"])
        with pytest.raises(GpupartError, match="list ResourceClaims"):
            down.claim_use()  # the actuator counts every GPU as held through DRA

        resource.delete_resource_slice(name)
        sink.slice_deleted({"metadata": {"name": name}})
        (again,) = resource.list_resource_slice(field_selector=f"spec.nodeName={node}").items
        assert again.metadata.uid != published.metadata.uid
        assert sink.writes == 2
    finally:
        core.delete_node(node)
        for left in resource.list_resource_slice(field_selector=f"spec.nodeName={node}").items:
            # The garbage collector may have taken it first: the Node owns its slices.
            with contextlib.suppress(client.exceptions.NotFoundException):
                resource.delete_resource_slice(left.metadata.name)
        api.close()


def test_a_node_moved_to_dra_and_back_with_pods_running_never_serves_a_gpu_twice(
    cp: ControlPlane, stack: Stack
) -> None:
    """Two whole GPUs moved from the device plugin to DRA and back while a device-plugin pod
    and a claim hold one each. A sampler checks, the whole time, from what the kubelet
    (PodResources) and the API server (slices, claims) say: no GPU is in the kubelet's
    device-plugin allocatable and in a slice at once, none a pod holds through the device plugin
    is in a slice, and none is held by a device-plugin pod and a claim at once."""
    node = "real-dra-move"
    pool = Pool(stack, node)
    core = pool.core
    stack.start_real_node(node, "2xH100-SXM5-80GB:mig-off", {})
    real = stack.real_nodes[node]
    pool.until(lambda: core.read_node(node), "the kubelet to register the Node")
    both = encode_desired((DesiredGroup("whole", 1, None, WHOLE_DP),))
    core.patch_node(node, {"metadata": {"annotations": {DESIRED_ANNOTATION: both}}})
    pool.until(lambda: (core.read_node(node).status.allocatable or {}).get(GPU) == "2", "2 GPUs")
    inventory = (core.read_node(node).metadata.annotations or {})["gpupart.io/inventory"]
    uuids = {g.index: g.uuid for g in decode_inventory(inventory).gpus}
    namespace = f"drapub-{uuid.uuid4().hex[:6]}"
    core.create_namespace({"metadata": {"name": namespace}})
    cp.wait_namespace_ready(namespace)
    kubelet = PodResourcesClient(str(real.pod_resources_socket))
    violations: list[str] = []
    samples = [0]
    stop = threading.Event()

    def sample() -> None:
        offered = set(kubelet.allocatable().get(GPU, ()))
        held = {d for p in kubelet.list() if p.resource == GPU for d in p.device_ids}
        found = pool.custom.list_cluster_custom_object(
            "resource.k8s.io", "v1", "resourceslices", field_selector=f"spec.nodeName={node}"
        )["items"]
        published = {
            str(v.attribute(names.UUID)) for s in read_slices(found).items for v in s.devices
        }
        claimed = set()
        listed = pool.custom.list_namespaced_custom_object(
            "resource.k8s.io", "v1", namespace, "resourceclaims"
        )["items"]
        for c in read_claims(listed).items:
            for r in c.results:
                if r.pool == node and (index := gpu_index(r.device)) is not None:
                    claimed.add(uuids[index])
        for what, overlap in (
            ("in allocatable and in a slice", offered & published),
            ("held by a pod and in a slice", held & published),
            ("held by a pod and a claim", held & claimed),
        ):
            if overlap:
                violations.append(f"{what}: {sorted(overlap)}")
        samples[0] += 1

    def sampler() -> None:
        # Paced: the kubelet rate-limits PodResources (QPS 100, burst 10), and the agent's own
        # reads must not be refused (unknown use would hold every GPU where it is).
        while not stop.wait(0.2):
            try:
                sample()
            except Exception as error:  # noqa: BLE001 - a read that failed is no sample
                print(f"sample failed: {error}")

    thread = threading.Thread(target=sampler, daemon=True)
    thread.start()

    def pod(name: str, spec: dict[str, Any]) -> None:
        claims = spec.pop("claims", None)
        core.create_namespaced_pod(
            namespace,
            {
                "metadata": {"name": name},
                "spec": {
                    "nodeSelector": {"kubernetes.io/hostname": node},
                    "terminationGracePeriodSeconds": 0,
                    "containers": [{"name": "main", "image": "gpupart/cuda:0", **spec}],
                    **({"resourceClaims": claims} if claims else {}),
                },
            },
        )

    def running(name: str) -> bool:
        return core.read_namespaced_pod(name, namespace).status.phase == "Running"

    try:
        pod("plugin-a", {"resources": {"limits": {GPU: "1"}}})
        pool.until(lambda: running("plugin-a"), "a device-plugin pod running")
        core.patch_node(
            node,
            {"metadata": {"annotations": {DESIRED_ANNOTATION: encode_desired(
                (DesiredGroup("whole", 2, None, WHOLE_DRA),)
            )}}},
        )  # fmt: skip
        # The free GPU moves; the held one waits for its pod.
        pool.until(
            lambda: sum(len(s["spec"].get("devices", [])) for s in pool.raw()) == 1,
            "the free GPU published",
        )
        pool.custom.create_namespaced_custom_object(
            "resource.k8s.io", "v1", namespace, "resourceclaims",
            {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
             "metadata": {"name": "whole"},
             "spec": {"devices": {"requests": [
                 {"name": "dev", "exactly": {"deviceClassName": "gpu.gpupart.io"}}]}}},
        )  # fmt: skip
        pod(
            "claims-b",
            {
                "resources": {"claims": [{"name": "dev"}]},
                "claims": [{"name": "dev", "resourceClaimName": "whole"}],
            },
        )
        pool.until(
            lambda: core.read_namespaced_pod("claims-b", namespace).spec.node_name,
            "the claim's pod bound",
        )
        core.delete_namespaced_pod("plugin-a", namespace, grace_period_seconds=0)
        pool.until(
            lambda: sum(len(s["spec"].get("devices", [])) for s in pool.raw()) == 2,
            "the other GPU published once its pod left",
        )
        # And back: the GPU the claim holds waits for it.
        core.patch_node(
            node,
            {"metadata": {"annotations": {DESIRED_ANNOTATION: encode_desired(
                (DesiredGroup("whole", 3, None, WHOLE_DP),)
            )}}},
        )  # fmt: skip
        pool.until(
            lambda: (core.read_node(node).status.allocatable or {}).get(GPU) == "1",
            "one GPU back on the device plugin",
        )
        pod("plugin-c", {"resources": {"limits": {GPU: "1"}}})
        pool.until(lambda: running("plugin-c"), "a device-plugin pod running again")
        core.delete_namespaced_pod("claims-b", namespace, grace_period_seconds=0)
        pool.custom.delete_namespaced_custom_object(
            "resource.k8s.io", "v1", namespace, "resourceclaims", "whole"
        )
        pool.until(
            lambda: (core.read_node(node).status.allocatable or {}).get(GPU) == "2",
            "both GPUs back on the device plugin",
        )
        pool.until(lambda: not pool.raw(), "no slice")
    finally:
        stop.set()
        thread.join(30)
        kubelet.close()
        core.delete_collection_namespaced_pod(namespace, grace_period_seconds=0)
        stack.stop_real_node(node)
    assert samples[0] > 20, samples
    assert violations == []


def test_a_pool_changed_while_the_api_server_restarts_is_published_once_it_is_back(
    cp: ControlPlane, caplog: pytest.LogCaptureFixture
) -> None:
    """The sink wired as the agent wires it (its slice watch's relist publishes again): a
    change offered while kube-apiserver is down is logged, and once the server is back the
    pool holds the new devices, every slice at one generation."""
    api = cp.api_client()
    core, resource = client.CoreV1Api(api), client.ResourceV1Api(api)
    node = f"drarestart-{uuid.uuid4().hex[:6]}"
    core.create_node({"metadata": {"name": node}})
    sim = SimulatedGpus(["H100-SXM5-80GB"] * 2, node=node, mig_enabled=[False, False])
    views = tuple(
        OfferedGpu(
            g.index,
            g.uuid,
            "H100-SXM5-80GB",
            g.memory_mib,
            g.index,
            0,
            Mode.NONE,
            interface=Interface.DRA,
            pci_bus_id=g.pci_bus_id,
        )  # fmt: skip
        for g in sim.gpus()
    )
    pool = PoolClient(api, node, timeout_s=2, backoff_s=(0.2, 1.0))
    sink = DraSink(pool, sim.model)
    sink.claims_listed(())
    stop = threading.Event()

    def follow_slices() -> None:
        for deleted in pool.watch_slices(stop, relist_s=5):
            sink.slice_deleted(deleted)

    def devices() -> tuple[set[str], set[int]]:
        found = resource.list_resource_slice(field_selector=f"spec.nodeName={node}").items
        return (
            {d.name for s in found for d in s.spec.devices or []},
            {s.spec.pool.generation for s in found},
        )

    watcher = threading.Thread(target=follow_slices, daemon=True)
    watcher.start()
    caplog.set_level(logging.INFO)
    try:
        sink.offer(Offer(views[:1], frozenset(), NodeReport((), ())))
        wait_for(lambda: devices()[0] == {"gpu-0"}, WAIT_S, "GPU 0 published")
        with cp.apiserver_stopped():
            sink.offer(Offer(views, frozenset(), NodeReport((), ())))  # logged, not raised
        assert any(r.getMessage() == "Failed to publish ResourceSlices" for r in caplog.records)
        found = wait_for(
            lambda: (d := devices())[0] == {"gpu-0", "gpu-1"} and d,
            WAIT_S,
            "both GPUs published after the restart",
            detail=lambda: str(devices()),
        )
        assert len(found[1]) == 1, found  # one generation: the pool is whole
    finally:
        stop.set()
        core.delete_node(node)
        for left in resource.list_resource_slice(field_selector=f"spec.nodeName={node}").items:
            with contextlib.suppress(client.exceptions.NotFoundException):
                resource.delete_resource_slice(left.metadata.name)
        api.close()
