"""Laws of the DRA core over every catalogue model: placements, counters, 7g placement, order, pool, publish plan."""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpupart.core.api.spec import Mode
from gpupart.core.dra import names
from gpupart.core.dra.allocator import DeviceRequest, first_fit, usable_pools
from gpupart.core.dra.devices import DraGpu, GpuDevices, Order, gpu_devices
from gpupart.core.dra.order import core_choice
from gpupart.core.dra.pool import PublishPlan, Slice, pool_slices, publish_plan
from gpupart.core.dra.read import AllocationResult, ClaimView, DeviceView, SliceView, read_slice
from gpupart.core.dynamic.model import Gpu, Instance, MigDemand, Mix, Use
from gpupart.core.dynamic.planner import plan
from gpupart.core.errors import InfeasibleLayout
from gpupart.core.mig.catalogue import GpuModel, catalogue
from gpupart.core.mig.layout import MigInstance, Placement, check_layout
from gpupart.core.node.devices import OfferedGpu

MODELS = catalogue()


def offered(
    model: GpuModel, index: int = 0, mode: Mode = Mode.MIG, replicas: int = 0
) -> OfferedGpu:
    return OfferedGpu(
        index,
        f"GPU-{index:04d}",
        model.product,
        model.memory_mib,
        index,
        0,
        mode,
        replicas=replicas,
    )


def dynamic(model: GpuModel, index: int = 0, **kw: object) -> GpuDevices:
    return gpu_devices(DraGpu(offered(model, index), model, dynamic=True, **kw))  # type: ignore[arg-type]


def views_of(devices: GpuDevices) -> tuple[DeviceView, ...]:
    doc = pool_slices("node-a", "uid-a", [devices])
    found = [read_slice(d) for d in doc]
    return tuple(d for view in found if view is not None for d in view.devices)


def counters_of(devices: GpuDevices) -> dict[str, Fraction]:
    doc = pool_slices("node-a", "uid-a", [devices])
    view = read_slice(doc[0])
    assert view is not None and view.counter_sets
    return dict(view.counter_sets[0][1])


def instance_of(device: DeviceView) -> MigInstance:
    start, size, profile = (
        device.attribute(k) for k in (names.PLACEMENT_START, names.PLACEMENT_SIZE, names.PROFILE)
    )
    assert isinstance(start, int) and isinstance(size, int) and isinstance(profile, str)
    return MigInstance(Placement(start, size), profile)


def counters_allow(capacity: dict[str, Fraction], devices: Sequence[DeviceView]) -> bool:
    used: dict[str, Fraction] = {}
    for device in devices:
        for _, amounts in device.consumes:
            for name, value in amounts:
                used[name] = used.get(name, Fraction(0)) + value
    return all(value <= capacity[name] for name, value in used.items())


def layout_ok(model: GpuModel, layout: Sequence[MigInstance]) -> bool:
    try:
        check_layout(model, layout)
    except InfeasibleLayout:
        return False
    return True


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.product)
def test_every_legal_placement_is_published_exactly_once(model: GpuModel) -> None:
    devices = views_of(dynamic(model))
    placements = [instance_of(d) for d in devices if d.attribute(names.TYPE) == names.TYPE_MIG]
    expected = {
        MigInstance(Placement(s, p.memory_slices), p.name) for p in model.profiles for s in p.starts
    }
    assert sorted(placements) == sorted(expected)
    assert len({d.name for d in devices}) == len(devices)
    # No whole-GPU device: a GPU in MIG mode cannot give one (ADR 030).
    assert not any(d.attribute(names.TYPE) == names.TYPE_GPU for d in devices)


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.product)
def test_the_full_size_placement_excludes_every_other(model: GpuModel) -> None:
    """The GPU's largest instance, the dynamic GPU's answer to a whole-GPU request, takes
    every counter: given, nothing else on that GPU can be."""
    published = dynamic(model)
    capacity = counters_of(published)
    devices = views_of(published)
    full = [
        d
        for d in devices
        if instance_of(d).placement.size == model.memory_slices
        and model.require_profile(instance_of(d).profile).compute_slices == model.compute_slices
    ]
    assert full, f"{model.product} has no placement of the whole GPU"
    for big in full:
        assert counters_allow(capacity, [big])
        for device in devices:
            if device is not big:
                assert counters_allow(capacity, [device])
                assert not counters_allow(capacity, [big, device]), (big.name, device.name)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(MODELS), st.data())
def test_counters_allow_a_set_of_placements_exactly_when_check_layout_does(
    model: GpuModel, data: st.DataObject
) -> None:
    published = dynamic(model)
    capacity = counters_of(published)
    placements = [d for d in views_of(published) if d.attribute(names.TYPE) == names.TYPE_MIG]
    chosen = data.draw(
        st.lists(st.sampled_from(placements), max_size=8, unique_by=lambda d: d.name)
    )
    layout = [instance_of(d) for d in chosen]
    assert counters_allow(capacity, chosen) == layout_ok(model, layout), layout


def random_layout(model: GpuModel, data: st.DataObject) -> tuple[MigInstance, ...]:
    """A valid layout grown from random placements (each kept only if the layout stays valid)."""
    candidates = [
        MigInstance(Placement(s, p.memory_slices), p.name) for p in model.profiles for s in p.starts
    ]
    picks = data.draw(st.lists(st.sampled_from(candidates), max_size=10))
    layout: list[MigInstance] = []
    for pick in picks:
        if pick not in layout and layout_ok(model, [*layout, pick]):
            layout.append(pick)
    return tuple(layout)


def claims_for(
    devices: Sequence[DeviceView], layout: Sequence[MigInstance], pool: str = "node-a"
) -> list[ClaimView]:
    by_instance = {
        instance_of(d): d.name for d in devices if d.attribute(names.TYPE) == names.TYPE_MIG
    }
    return [
        ClaimView(
            "ns", f"c{k}", f"u{k}", (AllocationResult("r", names.DRIVER, pool, by_instance[i]),)
        )
        for k, i in enumerate(layout)
    ]


def slices_for(devices: GpuDevices, node: str = "node-a") -> list[SliceView]:
    found = [read_slice(d) for d in pool_slices(node, "uid", [devices])]
    return [v for v in found if v is not None]


MIXES = st.one_of(
    st.just(Mix()),
    st.dictionaries(
        st.sampled_from(
            ["1g.10gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb", "1g.5gb", "2g.10gb", "1g.24gb"]
        ),
        st.integers(1, 10),
        max_size=4,
    ).map(Mix.of),
)


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(MODELS), st.data(), MIXES)
def test_first_fit_over_our_order_picks_the_cores_choice(
    model: GpuModel, data: st.DataObject, mix: Mix
) -> None:
    in_use = random_layout(model, data)
    profile = data.draw(st.sampled_from(model.profiles)).name
    published = gpu_devices(DraGpu(offered(model), model, dynamic=True, in_use=in_use), mix=mix)
    slices = slices_for(published)
    devices = [d for s in slices for d in s.devices]
    got = first_fit(
        slices,
        claims_for(devices, in_use),
        [DeviceRequest("r", ((names.TYPE, names.TYPE_MIG), (names.PROFILE, profile)))],
    )
    expected = core_choice(model, in_use, profile, mix)
    if expected is None:
        assert got is None
    else:
        assert got is not None
        chosen = next(d for d in devices if d.name == got[0].device)
        assert instance_of(chosen) == expected


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(MODELS), st.data())
def test_with_no_mix_the_first_fit_is_the_dynamic_planners_placement(
    model: GpuModel, data: st.DataObject
) -> None:
    in_use = random_layout(model, data)
    profile = data.draw(st.sampled_from(model.profiles)).name
    slices = slices_for(gpu_devices(DraGpu(offered(model), model, dynamic=True, in_use=in_use)))
    devices = [d for s in slices for d in s.devices]
    got = first_fit(
        slices,
        claims_for(devices, in_use),
        [DeviceRequest("r", ((names.TYPE, names.TYPE_MIG), (names.PROFILE, profile)))],
    )
    gpu = Gpu(
        "node-a", 0, model, tuple(Instance(i, Use.IN_USE, f"ns/p{k}") for k, i in enumerate(in_use))
    )
    planned = plan([gpu], [MigDemand("ns/new", (profile,))], now=0.0, mix=Mix())
    if not planned.reservations:
        assert got is None
    else:
        assert got is not None
        chosen = next(d for d in devices if d.name == got[0].device)
        assert instance_of(chosen) == planned.reservations[0].instance


def test_the_nvidia_order_is_lexicographic_and_takes_the_lowest_start() -> None:
    model = next(m for m in MODELS if m.product == "H100-SXM5-80GB")
    published = gpu_devices(DraGpu(offered(model), model, dynamic=True), order=Order.NVIDIA)
    assert [d["name"] for d in published.devices] == sorted(d["name"] for d in published.devices)
    slices = slices_for(published)
    got = first_fit(
        slices, [], [DeviceRequest("r", ((names.TYPE, names.TYPE_MIG), (names.PROFILE, "1g.10gb")))]
    )
    assert got is not None and got[0].device == "gpu-0-mig-1g10gb-0"
    ours = first_fit(
        slices_for(gpu_devices(DraGpu(offered(model), model, dynamic=True))),
        [],
        [DeviceRequest("r", ((names.TYPE, names.TYPE_MIG), (names.PROFILE, "1g.10gb")))],
    )
    assert (
        ours is not None and ours[0].device != "gpu-0-mig-1g10gb-0"
    )  # keeps 4g.40gb and 3g.40gb at 0


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.product)
def test_placements_are_exhausted_by_counters(model: GpuModel) -> None:
    smallest = min(model.profiles, key=lambda p: (p.memory_slices, p.compute_slices, p.name))
    slices = slices_for(dynamic(model))
    request = DeviceRequest(
        "r", ((names.TYPE, names.TYPE_MIG), (names.PROFILE, smallest.name)), count=1
    )
    claims: list[ClaimView] = []
    for k in range(smallest.max_count):
        got = first_fit(slices, claims, [request])
        assert got is not None, k
        claims.append(ClaimView("ns", f"c{k}", f"u{k}", got))
    assert first_fit(slices, claims, [request]) is None


def test_a_foreign_instance_hides_the_placements_it_overlaps_and_takes_its_counters() -> None:
    model = next(m for m in MODELS if m.product == "H100-SXM5-80GB")
    foreign = (MigInstance(Placement(0, 4), "3g.40gb"),)
    published = dynamic(model, foreign=foreign)
    devices = views_of(published)
    assert all(
        not instance_of(d).placement.overlaps(foreign[0].placement)
        for d in devices
        if d.attribute(names.TYPE) == names.TYPE_MIG
    )
    assert not any(d.attribute(names.TYPE) == names.TYPE_GPU for d in devices)
    capacity = counters_of(published)
    assert capacity[names.COUNTER_COMPUTE_SLICES] == 4
    placements = [d for d in devices if d.attribute(names.TYPE) == names.TYPE_MIG]
    for device in placements:
        layout = [*foreign, instance_of(device)]
        assert counters_allow(capacity, [device]) == layout_ok(model, layout)


# --- pool invariants -------------------------------------------------------------------------

H100 = next(m for m in MODELS if m.product == "H100-SXM5-80GB")


def node_gpus(kinds: Sequence[str]) -> list[GpuDevices]:
    found = []
    for index, kind in enumerate(kinds):
        if kind == "dynamic":
            found.append(dynamic(H100, index))
        elif kind == "shared":
            found.append(gpu_devices(DraGpu(offered(H100, index, Mode.MPS, replicas=4), H100)))
        else:
            found.append(gpu_devices(DraGpu(offered(H100, index, Mode.NONE), H100)))
    return found


KINDS = st.lists(st.sampled_from(["dynamic", "shared", "whole"]), min_size=1, max_size=20)


@settings(max_examples=60, deadline=None)
@given(KINDS, st.integers(0, 5))
def test_pool_invariants(kinds: list[str], generation: int) -> None:
    docs = pool_slices("node-a", "uid-a", node_gpus(kinds), generation=generation)
    assert len({d["metadata"]["name"] for d in docs}) == len(docs)
    for doc in docs:
        spec = doc["spec"]
        assert spec["pool"] == {
            "name": "node-a",
            "generation": generation,
            "resourceSliceCount": len(docs),
        }
        assert spec["nodeName"] == "node-a" and spec["driver"] == names.DRIVER
        assert doc["metadata"]["ownerReferences"][0]["uid"] == "uid-a"
        assert ("devices" in spec) != ("sharedCounters" in spec)
        assert len(spec.get("sharedCounters", [])) <= names.MAX_COUNTER_SETS
        limit = (
            names.MAX_DEVICES_WITH_COUNTERS
            if any("consumesCounters" in d for d in spec.get("devices", []))
            else names.MAX_DEVICES
        )
        assert len(spec.get("devices", [])) <= limit
    counter_slices = [d for d in docs if "sharedCounters" in d["spec"]]
    assert len(counter_slices) == -(-kinds.count("dynamic") // names.MAX_COUNTER_SETS)
    gpu_names = [d["metadata"]["name"] for d in docs if "devices" in d["spec"]]
    assert gpu_names == sorted(
        gpu_names
    )  # name order is GPU index order: the scheduler's search order
    order = [
        d["spec"]["devices"][0]["attributes"].get(
            "index", d["spec"]["devices"][0]["attributes"].get("parentIndex")
        )["int"]
        for d in docs
        if "devices" in d["spec"]
    ]
    assert order == list(range(len(kinds)))
    views = [read_slice(d) for d in docs]
    assert all(v is not None for v in views)
    assert len(usable_pools(v for v in views if v is not None)) == 1


# --- the publish plan ------------------------------------------------------------------------


def scheduler_view(slices: dict[str, Slice]) -> tuple[object, ...] | None:
    """The pool as the scheduler sees it: its slices' contents if complete, else None."""
    views = [read_slice(s) for s in slices.values()]
    pools = usable_pools(v for v in views if v is not None)
    if not pools:
        return None
    (found,) = pools.values()
    return tuple(sorted((v.name, v.content) for v in found))


def apply(state: dict[str, Slice], planned: PublishPlan) -> list[tuple[object, ...] | None]:
    seen = []
    for doc in (*planned.creates, *planned.updates):
        state[doc["metadata"]["name"]] = doc
        seen.append(scheduler_view(state))
    for name in planned.deletes:
        del state[name]
        seen.append(scheduler_view(state))
    return seen


def current(state: dict[str, Slice]) -> list[SliceView]:
    views = [read_slice(s) for s in state.values()]
    return [v for v in views if v is not None]


@settings(max_examples=80, deadline=None)
@given(KINDS, KINDS, st.data())
def test_the_publish_plan_never_leaves_the_pool_complete_but_wrong(
    before: list[str], after: list[str], data: st.DataObject
) -> None:
    state: dict[str, Slice] = {}
    apply(state, publish_plan([], pool_slices("node-a", "uid", node_gpus(before))))
    old = scheduler_view(state)
    assert old is not None
    wanted = pool_slices("node-a", "uid", node_gpus(after), generation=data.draw(st.integers(0, 9)))
    new_state = {d["metadata"]["name"]: d for d in wanted}
    target = tuple(sorted((v.name, v.content) for v in current(new_state)))
    planned = publish_plan(current(state), wanted)
    for seen in apply(state, planned):
        assert seen in (None, old, target)
    assert scheduler_view(state) == target
    assert publish_plan(current(state), wanted).empty  # a fixed point


def test_a_reorder_inside_one_slice_is_one_update_without_a_generation_bump() -> None:
    model = H100
    state: dict[str, Slice] = {}
    gpus = [dynamic(model, 0), dynamic(model, 1)]
    first = publish_plan([], pool_slices("node-a", "uid", gpus))
    apply(state, first)
    in_use = (MigInstance(Placement(4, 1), "1g.10gb"),)
    reordered = [
        gpu_devices(DraGpu(offered(model, 0), model, dynamic=True, in_use=in_use)),
        gpus[1],
    ]
    planned = publish_plan(current(state), pool_slices("node-a", "uid", reordered))
    assert len(planned.updates) == 1 and not planned.creates and not planned.deletes
    assert planned.generation == first.generation and not planned.bumps


def test_a_new_gpu_bumps_the_generation_on_every_slice() -> None:
    state: dict[str, Slice] = {}
    apply(state, publish_plan([], pool_slices("node-a", "uid", node_gpus(["whole"]))))
    planned = publish_plan(
        current(state), pool_slices("node-a", "uid", node_gpus(["whole", "dynamic"]))
    )
    assert planned.bumps and planned.generation == 1
    assert {d["spec"]["pool"]["generation"] for d in (*planned.creates, *planned.updates)} == {1}


def test_a_requoted_quantity_is_no_change() -> None:
    """The API server writes 81559Mi back as it likes (here in bytes): the same content."""
    docs = pool_slices("node-a", "uid", node_gpus(["whole"]))
    device = docs[0]["spec"]["devices"][0]
    mib = int(device["capacity"]["memory"]["value"].removesuffix("Mi"))
    respelled = {**device, "capacity": {"memory": {"value": str(mib * 2**20)}}}
    back = {**docs[0], "spec": {**docs[0]["spec"], "devices": [respelled]}}
    view = read_slice(back)
    assert view is not None
    assert publish_plan([view], docs).empty
    changed = {**device, "capacity": {"memory": {"value": str(mib * 2**20 - 1)}}}
    other = read_slice({**docs[0], "spec": {**docs[0]["spec"], "devices": [changed]}})
    assert other is not None and not publish_plan([other], docs).empty
