"""Slices and claims read back: foreign ones skipped, malformed ones skipped with a reason naming object and field."""

from __future__ import annotations

import copy
from fractions import Fraction
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpupart.core.api.spec import Mode
from gpupart.core.dra import names
from gpupart.core.dra.allocator import DeviceRequest, first_fit, round_up
from gpupart.core.dra.claims import pool_use
from gpupart.core.dra.devices import DraGpu, GpuFacts, gpu_devices
from gpupart.core.dra.pool import pool_slices
from gpupart.core.dra.read import (
    AllocationResult,
    Capacity,
    ClaimView,
    RequestPolicy,
    read_claim,
    read_claims,
    read_slices,
)
from gpupart.core.errors import InvalidInput
from gpupart.core.mig.catalogue import require_gpu_model
from gpupart.core.mig.layout import MigInstance, Placement
from gpupart.core.node.devices import OfferedGpu, OfferedMigDevice

H100 = require_gpu_model("H100-SXM5-80GB")


def gpu(index: int, mode: Mode, **kw: Any) -> OfferedGpu:
    return OfferedGpu(
        index, f"GPU-{index}", "NVIDIA H100 80GB HBM3", H100.memory_mib, index, 0, mode, **kw
    )


def docs() -> list[dict[str, Any]]:
    gpus = [
        gpu_devices(DraGpu(gpu(0, Mode.MIG), H100, dynamic=True)),
        gpu_devices(DraGpu(gpu(1, Mode.MPS, replicas=4), H100)),
    ]
    return [copy.deepcopy(d) for d in pool_slices("node-a", "uid", gpus)]


def claim(device: str, driver: str = names.DRIVER, **extra: Any) -> dict[str, Any]:
    result = {"request": "r", "driver": driver, "pool": "node-a", "device": device, **extra}
    return {
        "metadata": {"namespace": "ns", "name": "c", "uid": "u1"},
        "status": {
            "allocation": {"devices": {"results": [result]}},
            "reservedFor": [{"resource": "pods", "name": "p", "uid": "pu"}],
        },
    }


def test_our_documents_read_back_as_written() -> None:
    reading = read_slices(docs())
    # the counters, one slice per H100 profile, the shared GPU's
    assert len(reading.items) == 2 + len(H100.profiles)
    assert not reading.skipped and reading.foreign == 0
    shared = next(d for s in reading.items for d in s.devices if d.multiple)
    memory = shared.capacity_of(names.MEMORY)
    assert memory is not None and memory.value == H100.memory_mib * 2**20
    assert memory.policy is not None and memory.policy.step == 2**20


def test_a_foreign_driver_is_skipped_without_a_reason() -> None:
    found = docs()
    found[1]["spec"]["driver"] = "gpu.nvidia.com"
    found[1]["spec"]["devices"][0]["capacity"]["memory"]["value"] = "not a quantity"
    reading = read_slices(found)
    assert reading.foreign == 1 and not reading.skipped and len(reading.items) == len(found) - 1


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (
            lambda d: d["spec"]["devices"][0]["capacity"]["memory"].update(value="10Gx"),
            "capacity.memory.value",
        ),
        (
            lambda d: d["spec"]["devices"][0]["capacity"]["memory"].update(value="-1"),
            "capacity.memory.value",
        ),
        (
            lambda d: d["spec"]["devices"][0]["capacity"]["memory"].update(value="9" * 200),
            "capacity.memory.value",
        ),
        (lambda d: d["spec"]["devices"][0].update(name="Not.A.Label"), "devices[0].name"),
        (
            lambda d: d["spec"]["devices"][0]["attributes"]["parentIndex"].update(int="zero"),
            "attributes.parentIndex.int",
        ),
        (lambda d: d["spec"]["pool"].update(generation=-1), "pool.generation"),
        (
            lambda d: d["spec"]["devices"][0]["attributes"].update({"x" * 5000: {"int": 1}}),
            "attributes.xxx",
        ),
        (
            lambda d: d["spec"]["devices"][0]["consumesCounters"][0]["counters"].update(
                {"Bad_Name": {"value": "1"}}
            ),
            "counters.Bad_Name",
        ),
        (lambda d: d["spec"]["pool"].update(resourceSliceCount=10**12), "pool.resourceSliceCount"),
        (lambda d: d["spec"].update(devices=[d["spec"]["devices"][0]] * 200), "spec.devices"),
        (lambda d: d["spec"].update(devices="gpu-0"), "spec.devices"),
        (
            lambda d: d["spec"]["devices"][0]["consumesCounters"][0]["counters"][
                "compute-slices"
            ].update(value=[1]),
            "compute-slices.value",
        ),
    ],
)
def test_a_malformed_slice_is_skipped_with_a_reason_naming_object_and_field(
    change: Any, field: str
) -> None:
    found = docs()
    bad = found[1]
    change(bad)
    reading = read_slices(found)
    assert len(reading.items) == len(found) - 1  # the others are read
    (skipped,) = reading.skipped
    assert skipped.kind == "ResourceSlice" and skipped.name == bad["metadata"]["name"]
    assert bad["metadata"]["name"] in skipped.reason and field in skipped.reason, skipped.reason


@settings(max_examples=200, deadline=None)
@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=8),
        lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
        max_leaves=12,
    )
)
def test_any_json_is_read_or_skipped_never_raised(garbage: Any) -> None:
    found = docs()
    found[2]["spec"]["devices"] = [garbage]
    reading = read_slices([*found, garbage, {"metadata": {"name": "x"}, "spec": garbage}])
    assert len(reading.items) >= 2
    claims = read_claims([garbage, {"metadata": {"name": "c"}, "status": garbage}, claim("gpu-0")])
    assert len(claims.items) == 1


def test_claims_keep_only_our_results_and_foreign_claims_are_not_ours() -> None:
    view = read_claim(
        claim("gpu-1-shared", shareID="s1", consumedCapacity={"memory": "10Gi", "compute": "25"})
    )
    assert view is not None and view.key == "ns/c"
    (result,) = view.results
    assert result.share_id == "s1" and dict(result.consumed) == {
        "memory": 10 * 2**30,
        "compute": 25,
    }
    assert view.reserved_for[0].name == "p"
    assert read_claim(claim("gpu-0", driver="gpu.nvidia.com")) is None
    assert read_claim({"metadata": {"name": "pending", "namespace": "ns"}, "spec": {}}) is None
    reading = read_claims([claim("gpu-0", consumedCapacity={"memory": "lots"}), claim("gpu-0")])
    assert len(reading.items) == 1
    (skipped,) = reading.skipped
    assert "ResourceClaim ns/c" in skipped.reason and "consumedCapacity.memory" in skipped.reason


# --- consumable capacity ---------------------------------------------------------------------


def test_requests_round_up_to_the_policy_step_and_refuse_beyond_the_maximum() -> None:
    policy = RequestPolicy(Fraction(4), minimum=Fraction(2), maximum=Fraction(10), step=Fraction(4))
    capacity = Capacity(Fraction(10), policy)
    assert round_up(Fraction(1), capacity) == 2
    assert round_up(Fraction(3), capacity) == 6
    assert round_up(Fraction(6), capacity) == 6
    assert round_up(Fraction(11), capacity) is None
    assert round_up(None, capacity) == 4
    assert round_up(None, Capacity(Fraction(10))) == 10


def test_shared_memory_is_never_over_committed() -> None:
    slices = list(read_slices(docs()).items)
    request = DeviceRequest(
        "r",
        ((names.TYPE, names.TYPE_SHARED),),
        capacity=(("memory", Fraction(30 * 2**30)), ("compute", Fraction(1))),
    )
    held: list[ClaimView] = []
    for k in range(2):
        got = first_fit(slices, held, [request])
        assert got is not None and got[0].device == "gpu-1-shared"
        held.append(ClaimView("ns", f"c{k}", f"u{k}", got))
    assert first_fit(slices, held, [request]) is None  # 90 GiB > the GPU's 81559 MiB
    half_mib = DeviceRequest(
        "r", ((names.TYPE, names.TYPE_SHARED),), capacity=(("memory", Fraction(2**19)),)
    )
    got = first_fit(slices, [], [half_mib])
    assert got is not None and dict(got[0].consumed)["memory"] == 2**20  # rounded up to 1 MiB
    assert dict(got[0].consumed)["compute"] == 25  # unrequested: the default share of 4 replicas


def test_an_admin_access_is_no_allocation() -> None:
    """As the scheduler counts it: an adminAccess result takes nothing from the device."""
    view = read_claim(claim("gpu-1-shared", adminAccess=True))
    assert view is not None and view.results[0].admin_access
    slices = list(read_slices(docs()).items)
    watching = AllocationResult(
        "r", names.DRIVER, "node-a", "gpu-1-shared",
        consumed=(("memory", Fraction(80 * 2**30)),), admin_access=True,
    )  # fmt: skip
    held = [ClaimView("ns", "adm", "ua", (watching,))]
    request = DeviceRequest(
        "r", ((names.TYPE, names.TYPE_SHARED),), capacity=(("memory", Fraction(30 * 2**30)),)
    )
    assert first_fit(slices, held, [request]) is not None
    assert pool_use(held, "node-a").devices == {}


def test_an_mps_share_is_never_more_than_the_daemon_lets_one_client_hold() -> None:
    """The partition's ceilings (9216 MiB, 25 %) are the shared device's largest request, so
    the scheduler never allocates a claim that prepare would refuse (ADR 033)."""
    capped = gpu(1, Mode.MPS, replicas=8, mps_memory_mib=9216, mps_compute_percent=25)
    slices = list(
        read_slices(pool_slices("node-a", "uid", [gpu_devices(DraGpu(capped, H100))])).items
    )

    def share(memory_mib: int, compute: int) -> DeviceRequest:
        amounts = (("memory", Fraction(memory_mib * 2**20)), ("compute", Fraction(compute)))
        return DeviceRequest("r", ((names.TYPE, names.TYPE_SHARED),), capacity=amounts)

    assert first_fit(slices, [], [share(9216, 25)]) is not None
    assert first_fit(slices, [], [share(9217, 1)]) is None
    assert first_fit(slices, [], [share(1024, 26)]) is None
    unasked = DeviceRequest("r", ((names.TYPE, names.TYPE_SHARED),))
    got = first_fit(slices, [], [unasked])
    assert got is not None and dict(got[0].consumed) == {"memory": 9216 * 2**20, "compute": 12}


# --- the builder -----------------------------------------------------------------------------


def test_unknown_attributes_are_omitted_and_versions_are_semver() -> None:
    bare = gpu_devices(DraGpu(gpu(0, Mode.NONE))).devices[0]["attributes"]
    assert set(bare) == {"type", "uuid", "index", "productName"}
    known = gpu_devices(
        DraGpu(gpu(0, Mode.NONE), H100, facts=GpuFacts("0000:3b:00.0", "535.104.05"))
    ).devices[0]["attributes"]
    assert known["driverVersion"] == {"version": "535.104.5"}
    assert known["cudaComputeCapability"] == {"version": "9.0.0"}
    assert known["architecture"] == {"string": "Hopper"}
    assert known[names.PCI_BUS_ID] == {"string": "0000:3b:00.0"}
    odd = gpu_devices(
        DraGpu(gpu(0, Mode.NONE), facts=GpuFacts(driver_version="r570-beta"))
    ).devices[0]["attributes"]
    assert "driverVersion" not in odd


def test_static_mig_publishes_each_instance_and_no_whole_gpu() -> None:
    migs = (
        OfferedMigDevice("MIG-1", MigInstance(Placement(0, 4), "3g.40gb"), 1, 0),
        OfferedMigDevice("MIG-2", MigInstance(Placement(4, 1), "1g.10gb"), 2, 0),
    )
    found = gpu_devices(DraGpu(gpu(0, Mode.MIG, mig=migs), H100))
    assert found.counters is None
    assert [d["name"] for d in found.devices] == ["gpu-0-mig-1g10gb-4", "gpu-0-mig-3g40gb-0"]
    assert found.devices[0]["attributes"]["uuid"] == {"string": "MIG-2"}


def test_a_mig_gpu_without_its_model_is_refused_clearly() -> None:
    with pytest.raises(InvalidInput, match="gpu 0.model"):
        gpu_devices(DraGpu(gpu(0, Mode.MIG), dynamic=True))


def test_more_than_eight_counter_sets_need_a_second_counters_slice() -> None:
    gpus = [gpu_devices(DraGpu(gpu(i, Mode.MIG), H100, dynamic=True)) for i in range(17)]
    slices = pool_slices("node-a", "uid", gpus)
    counters = [s for s in slices if "sharedCounters" in s["spec"]]
    assert [len(s["spec"]["sharedCounters"]) for s in counters] == [8, 8, 1]
    assert all(s["spec"]["pool"]["resourceSliceCount"] == len(slices) for s in slices)


def test_profile_labels_are_distinct_dns_labels() -> None:
    from gpupart.core.mig.catalogue import catalogue

    profiles = sorted({p.name for m in catalogue() for p in m.profiles})
    labels = [names.profile_label(p) for p in profiles]
    assert len(set(labels)) == len(labels)
    for label in labels:
        names.check_dns_label(f"gpu-99-mig-{label}-7", "test")


def test_slice_names_stay_within_the_api_limit_and_apart() -> None:
    long_a, long_b = "n" * 250 + "a", "n" * 250 + "b"
    a, b = names.slice_name(long_a, "whole"), names.slice_name(long_b, "whole")
    assert len(a) <= 253 and len(b) <= 253 and a != b
    with pytest.raises(InvalidInput, match="gpu.index"):
        names.check_gpu_index(100)
