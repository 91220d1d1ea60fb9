"""A pass's new MIG counts reach the Node's status once the kubelet holds them (real gRPC, fake kubelet, PodResources).

We test these aspects:
- an instance a plan creates is written only after PodResources GetAllocatableResources lists
  its device, never before; a pass that changes nothing writes nothing and asks nothing;
- a decrease (the instance destroyed) is written at once, even while the kubelet lags;
- a plan creating two instances: the first is written once the kubelet lists it, before the
  second exists;
- a kubelet that never lists the device within the bound: nothing written, the pass still done;
- a kubelet without GetAllocatableResources (UNIMPLEMENTED): nothing written, logged once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from plugin_fakes import FakeKubelet, FakePodResources

from gpupart.core.api.spec import GpuConfig, Mode
from gpupart.core.api.wire import (
    DesiredGroup,
    GpuState,
    MigPlan,
    PlannedGpu,
    PlanReport,
    decode_report,
    encode_desired,
    encode_mig_plan,
)
from gpupart.core.mig.layout import MigInstance, Placement
from gpupart_plugin.actuator import Actuator
from gpupart_plugin.agent import NodeAgent
from gpupart_plugin.annotations import NodeAnnotations
from gpupart_plugin.checkpoint import Checkpoint
from gpupart_plugin.deviceplugin.allocator import Allocator
from gpupart_plugin.deviceplugin.hub import DeviceHub
from gpupart_plugin.deviceplugin.nodestatus import NodeStatusWriter
from gpupart_plugin.deviceplugin.registration import DevicePlugins
from gpupart_plugin.deviceplugin.sink import DevicePluginSink
from gpupart_plugin.metrics import NodeMetrics
from gpupart_plugin.mps import MpsDaemons
from gpupart_plugin.podresources import PodResourcesClient
from gpupart_plugin.simgpu import SimulatedGpus

MIG_3G = "nvidia.com/mig-3g.71gb"
DESIRED = encode_desired((DesiredGroup("d", 1, (0,), GpuConfig(Mode.MIG, (), dynamic=True)),))
ONE = (MigInstance(Placement(0, 4), "3g.71gb"),)
TWO = (*ONE, MigInstance(Placement(4, 4), "3g.71gb"))


def plan(plan_id: str, layout: tuple[MigInstance, ...]) -> str:
    return encode_mig_plan(MigPlan(plan_id, (PlannedGpu(0, layout),)))


@dataclass
class Written:
    """One status write: its amounts and the kubelet's latest GetAllocatableResources answer then."""

    capacity: dict[str, int]
    allocatable: dict[str, int]
    kubelet_held: dict[str, set[str]] | None
    made: int
    """The complete instances on the GPU then."""


@dataclass
class Node:
    agent: NodeAgent
    kubelet: FakeKubelet
    pod_resources: FakePodResources
    sim: SimulatedGpus
    writes: list[Written] = field(default_factory=list)
    states: list[str] = field(default_factory=list)

    def device(self) -> str:
        """The 3g.71gb device id the fake kubelet last received."""
        listed = self.kubelet.wait_for(MIG_3G, lambda listed: len(listed) == 1)
        return listed[0][0]


def make_node(
    kubelet: FakeKubelet, tmp_path: Path, *, implements_allocatable: bool = True, timeout_s: float
) -> Iterator[Node]:
    hub, metrics = DeviceHub(), NodeMetrics()
    allocator = Allocator(
        hub,
        "node-a",
        lambda: (),
        lambda _pod, _given: None,
        Checkpoint(tmp_path / "state", "node-a"),
    )
    plugins = DevicePlugins(
        hub, allocator, metrics, plugin_dir=kubelet.directory, kubelet_socket=kubelet.socket,
        poll_s=0.05,
    )  # fmt: skip
    pod_resources = FakePodResources(kubelet, implements_allocatable=implements_allocatable)
    pod_resources.start()
    client = PodResourcesClient(str(pod_resources.socket), timeout_s=2)
    sim = SimulatedGpus(["H200-141GB"], mode_change_needs_reset=False)
    actuator = Actuator(sim, lambda: (), MpsDaemons(tmp_path / "mps", ["true"]))

    def write(capacity: Mapping[str, int], allocatable: Mapping[str, int]) -> None:
        answers = pod_resources.answers
        made = sum(1 for r in sim.instances(0) if r.compute_instances)
        held = answers[-1] if answers else None
        node.writes.append(Written(dict(capacity), dict(allocatable), held, made))

    status = NodeStatusWriter(hub, client.allocatable, write, timeout_s=timeout_s, poll_s=0.02)
    sinks = (
        DevicePluginSink(hub, plugins, metrics),
        NodeAnnotations(lambda s, _i, _c: node.states.append(s)),
        status,
    )
    agent = NodeAgent(actuator, sinks, metrics)
    node = Node(agent, kubelet, pod_resources, sim)
    yield node
    plugins.stop()
    client.close()
    pod_resources.stop()


@pytest.fixture
def node(kubelet: FakeKubelet, tmp_path: Path) -> Iterator[Node]:
    yield from make_node(kubelet, tmp_path, timeout_s=30)


def test_a_new_instance_is_written_only_once_the_kubelet_lists_it_and_a_decrease_at_once(
    node: Node,
) -> None:
    node.agent.reconcile(DESIRED)
    assert node.writes == [], "a pass that creates nothing writes nothing"
    node.pod_resources.pause()  # the kubelet's device manager lags behind its ListAndWatch
    passed = threading.Thread(target=node.agent.reconcile, args=(DESIRED, plan("p1", ONE)))
    passed.start()
    device = node.device()  # the fake kubelet received the new device over ListAndWatch
    asked = len(node.pod_resources.answers)
    deadline = time.monotonic() + 10
    while len(node.pod_resources.answers) < asked + 5 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(node.pod_resources.answers) >= asked + 5, "the agent polls while it waits"
    assert node.writes == [], "nothing written while the kubelet does not list the device"
    node.pod_resources.resume()
    passed.join(10)
    assert not passed.is_alive()
    assert [(w.capacity, w.allocatable) for w in node.writes] == [({MIG_3G: 1}, {MIG_3G: 1})]
    held = node.writes[0].kubelet_held
    assert held is not None and device in held[MIG_3G], "written after the kubelet listed it"

    asked = len(node.pod_resources.answers)
    node.agent.reconcile(DESIRED, plan("p1", ONE))
    assert len(node.writes) == 1, "a pass that changes nothing writes nothing"
    assert len(node.pod_resources.answers) == asked, "and asks the kubelet nothing"

    node.pod_resources.pause()  # the kubelet still holds the device
    node.agent.reconcile(DESIRED, plan("p2", ()))
    assert [(w.capacity, w.allocatable) for w in node.writes[1:]] == [({MIG_3G: 0}, {MIG_3G: 0})]
    assert len(node.pod_resources.answers) == asked, "a decrease waits for nobody"


def test_each_instance_of_a_plan_is_written_before_the_next_one_exists(node: Node) -> None:
    node.agent.reconcile(DESIRED)
    node.agent.reconcile(DESIRED, plan("p1", TWO))
    assert [(w.capacity, w.allocatable, w.made) for w in node.writes] == [
        ({MIG_3G: 1}, {MIG_3G: 1}, 1),
        ({MIG_3G: 2}, {MIG_3G: 2}, 2),
    ]
    held = node.writes[0].kubelet_held
    assert held is not None and len(held[MIG_3G]) == 1, "written once the kubelet held it"
    assert [decode_report(s).plan for s in node.states] == [
        None,
        None,
        None,
        PlanReport("p1", GpuState.APPLIED),
    ], "the answer only at the end of the pass"


def test_nothing_is_written_when_the_kubelet_never_lists_the_device(
    kubelet: FakeKubelet, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="gpupart_plugin.deviceplugin.nodestatus")
    for node in make_node(kubelet, tmp_path, timeout_s=0.5):
        node.pod_resources.pause()
        node.agent.reconcile(DESIRED, plan("p1", ONE))
        node.device()
        assert node.writes == []
        assert decode_report(node.states[-1]).plan == PlanReport("p1", GpuState.APPLIED)
        assert len(node.pod_resources.answers) >= 2, "it polled until the bound"
        (record,) = [
            r for r in caplog.records if r.name == "gpupart_plugin.deviceplugin.nodestatus"
        ]
        fields = record.__dict__["kv"]
        assert fields["resources"] == MIG_3G and fields["timeout"] == "0.5s", fields


def test_a_kubelet_without_get_allocatable_resources_gets_no_early_write_and_one_log(
    kubelet: FakeKubelet, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="gpupart_plugin.deviceplugin.nodestatus")
    for node in make_node(kubelet, tmp_path, implements_allocatable=False, timeout_s=30):
        node.agent.reconcile(DESIRED, plan("p1", ONE))
        node.device()
        node.agent.reconcile(DESIRED, plan("p2", TWO))
        node.kubelet.wait_for(MIG_3G, lambda listed: len(listed) == 2)
        assert node.writes == []
        assert decode_report(node.states[-1]).plan == PlanReport("p2", GpuState.APPLIED)
        logged = [r for r in caplog.records if r.name == "gpupart_plugin.deviceplugin.nodestatus"]
        assert len(logged) == 1 and "UNIMPLEMENTED" in str(logged[0].__dict__["kv"]["err"])
