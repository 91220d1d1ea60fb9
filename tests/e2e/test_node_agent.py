"""The node agent against a real kube-apiserver: its Node's desired and plan annotations in, state and inventory out."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from gpupart.core.api.spec import GpuConfig, Mode
from gpupart.core.api.wire import (
    DESIRED_ANNOTATION,
    INVENTORY_ANNOTATION,
    MIG_PLAN_ANNOTATION,
    STATE_ANNOTATION,
    DesiredGroup,
    GpuState,
    MigPlan,
    PlannedGpu,
    PlanReport,
    decode_inventory,
    decode_report,
    encode_desired,
    encode_mig_plan,
)
from gpupart.core.mig.layout import MigInstance, Placement
from gpupart.keyfile import KeyFile
from gpupart_plugin.actuator import Actuator
from gpupart_plugin.agent import NodeAgent, ViewSink
from gpupart_plugin.annotations import NodeAnnotations, Publish
from gpupart_plugin.deviceplugin.hub import DeviceHub
from gpupart_plugin.deviceplugin.sink import DevicePluginSink
from gpupart_plugin.kube import NodeClient, PassInput
from gpupart_plugin.metrics import NodeMetrics
from gpupart_plugin.mps import MpsDaemons
from gpupart_plugin.simgpu import SimulatedGpus

pytestmark = pytest.mark.e2e


def sinks(publish: Publish) -> tuple[ViewSink, ...]:
    """The device hub without gRPC servers, and the Node's annotations through the real client."""
    return (DevicePluginSink(DeviceHub(), None, NodeMetrics()), NodeAnnotations(publish))


def test_one_pass_applies_the_desired_layout_and_reports(k8s_api: Any, tmp_path: Path) -> None:
    core = client.CoreV1Api(k8s_api)
    name = "gpupart-agent-e2e"
    desired = encode_desired(
        (DesiredGroup("train", 3, None, GpuConfig(Mode.MIG, (("1g.18gb", 3), ("3g.71gb", 1)))),)
    )
    core.create_node({"metadata": {"name": name, "annotations": {DESIRED_ANNOTATION: desired}}})
    try:
        node = NodeClient(k8s_api, name, KeyFile.public(tmp_path / "assignment-keys"))
        sim = SimulatedGpus(["H200-141GB"] * 2, node=name)
        actuator = Actuator(sim, lambda: (), MpsDaemons(tmp_path / "mps", ["true"]))
        agent = NodeAgent(actuator, sinks(node.publish), NodeMetrics())
        wanted = node.read_input()
        agent.reconcile(wanted.desired, wanted.plan)
        annotations = core.read_node(name).metadata.annotations
        report = decode_report(annotations[STATE_ANNOTATION])
        assert report.observed == (("train", 3),)
        assert [g.state for g in report.gpus] == [GpuState.APPLIED, GpuState.APPLIED]
        inventory = decode_inventory(annotations[INVENTORY_ANNOTATION]).gpus
        assert [g.uuid for g in inventory] == [g.uuid for g in sim.gpus()]
        assert all(len(g.mig_devices) == 4 and g.mode is Mode.MIG for g in inventory)
        assert node.last_inventory() == annotations[INVENTORY_ANNOTATION]  # read back on restart
    finally:
        core.delete_node(name)


def test_the_plan_annotation_starts_a_pass_and_gets_its_answer(
    k8s_api: Any, tmp_path: Path
) -> None:
    core = client.CoreV1Api(k8s_api)
    name = "gpupart-agent-plan-e2e"
    dynamic = DesiredGroup("dyn", 1, None, GpuConfig(Mode.MIG, (), dynamic=True))
    desired = encode_desired((dynamic,))
    core.create_node({"metadata": {"name": name, "annotations": {DESIRED_ANNOTATION: desired}}})
    stop = threading.Event()
    node = NodeClient(k8s_api, name, KeyFile.public(tmp_path / "assignment-keys"))
    seen = node.watch_input(stop, relist_s=30)
    try:
        assert next(seen) == PassInput(desired, None)
        layout = (MigInstance(Placement(0, 4), "3g.71gb"), MigInstance(Placement(6, 1), "1g.18gb"))
        plan = encode_mig_plan(MigPlan("p1", (PlannedGpu(0, layout),)))
        core.patch_node(name, {"metadata": {"annotations": {MIG_PLAN_ANNOTATION: plan}}})
        wanted = next(seen)  # a change of the plan alone is a pass
        assert wanted == PassInput(desired, plan)
        sim = SimulatedGpus(["H200-141GB"], node=name)
        actuator = Actuator(sim, lambda: (), MpsDaemons(tmp_path / "mps", ["true"]))
        agent = NodeAgent(actuator, sinks(node.publish), NodeMetrics())
        agent.reconcile(wanted.desired, wanted.plan)
        annotations = core.read_node(name).metadata.annotations
        assert decode_report(annotations[STATE_ANNOTATION]).plan == PlanReport(
            "p1", GpuState.APPLIED
        )
        (gpu,) = decode_inventory(annotations[INVENTORY_ANNOTATION]).gpus
        assert [d.instance for d in gpu.mig_devices] == list(layout)
        assert not any(d.used for d in gpu.mig_devices)
    finally:
        stop.set()
        seen.close()
        core.delete_node(name)
