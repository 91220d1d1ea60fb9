"""DRA reasons with the real kube-scheduler: a pod whose claim cannot be allocated gets gpupart's sentence as an Event.

Its own control plane with kube-controller-manager (the resourceclaim controller makes the
claims from templates) and the chart's DeviceClasses; kwok nodes carry our pool documents as
`test_dra_scheduler` publishes them. The extender's watch, pending-pods store and reporter run in
this process with the real Event writer, for pods of the default scheduler (kube-scheduler
allocates DRA claims itself; the extender only explains). We read kube-scheduler's own
PodScheduled message first: it says the claims cannot be allocated, and nothing more.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Generator
from typing import Any

import pytest
from kubernetes import client

from gpupart.core.api.spec import Mode
from gpupart.core.dra import names
from gpupart.core.dra.devices import DraGpu
from gpupart_extender.cache import ClusterCache
from gpupart_extender.kube import ApiBinder, ApiEvents, Watcher
from gpupart_extender.metrics import Metrics
from gpupart_extender.pending import REASON, PendingPods, Reporter
from gpupart_extender.service import ExtenderService
from gpupart_extender.settings import ExtenderSettings
from gpupart_testsupport.cluster import ControlPlane, condition
from gpupart_testsupport.polling import wait_for

from .test_dra_scheduler import (
    FACTS,
    H100,
    WAIT_S,
    allocated_device,
    claim_pod,
    create,
    make_node,
    offered,
    scheduled,
    template,
    unschedulable,
)

pytestmark = pytest.mark.e2e

SCHEDULERS = ("default-scheduler",)


@pytest.fixture(scope="module")
def cp(dra_kwok_plane: ControlPlane) -> ControlPlane:
    """The module's own control plane with kube-controller-manager and our DeviceClasses."""
    return dra_kwok_plane


@pytest.fixture(scope="module")
def api(cp: ControlPlane) -> Generator[Any, None, None]:
    api_client = cp.api_client()
    yield api_client
    api_client.close()


@pytest.fixture(scope="module")
def reporter(api: Any) -> Generator[ExtenderService, None, None]:
    """The extender's watch (DRA kinds included) and its pending-reasons reporter."""
    cache = ClusterCache()
    settings = ExtenderSettings()
    service = ExtenderService(
        cache,
        settings.scoring(),
        binder=ApiBinder(api),
        metrics=Metrics(),
        scheduler_names=SCHEDULERS,
    )
    pending = PendingPods(SCHEDULERS)
    watcher = Watcher(api, cache, period_seconds=60, pending=pending)
    watcher.start()
    posting = Reporter(pending, service.pending_reason, ApiEvents(api))
    thread = threading.Thread(target=posting.run, args=(watcher.stopping, 0.5), daemon=True)
    thread.start()
    try:
        wait_for(lambda: all(cache.synced.values()), 30, "the extender's watch cache to sync")
        yield service
    finally:
        watcher.stop()
        thread.join(10)


@pytest.fixture
def namespace(cp: ControlPlane, api: Any) -> str:
    name = f"reasons-{uuid.uuid4().hex[:6]}"
    client.CoreV1Api(api).create_namespace({"metadata": {"name": name}})
    cp.wait_namespace_ready(name)
    return name


def our_event(api: Any, namespace: str, pod: str, needle: str) -> str:
    """The text of the extender's FailedScheduling Event on `pod` that contains `needle`."""
    core = client.CoreV1Api(api)

    def check() -> str | None:
        for event in core.list_namespaced_event(namespace).items:
            if (
                event.involved_object.name == pod
                and event.reason == REASON
                and needle in (event.message or "")
            ):
                return str(event.message)
        return None

    return wait_for(check, WAIT_S, f"gpupart's FailedScheduling event on {pod} with {needle!r}")


def test_a_4g_claim_blocked_by_a_1g_gets_the_node_gpu_and_holder(
    api: Any, namespace: str, reporter: ExtenderService
) -> None:
    node, _ = make_node(api, [DraGpu(offered(0, Mode.MIG), H100, dynamic=True, facts=FACTS)])
    domain = f'device.attributes["{names.DRIVER}"]'
    template(
        api,
        namespace,
        "at-2",
        "mig-1g10gb.gpupart.io",
        selector=f"{domain}.{names.PLACEMENT_START} == 2",
    )
    create(api, claim_pod(namespace, "holder", node, "at-2"))
    scheduled(api, namespace, "holder")
    assert allocated_device(api, namespace, "holder") == names.mig_device_name(0, "1g.10gb", 2)
    template(api, namespace, "one-4g", "mig-4g40gb.gpupart.io")
    create(api, claim_pod(namespace, "big", node, "one-4g"))
    found = unschedulable(api, namespace, "big")
    # kube-scheduler's own words: the claims cannot be allocated, no device, no holder.
    scheduler_says = str((condition(found, "PodScheduled") or {}).get("message"))
    assert "cannot allocate all claims" in scheduler_says, scheduler_says
    sentence = f"{node}: GPU 0 has 4g.40gb only at slots 0-3, taken by {namespace}/holder"
    text = our_event(api, namespace, "big", sentence)
    assert f"{sentence} (1g.10gb at slot 2)" in text, text
    # diagnose answers the same pod with the same sentence.
    live = api.sanitize_for_serialization(
        client.CoreV1Api(api).read_namespaced_pod("big", namespace)
    )
    assert reporter.diagnose(live, [node]).failed[node] == f"{sentence} (1g.10gb at slot 2)"


@pytest.mark.usefixtures("reporter")
def test_an_extended_resource_pod_served_by_dra_gets_the_same_words(
    api: Any, namespace: str
) -> None:
    """`nvidia.com/mig-4g.40gb: 1` on a node that does not advertise it is DRA's (KEP-5004)."""
    node, _ = make_node(api, [DraGpu(offered(0, Mode.MIG), H100, dynamic=True, facts=FACTS)])
    template(api, namespace, "whole", "mig-7g80gb.gpupart.io")
    create(api, claim_pod(namespace, "whole", node, "whole"))
    scheduled(api, namespace, "whole")
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
                    "resources": {"limits": {"nvidia.com/mig-4g.40gb": "1"}},
                }
            ],
        },
    }
    create(api, pod)
    found = unschedulable(api, namespace, "legacy")
    scheduler_says = str((condition(found, "PodScheduled") or {}).get("message"))
    assert "claim" in scheduler_says, scheduler_says
    sentence = f"{node}: GPU 0 has 4g.40gb only at slots 0-3, taken by {namespace}/whole"
    assert f"{sentence} (7g.80gb at slots 0-7)" in our_event(api, namespace, "legacy", sentence)
