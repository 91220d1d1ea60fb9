"""Pure device logic: device ids per mode, preferred allocation, Allocate contents, MPS, targets, status changes."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpupart.core.api.spec import GpuConfig, Interface, Mode, MpsSettings
from gpupart.core.api.wire import DesiredGroup
from gpupart.core.errors import InvalidInput
from gpupart.core.mig.layout import MigInstance, Placement
from gpupart.core.node.allocation import exclusive_allocation
from gpupart.core.node.devices import (
    Listing,
    OfferedGpu,
    OfferedMigDevice,
    XidEvent,
    affected_devices,
    node_devices,
    preferred_allocation,
    resolve_devices,
    status_changes,
)
from gpupart.core.node.mps import MpsLimits, client_limits, daemon_commands, mps_limits
from gpupart.core.node.targets import UNPARTITIONED, gpu_targets


def shared_gpus(slots: list[int]) -> list[OfferedGpu]:
    return [
        OfferedGpu(i, f"GPU-{i}", "H200-141GB", 143771, i, i // 2, Mode.TIME_SLICING, replicas=n)
        for i, n in enumerate(slots)
    ]


@given(st.lists(st.integers(1, 6), min_size=1, max_size=6), st.data())
def test_preferred_allocation_is_a_subset_of_size_with_must_include(
    slots: list[int], data: st.DataObject
) -> None:
    devices = {d.id: d for d in node_devices(shared_gpus(slots))["nvidia.com/gpu.shared"]}
    available = data.draw(st.lists(st.sampled_from(sorted(devices)), unique=True, min_size=1))
    must = data.draw(st.lists(st.sampled_from(available), unique=True, max_size=2))
    size = data.draw(st.integers(len(must), len(available)))
    chosen = preferred_allocation(available, must, size, devices)
    assert len(chosen) == size and len(set(chosen)) == size
    assert set(must) <= set(chosen) <= set(available)
    # One GPU whenever one GPU can hold it all.
    per_gpu = {}
    for i in available:
        per_gpu.setdefault(devices[i].gpu.uuid, set()).add(i)
    if size and not must and any(len(ids) >= size for ids in per_gpu.values()):
        assert len({devices[i].gpu.uuid for i in chosen}) == 1


def test_mig_devices_resolve_and_allocate_with_caps() -> None:
    slice_ = OfferedMigDevice("MIG-x", MigInstance(Placement(0, 4), "3g.71gb"), 2, 0, (21, 22))
    gpu = OfferedGpu(0, "GPU-0", "H200-141GB", 143771, 3, 0, Mode.MIG, mig=(slice_,))
    devices = {d.id: d for d in node_devices([gpu])["nvidia.com/mig-3g.71gb"]}
    allocation = exclusive_allocation(resolve_devices(["MIG-x"], devices))
    assert dict(allocation.envs) == {"NVIDIA_VISIBLE_DEVICES": "MIG-x"}
    paths = [d.path for d in allocation.devices]
    assert "/dev/nvidia3" in paths and "/dev/nvidia-caps/nvidia-cap21" in paths
    with pytest.raises(InvalidInput):
        resolve_devices(["MIG-x", "MIG-x"], devices)
    with pytest.raises(InvalidInput):
        resolve_devices(["MIG-gone"], devices)


def test_xid_on_one_instance_hits_only_that_instance() -> None:
    slices = tuple(
        OfferedMigDevice(f"MIG-{n}", MigInstance(Placement(n, 1), "1g.18gb"), n + 1, 0)
        for n in range(3)
    )
    gpu = OfferedGpu(0, "GPU-0", "H200-141GB", 143771, 0, 0, Mode.MIG, mig=slices)
    devices = node_devices([gpu])["nvidia.com/mig-1g.18gb"]
    assert affected_devices(XidEvent("GPU-0", 79, 2), devices) == {"MIG-1"}
    assert affected_devices(XidEvent("GPU-0", 79), devices) == {"MIG-0", "MIG-1", "MIG-2"}
    assert affected_devices(XidEvent("GPU-0", 43, 2), devices) == frozenset()
    assert affected_devices(XidEvent("GPU-9", 79), devices) == frozenset()


def test_mps_limits_and_commands() -> None:
    limits = mps_limits(GpuConfig(Mode.MPS, mps=MpsSettings(), replicas=4), 80000)
    assert (limits.memory_mib, limits.compute_percent) == (20000, 25)
    assert daemon_commands(limits) == (
        "set_default_active_thread_percentage 25",
        "set_default_device_pinned_mem_limit 0 20000M",
    )
    assert client_limits(0, 0, defaults=limits, gpu_memory_mib=80000) == (20000, 25)
    assert client_limits(5000, 20, defaults=limits, gpu_memory_mib=80000) == (5000, 20)
    assert client_limits(20000, 25, defaults=limits, gpu_memory_mib=80000) == (20000, 25)
    # The daemon's defaults are ceilings a client can only lower: above them is refused.
    for memory, compute, field in ((20001, 0, "gpu-memory"), (0, 26, "gpu-compute")):
        with pytest.raises(InvalidInput, match=f"gpupart.io/{field}.*MPS lets one client"):
            client_limits(memory, compute, defaults=limits, gpu_memory_mib=80000)
    with pytest.raises(InvalidInput):
        client_limits(90000, 0, defaults=limits, gpu_memory_mib=80000)


@pytest.mark.parametrize("interface", [Interface.DEVICE_PLUGIN, Interface.DRA])
def test_both_interfaces_hold_clients_to_the_partitions_ceilings(interface: Interface) -> None:
    """Through DRA too: the daemon is what holds a client whose environment lies."""
    given = MpsSettings(default_memory_mib=9216, default_compute_percent=25)
    config = GpuConfig(Mode.MPS, mps=given, replicas=8, interface=interface)
    assert mps_limits(config, 81920) == MpsLimits(8, 9216, 25)
    even = GpuConfig(Mode.MPS, mps=MpsSettings(), replicas=8, interface=interface)
    assert mps_limits(even, 81920) == MpsLimits(8, 10240, 12)


def test_first_group_naming_a_gpu_wins_and_the_rest_are_whole() -> None:
    groups = (
        DesiredGroup("a", 1, (0,), GpuConfig(Mode.MIG, (("1g.18gb", 7),))),
        DesiredGroup("b", 1, (0, 1), GpuConfig(Mode.TIME_SLICING, replicas=3)),
    )
    targets = gpu_targets(groups, [0, 1, 2])
    assert targets[0] == groups[0].config and targets[1].replicas == 3
    assert targets[2] == UNPARTITIONED


def test_a_gpu_no_partition_names_on_a_dra_node_is_a_whole_gpu_through_dra():
    dra = GpuConfig(Mode.MIG, (("1g.18gb", 7),), interface=Interface.DRA)
    targets = gpu_targets((DesiredGroup("a", 1, (0,), dra),), [0, 1])
    assert targets[1] == GpuConfig(Mode.NONE, interface=Interface.DRA)
    assert gpu_targets((), [0])[0].interface is Interface.DEVICE_PLUGIN


IDS = st.frozensets(st.sampled_from([f"MIG-{n}" for n in range(6)]))


@st.composite
def listings(draw: st.DrawFn) -> dict[str, Listing]:
    found = {}
    for resource in draw(st.sets(st.sampled_from(["nvidia.com/mig-1g.18gb", "nvidia.com/gpu"]))):
        ids = draw(IDS)
        found[resource] = Listing(
            ids, frozenset(draw(st.sets(st.sampled_from(sorted(ids))))) if ids else frozenset()
        )
    return found


@given(listings(), listings())
def test_status_changes_never_write_an_increase_the_kubelet_is_not_asked_to_confirm(
    before: dict[str, Listing], after: dict[str, Listing]
) -> None:
    changes, left = status_changes(before, after)
    empty = Listing()
    for change in changes:
        old, new = before.get(change.resource, empty), after.get(change.resource, empty)
        assert change.resource.startswith("nvidia.com/mig-")
        assert (change.capacity, change.allocatable) == (new.capacity, new.allocatable)
        assert (new.capacity, new.allocatable) != (old.capacity, old.allocatable)
        if new.capacity > old.capacity or new.allocatable > old.allocatable:
            # Every device the kubelet may not hold yet is awaited, and only healthy ones.
            assert change.awaited == new.healthy - old.healthy and change.awaited
            assert new.ids - old.ids <= change.awaited
        else:
            assert change.awaited == frozenset()
    for resource in left:
        new, old = after.get(resource, empty), before.get(resource, empty)
        assert (new.ids - old.ids) - new.healthy, "only a new unhealthy device is left out"
    named = {c.resource for c in changes} | set(left)
    for resource in {*before, *after} - named:
        old, new = before.get(resource, empty), after.get(resource, empty)
        assert not resource.startswith("nvidia.com/mig-") or (
            (old.capacity, old.allocatable) == (new.capacity, new.allocatable)
        )
