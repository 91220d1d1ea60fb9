"""The simulated GPU agrees with the plan oracle `apply_steps`: same instances, same refusals, NVML's error kinds.

We test these aspects:
- any step list, valid or not, applied one step at a time to `SimulatedGpus` and to
  `apply_steps` gives the same instances (with compute instance counts) after every step, and the
  same steps are refused by both;
- each refusal carries the error kind the NVML driver returns for it, from a table written here
  (not taken from either implementation): a missing instance NotFound, destroying a GPU instance
  that has its compute instance InUse, no room or a second compute instance InsufficientResources,
  an unknown profile NotSupported;
- what only NVML adds: a destroy under a running process is InUse, and MIG calls on a GPU
  without MIG mode are NotSupported;
- a simulated create latency holds only its own GPU: reads and other GPUs' steps go on.
"""

from __future__ import annotations

import threading
import time

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from gpupart.core.errors import GpupartError
from gpupart.core.mig.catalogue import GpuModel, require_gpu_model
from gpupart.core.mig.layout import MigInstance, Placement
from gpupart.core.mig.planning import (
    CreateComputeInstance,
    CreateGpuInstance,
    DestroyComputeInstance,
    DestroyGpuInstance,
    GpuInstanceState,
    Step,
    apply_steps,
)
from gpupart_plugin.backend import NvmlError, NvmlFailure
from gpupart_plugin.simgpu import SimulatedGpus

PRODUCTS = ("A100-SXM4-80GB", "H200-141GB", "A30-24GB")
STEP_TYPES = (CreateGpuInstance, CreateComputeInstance, DestroyComputeInstance, DestroyGpuInstance)


def candidates(model: GpuModel) -> list[MigInstance]:
    """Every valid placement of every profile, some invalid ones, and an unknown profile."""
    found = []
    for profile in model.profiles:
        size = profile.memory_slices
        found += [MigInstance(Placement(start, size), profile.name) for start in profile.starts]
        found.append(MigInstance(Placement(model.memory_slices - 1, size), profile.name))
    found.append(MigInstance(Placement(0, 1), "9g.999gb"))
    return found


def expected_kind(step: Step, before: dict[MigInstance, int]) -> NvmlFailure:
    """What NVML answers when it refuses `step` on a GPU holding `before` (instance -> CIs)."""
    present = step.instance in before
    match step:
        case CreateGpuInstance():
            unknown = step.instance.profile == "9g.999gb"
            return NvmlFailure.NOT_SUPPORTED if unknown else NvmlFailure.INSUFFICIENT_RESOURCES
        case CreateComputeInstance():
            return NvmlFailure.INSUFFICIENT_RESOURCES if present else NvmlFailure.NOT_FOUND
        case DestroyComputeInstance():
            return NvmlFailure.NOT_FOUND
        case DestroyGpuInstance():
            return NvmlFailure.IN_USE if present else NvmlFailure.NOT_FOUND
    raise AssertionError(step)


def simulated(sim: SimulatedGpus) -> dict[MigInstance, int]:
    return {r.device.instance: r.compute_instances for r in sim.instances(0)}


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(PRODUCTS), st.data())
def test_random_step_lists_give_the_same_instances_and_refusals_in_both(
    product: str, data: st.DataObject
) -> None:
    model = require_gpu_model(product)
    sim = SimulatedGpus([product])
    pool = candidates(model)
    oracle: tuple[GpuInstanceState, ...] = ()
    for _ in range(data.draw(st.integers(1, 30), label="steps")):
        # Half the time an instance the GPU holds: steps that can apply, not only refusals.
        held = [s.instance for s in oracle]
        instance = data.draw(st.sampled_from(held if held and data.draw(st.booleans()) else pool))
        step = data.draw(st.sampled_from(STEP_TYPES))(0, instance)
        before = simulated(sim)
        try:
            oracle = apply_steps(model, oracle, (step,))
        except GpupartError:
            with pytest.raises(NvmlError) as caught:
                sim.apply(step)
            assert caught.value.kind is expected_kind(step, before), step
            event(f"refused {type(step).__name__}")
        else:
            sim.apply(step)  # the oracle accepted it: the simulated GPU must too
            event(f"applied {type(step).__name__}")
        assert simulated(sim) == {s.instance: s.compute_instances for s in oracle}, step


def test_only_nvml_rules_are_added_processes_and_mig_mode() -> None:
    sim = SimulatedGpus(["A100-SXM4-80GB"])
    instance = MigInstance(Placement(0, 4), "3g.40gb")
    for step in (CreateGpuInstance(0, instance), CreateComputeInstance(0, instance)):
        sim.apply(step)
    sim.start_process(0, 7, instance)
    for step in (DestroyComputeInstance(0, instance), DestroyGpuInstance(0, instance)):
        with pytest.raises(NvmlError) as caught:
            sim.apply(step)
        assert caught.value.kind is NvmlFailure.IN_USE
    assert simulated(sim) == {instance: 1}, "a refused step changes nothing"
    off = SimulatedGpus(["A100-SXM4-80GB"], mig_enabled=False)
    with pytest.raises(NvmlError) as caught:
        off.apply(CreateGpuInstance(0, instance))
    assert caught.value.kind is NvmlFailure.NOT_SUPPORTED


def test_a_slow_create_holds_only_its_own_gpu() -> None:
    sim = SimulatedGpus(["H200-141GB"] * 2, create_s=2.0)
    whole = MigInstance(Placement(0, 8), "7g.141gb")
    worker = threading.Thread(target=sim.apply, args=(CreateGpuInstance(0, whole),))
    worker.start()
    time.sleep(0.2)  # into its create; the assertions below hold for any delay under 2 s
    with pytest.raises(NvmlError, match="NotFound"):
        sim.apply(DestroyComputeInstance(1, whole))  # GPU 1's step is answered now
    assert sim.instances(0) == (), "the read did not wait for GPU 0's create"
    worker.join(10)
    assert [r.device.instance for r in sim.instances(0)] == [whole]


def test_a_state_file_keeps_mig_modes_and_instances_across_restarts(tmp_path) -> None:
    from gpupart.core.errors import InvalidInput
    from gpupart.core.mig.layout import MigInstance, Placement
    from gpupart.core.mig.planning import CreateComputeInstance, CreateGpuInstance
    from gpupart_plugin.simgpu import SimulatedGpus

    path = tmp_path / "gpus.json"
    first = SimulatedGpus(["H100-SXM5-80GB", "H100-SXM5-80GB"], node="n", state_path=path)
    made = MigInstance(Placement(4, 4), "3g.40gb")
    first.apply(CreateGpuInstance(1, made))
    first.apply(CreateComputeInstance(1, made))
    again = SimulatedGpus(["H100-SXM5-80GB", "H100-SXM5-80GB"], node="n", state_path=path)
    assert again.instances(1) == first.instances(1) and again.instances(0) == ()
    # A new instance after the restart gets a UUID never used before.
    other = MigInstance(Placement(0, 4), "3g.40gb")
    again.apply(CreateGpuInstance(1, other))
    uuids = [r.device.uuid for r in again.instances(1)]
    assert len(set(uuids)) == 2
    with pytest.raises(InvalidInput, match="gpus.json: cannot be read"):
        SimulatedGpus(["A100-SXM4-80GB"], node="n", state_path=path)  # other GPUs
    path.write_text("{")
    with pytest.raises(InvalidInput, match="--simulate-state"):
        SimulatedGpus(["H100-SXM5-80GB", "H100-SXM5-80GB"], node="n", state_path=path)


def test_a_faults_file_fails_the_calls_it_names_while_it_lists_them(tmp_path, caplog) -> None:
    import json
    import os

    path = tmp_path / "faults.json"
    sim = SimulatedGpus(["A100-SXM4-80GB"], node="n", faults_path=path)
    one = MigInstance(Placement(0, 1), "1g.10gb")

    def write(text: str) -> None:
        partial = tmp_path / "partial"
        partial.write_text(text)
        os.replace(partial, path)  # a new inode: read again even within one mtime tick

    write(
        json.dumps(
            [{"operation": "CreateComputeInstance", "kind": "InsufficientResources", "times": 2}]
        )
    )
    sim.apply(CreateGpuInstance(0, one))  # another operation: not failed
    for _ in range(2):
        with pytest.raises(NvmlError, match="InsufficientResources"):
            sim.apply(CreateComputeInstance(0, one))
    sim.apply(CreateComputeInstance(0, one))  # its two failures spent
    # A file that cannot be parsed keeps the faults there are, and the log says why.
    write(json.dumps([{"kind": "NotFound"}]))
    with pytest.raises(NvmlError, match="NotFound"):
        sim.apply(DestroyComputeInstance(0, one))
    write(json.dumps([{"kind": "NotFound", "times": 0}]))
    with caplog.at_level("WARNING"):
        sim.apply(DestroyComputeInstance(0, one))  # the earlier fault's one failure was spent
    (record,) = [
        r for r in caplog.records if r.getMessage() == "Ignored unreadable simulated faults"
    ]
    error = record.kv["error"]  # type: ignore[attr-defined]
    assert "faults.json [0]" in error and "times ≥ 1" in error, error
    # An Xid it lists is raised once, on the GPU it names.
    write(json.dumps([{"xid": 79, "gpu": 0}]))
    event = sim.wait_xid(0)
    assert event is not None and (event.gpu_uuid, event.xid) == (sim.gpus()[0].uuid, 79)
    assert sim.wait_xid(0) is None
    write(json.dumps([{"kind": "Other"}]))
    path.unlink()  # gone: no faults
    sim.apply(DestroyGpuInstance(0, one))
    assert sim.instances(0) == ()


def test_one_gpu_read_alone_is_that_gpu_of_the_whole_read() -> None:
    sim = SimulatedGpus(["A100-SXM4-80GB", "H100-SXM5-80GB"], node="n", mig_enabled=[True, False])
    every = sim.gpus()
    assert sim.indices() == (0, 1)
    assert [sim.gpu(i) for i in sim.indices()] == list(every)
    assert sim.gpu(2) is None and sim.gpu(-1) is None
