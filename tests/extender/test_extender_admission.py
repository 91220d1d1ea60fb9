"""One shared-GPU pod awaiting admission per node: binds wait for the device plugin's allocation record.

We test these aspects:
- on a node whose plugin admits one pod at a time (`serialAdmission`), a second shared pod is
  bound only once the first pod's allocation record (its `gpupart.io/SharedGpuAllocated`
  status condition, which tenants cannot write) covers its containers, or the
  first pod finished or is being deleted; until then bind answers why, after a bounded wait;
- a bind that waits is released by the watch event that completes the record;
- MIG pods, and nodes without serial admission, are never held.
"""

from __future__ import annotations

import threading
from typing import Any

from extender_objects import FakeBinder

from gpupart.core.api.wire import (
    ASSIGNMENT_ANNOTATION,
    GivenContainer,
    allocation_condition,
)
from gpupart_extender.cache import NODE, POD, ClusterCache
from gpupart_extender.metrics import Metrics
from gpupart_extender.service import ExtenderService
from gpupart_extender.settings import ExtenderSettings
from gpupart_testsupport.objects import keys, node, pod, shared, shared_gpu


def service(binder: FakeBinder, *, wait: float = 0.05) -> tuple[ExtenderService, ClusterCache]:
    cache = ClusterCache(keys=keys)
    gpus = [shared_gpu(0, memory=40000), shared_gpu(1, memory=40000)]
    cache.replace(NODE, [node("serial", gpus, serial=True), node("plain", gpus)])
    cache.replace(POD, [])
    scoring = ExtenderSettings().scoring()
    return (
        ExtenderService(
            cache, scoring, keys=keys, binder=binder, metrics=Metrics(), admission_wait_seconds=wait
        ),
        cache,
    )


def bind(svc: ExtenderService, name: str, node_name: str, resources: Any = None) -> str:
    p = pod(name, resources or shared(8000))
    assert isinstance(svc.binder, FakeBinder)
    svc.binder.live(p)
    svc.filter(p, [node_name])
    return svc.bind("team-a", name, f"uid-team-a-{name}", node_name)


def watched(
    binder: FakeBinder, name: str, *, record: bool = False, **status: Any
) -> dict[str, Any]:
    """The pod as the watch shows it after the bind, with the plugin's record if `record`."""
    ((_, _, _, annotations),) = [a for a in binder.annotations if a[1] == name]
    obj = pod(name, shared(8000), node=[b for b in binder.bindings if b[1] == name][0][3])
    obj["metadata"]["annotations"][ASSIGNMENT_ANNOTATION] = annotations[ASSIGNMENT_ANNOTATION]
    if record:
        given = (GivenContainer("main", ("GPU-0000::0",), "GPU-0000", 8000, 0),)
        obj["status"]["conditions"] = [allocation_condition(given, "2026-01-01T00:00:00Z")]
    obj["status"].update(status)
    return obj


def test_second_shared_pod_waits_for_the_first_pods_allocation_record() -> None:
    binder = FakeBinder()
    svc, cache = service(binder)
    assert bind(svc, "a", "serial") == ""
    refused = bind(svc, "b", "serial")
    assert refused.startswith("node serial is still admitting team-a/a: the device plugin")
    assert [b[1] for b in binder.bindings] == ["a"]
    cache.apply(POD, "MODIFIED", watched(binder, "a"))  # bound, not yet served
    assert "still admitting team-a/a" in bind(svc, "b", "serial")
    cache.apply(POD, "MODIFIED", watched(binder, "a", record=True))
    assert bind(svc, "b", "serial") == ""
    # A pod that finished or is being deleted holds the node no more.
    cache.apply(POD, "MODIFIED", watched(binder, "b", phase="Failed"))
    assert bind(svc, "c", "serial") == ""
    deleting = watched(binder, "c")
    deleting["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    cache.apply(POD, "MODIFIED", deleting)
    assert bind(svc, "d", "serial") == ""


def test_a_waiting_bind_is_released_by_the_record() -> None:
    binder = FakeBinder()
    svc, cache = service(binder, wait=30.0)
    assert bind(svc, "a", "serial") == ""
    cache.apply(POD, "MODIFIED", watched(binder, "a"))
    result: list[str] = []
    waiter = threading.Thread(target=lambda: result.append(bind(svc, "b", "serial")))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive() and result == []  # held while pod a awaits its slots
    cache.apply(POD, "MODIFIED", watched(binder, "a", record=True))
    waiter.join(10)
    assert result == [""]


def test_nodes_without_serial_admission_and_mig_pods_are_not_held() -> None:
    binder = FakeBinder()
    svc, _ = service(binder)
    assert [bind(svc, n, "plain") for n in ("a", "b", "c")] == ["", "", ""]
    assert bind(svc, "d", "serial") == ""
    assert "still admitting" not in bind(svc, "m", "serial", {"nvidia.com/gpu": 1})
