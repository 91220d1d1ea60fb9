"""Device taints after a GPU fault: the fault book's clean window, which devices a fault taints, and the publish plan.

We test these aspects:
- the fault book: one fault per GPU or GPU instance, its first Xid and start kept while it
  lasts, an application's Xid ignored, a fault cleared only once its GPU answers and stays
  quiet for the window, an instance fault pinned to the instance's MIG UUID;
- which devices a fault taints: every device of the GPU for a GPU fault, the instance's device
  (and the whole GPU's) for an instance fault, nothing on another GPU;
- the taint itself: key, a label value naming the Xid, the effect asked, `timeAdded` as the API
  writes it back, stable across republishes (laws over random pools and faults);
- the pool: a fault coming and going is one slice update at the same generation each, and a
  tainted slice reads back as what was written;
- the scheduler model and the reasons: a tainted device is not allocated unless a toleration
  of the request matches, and a pod waiting on tainted GPUs is told so.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpupart.core.api.spec import Mode
from gpupart.core.dra import names
from gpupart.core.dra.allocator import DeviceRequest, DeviceToleration, first_fit
from gpupart.core.dra.devices import DraGpu, GpuDevices, gpu_devices
from gpupart.core.dra.pool import pool_slices, publish_plan
from gpupart.core.dra.read import DeviceTaint, SliceView, read_slice, read_slices
from gpupart.core.dra.reasons import DraAsk, Wanted, free_devices, node_reason
from gpupart.core.dra.requests import read_claim_spec
from gpupart.core.dra.taints import TaintEffect, taint_devices, time_added
from gpupart.core.errors import InvalidInput
from gpupart.core.mig.catalogue import require_gpu_model
from gpupart.core.mig.layout import MigInstance, Placement
from gpupart.core.node.devices import OfferedGpu, OfferedMigDevice, XidEvent
from gpupart.core.node.faults import FaultBook, GpuFault

H100 = require_gpu_model("H100-SXM5-80GB")
SINCE = 1_796_300_000.25
"""A wall-clock start (Unix seconds) with a fraction the API drops."""
LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")


def mig(gi: int, start: int, profile: str = "1g.10gb", size: int = 1) -> OfferedMigDevice:
    return OfferedMigDevice(
        f"MIG-{gi}-{start}", MigInstance(Placement(start, size), profile), gi, 0
    )


def view(index: int, mode: Mode, *instances: OfferedMigDevice, dynamic: bool = False) -> OfferedGpu:
    return OfferedGpu(
        index,
        f"GPU-{index:04d}",
        H100.product,
        H100.memory_mib,
        index,
        0,
        mode,
        mig=instances,
        replicas=4 if mode.is_shared else 0,
        dynamic=dynamic,
    )


def devices_of(gpu: OfferedGpu) -> GpuDevices:
    if gpu.mode is Mode.MIG and gpu.dynamic:
        in_use = tuple(m.instance for m in gpu.mig)
        return gpu_devices(DraGpu(gpu, H100, dynamic=True, in_use=in_use))
    return gpu_devices(DraGpu(gpu, H100))


def tainted(found: GpuDevices) -> dict[str, list[dict[str, Any]]]:
    return {str(d["name"]): d["taints"] for d in found.devices if "taints" in d}


# ---- the fault book ----


def test_book_keeps_the_first_xid_and_start_while_the_fault_lasts() -> None:
    gpu = view(0, Mode.NONE)
    book = FaultBook().record_xid(XidEvent(gpu.uuid, 79), [gpu], wall=SINCE, now=10)
    book = book.record_xid(XidEvent(gpu.uuid, 48), [gpu], wall=SINCE + 30, now=40)
    (fault,) = book.faults
    assert (fault.xid, fault.since, fault.gpu_instance_id) == (79, SINCE, None)
    assert book.recover({gpu.uuid}, 40 + 59, quiet_s=60).faults == (fault,)  # window from the last
    assert book.recover({gpu.uuid}, 40 + 60, quiet_s=60).faults == ()


def test_book_ignores_an_applications_xid() -> None:
    gpu = view(0, Mode.NONE)
    assert FaultBook().record_xid(XidEvent(gpu.uuid, 13), [gpu], wall=SINCE, now=0).faults == ()


def test_book_keeps_a_fault_while_its_gpu_does_not_answer() -> None:
    gpu = view(0, Mode.NONE)
    book = FaultBook().record_silent([gpu.uuid], wall=SINCE, now=0)
    (fault,) = book.faults
    assert fault.xid is None and fault.since == SINCE
    assert book.recover(set(), 1000, quiet_s=60).faults == (fault,)  # silent: never cleared
    assert book.recover({gpu.uuid}, 1000, quiet_s=60).faults == ()


def test_book_pins_an_instance_fault_to_the_instances_mig_uuid() -> None:
    gpu = view(0, Mode.MIG, mig(gi=3, start=2), dynamic=True)
    book = FaultBook().record_xid(XidEvent(gpu.uuid, 94, 3), [gpu], wall=SINCE, now=0)
    (fault,) = book.faults
    assert (fault.gpu_instance_id, fault.mig_uuid) == (3, "MIG-3-2")
    unknown = FaultBook().record_xid(XidEvent(gpu.uuid, 94, 5), [gpu], wall=SINCE, now=0)
    assert unknown.faults[0].mig_uuid == ""


# ---- which devices a fault taints ----


@pytest.mark.parametrize(
    ("gpu", "fault", "want"),
    [
        pytest.param(view(0, Mode.NONE), GpuFault("GPU-0000", xid=79), {"gpu-0"}, id="whole"),
        pytest.param(
            view(0, Mode.MPS), GpuFault("GPU-0000", xid=79), {"gpu-0-shared"}, id="shared"
        ),
        pytest.param(
            view(0, Mode.NONE), GpuFault("GPU-0001", xid=79), set(), id="another GPU's fault"
        ),
        pytest.param(
            view(0, Mode.MIG, mig(3, 2), mig(4, 3), dynamic=True),
            GpuFault("GPU-0000", 3, "MIG-3-2", 94),
            {"gpu-0-mig-1g10gb-2"},
            id="instance fault: its device only (a GPU in MIG mode has no whole device)",
        ),
        pytest.param(
            view(0, Mode.MIG, mig(3, 2), dynamic=True),
            GpuFault("GPU-0000", 3, "", 94),
            {"gpu-0-mig-1g10gb-2"},
            id="instance fault not pinned: by its id",
        ),
        pytest.param(
            view(0, Mode.MIG, mig(3, 5), dynamic=True),
            GpuFault("GPU-0000", 3, "MIG-3-2", 94),
            set(),
            id="pinned instance gone, its id given to a new one: the new one is clean",
        ),
        pytest.param(
            view(0, Mode.MIG, mig(3, 2), mig(4, 3)),
            GpuFault("GPU-0000", 4, "MIG-4-3", 94),
            {"gpu-0-mig-1g10gb-3"},
            id="static MIG: only that instance",
        ),
    ],
)
def test_a_fault_taints_these_devices(gpu: OfferedGpu, fault: GpuFault, want: set[str]) -> None:
    found = taint_devices(gpu, devices_of(gpu), [fault])
    assert set(tainted(found)) == want


def test_a_gpu_fault_taints_every_device_of_a_dynamic_gpu_placed_or_not() -> None:
    gpu = view(1, Mode.MIG, mig(3, 2), dynamic=True)
    plain = devices_of(gpu)
    found = taint_devices(gpu, plain, [GpuFault(gpu.uuid, xid=79, since=SINCE)])
    assert set(tainted(found)) == {str(d["name"]) for d in plain.devices}
    assert len(plain.devices) > 20  # every placement, not only the prepared one


def test_the_taint_names_the_xid_and_its_start_as_the_api_writes_it() -> None:
    gpu = view(0, Mode.NONE)
    found = taint_devices(
        gpu,
        devices_of(gpu),
        [GpuFault(gpu.uuid, xid=79, since=SINCE)],
        effect=TaintEffect.NO_EXECUTE,
    )
    assert tainted(found) == {
        "gpu-0": [
            {
                "key": "gpu.gpupart.io/unhealthy",
                "value": "xid-79",
                "effect": "NoExecute",
                "timeAdded": "2026-12-03T12:13:20Z",
            }
        ]
    }
    assert time_added(SINCE) == "2026-12-03T12:13:20Z"


def test_of_two_faults_the_earlier_names_the_taint() -> None:
    gpu = view(0, Mode.MIG, mig(3, 2), dynamic=True)
    faults = [
        GpuFault(gpu.uuid, 3, "MIG-3-2", 94, since=SINCE),
        GpuFault(gpu.uuid, xid=None, since=SINCE + 5),
    ]
    found = tainted(taint_devices(gpu, devices_of(gpu), faults))
    assert found["gpu-0-mig-1g10gb-2"][0]["value"] == "xid-94"
    assert found["gpu-0-mig-1g10gb-3"][0]["value"] == "unresponsive"
    assert all(len(t) == 1 for t in found.values())


def test_a_device_with_sixteen_taints_refuses_one_more() -> None:
    gpu = view(0, Mode.NONE)
    plain = devices_of(gpu)
    full = GpuDevices(
        0,
        ({**plain.devices[0], "taints": [{"key": f"k/{n}", "effect": "None"} for n in range(16)]},),
    )
    with pytest.raises(InvalidInput, match="17 taints, the API allows 16"):
        taint_devices(gpu, full, [GpuFault(gpu.uuid, xid=79)])


# ---- the pool and the publish plan ----


def test_a_tainted_slice_reads_back_as_written() -> None:
    gpu = view(0, Mode.NONE)
    found = taint_devices(gpu, devices_of(gpu), [GpuFault(gpu.uuid, xid=79, since=SINCE)])
    (doc,) = pool_slices("node-a", "uid-a", [found])
    read = read_slice(doc)
    assert read is not None
    assert read.devices[0].taints == (
        DeviceTaint(names.TAINT_UNHEALTHY, "xid-79", "NoSchedule", int(SINCE)),
    )


def test_a_taint_written_back_with_fractional_seconds_is_no_change() -> None:
    gpu = view(0, Mode.NONE)
    found = taint_devices(gpu, devices_of(gpu), [GpuFault(gpu.uuid, xid=79, since=SINCE)])
    (doc,) = pool_slices("node-a", "uid-a", [found])
    back = {**doc, "spec": {**doc["spec"], "devices": [dict(doc["spec"]["devices"][0])]}}
    back["spec"]["devices"][0]["taints"] = [
        {**doc["spec"]["devices"][0]["taints"][0], "timeAdded": "2026-12-03T12:13:20+00:00"}
    ]
    assert publish_plan(read_slices([back]).items, [doc]).empty


def test_an_unreadable_time_added_names_the_field() -> None:
    gpu = view(0, Mode.NONE)
    found = taint_devices(gpu, devices_of(gpu), [GpuFault(gpu.uuid, xid=79, since=SINCE)])
    (doc,) = pool_slices("node-a", "uid-a", [found])
    doc["spec"]["devices"][0]["taints"][0]["timeAdded"] = "yesterday"
    reading = read_slices([doc])
    assert reading.items == () and "taints[0].timeAdded" in reading.skipped[0].reason


KINDS = st.lists(st.sampled_from(["dynamic", "shared", "whole", "static"]), min_size=1, max_size=8)


def pool_views(kinds: list[str]) -> list[OfferedGpu]:
    found = []
    for index, kind in enumerate(kinds):
        if kind == "dynamic":
            found.append(view(index, Mode.MIG, mig(1, 0, "3g.40gb", 4), dynamic=True))
        elif kind == "static":
            found.append(view(index, Mode.MIG, mig(1, 0, "3g.40gb", 4), mig(2, 4, "3g.40gb", 4)))
        elif kind == "shared":
            found.append(view(index, Mode.MPS))
        else:
            found.append(view(index, Mode.NONE))
    return found


@st.composite
def faults_on(draw: st.DrawFn, gpus: list[OfferedGpu]) -> list[GpuFault]:
    faults = []
    for gpu in draw(st.lists(st.sampled_from(gpus), max_size=4)):
        instance = draw(st.sampled_from([None, *gpu.mig]))
        faults.append(
            GpuFault(
                gpu.uuid,
                None if instance is None else instance.gpu_instance_id,
                "" if instance is None else instance.uuid,
                draw(st.one_of(st.none(), st.integers(0, 200))),
                draw(st.floats(1.7e9, 1.9e9)),
            )
        )
    return faults


@settings(max_examples=40, deadline=None)
@given(st.data(), KINDS)
def test_law_taints_follow_the_faults_and_republishing_writes_nothing(
    data: st.DataObject, kinds: list[str]
) -> None:
    gpus = pool_views(kinds)
    faults = data.draw(faults_on(gpus))
    found = [taint_devices(g, devices_of(g), faults) for g in gpus]
    docs = pool_slices("node-a", "uid-a", found)
    for gpu, devices in zip(gpus, found, strict=True):
        names_tainted = set(tainted(devices))
        mine = [f for f in faults if f.gpu_uuid == gpu.uuid]
        if not mine:
            assert names_tainted == set()  # a healthy GPU's devices carry no taint
        if any(f.gpu_instance_id is None for f in mine):
            assert names_tainted == {str(d["name"]) for d in devices.devices}
        for taints in tainted(devices).values():
            (taint,) = taints
            assert taint["key"] == names.TAINT_UNHEALTHY and taint["effect"] == "NoSchedule"
            assert LABEL_VALUE.fullmatch(taint["value"]) and len(taint["value"]) <= 63
    for doc in docs:
        devices = doc["spec"].get("devices", [])
        if any("taints" in d or "consumesCounters" in d for d in devices):
            assert len(devices) <= names.MAX_DEVICES_WITH_COUNTERS
    existing = read_slices(docs).items
    again = pool_slices("node-a", "uid-a", [taint_devices(g, devices_of(g), faults) for g in gpus])
    assert publish_plan(existing, again).empty  # the same faults: the same slices


@settings(max_examples=40, deadline=None)
@given(st.data(), KINDS)
def test_law_a_fault_on_one_gpu_coming_and_going_updates_its_slices_in_place(
    data: st.DataObject, kinds: list[str]
) -> None:
    """The slices holding the GPU's devices are updated, no other, at the same generation."""
    gpus = pool_views(kinds)
    gpu = data.draw(st.sampled_from(gpus))
    fault = data.draw(faults_on([gpu]).filter(bool))[0]
    healthy = pool_slices("node-a", "uid-a", [devices_of(g) for g in gpus], generation=3)
    sick = pool_slices("node-a", "uid-a", [taint_devices(g, devices_of(g), [fault]) for g in gpus])
    taint = publish_plan(read_slices(healthy).items, sick)
    assert taint.updates and not taint.bumps and taint.generation == 3
    tainted = {d["name"] for doc in sick for d in doc["spec"].get("devices", []) if d.get("taints")}
    holding = {
        doc["metadata"]["name"]
        for doc in sick
        if tainted & {d["name"] for d in doc["spec"].get("devices", [])}
    }
    assert {d["metadata"]["name"] for d in taint.updates} == holding
    changed = {d["metadata"]["name"] for d in taint.updates}
    now = (*taint.updates, *(d for d in healthy if d["metadata"]["name"] not in changed))
    clear = publish_plan(
        read_slices(now).items, pool_slices("node-a", "uid-a", [devices_of(g) for g in gpus])
    )
    assert {d["metadata"]["name"] for d in clear.updates} == holding
    assert not clear.bumps and clear.generation == 3


# ---- the scheduler model and the reasons: a tainted device is not allocated ----

WHOLE = DeviceRequest("dev", ((names.TYPE, names.TYPE_GPU),))


def whole_pool(faults: list[GpuFault]) -> list[SliceView]:
    gpus = [view(0, Mode.NONE), view(1, Mode.NONE)]
    docs = pool_slices("node-3", "uid", [taint_devices(g, devices_of(g), faults) for g in gpus])
    return list(read_slices(docs).items)


def test_the_model_passes_a_tainted_device_by_as_the_scheduler_does() -> None:
    slices = whole_pool([GpuFault("GPU-0000", xid=79, since=SINCE)])
    (found,) = first_fit(slices, [], [WHOLE]) or ()
    assert found.device == "gpu-1"


@pytest.mark.parametrize(
    ("toleration", "tolerated"),
    [
        pytest.param(DeviceToleration(names.TAINT_UNHEALTHY, "Exists"), True, id="exists"),
        pytest.param(DeviceToleration(operator="Exists"), True, id="every key"),
        pytest.param(DeviceToleration(names.TAINT_UNHEALTHY, "Equal", "xid-79"), True, id="equal"),
        pytest.param(DeviceToleration(names.TAINT_UNHEALTHY, "Equal", "xid-48"), False, id="other"),
        pytest.param(
            DeviceToleration(names.TAINT_UNHEALTHY, "Exists", effect="NoExecute"),
            False,
            id="another effect",
        ),
    ],
)
def test_a_toleration_lets_the_model_allocate_a_tainted_device(
    toleration: DeviceToleration, tolerated: bool
) -> None:
    slices = whole_pool(
        [GpuFault("GPU-0000", xid=79, since=SINCE), GpuFault("GPU-0001", xid=79, since=SINCE)]
    )
    request = DeviceRequest("dev", WHOLE.match, tolerations=(toleration,))
    assert (first_fit(slices, [], [request]) is not None) is tolerated


def test_a_pod_waiting_on_tainted_gpus_is_told_which_and_why() -> None:
    slices = whole_pool(
        [GpuFault("GPU-0000", xid=79, since=SINCE), GpuFault("GPU-0001", since=SINCE)]
    )
    ask = DraAsk("team-b/p", (Wanted("dev/dev", (WHOLE,), ("whole GPU",)),))
    found = node_reason("node-3", slices, [], ask)
    assert not found.fits
    assert found.text == (
        "node-3: GPU 0 is tainted gpu.gpupart.io/unhealthy=xid-79:NoSchedule; "
        "GPU 1 is tainted gpu.gpupart.io/unhealthy=unresponsive:NoSchedule"
    )
    assert free_devices(slices, [], WHOLE) == ()


def test_a_claims_tolerations_are_read_and_bounded() -> None:
    claim = {
        "metadata": {"name": "c", "namespace": "ns"},
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": "r",
                        "exactly": {
                            "deviceClassName": "gpu.gpupart.io",
                            "tolerations": [
                                {"key": names.TAINT_UNHEALTHY, "operator": "Exists"},
                                {"operator": "Exists", "effect": "NoSchedule"},
                            ],
                        },
                    }
                ]
            }
        },
    }
    (request,) = read_claim_spec(claim).requests
    assert request.alternatives[0].tolerations == (
        DeviceToleration(names.TAINT_UNHEALTHY, "Exists"),
        DeviceToleration(operator="Exists", effect="NoSchedule"),
    )
    exactly = claim["spec"]["devices"]["requests"][0]["exactly"]  # type: ignore[index]
    exactly["tolerations"] = [{"operator": "Exists"}] * 17
    with pytest.raises(InvalidInput, match=r"exactly\.tolerations.*more than 16"):
        read_claim_spec(claim)
