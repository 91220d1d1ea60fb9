"""The node agent's reconcile loop: a GPU left Blocked or Pending, or a pod that left still listed, is retried."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpupart.core.api.spec import GpuConfig, Mode
from gpupart.core.api.wire import (
    DesiredGroup,
    GpuState,
    Inventory,
    NodeReport,
    decode_inventory,
    decode_report,
    encode_desired,
)
from gpupart.watch import Backoff
from gpupart_plugin.actuator import Actuator, NodePass
from gpupart_plugin.agent import NodeAgent
from gpupart_plugin.annotations import NodeAnnotations
from gpupart_plugin.deviceplugin.hub import DeviceHub
from gpupart_plugin.deviceplugin.sink import DevicePluginSink
from gpupart_plugin.kube import PassInput
from gpupart_plugin.main import PassTrigger, serve
from gpupart_plugin.metrics import NodeMetrics
from gpupart_plugin.mps import MpsDaemons
from gpupart_plugin.podresources import PodDevices
from gpupart_plugin.simgpu import SimulatedGpus

SEVEN = encode_desired((DesiredGroup("p", 1, None, GpuConfig(Mode.MIG, (("1g.18gb", 7),))),))
ONE = encode_desired((DesiredGroup("p", 2, None, GpuConfig(Mode.MIG, (("7g.141gb", 1),))),))


class Loop:
    """`serve` on a thread over an agent of one simulated H200; `reports` gets every pass's report."""

    def __init__(self, tmp_path: Path, retry: Backoff) -> None:
        self.sim = SimulatedGpus(["H200-141GB"])
        self.held: list[PodDevices] = []  # what the kubelet's PodResources lists
        self.reports: queue.Queue[tuple[NodeReport, Inventory]] = queue.Queue()
        actuator = Actuator(
            self.sim, lambda: tuple(self.held), MpsDaemons(tmp_path / "mps", ["true"])
        )
        publish = NodeAnnotations(
            lambda state, inventory, _capacity: self.reports.put(
                (decode_report(state), decode_inventory(inventory))
            )
        )
        metrics = NodeMetrics()
        sinks = (DevicePluginSink(DeviceHub(), None, metrics), publish)
        self.agent = NodeAgent(actuator, sinks, metrics)
        self.passes = PassTrigger(retry)
        self.stop = threading.Event()
        self.thread = threading.Thread(
            target=serve, args=(self.passes, self.reconcile, self.stop), daemon=True
        )

    def reconcile(self, wanted: PassInput) -> NodePass:
        return self.agent.reconcile(wanted.desired, wanted.plan)

    def report(self) -> NodeReport:
        return self.reports.get(timeout=10)[0]

    def used(self) -> list[str]:
        """The MIG devices the next pass's inventory marks used."""
        _, inventory = self.reports.get(timeout=10)
        return [d.uuid for g in inventory.gpus for d in g.mig_devices if d.used]


@pytest.fixture
def loop(tmp_path: Path) -> Iterator[Loop]:
    running = Loop(tmp_path, Backoff(0.05, 0.2))
    running.thread.start()
    yield running
    running.stop.set()
    running.thread.join(timeout=5)


def test_a_blocked_pass_is_retried_once_the_pods_usage_disappears_without_a_pod_event(
    loop: Loop,
) -> None:
    loop.passes.read(PassInput(SEVEN))
    assert loop.report().gpus[0].state is GpuState.APPLIED
    busy = loop.sim.instances(0)[0].device
    loop.held.append(PodDevices("ml/train-0", "nvidia.com/mig-1g.18gb", (busy.uuid,)))
    loop.passes.read(PassInput(ONE))
    blocked = loop.report().gpus[0]
    assert blocked.state is GpuState.BLOCKED and blocked.blocking_pods == ("ml/train-0",)
    assert loop.report().gpus[0].state is GpuState.BLOCKED  # retried: still listed

    loop.held.clear()  # PodResources stops listing the pod; no pod event comes
    while (gpu := loop.report().gpus[0]).state is GpuState.BLOCKED:
        pass
    assert gpu.state is GpuState.APPLIED
    assert [r.device.instance.profile for r in loop.sim.instances(0)] == ["7g.141gb"]
    # Applied: the retries end (five longest backoffs go by without a pass).
    with pytest.raises(queue.Empty):
        loop.reports.get(timeout=1.0)


def test_a_pod_that_left_but_is_still_listed_is_retried_until_its_device_shows_free(
    loop: Loop,
) -> None:
    loop.passes.read(PassInput(SEVEN))
    loop.report()
    held = loop.sim.instances(0)[0].device.uuid
    loop.held.append(PodDevices("ml/a", "nvidia.com/mig-1g.18gb", (held,)))
    loop.passes.wake()  # a pass (another pod left): ml/a is now used
    assert loop.used() == [held]
    loop.passes.wake("ml/a")  # it left, but PodResources still lists it: no GPU waits
    assert loop.used() == [held]
    assert loop.used() == [held]  # retried without any event
    loop.held.clear()  # the kubelet catches up; no event comes
    while loop.used():
        pass
    # Free in the inventory: the retries end (five longest backoffs go by without a pass).
    with pytest.raises(queue.Empty):
        loop.reports.get(timeout=1.0)


def test_retries_back_off_doubling_and_start_over_on_an_event() -> None:
    passes = PassTrigger(Backoff(1.0, 4.0))
    assert [passes.passed(True) for _ in range(4)] == [1.0, 2.0, 4.0, 4.0]
    passes.wake()  # a pod left: what it held may be free soon
    assert passes.passed(True) == 1.0
    passes.passed(True)
    passes.read(PassInput("a"))  # a new desired annotation is a new wait
    assert passes.passed(True) == 1.0
    passes.passed(True)
    passes.read(PassInput("a"))  # its relist is not
    assert passes.passed(True) == 4.0
    assert passes.passed(False) is None  # nothing waits: no retry, and the next wait starts short
    assert passes.passed(True) == 1.0


def test_a_due_retry_runs_a_pass_without_any_trigger() -> None:
    passes, stop = PassTrigger(Backoff(0.05, 0.05)), threading.Event()
    passes.read(PassInput(SEVEN))
    assert passes.next(stop) == (True, PassInput(SEVEN))
    passes.passed(True)
    assert passes.next(stop) == (True, PassInput(SEVEN))  # after 0.05 s, nothing but the retry
    passes.passed(False)
    threading.Timer(0.3, stop.set).start()
    # Nothing waits: only `stop` ends the wait.
    assert passes.next(stop) == (False, PassInput(SEVEN))
