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
from gpupart.core.dra.order import core_choice, node_choice
from gpupart.core.dra.pool import (
    PublishPlan,
    Slice,
    keep_choices,
    pool_slices,
    publish_plan,
    slice_part,
)
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


def dynamic(model: GpuModel, index: int = 0, mix: Mix | None = None, **kw: object) -> GpuDevices:
    return gpu_devices(DraGpu(offered(model, index), model, dynamic=True, **kw), mix=mix)  # type: ignore[arg-type]


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
    devices: Sequence[DeviceView],
    layout: Sequence[MigInstance],
    pool: str = "node-a",
    index: int = 0,
) -> list[ClaimView]:
    by_instance = {
        instance_of(d): d.name
        for d in devices
        if d.attribute(names.TYPE) == names.TYPE_MIG and d.attribute(names.PARENT_INDEX) == index
    }
    return [
        ClaimView(
            "ns",
            f"c{index}-{k}",
            f"u{index}-{k}",
            (AllocationResult("r", names.DRIVER, pool, by_instance[i]),),
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


def slices_of(gpus: Sequence[GpuDevices], node: str = "node-a") -> list[SliceView]:
    found = [read_slice(d) for d in pool_slices(node, "uid", gpus)]
    return [v for v in found if v is not None]


SAME_MODEL_NODES = st.sampled_from([m for m in MODELS if m.memory_slices <= 8])


@settings(max_examples=150, deadline=None)
@given(SAME_MODEL_NODES, st.integers(1, 4), st.data(), MIXES)
def test_first_fit_over_our_order_picks_the_cores_choice_across_the_nodes_gpus(
    model: GpuModel, count: int, data: st.DataObject, mix: Mix
) -> None:
    """One slice per profile across the GPUs: the scheduler's first fit picks the GPU and the
    placement that `node_choice` picks for the node (ADR 032)."""
    layouts = [random_layout(model, data) for _ in range(count)]
    profile = data.draw(st.sampled_from(model.profiles)).name
    gpus = [
        gpu_devices(DraGpu(offered(model, i), model, dynamic=True, in_use=layouts[i]), mix=mix)
        for i in range(count)
    ]
    slices = slices_of(gpus)
    devices = [d for s in slices for d in s.devices]
    claims = [c for i in range(count) for c in claims_for(devices, layouts[i], index=i)]
    got = first_fit(
        slices,
        claims,
        [DeviceRequest("r", ((names.TYPE, names.TYPE_MIG), (names.PROFILE, profile)))],
    )
    expected = node_choice(((i, model, layouts[i]) for i in range(count)), profile, mix)
    if expected is None:
        assert got is None
    else:
        assert got is not None
        chosen = next(d for d in devices if d.name == got[0].device)
        assert (chosen.attribute(names.PARENT_INDEX), instance_of(chosen)) == expected


def test_our_order_fills_the_busier_gpu_and_keeps_an_empty_one_whole() -> None:
    """A 1g beside a GPU that holds one already goes there, not to the empty GPU 0."""
    held = (MigInstance(Placement(6, 1), "1g.10gb"),)
    gpus = [dynamic(H100, 0), dynamic(H100, 1, in_use=held)]
    slices = slices_of(gpus)
    devices = [d for s in slices for d in s.devices]
    got = first_fit(
        slices,
        claims_for(devices, held, index=1),
        [DeviceRequest("r", ((names.TYPE, names.TYPE_MIG), (names.PROFILE, "1g.10gb")))],
    )
    assert got is not None and got[0].device.startswith("gpu-1-")


def test_the_nvidia_order_is_lexicographic_and_takes_the_lowest_start() -> None:
    model = next(m for m in MODELS if m.product == "H100-SXM5-80GB")
    nvidia = [
        gpu_devices(DraGpu(offered(model, i), model, dynamic=True), order=Order.NVIDIA)
        for i in range(2)
    ]
    slices = slices_of(nvidia)
    for view in slices:
        assert [d.name for d in view.devices] == sorted(d.name for d in view.devices)
    request = DeviceRequest("r", ((names.TYPE, names.TYPE_MIG), (names.PROFILE, "1g.10gb")))
    got = first_fit(slices, [], [request])
    assert got is not None and got[0].device == "gpu-0-mig-1g10gb-0"
    ours = first_fit(slices_of([dynamic(model, i) for i in range(2)]), [], [request])
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
    device_slices = [d for d in docs if "devices" in d["spec"]]
    assert [d["metadata"]["name"] for d in device_slices] == sorted(
        d["metadata"]["name"] for d in device_slices
    )  # the builder's order is the scheduler's search order
    published = [dev["name"] for d in device_slices for dev in d["spec"]["devices"]]
    expected = [dev["name"] for g in node_gpus(kinds) for dev in g.devices]
    assert sorted(published) == sorted(expected)  # every device once
    for doc in device_slices:
        # one kind a slice, and one MIG profile a slice
        assert len({slice_part(dev) for dev in doc["spec"]["devices"]}) == 1
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


def test_a_reorder_updates_slices_in_place_without_a_generation_bump() -> None:
    model = H100
    state: dict[str, Slice] = {}
    gpus = [dynamic(model, 0), dynamic(model, 1)]
    first = publish_plan([], pool_slices("node-a", "uid", gpus))
    apply(state, first)
    before = current(state)
    in_use = (MigInstance(Placement(4, 1), "1g.10gb"),)
    reordered = [dynamic(model, 0, in_use=in_use), gpus[1]]
    planned = publish_plan(before, pool_slices("node-a", "uid", reordered))
    assert planned.updates and not planned.creates and not planned.deletes
    assert planned.generation == first.generation and not planned.bumps
    held = {v.name: v.holds for v in before}
    for seen in apply(state, planned):
        assert seen is not None  # complete at every step
    assert {v.name: v.holds for v in current(state)} == held  # no device moved


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.data())
def test_every_step_of_a_reorder_is_a_complete_pool_of_the_same_devices(
    count: int, data: st.DataObject
) -> None:
    """Updates in place at one generation: whichever slices the scheduler reads old or new,
    it sees each device once, with its counters, never a pool missing one."""
    state: dict[str, Slice] = {}
    before = [dynamic(H100, i, in_use=random_layout(H100, data)) for i in range(count)]
    apply(state, publish_plan([], pool_slices("node-a", "uid", before)))
    old = {d.name: d for v in current(state) for d in v.devices}
    after = [dynamic(H100, i, in_use=random_layout(H100, data)) for i in range(count)]
    planned = publish_plan(current(state), pool_slices("node-a", "uid", after))
    assert not planned.bumps
    for doc in planned.updates:
        state[doc["metadata"]["name"]] = doc
        views = current(state)
        assert scheduler_view(state) is not None
        seen = [d for v in views for d in v.devices]
        assert sorted(d.name for d in seen) == sorted(old)
        assert all(d.consumes == old[d.name].consumes for d in seen)


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


# --- re-orders that change a pick (keep_choices, ADR 032) ------------------------------------


def held_claims(
    slices: Sequence[SliceView], layouts: Sequence[Sequence[MigInstance]]
) -> list[ClaimView]:
    devices = [d for s in slices for d in s.devices]
    return [c for i, layout in enumerate(layouts) for c in claims_for(devices, layout, index=i)]


def next_pick(slices: Sequence[SliceView], claims: Sequence[ClaimView], profile: str) -> object:
    request = DeviceRequest("r", ((names.TYPE, names.TYPE_MIG), (names.PROFILE, profile)))
    return first_fit(slices, claims, [request])


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3), st.data(), MIXES, st.sampled_from([None, 1, 2]))
def test_kept_orders_change_no_next_pick_and_re_order_at_most_the_budget(
    count: int, data: st.DataObject, mix: Mix, budget: int | None
) -> None:
    """Whatever was published before, the slices `keep_choices` leaves give every profile the
    next pick of the wanted order, except where the re-order budget ran out; at most `budget`
    slices change only their order."""
    before = [random_layout(H100, data) for _ in range(count)]
    after = [random_layout(H100, data) for _ in range(count)]
    old = slices_of([dynamic(H100, i, in_use=before[i], mix=mix) for i in range(count)])
    wanted = pool_slices(
        "node-a", "uid", [dynamic(H100, i, in_use=after[i], mix=mix) for i in range(count)]
    )
    new = slices_of([dynamic(H100, i, in_use=after[i], mix=mix) for i in range(count)])
    claims = held_claims(new, after)
    kept = keep_choices(old, wanted, claims, mix=mix, reorders=budget)
    views = [v for v in (read_slice(d) for d in kept) if v is not None]
    was = {v.name: v for v in old}
    reordered = [v for v in views if v.content != was[v.name].content]
    assert all(v.holds == was[v.name].holds for v in views)  # only orders differ here
    assert budget is None or len(reordered) <= budget
    missed = 0
    for profile in {p.name for p in H100.profiles}:
        if next_pick(views, claims, profile) != next_pick(new, claims, profile):
            missed += 1
    if budget is None:
        assert missed == 0
    assert publish_plan(views, kept).empty  # a fixed point once written
    assert not publish_plan(old, kept).bumps
