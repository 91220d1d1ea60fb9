"""Actuator on the simulated GPU: layouts, idempotence, in-use protection, faults at every step, restarts, MPS."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from plugin_fakes import Pods

from gpupart.core.api.spec import GpuConfig, Interface, Mode, MpsSettings
from gpupart.core.api.wire import (
    DesiredGroup,
    GpuState,
    Inventory,
    InventoryGpu,
    encode_desired,
    encode_inventory,
)
from gpupart.core.mig.layout import MigInstance, Placement, layout_counts
from gpupart.core.mig.planning import GpuInstanceState, plan_counts
from gpupart.core.node.interface import ClaimUse
from gpupart.logs import KlogFormatter
from gpupart_plugin.actuator import Actuator
from gpupart_plugin.agent import NodeAgent
from gpupart_plugin.annotations import NodeAnnotations, inventory
from gpupart_plugin.backend import NvmlFailure
from gpupart_plugin.deviceplugin.hub import DeviceHub
from gpupart_plugin.deviceplugin.sink import DevicePluginSink
from gpupart_plugin.kube import KubeUnavailable
from gpupart_plugin.metrics import NodeMetrics
from gpupart_plugin.mps import MpsDaemons
from gpupart_plugin.podresources import PodDevices
from gpupart_plugin.simgpu import Fault, SimulatedGpus

H200 = "H200-141GB"
SEVEN = (("1g.18gb", 7),)
TWO = (("3g.71gb", 1), ("4g.71gb", 1))


def mig(counts: tuple[tuple[str, int], ...], gpus: tuple[int, ...] | None = None) -> DesiredGroup:
    return DesiredGroup("p", 1, gpus, GpuConfig(Mode.MIG, counts))


def agent(sim: SimulatedGpus, pods: Pods, tmp_path: Path, command: list[str]) -> Actuator:
    return Actuator(sim, pods, MpsDaemons(tmp_path / "mps", command))


def instances(sim: SimulatedGpus, index: int = 0) -> dict[MigInstance, int]:
    return {r.device.instance: r.compute_instances for r in sim.instances(index)}


def test_applies_a_layout_and_reports_it(tmp_path: Path) -> None:
    sim = SimulatedGpus([H200, H200])
    result = agent(sim, Pods(), tmp_path, ["true"]).reconcile((mig(SEVEN, (0,)), mig(TWO, (1,))))
    states = [g.state for g in result.report.gpus]
    assert states == [GpuState.APPLIED, GpuState.APPLIED]
    assert layout_counts(result.report.gpus[0].layout) == {"1g.18gb": 7}
    assert layout_counts(result.report.gpus[1].layout) == dict(TWO)
    assert len(result.views[0].mig) == 7
    assert all(m.uuid.startswith("MIG-") for m in result.views[0].mig)
    assert result.report.observed == (("p", 1),)
    assert not result.failed


def test_second_pass_changes_nothing(tmp_path: Path) -> None:
    sim = SimulatedGpus([H200])
    actuator = agent(sim, Pods(), tmp_path, ["true"])
    actuator.reconcile((mig(TWO),))
    calls = len(sim.calls)
    again = actuator.reconcile((mig(TWO),))
    assert len(sim.calls) == calls
    assert again.report.gpus[0].state is GpuState.APPLIED


def test_instance_in_use_by_a_pod_is_never_destroyed(tmp_path: Path) -> None:
    sim, pods = SimulatedGpus([H200]), Pods()
    actuator = agent(sim, pods, tmp_path, ["true"])
    first = actuator.reconcile((mig(SEVEN),))
    busy = first.views[0].mig[0]
    pods.held.append(PodDevices("ml/train-0", "nvidia.com/mig-1g.18gb", (busy.uuid,)))
    result = actuator.reconcile((mig((("7g.141gb", 1),)),))
    report = result.report.gpus[0]
    assert report.state is GpuState.BLOCKED
    assert report.blocking_pods == ("ml/train-0",)
    assert busy.instance in instances(sim)


def test_instance_with_a_process_is_kept_while_others_change(tmp_path: Path) -> None:
    sim = SimulatedGpus([H200])
    actuator = agent(sim, Pods(), tmp_path, ["true"])
    actuator.reconcile((mig(SEVEN),))
    keep = MigInstance(Placement(6, 1), "1g.18gb")
    sim.start_process(0, 4242, keep)
    result = actuator.reconcile((mig((("1g.18gb", 1), ("3g.71gb", 1))),))
    assert result.report.gpus[0].state is GpuState.APPLIED
    assert keep in instances(sim)
    assert layout_counts(result.report.gpus[0].layout) == {"1g.18gb": 1, "3g.71gb": 1}


def test_unknown_pod_usage_protects_every_instance(tmp_path: Path) -> None:
    sim, pods = SimulatedGpus([H200]), Pods()
    actuator = agent(sim, pods, tmp_path, ["true"])
    actuator.reconcile((mig(SEVEN),))
    pods.down = True
    result = actuator.reconcile((mig(TWO),))
    assert result.report.gpus[0].state is GpuState.BLOCKED
    assert layout_counts(result.report.gpus[0].layout) == {"1g.18gb": 7}


def _transition_steps() -> int:
    model = SimulatedGpus([H200]).model(0)
    _, before = plan_counts(model, 0, [], dict(SEVEN))
    states = [
        GpuInstanceState(s.instance) for s in before if type(s).__name__ == "CreateGpuInstance"
    ]
    _, steps = plan_counts(model, 0, states, dict(TWO))
    return len(steps)


@pytest.mark.parametrize("kind", [NvmlFailure.INSUFFICIENT_RESOURCES, NvmlFailure.IN_USE])
@pytest.mark.parametrize("at", range(_transition_steps()))
def test_fault_at_every_step_rolls_back_and_then_converges(
    tmp_path: Path, at: int, kind: NvmlFailure
) -> None:
    sim, pods = SimulatedGpus([H200]), Pods()
    actuator = agent(sim, pods, tmp_path, ["true"])
    actuator.reconcile((mig(SEVEN),))
    old = set(instances(sim))
    sim.inject(Fault(kind, after=at))
    failed = actuator.reconcile((mig(TWO),)).report.gpus[0]
    assert failed.state is GpuState.FAILED
    assert kind.value in failed.message and "rolled back" in failed.message
    now = instances(sim)
    assert set(now) == old, "a one-off fault must leave the old layout"
    assert all(n == 1 for n in now.values()), "nothing half-built"
    assert set(failed.layout) == old
    done = actuator.reconcile((mig(TWO),)).report.gpus[0]
    assert done.state is GpuState.APPLIED
    assert layout_counts(done.layout) == dict(TWO)


def test_persistent_fault_is_reported_with_what_is_on_the_gpu(tmp_path: Path) -> None:
    sim = SimulatedGpus([H200])
    actuator = agent(sim, Pods(), tmp_path, ["true"])
    actuator.reconcile((mig(SEVEN),))
    sim.inject(Fault(NvmlFailure.INSUFFICIENT_RESOURCES, after=3, times=1000))
    report = actuator.reconcile((mig(TWO),)).report.gpus[0]
    assert report.state is GpuState.FAILED
    present = {i for i, n in instances(sim).items() if n}
    assert set(report.layout) == present
    half = [i for i, n in instances(sim).items() if not n]
    assert not half or "half-built" in report.message
    sim.clear_faults()
    assert actuator.reconcile((mig(TWO),)).report.gpus[0].state is GpuState.APPLIED


@pytest.mark.parametrize("crash_after", range(_transition_steps()))
def test_restart_mid_apply_converges(tmp_path: Path, crash_after: int) -> None:
    sim = SimulatedGpus([H200])
    agent(sim, Pods(), tmp_path, ["true"]).reconcile((mig(SEVEN),))
    states = [GpuInstanceState(i, n) for i, n in instances(sim).items()]
    _, steps = plan_counts(sim.model(0), 0, states, dict(TWO))
    for step in steps[:crash_after]:  # the process died here
        sim.apply(step)
    fresh = agent(sim, Pods(), tmp_path, ["true"])
    report = fresh.reconcile((mig(TWO),)).report.gpus[0]
    assert report.state is GpuState.APPLIED
    assert layout_counts(report.layout) == dict(TWO)
    assert all(n == 1 for n in instances(sim).values())


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from([SEVEN, TWO, (("2g.35gb", 3),), (("1g.35gb", 4),), (("7g.141gb", 1),)]),
            st.integers(0, 12),
            st.booleans(),
        ),
        min_size=1,
        max_size=5,
    )
)
def test_random_repartitions_with_faults_and_busy_instances(
    tmp_path_factory: pytest.TempPathFactory,
    rounds: list[tuple[tuple[tuple[str, int], ...], int, bool]],
) -> None:
    tmp = tmp_path_factory.mktemp("r")
    sim, pods = SimulatedGpus([H200]), Pods()
    actuator = agent(sim, pods, tmp, ["true"])
    for counts, fault_at, busy in rounds:
        before = instances(sim)
        held = [i for i, n in before.items() if n][:1] if busy else []
        pods.held = [
            PodDevices("ns/p", "x", (r.device.uuid,))
            for r in sim.instances(0)
            if r.device.instance in held
        ]
        sim.inject(Fault(NvmlFailure.OTHER, after=fault_at))
        report = actuator.reconcile((mig(counts),)).report.gpus[0]
        sim.clear_faults()
        after = instances(sim)
        assert all(i in after for i in held), "an in-use instance was destroyed"
        assert report.state in (GpuState.APPLIED, GpuState.FAILED, GpuState.BLOCKED)
        assert set(report.layout) == {i for i, n in after.items() if n}
        if report.state is GpuState.APPLIED:
            assert layout_counts(report.layout) == dict(counts)
        pods.held = []
        final = actuator.reconcile((mig(counts),)).report.gpus[0]
        assert final.state is GpuState.APPLIED
        assert layout_counts(final.layout) == dict(counts)


def test_mig_mode_change_is_pending_until_reset(tmp_path: Path) -> None:
    sim = SimulatedGpus([H200], mig_enabled=False)
    actuator = agent(sim, Pods(), tmp_path, ["true"])
    pending = actuator.reconcile((mig(TWO),)).report.gpus[0]
    assert pending.state is GpuState.PENDING and "reset" in pending.message
    sim.reset(0)
    assert actuator.reconcile((mig(TWO),)).report.gpus[0].state is GpuState.APPLIED


def test_mig_mode_is_not_changed_under_a_running_process(tmp_path: Path) -> None:
    sim = SimulatedGpus([H200], mig_enabled=False)
    sim.start_process(0, 77)
    report = agent(sim, Pods(), tmp_path, ["true"]).reconcile((mig(TWO),)).report.gpus[0]
    assert report.state is GpuState.BLOCKED
    assert "set_mig_mode" not in sim.calls


def test_mps_daemon_started_configured_and_stopped(tmp_path: Path, mps_command: list[str]) -> None:
    sim, pods = SimulatedGpus([H200], mig_enabled=False, mode_change_needs_reset=False), Pods()
    actuator = agent(sim, pods, tmp_path, mps_command)
    group = DesiredGroup("s", 3, None, GpuConfig(Mode.MPS, mps=MpsSettings(), replicas=4))
    result = actuator.reconcile((group,))
    assert result.report.gpus[0].state is GpuState.APPLIED
    view = result.views[0]
    assert view.mode is Mode.MPS and view.replicas == 4
    assert view.mps_memory_mib == 143771 // 4 and view.mps_compute_percent == 25
    log = (Path(view.mps_pipe_directory) / "commands.log").read_text()
    assert f"start {view.uuid}" in log
    assert "set_default_device_pinned_mem_limit 0 35942M" in log
    assert sim.exclusive(0)
    calls = log.count("\n")
    actuator.reconcile((group,))
    log2 = (Path(view.mps_pipe_directory) / "commands.log").read_text()
    assert log2.count("set_default") == log.count("set_default"), "idempotent pass"
    assert log2.count("\n") >= calls
    pods.held = [PodDevices("a/b", "nvidia.com/gpu.shared", (f"{view.uuid}::0",))]
    blocked = actuator.reconcile(()).report.gpus[0]
    assert blocked.state is GpuState.BLOCKED and blocked.blocking_pods == ("a/b",)
    pods.held = []
    whole = actuator.reconcile(())
    assert whole.report.gpus[0].state is GpuState.APPLIED
    assert whole.views[0].mode is Mode.NONE
    assert "quit" in (Path(view.mps_pipe_directory) / "commands.log").read_text()
    assert not sim.exclusive(0)


def test_time_slicing_replicas_and_inventory(tmp_path: Path) -> None:
    sim = SimulatedGpus([H200, H200], mig_enabled=False)
    actuator = agent(sim, Pods(), tmp_path, ["true"])
    groups = (DesiredGroup("t", 1, (1,), GpuConfig(Mode.TIME_SLICING, replicas=5)), mig(TWO, (0,)))
    result = actuator.reconcile(groups)
    assert result.report.gpus[1].state is GpuState.APPLIED
    assert result.views[1].mode is Mode.TIME_SLICING and result.views[1].replicas == 5
    gpus = inventory(result.views)
    assert gpus[1].replicas == 5 and gpus[1].product == H200
    assert gpus[0].mode is Mode.NONE  # MIG enable pending a reset: still a whole GPU


def test_no_desired_annotation_changes_nothing(tmp_path: Path) -> None:
    sim = SimulatedGpus([H200])
    result = agent(sim, Pods(), tmp_path, ["true"]).reconcile(None)
    assert sim.calls == []
    assert result.report.gpus[0].state is GpuState.APPLIED


def test_reset_idle_makes_a_pending_mig_change_take_effect_once_the_gpu_is_idle(
    tmp_path: Path, mps_command: list[str]
) -> None:
    # Two GPUs, one per starting mode, as `--simulate A100-SXM4-80GB:mig-off,A100-SXM4-80GB`.
    sim = SimulatedGpus(["A100-SXM4-80GB"] * 2, mig_enabled=[False, True])
    actuator = agent(sim, Pods(), tmp_path, mps_command)
    mps = (DesiredGroup("s", 1, None, GpuConfig(Mode.MPS, mps=MpsSettings(), replicas=4)),)
    first = actuator.reconcile(mps).report.gpus
    assert [g.state for g in first] == [GpuState.APPLIED, GpuState.PENDING]
    assert sim.reset_idle() == (1,)
    second = actuator.reconcile(mps)
    assert [g.state for g in second.report.gpus] == [GpuState.APPLIED, GpuState.APPLIED]
    assert [v.mode for v in second.views] == [Mode.MPS, Mode.MPS]
    assert sim.reset_idle() == ()  # nothing pending: no reset

    # Back to MIG: a process on GPU 0 keeps it Blocked; GPU 1 goes Pending, then Applied.
    sim.start_process(0, 42)
    assert actuator.reconcile((mig((("3g.40gb", 2),)),)).report.gpus[0].state is GpuState.BLOCKED
    sim.stop_process(0, 42)
    assert [g.state for g in actuator.reconcile((mig((("3g.40gb", 2),)),)).report.gpus] == [
        GpuState.PENDING,
        GpuState.PENDING,
    ]
    sim.start_process(1, 43)  # not idle: a reset waits
    assert sim.reset_idle() == (0,)
    sim.stop_process(1, 43)
    assert sim.reset_idle() == (1,)
    final = actuator.reconcile((mig((("3g.40gb", 2),)),)).report.gpus
    assert [g.state for g in final] == [GpuState.APPLIED, GpuState.APPLIED]
    assert all(layout_counts(g.layout) == {"3g.40gb": 2} for g in final)


@pytest.mark.parametrize(
    ("gpus", "words"),
    [
        ((0, 0), "partition p names a GPU twice: [0, 0]"),
        ((0, 99), "partition p names GPU 99; this node has GPU 0, 1"),
        ((0, 0, 99), "names a GPU twice"),
    ],
)
def test_a_desired_state_naming_a_gpu_twice_or_one_not_here_is_refused(
    tmp_path: Path, gpus: tuple[int, ...], words: str
) -> None:
    sim = SimulatedGpus([H200, H200])
    actuator = agent(sim, Pods(), tmp_path, ["true"])
    actuator.reconcile((mig(TWO, (1,)),))
    before = (instances(sim, 0), instances(sim, 1))
    result = actuator.reconcile((mig(SEVEN, gpus),))
    assert (instances(sim, 0), instances(sim, 1)) == before, "nothing was applied"
    assert [g.state for g in result.report.gpus] == [GpuState.FAILED, GpuState.FAILED]
    assert all(words in g.message for g in result.report.gpus), result.report.gpus[0].message
    assert result.report.gpus[0].message.startswith("gpupart.io/desired.groups[0].gpus: ")
    assert result.report.observed == (("p", 1),), "the partition shows the reason"


# --- a restart reads back what the agent published ---------------------------------------------

SHARED = (
    DesiredGroup("s", 1, (0,), GpuConfig(Mode.MPS, mps=MpsSettings(), replicas=4)),
    DesiredGroup("t", 1, (1,), GpuConfig(Mode.TIME_SLICING, replicas=5)),
)


def node_agent(
    sim: SimulatedGpus,
    pods: Pods,
    tmp_path: Path,
    command: list[str],
    published: Callable[[], str | None] | None = None,
) -> tuple[NodeAgent, list[str]]:
    """An agent without device plugins; the list collects the inventories it publishes."""
    inventories: list[str] = []
    publish = NodeAnnotations(lambda _state, inventory, _capacity: inventories.append(inventory))
    agent = NodeAgent(
        Actuator(sim, pods, MpsDaemons(tmp_path / "mps", command)),
        (DevicePluginSink(DeviceHub(), None, NodeMetrics()), publish),
        NodeMetrics(),
        published=published,
    )
    return agent, inventories


def shared_node(tmp_path: Path, command: list[str]) -> tuple[SimulatedGpus, Pods, str]:
    """GPU 0 on MPS, GPU 1 time-sliced, pods on both; the inventory the agent published."""
    sim, pods = SimulatedGpus([H200, H200], mig_enabled=False), Pods()
    first, inventories = node_agent(sim, pods, tmp_path, command)
    result = first.reconcile(encode_desired(SHARED))
    assert [g.state for g in result.report.gpus] == [GpuState.APPLIED, GpuState.APPLIED]
    pods.held = [
        PodDevices("ml/a", "nvidia.com/gpu.shared", (f"{result.views[0].uuid}::0",)),
        PodDevices("ml/b", "nvidia.com/gpu.shared", (f"{result.views[1].uuid}::3",)),
    ]
    return sim, pods, inventories[-1]


def test_a_restart_keeps_mps_and_time_slicing_from_the_last_inventory_without_a_guess(
    tmp_path: Path, mps_command: list[str]
) -> None:
    sim, pods, published = shared_node(tmp_path, mps_command)
    pods.down = True  # the kubelet does not answer either: nothing to infer the modes from
    agent, _ = node_agent(sim, pods, tmp_path, mps_command, lambda: published)
    result = agent.reconcile(encode_desired(SHARED))
    assert [g.state for g in result.report.gpus] == [GpuState.APPLIED, GpuState.APPLIED]
    assert [(v.mode, v.replicas) for v in result.views] == [(Mode.MPS, 4), (Mode.TIME_SLICING, 5)]

    # A new wish for whole GPUs meets pods nobody can see: Blocked, still shared, not switched.
    whole = agent.reconcile(encode_desired(()))
    assert [g.state for g in whole.report.gpus] == [GpuState.BLOCKED, GpuState.BLOCKED]
    assert [(v.mode, v.replicas) for v in whole.views] == [(Mode.MPS, 4), (Mode.TIME_SLICING, 5)]
    assert "unknown pods" in whole.report.gpus[1].message


def test_a_restart_keeps_the_slot_count_when_the_target_changed(
    tmp_path: Path, mps_command: list[str]
) -> None:
    sim, pods, published = shared_node(tmp_path, mps_command)
    agent, _ = node_agent(sim, pods, tmp_path, mps_command, lambda: published)
    result = agent.reconcile(encode_desired((mig(TWO, (1,)),)))  # GPU 1 held by ml/b
    gpu = result.report.gpus[1]
    assert gpu.state is GpuState.BLOCKED and gpu.blocking_pods == ("ml/b",)
    assert (result.views[1].mode, result.views[1].replicas) == (Mode.TIME_SLICING, 5)


def _unreachable() -> str | None:
    raise KubeUnavailable("read the inventory of node n: connection refused")


@pytest.mark.parametrize(
    ("published", "logged"),
    [
        (lambda: None, "Found no earlier inventory"),
        (lambda: '{"version": 1, "gpus": [{"index": 0', "Failed to read the last inventory"),
        (lambda: '{"version": 99, "gpus": []}', "Failed to read the last inventory"),
        (_unreachable, '"Failed to read the last inventory; not resumed" err="read the inventory'),
        (
            lambda: encode_inventory(
                Inventory((InventoryGpu(1, "GPU-other", H200, 1, Mode.TIME_SLICING, (), 5),))
            ),
            '"Ignored earlier mode" gpu=1 mode="TimeSlicing" reason="not this GPU now"',
        ),
    ],
)
def test_a_missing_bad_or_foreign_inventory_falls_back_and_is_logged(
    tmp_path: Path,
    mps_command: list[str],
    caplog: pytest.LogCaptureFixture,
    published: Callable[[], str | None],
    logged: str,
) -> None:
    sim, pods, _ = shared_node(tmp_path, mps_command)
    pods.down = True
    agent, _ = node_agent(sim, pods, tmp_path, mps_command, published)
    caplog.set_level(logging.INFO, logger="gpupart_plugin")
    caplog.handler.setFormatter(KlogFormatter())
    result = agent.reconcile(encode_desired(SHARED))
    assert logged in caplog.text
    # As a first start: the MPS daemon still tells its mode; the time-sliced GPU is not known,
    # and with the kubelet silent it is not changed either.
    assert result.views[0].mode is Mode.MPS
    assert result.report.gpus[1].state is GpuState.BLOCKED
    agent.reconcile(encode_desired(SHARED))
    assert caplog.text.count(logged) == 1, "read once, before the first pass"


def test_a_gpu_moves_to_dra_once_no_pod_holds_it_and_back_once_no_claim_does(
    tmp_path: Path,
) -> None:
    """Withdrawn first (neither offers it, Pending naming the holders), then offered through
    the new interface once nothing holds it through the old one; the bus id rides along."""
    sim = SimulatedGpus([H200, H200], mig_enabled=[False, False])
    pods = Pods()
    claims: dict[int, tuple[str, ...]] = {}
    actuator = Actuator(
        sim, pods, MpsDaemons(tmp_path / "mps", ["true"]), lambda: ClaimUse(dict(claims))
    )
    plain = DesiredGroup("p", 1, None, GpuConfig(Mode.NONE))
    dra = DesiredGroup("p", 2, (0,), GpuConfig(Mode.NONE, interface=Interface.DRA))
    first = actuator.reconcile((plain,))
    assert [v.interface for v in first.views] == [Interface.DEVICE_PLUGIN] * 2
    assert [v.pci_bus_id for v in first.views] == ["0000:18:00.0", "0000:19:00.0"]
    uuid = first.views[0].uuid
    pods.held = [PodDevices("team-a/train", "nvidia.com/gpu", (uuid,))]
    for _ in range(2):  # withdrawn, then held back while the pod runs
        moving = actuator.reconcile((dra, replace(plain, gpus=(1,))))
        assert [v.interface for v in moving.views] == [None, Interface.DEVICE_PLUGIN]
        report = moving.report.gpus[0]
        assert report.state is GpuState.PENDING and report.blocking_pods == ("team-a/train",)
        assert "pods team-a/train" in report.message and moving.waiting
    pods.held = []
    assert actuator.reconcile((dra, replace(plain, gpus=(1,)))).views[0].interface is Interface.DRA
    claims[0] = ("team-b/claim",)
    for _ in range(2):
        back = actuator.reconcile((plain,))
        assert back.views[0].interface is None
        assert "claims team-b/claim" in back.report.gpus[0].message
    claims.clear()
    done = actuator.reconcile((plain,))
    assert done.views[0].interface is Interface.DEVICE_PLUGIN
    assert done.report.gpus[0].state is GpuState.APPLIED


def test_a_restart_resumes_the_interface_and_unknown_claims_hold_the_move(tmp_path: Path) -> None:
    sim = SimulatedGpus([H200], mig_enabled=[False])
    (gpu,) = sim.gpus()
    previous = Inventory((InventoryGpu(0, gpu.uuid, H200, 1, Mode.NONE, interface=Interface.DRA),))

    def unreadable() -> ClaimUse:
        raise KubeUnavailable("list claims: 503")

    actuator = Actuator(sim, Pods(), MpsDaemons(tmp_path / "mps", ["true"]), unreadable)
    actuator.resume(previous)
    dra = DesiredGroup("p", 1, None, GpuConfig(Mode.NONE, interface=Interface.DRA))
    assert actuator.reconcile((dra,)).views[0].interface is Interface.DRA  # no withdrawal
    plain = DesiredGroup("p", 2, None, GpuConfig(Mode.NONE))
    actuator.reconcile((plain,))
    held = actuator.reconcile((plain,))
    assert held.views[0].interface is None
    assert "unknown claims" in held.report.gpus[0].message and "503" in held.report.gpus[0].message
