"""The extender and DRA: it keeps off GPUs the device plugin does not serve, reads DRA objects, explains DRA pods.

We test these aspects:
- the inventory's GPUs served through DRA (or moving, interface null) are not in the
  snapshot's views: filter neither counts nor assigns them;
- ResourceSlices, ResourceClaims and DeviceClasses are read one by one: a malformed one is
  listed as unreadable with its reason, the others are read;
- a pending pod whose claim cannot be allocated gets our sentence (node, GPU, holder pod) from
  `pending_reason`, and `diagnose` answers it in the same JSON shape;
- `PendingPods` keeps a claim-only pod kube-scheduler gave up on.
"""

from __future__ import annotations

import copy
from typing import Any

from extender_objects import FakeBinder
from fastapi.testclient import TestClient

from gpupart.core.api.spec import Interface, Mode
from gpupart.core.api.wire import InventoryGpu
from gpupart.core.dra import names
from gpupart.core.dra.allocator import DeviceRequest, first_fit
from gpupart.core.dra.read import read_slices
from gpupart_extender.app import create_app
from gpupart_extender.cache import NAMESPACE, NODE, POD, ClusterCache
from gpupart_extender.metrics import Metrics
from gpupart_extender.objects import DEVICE_CLASS, RESOURCE_CLAIM, RESOURCE_SLICE
from gpupart_extender.pending import PendingPods
from gpupart_extender.service import ExtenderService
from gpupart_extender.settings import ExtenderSettings
from gpupart_testsupport.draobjects import claim, claim_pod, device_classes, dynamic_h100, pool
from gpupart_testsupport.objects import namespace, node, pod, whole_gpu


def _dra_gpu(index: int, interface: Interface | None) -> InventoryGpu:
    return InventoryGpu(
        index, f"GPU-D{index}", "NVIDIA H100 80GB HBM3", 81559, Mode.NONE, interface=interface
    )


def _service(cache: ClusterCache) -> ExtenderService:
    return ExtenderService(
        cache, ExtenderSettings().scoring(), binder=FakeBinder(), metrics=Metrics()
    )


def test_gpus_not_served_by_the_device_plugin_are_not_the_extenders() -> None:
    cache = ClusterCache()
    gpus = [whole_gpu(0), _dra_gpu(1, Interface.DRA), _dra_gpu(2, None)]
    cache.replace(NODE, [node("mixed", gpus)])
    cache.replace(POD, [])
    cache.replace(NAMESPACE, [namespace("team-a")])
    view = cache.snapshot.view("mixed")
    assert view is not None and [g.index for g in view.gpus] == [0]
    service = _service(cache)
    one = service.filter(pod("one", {"nvidia.com/gpu": 1}), ["mixed"])
    assert one.passed == ["mixed"]
    two = service.filter(pod("two", {"nvidia.com/gpu": 2}), ["mixed"])
    assert two.unresolvable == {"mixed": "mixed: needs 2 whole GPUs, the node offers 1"}


NODE_NAME = "dra-node"


def _dra_cache() -> tuple[ClusterCache, dict[str, Any]]:
    """A node with one dynamic-MIG H100 published as DRA devices, a 1g.10gb at slot 2 held by
    team-a/train-2, and a pending pod whose 4g.40gb claim (made from its template) cannot fit."""
    cache = ClusterCache()
    cache.replace(NODE, [node(NODE_NAME, [_dra_gpu(0, Interface.DRA)]), node("other", None)])
    cache.replace(POD, [])
    cache.replace(NAMESPACE, [namespace("team-a"), namespace("team-b")])
    docs = pool(NODE_NAME, "uid-node", [dynamic_h100(0)])
    slices = read_slices(docs).items
    request = DeviceRequest(
        "dev", ((names.PLACEMENT_START, 2), (names.PROFILE, "1g.10gb"), (names.TYPE, "mig"))
    )
    held = first_fit(slices, [], [request])
    assert held is not None
    cache.replace(RESOURCE_SLICE, docs)
    cache.replace(DEVICE_CLASS, device_classes())
    cache.replace(
        RESOURCE_CLAIM,
        [
            claim(
                "team-a",
                "train-2-dev",
                "mig-1g10gb.gpupart.io",
                results=held,
                reserved_for=["train-2"],
            ),
            claim("team-b", "big-dev-x7", "mig-4g40gb.gpupart.io"),
        ],
    )
    pending = claim_pod("team-b", "big", template="one-4g", made="big-dev-x7")
    pending["status"]["conditions"] = [
        {
            "type": "PodScheduled",
            "status": "False",
            "reason": "Unschedulable",
            "message": "0/2 nodes are available: 1 cannot allocate all claims.",
        }
    ]
    return cache, pending


EXPECTED = (
    "dra-node: GPU 0 has 4g.40gb only at slots 0-3, taken by team-a/train-2 (1g.10gb at slot 2)"
)


def test_a_pending_dra_pod_gets_the_node_gpu_and_holder() -> None:
    cache, pending = _dra_cache()
    text = _service(cache).pending_reason(pending)
    assert text.startswith("0/2 nodes can take it (gpupart): "), text
    assert EXPECTED in text, text
    assert "1 node(s) had no gpupart DRA devices" in text, text
    kept = PendingPods(("default-scheduler",))
    kept.apply("ADDED", pending)
    assert list(kept.pods()) == ["uid-team-b-big"]


def test_a_claim_not_made_yet_is_said_before_the_nodes() -> None:
    cache, pending = _dra_cache()
    del pending["status"]["resourceClaimStatuses"]
    text = _service(cache).pending_reason(pending)
    assert text == (
        "its claim dev is not made yet (the resourceclaim controller of kube-controller-manager "
        "makes it from template one-4g)."
    )
    found = _service(cache).diagnose(pending)
    assert found.scores == {} and found.failed[NODE_NAME].startswith(f"{NODE_NAME}: its claim dev")


def test_diagnose_answers_a_dra_pod_in_the_same_shape() -> None:
    cache, pending = _dra_cache()
    service = _service(cache)
    settings = ExtenderSettings(url_prefix="/gpupart")
    with TestClient(create_app(settings, service)) as http:
        answer = http.post("/gpupart/diagnose", json=pending)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["Pod"] == "team-b/big" and body["Scores"] == {}
    assert body["FailedNodes"][NODE_NAME] == EXPECTED
    assert body["FailedNodes"]["other"] == "other: no gpupart DRA devices (no ResourceSlice)"
    # Once the holder's claim is gone, the node fits: its score is 0 (DRA nodes are not ranked).
    cache.apply(RESOURCE_CLAIM, "DELETED", claim("team-a", "train-2-dev", "mig-1g10gb.gpupart.io"))
    found = service.diagnose(pending)
    assert found.scores == {NODE_NAME: 0}


def test_one_bad_dra_object_is_listed_and_affects_only_itself() -> None:
    cache, pending = _dra_cache()
    bad_slice = copy.deepcopy(pool("bad-node", "uid-bad", [dynamic_h100(0)])[1])
    bad_slice["spec"]["devices"][0]["capacity"]["memory"]["value"] = "lots"
    cache.apply(RESOURCE_SLICE, "ADDED", bad_slice)
    cache.apply(
        RESOURCE_CLAIM, "ADDED", {"metadata": {"name": "odd", "namespace": "team-b"}, "spec": []}
    )
    cache.apply(DEVICE_CLASS, "ADDED", {"metadata": {"name": "broken"}, "spec": {"selectors": "x"}})
    unreadable = {(u.kind, u.name): u.problem for u in cache.snapshot.unreadable}
    assert "capacity.memory.value" in unreadable[(RESOURCE_SLICE, bad_slice["metadata"]["name"])]
    assert "ResourceClaim team-b/odd.spec" in unreadable[(RESOURCE_CLAIM, "team-b/odd")]
    assert "DeviceClass broken.spec.selectors" in unreadable[(DEVICE_CLASS, "broken")]
    assert cache.snapshot.unreadable_counts()[RESOURCE_SLICE] == 1
    assert EXPECTED in _service(cache).pending_reason(pending)
    # Fixed, it is read, and its problem is gone.
    cache.apply(DEVICE_CLASS, "MODIFIED", {"metadata": {"name": "broken"}, "spec": {}})
    assert (DEVICE_CLASS, "broken") not in {(u.kind, u.name) for u in cache.snapshot.unreadable}


def test_a_class_selector_gpupart_cannot_read_is_named() -> None:
    cache, pending = _dra_cache()
    odd = device_classes()[0]
    odd["metadata"]["name"] = "mig-4g40gb.gpupart.io"
    odd["spec"]["selectors"] = [
        {"cel": {"expression": 'device.attributes["gpu.gpupart.io"].profile.startsWith("4g")'}}
    ]
    cache.apply(DEVICE_CLASS, "MODIFIED", odd)
    text = _service(cache).pending_reason(pending)
    assert text.startswith(
        "gpupart cannot explain this pod: class mig-4g40gb.gpupart.io's selector is not one gpupart reads"
    ), text
    with TestClient(create_app(ExtenderSettings(url_prefix="/gpupart"), _service(cache))) as http:
        answer = http.post("/gpupart/diagnose", json=pending)
    assert answer.status_code == 400
    assert "mig-4g40gb.gpupart.io's selector is not one gpupart reads" in answer.json()["Error"]
