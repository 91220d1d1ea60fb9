"""The health monitor's GPU faults, for the DRA publisher's taints: from simulated NVML events to the fault board.

We test these aspects:
- an Xid on a GPU no pod holds is still a fault of that GPU (the device plugin's board is
  empty), with its Xid and the wall-clock start;
- an Xid naming a GPU instance is that instance's fault, pinned to its MIG UUID;
- an application's Xid is no fault;
- a GPU that stops answering is a fault until it answers again and stays quiet;
- the board hears each change once, and the fault clears after the clean window.
"""

from __future__ import annotations

from gpupart.core.api.spec import Mode
from gpupart.core.mig.layout import MigInstance, Placement
from gpupart.core.node.devices import Device, OfferedGpu, OfferedMigDevice
from gpupart.core.node.faults import GpuFault
from gpupart_plugin.health import HealthMonitor
from gpupart_plugin.simgpu import SimulatedGpus

A100 = "A100-SXM4-80GB"
WALL = 1_796_300_000.0


class NoDevices:
    """A health board with nothing advertised (a node whose GPUs are all DRA's, no claim)."""

    def all_devices(self) -> tuple[Device, ...]:
        return ()

    def set_unhealthy(self, ids: frozenset[str]) -> None:
        raise AssertionError(f"no device to mark, got {sorted(ids)}")


class Faults:
    """A fault board that serves fixed GPU views and keeps every change it is told."""

    def __init__(self, gpus: tuple[OfferedGpu, ...]) -> None:
        self.gpus = gpus
        self.seen: list[tuple[GpuFault, ...]] = []

    def fault_gpus(self) -> tuple[OfferedGpu, ...]:
        return self.gpus

    def set_faults(self, faults: tuple[GpuFault, ...]) -> None:
        self.seen.append(faults)


def views(sim: SimulatedGpus, *mig: OfferedMigDevice) -> tuple[OfferedGpu, ...]:
    return tuple(
        OfferedGpu(
            g.index,
            g.uuid,
            g.name,
            g.memory_mib,
            g.minor,
            None,
            Mode.MIG if g.index == 1 else Mode.NONE,
            mig=mig if g.index == 1 else (),
        )
        for g in sim.gpus()
    )


def monitor(sim: SimulatedGpus, board: Faults, now: list[float]) -> HealthMonitor:
    return HealthMonitor(
        sim, NoDevices(), quiet_s=10, clock=lambda: now[0], faults=board, wall=lambda: WALL
    )


def test_an_xid_on_a_gpu_no_pod_holds_is_a_fault_until_the_clean_window_passes() -> None:
    sim = SimulatedGpus([A100, A100], mode_change_needs_reset=False)
    board, now = Faults(views(sim)), [0.0]
    health = monitor(sim, board, now)
    sim.inject_xid(0, 13)  # an application's error: no fault
    assert not health.step(0.2)
    assert board.seen == []
    sim.inject_xid(0, 79)
    health.step(0.2)
    assert board.seen == [(GpuFault(sim.gpus()[0].uuid, xid=79, since=WALL),)]
    now[0] = 9
    health.step(0.01)
    assert len(board.seen) == 1  # no change told twice; the window is not over
    now[0] = 10
    health.step(0.01)
    assert board.seen[-1] == ()


def test_an_xid_naming_a_gpu_instance_is_that_instances_fault() -> None:
    sim = SimulatedGpus([A100, A100], mode_change_needs_reset=False)
    instance = OfferedMigDevice("MIG-a", MigInstance(Placement(2, 1), "1g.10gb"), 7, 0)
    board, now = Faults(views(sim, instance)), [0.0]
    health = monitor(sim, board, now)
    sim.inject_xid(1, 94, 7)
    health.step(0.2)
    assert board.seen == [(GpuFault(sim.gpus()[1].uuid, 7, "MIG-a", 94, WALL),)]


def test_a_gpu_that_stops_answering_is_a_fault_until_it_answers_and_stays_quiet() -> None:
    sim = SimulatedGpus([A100, A100], mode_change_needs_reset=False)
    board, now = Faults(views(sim)), [0.0]
    health = monitor(sim, board, now)
    lost = board.gpus[1].uuid
    sim.set_lost(1, True)
    health.step(0.01)
    assert board.seen == [(GpuFault(lost, xid=None, since=WALL),)]
    now[0] = 100
    health.step(0.01)
    assert len(board.seen) == 1  # still silent: kept however long
    sim.set_lost(1, False)
    now[0] = 105
    health.step(0.01)  # answers again, 5 s after its last silence
    assert len(board.seen) == 1
    now[0] = 110
    health.step(0.01)
    assert board.seen[-1] == ()
