"""What our claims hold in one pool: every published MIG placement reads back as itself; odd results skipped."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gpupart.core.api.spec import Mode
from gpupart.core.dra import names
from gpupart.core.dra.claims import claimed_placements, gpu_index, pool_use
from gpupart.core.dra.devices import DraGpu, gpu_devices
from gpupart.core.dra.read import AllocationResult, ClaimView
from gpupart.core.mig.catalogue import catalogue
from gpupart.core.node.devices import OfferedGpu

MODELS = sorted(catalogue(), key=lambda m: m.product)


def claim(name: str, *results: tuple[str, str]) -> ClaimView:
    return ClaimView(
        "ns",
        name,
        f"uid-{name}",
        tuple(AllocationResult("dev", names.DRIVER, pool, device) for pool, device in results),
    )


@settings(deadline=None, max_examples=40)  # building every placement's order takes time
@given(st.sampled_from(MODELS), st.integers(0, 15), st.data())
def test_every_published_placement_reads_back_as_itself(model, index, data):
    """A dynamic GPU's devices as published: each MIG one names its placement; the whole GPU none."""
    view = OfferedGpu(index, "GPU-x", model.product, model.memory_mib, index, 0, Mode.MIG)
    devices = gpu_devices(DraGpu(view, model, dynamic=True)).devices
    held = data.draw(st.lists(st.sampled_from(devices), max_size=6, unique_by=lambda d: d["name"]))
    placements = claimed_placements(model, index, [d["name"] for d in held])
    expected = sorted(
        {
            (
                d["attributes"][names.PROFILE]["string"],
                d["attributes"][names.PLACEMENT_START]["int"],
            )
            for d in held
            if names.PROFILE in d["attributes"]
        }
    )
    assert sorted((p.profile, p.placement.start) for p in placements) == expected
    assert all(gpu_index(d["name"]) == index for d in devices)


def test_results_of_other_pools_are_ignored_and_names_not_ours_skipped():
    use = pool_use(
        [
            claim("a", ("node-1", "gpu-0-mig-1g10gb-3"), ("node-2", "gpu-1")),
            claim("b", ("node-1", "gpu-1-shared"), ("node-1", "gpu-1")),
            claim("odd", ("node-1", "tpu-0")),
        ],
        "node-1",
    )
    assert use.devices == {
        0: (("ns/a", "gpu-0-mig-1g10gb-3"),),
        1: (("ns/b", "gpu-1"), ("ns/b", "gpu-1-shared")),
    }
    assert use.claim_use().holders(1).names == ("ns/b",)
    assert not use.claim_use().holders(2).held
    ((skipped),) = use.skipped
    assert skipped.name == "ns/odd" and "'tpu-0' is not a device of ours" in skipped.reason
    assert gpu_index("gpu-3-mig-nonsense") is None and gpu_index("gpu-100") is None
