"""Dynamic MIG on a node without a GPU count label, then restoreOnDelete: deletion waits for the pod on a slice.

Real etcd, kube-apiserver, kube-scheduler (the chart's gpupart-scheduler configuration), a real
kubelet with the fake CRI runtime; `gpupart operator`, `gpupart node --simulate` (one H100 in
MIG mode whose mode changes take effect once idle) and `gpupart extender` as processes. The
node has GFD's product label but no `nvidia.com/gpu.count`: its GPUs come from the node agent's
`gpupart.io/inventory` (docs/operator.md, ADR 018).
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest

from gpupart.core.api.spec import Mode
from gpupart.core.api.wire import DESIRED_ANNOTATION, MIG_PLAN_ANNOTATION
from gpupart_testsupport.stack import Stack

from .test_full_stack import GROUP, LABEL, PLURAL, VERSION, Cluster, partition, pod, remove

pytestmark = pytest.mark.e2e

SCENARIO = "restore"
NODE = "stack-restore-0"
NAME = "stack-restore"
H100 = "NVIDIA-H100-80GB-HBM3"
MIG_3G = "nvidia.com/mig-3g.40gb"


def _partition(c: Cluster) -> dict[str, Any] | None:
    try:
        found: dict[str, Any] = c.custom.get_cluster_custom_object(GROUP, VERSION, PLURAL, NAME)
    except Exception as error:  # noqa: BLE001 - 404 once the finalizer went
        if getattr(error, "status", None) == 404:
            return None
        raise
    return found


def _ready(obj: dict[str, Any] | None) -> dict[str, Any]:
    for c in ((obj or {}).get("status") or {}).get("conditions") or []:
        if c["type"] == "Ready":
            return dict(c)
    return {}


def _annotations(c: Cluster) -> dict[str, str]:
    return dict(c.core.read_node(NODE).metadata.annotations or {})


def test_restore_on_delete_waits_for_the_pod_on_a_slice_then_the_node_is_whole(
    stack: Stack, namespace: str
) -> None:
    c = Cluster(stack)
    # GFD's product label, no nvidia.com/gpu.count: the agent's inventory says 1 GPU.
    stack.start_real_node(
        NODE, "1xH100-SXM5-80GB", {LABEL: SCENARIO, "nvidia.com/gpu.product": H100}, auto_reset=True
    )
    spec = {
        "mode": "MIG",
        "mig": {"dynamic": {"minIdleSeconds": 0}},
        "restoreOnDelete": True,
    }
    c.custom.create_cluster_custom_object(GROUP, VERSION, PLURAL, partition(NAME, SCENARIO, spec))
    try:
        _steps(c, namespace)
    except BaseException:
        # The cleanup's own timeout would hide why the test failed (Cluster.until raises from None).
        with contextlib.suppress(BaseException):
            remove(stack, NAME, [NODE])
        raise
    remove(stack, NAME, [NODE])


def _steps(c: Cluster, namespace: str) -> None:
    c.until(lambda: c.node_states(NAME).get(NODE, {}).get("state") == "Applied", 90, "Applied")
    assert _ready(_partition(c)).get("reason") == "Applied"

    # Dynamic MIG makes the slice for the pod: the operator counted the GPU from the inventory.
    c.core.create_namespaced_pod(namespace, pod("train", SCENARIO, {MIG_3G: "1"}))
    c.until(lambda: "train" in c.running(namespace), 90, "train Running on a new 3g.40gb")
    c.until(
        lambda: any(
            e.startswith("MigSlicePlanned: creating 3g.40gb on " + NODE)
            for e in c.events(namespace, "train")
        ),
        30,
        "a MigSlicePlanned Event on train",
    )
    held = c.env(namespace, "train")["NVIDIA_VISIBLE_DEVICES"]
    assert held.startswith("MIG-")

    # Delete: the node keeps a desired annotation without groups (whole GPUs), the agent
    # is Blocked by the pod, and the partition stays, saying which pod it waits for.
    c.custom.delete_cluster_custom_object(GROUP, VERSION, PLURAL, NAME)
    who = f"{namespace}/train"

    def blocked() -> dict[str, Any] | None:
        obj = _partition(c)
        entry = (((obj or {}).get("status") or {}).get("nodes") or {}).get(NODE, {})
        ok = entry.get("state") == "Blocked" and who in entry.get("message", "")
        return obj if ok else None

    obj = c.until(blocked, 60, "the deleting partition Blocked by the pod")
    ready = _ready(obj)
    assert ready["reason"] == "Restoring" and who in ready["message"], ready
    assert "gpupart.io/finalizer" in obj["metadata"]["finalizers"]
    assert _annotations(c).get(DESIRED_ANNOTATION) is not None
    # No dynamic partition holds the node now: the next demand round drops its MIG plan.
    c.until(lambda: MIG_PLAN_ANNOTATION not in _annotations(c), 30, "the MIG plan removed")
    # Nothing in use was destroyed: the pod's instance is still there, still its.
    assert held in {d.uuid for g in c.inventory(NODE) for d in g.mig_devices}
    assert "train" in c.running(namespace)

    def progress() -> str | None:
        annotations = (_partition(c) or {})["metadata"].get("annotations", {})
        text = annotations.get("gpupart.io/release", "")
        return text if who in text else None

    # kopf's retry of the waiting delete handler names the pod too.
    assert "restoreOnDelete" in c.until(progress, 30, "kopf's progress naming the pod")
    c.until(
        lambda: any(e.startswith("Restoring: Ready=False") for e in c.events("default", NAME)),
        30,
        "an Event for the Restoring condition",
    )

    # The pod goes: the instance is destroyed, MIG mode off, the finalizer released.
    c.core.delete_namespaced_pod("train", namespace, grace_period_seconds=0)
    c.until(lambda: _partition(c) is None, 90, "the partition deleted once the GPU is whole")
    (gpu,) = c.inventory(NODE)
    assert gpu.mode is Mode.NONE and gpu.mig_devices == (), gpu
    report = c.gpu_report(NODE)
    assert [(g.state.value, g.mode) for g in report.gpus] == [("Applied", Mode.NONE)]
    c.until(lambda: c.capacity(NODE, "nvidia.com/gpu") == 1, 30, "a whole GPU advertised")
    assert c.capacity(NODE, MIG_3G) == 0
    # With the partition gone, the operator removes the annotation; the GPU stays whole.
    c.until(lambda: DESIRED_ANNOTATION not in _annotations(c), 30, "desired removed")
