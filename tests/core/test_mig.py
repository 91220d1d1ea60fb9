"""MIG layout solver: exact against exhaustive search on every profile multiset of every product.

Aspects: exactness (solver finds a layout iff a brute-force search does), validity of every
layout returned, in-use instances kept in place, reasons a person can act on, and laws over
random occupied GPUs.
"""

import itertools
from functools import cache

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpupart.core.errors import InfeasibleLayout, InvalidInput, UnknownProfile
from gpupart.core.mig.catalogue import GpuModel, MediaEngines, catalogue, require_gpu_model
from gpupart.core.mig.layout import (
    MigInstance,
    Placement,
    check_layout,
    fit_layout,
    layout_counts,
    solve_layout,
)


def brute_force_fits(model: GpuModel, counts: dict[str, int], fixed=()) -> bool:
    """Independent oracle: try every start for every instance, backtracking on overlaps.

    `fixed` instances (part of `counts`) stay where they are; the others are placed around them.
    """
    instances = [model.require_profile(n) for n, c in counts.items() for _ in range(c)]
    if len(instances) > model.max_instances:
        return False
    if sum(p.compute_slices for p in instances) > model.compute_slices:
        return False
    if any(c > model.require_profile(n).max_count for n, c in counts.items()):
        return False
    for unit in ("decoders", "encoders", "jpeg", "ofa"):
        if sum(getattr(p.engines, unit) for p in instances) > getattr(model.engines, unit):
            return False

    free = list(instances)
    taken: set[int] = set()
    for instance in fixed:
        profile = model.require_profile(instance.profile)
        if profile not in free:
            return False  # counts do not include the fixed instance
        free.remove(profile)
        taken |= set(
            range(instance.placement.start, instance.placement.start + instance.placement.size)
        )

    def place(i: int, used: set[int]) -> bool:
        if i == len(free):
            return True
        profile = free[i]
        for start in profile.starts:
            slots = set(range(start, start + profile.memory_slices))
            if not slots & used and place(i + 1, used | slots):
                return True
        return False

    return place(0, taken)


def all_multisets(model: GpuModel):
    ranges = [range(p.max_count + 1) for p in model.profiles]
    for vector in itertools.product(*ranges):
        yield {p.name: n for p, n in zip(model.profiles, vector, strict=True) if n}


@cache
def oracle_answers(geometry: tuple) -> dict[tuple, bool]:
    """Brute force once per distinct geometry (products that differ only in names share it)."""
    model = geometry_model[geometry]
    return {tuple(sorted(c.items())): brute_force_fits(model, c) for c in all_multisets(model)}


def geometry_of(model: GpuModel) -> tuple:
    return (
        model.memory_slices,
        model.compute_slices,
        model.max_instances,
        model.engines,
        tuple(
            (p.compute_slices, p.memory_slices, p.max_count, p.starts, p.engines)
            for p in model.profiles
        ),
    )


geometry_model = {geometry_of(m): m for m in catalogue()}


@pytest.mark.parametrize("product", [m.product for m in catalogue()])
def test_solver_agrees_with_exhaustive_search_on_every_multiset(product):
    model = require_gpu_model(product)
    reference = geometry_model[geometry_of(model)]
    answers = oracle_answers(geometry_of(model))
    rename = {a.name: b.name for a, b in zip(reference.profiles, model.profiles, strict=True)}
    checked = feasible = 0
    for key, fits in answers.items():
        counts = {rename[name]: n for name, n in key}
        layout = fit_layout(model, counts)
        assert (layout is not None) == fits, counts
        checked += 1
        if layout is not None:
            feasible += 1
            check_layout(model, layout)
            assert layout_counts(layout) == {k: v for k, v in counts.items() if v}
            # law: no accepted layout takes more media engines than the GPU has
            taken = sum((model.require_profile(i.profile).engines for i in layout), MediaEngines())
            assert taken.within(model.engines), layout
        else:
            with pytest.raises(InfeasibleLayout) as error:
                solve_layout(model, counts)
            assert model.product in str(error.value)
    assert checked == len(list(all_multisets(model)))
    assert 0 < feasible < checked


@pytest.mark.parametrize("product", [m.product for m in catalogue()])
def test_law_every_product_offers_its_whole_gpu_profile_alone(product):
    model = require_gpu_model(product)
    whole = [
        p
        for p in model.profiles
        if p.memory_slices == model.memory_slices and p.compute_slices == model.compute_slices
    ]
    assert whole, model.profile_names
    for profile in whole:
        (instance,) = solve_layout(model, {profile.name: 1})
        assert instance.placement == Placement(0, model.memory_slices)
        assert profile.engines == model.engines  # the whole GPU has every media engine


@pytest.mark.parametrize(
    ("product", "counts", "short"),
    [
        ("A30-24GB", {"1g.6gb+me": 1, "2g.12gb+me": 1}, "JPEG and OFA"),
        ("RTX-PRO-6000-96GB", {"1g.24gb+me": 1, "2g.48gb+me.all": 1}, "NVDEC and NVENC"),
        ("RTX-PRO-6000-96GB", {"1g.24gb+me.all": 1, "1g.24gb": 1}, "NVDEC and NVENC and JPEG"),
        ("A100-SXM4-40GB", {"1g.5gb+me": 1, "7g.40gb": 1}, "memory slices"),
    ],
)
def test_two_media_extension_instances_are_refused_naming_the_engines(product, counts, short):
    model = require_gpu_model(product)
    assert all(n <= model.require_profile(p).max_count for p, n in counts.items())
    with pytest.raises(InfeasibleLayout, match=short) as error:
        solve_layout(model, counts)
    if "slices" not in short:
        assert "media engines" in str(error.value) and model.product in str(error.value)


def test_me_all_leaves_only_media_free_instances():
    model = require_gpu_model("RTX-PRO-6000-96GB")
    layout = solve_layout(model, {"1g.24gb+me.all": 1, "1g.24gb-me": 3})
    assert len(layout) == 4
    assert fit_layout(model, {"2g.48gb+me.all": 1, "2g.48gb-me": 1}) is not None
    assert fit_layout(model, {"2g.48gb+me.all": 1, "2g.48gb+gfx": 1}) is None


def test_empty_counts_give_an_empty_layout():
    assert solve_layout(require_gpu_model("H100-SXM5-80GB"), {}) == ()


def test_layout_for_the_classic_a100_mix():
    model = require_gpu_model("A100-SXM4-80GB")
    layout = solve_layout(model, {"3g.40gb": 1, "2g.20gb": 1, "1g.10gb": 2})
    assert MigInstance(Placement(4, 4), "3g.40gb") in layout
    assert layout_counts(layout) == {"3g.40gb": 1, "2g.20gb": 1, "1g.10gb": 2}


def test_single_small_instance_leaves_room_for_the_big_profiles():
    model = require_gpu_model("A100-SXM4-80GB")
    (instance,) = solve_layout(model, {"1g.10gb": 1})
    # Anywhere but 0..3 keeps 4g.40gb possible; the solver must not pick slot 0.
    rest = fit_layout(model, {"1g.10gb": 1, "4g.40gb": 1}, keep=[instance])
    assert rest is not None


@pytest.mark.parametrize(
    ("counts", "words"),
    [
        ({"1g.10gb": 8}, "8 × 1g.10gb requested, at most 7"),
        ({"1g.10gb+me": 2}, "at most 1"),
        ({"3g.40gb": 2, "1g.10gb": 1}, "need 9 memory slices, the GPU has 8"),
        ({"4g.40gb": 1, "2g.20gb": 2}, "need 8 compute slices, the GPU has 7"),
        ({"7g.80gb": 1, "1g.10gb": 1}, "memory slices"),
    ],
)
def test_infeasible_counts_say_which_limit_breaks(counts, words):
    with pytest.raises(InfeasibleLayout, match=words):
        solve_layout(require_gpu_model("A100-SXM4-80GB"), counts)


def test_placement_conflict_names_the_start_slots_and_what_blocks_them():
    model = require_gpu_model("A100-SXM4-80GB")
    busy = MigInstance(Placement(3, 1), "1g.10gb")
    with pytest.raises(InfeasibleLayout) as error:
        solve_layout(model, {"1g.10gb": 1, "4g.40gb": 1}, keep=[busy])
    message = str(error.value)
    assert "4g.40gb needs start slot 0" in message
    assert "1g.10gb at slot 3 (in use)" in message


def test_three_2g_around_a_busy_1g_explains_every_start():
    model = require_gpu_model("A100-SXM4-80GB")
    busy = MigInstance(Placement(3, 1), "1g.10gb")
    with pytest.raises(InfeasibleLayout, match=r"2g\.20gb needs start slot 0, 2 or 4") as error:
        solve_layout(model, {"1g.10gb": 1, "2g.20gb": 3}, keep=[busy])
    assert str(error.value).count("start ") >= 3


def test_dropping_an_in_use_instance_is_named():
    model = require_gpu_model("A100-SXM4-80GB")
    busy = MigInstance(Placement(0, 1), "1g.10gb")
    with pytest.raises(InfeasibleLayout, match="1g.10gb at slot 0 is in use"):
        solve_layout(model, {"3g.40gb": 1}, keep=[busy])


def test_bad_counts_and_unknown_profiles_are_rejected():
    model = require_gpu_model("H100-SXM5-80GB")
    with pytest.raises(InvalidInput, match="whole number"):
        fit_layout(model, {"1g.10gb": -1})
    with pytest.raises(InvalidInput, match="whole number"):
        fit_layout(model, {"1g.10gb": 1.5})  # type: ignore[dict-item]
    with pytest.raises(UnknownProfile, match="1g.5gb"):
        fit_layout(model, {"1g.5gb": 1})


def test_check_layout_rejects_overlaps_and_wrong_starts():
    model = require_gpu_model("A100-SXM4-40GB")
    with pytest.raises(InfeasibleLayout, match="overlaps"):
        check_layout(
            model,
            [MigInstance(Placement(0, 4), "3g.20gb"), MigInstance(Placement(2, 2), "2g.10gb")],
        )
    with pytest.raises(InfeasibleLayout, match="start slot 0 or 4"):
        check_layout(model, [MigInstance(Placement(2, 4), "3g.20gb")])
    with pytest.raises(InfeasibleLayout, match="start slot 0, 1, 2, 3, 4, 5 or 6"):
        check_layout(model, [MigInstance(Placement(7, 1), "1g.5gb")])


# ---- laws over random occupied GPUs -------------------------------------------------

MODELS = [
    require_gpu_model("A100-SXM4-80GB"),
    require_gpu_model("A30-24GB"),
    require_gpu_model("H200-141GB"),
]


@cache
def feasible_layouts(model: GpuModel) -> tuple:
    return tuple(filter(None, (fit_layout(model, c) for c in all_multisets(model))))


@cache
def multisets(model: GpuModel) -> tuple:
    return tuple(all_multisets(model))


@st.composite
def occupied_gpu(draw):
    """A model, a valid current layout, a subset of it marked in use, and target counts."""
    model = draw(st.sampled_from(MODELS))
    current = draw(st.sampled_from(feasible_layouts(model)))
    busy = draw(st.lists(st.sampled_from(current), unique=True)) if current else []
    counts = draw(st.sampled_from(multisets(model)))
    return model, current, busy, counts


@given(occupied_gpu())
def test_law_solver_keeps_in_use_instances_and_meets_counts(case):
    model, current, busy, counts = case
    wanted = counts | {}
    for instance in busy:  # ask for at least what is in use, so keeping it is possible
        wanted[instance.profile] = max(
            wanted.get(instance.profile, 0), layout_counts(busy)[instance.profile]
        )
    layout = fit_layout(model, wanted, keep=busy, prefer=current)
    # The oracle: a layout with these counts that leaves every in-use instance where it is.
    # The solver must find one whenever one exists, and may answer None only when none does.
    assert (layout is not None) == brute_force_fits(model, wanted, fixed=busy)
    if layout is None:
        return
    check_layout(model, layout)
    assert set(busy) <= set(layout)
    assert layout_counts(layout) == {k: v for k, v in wanted.items() if v}


def test_in_use_instances_are_kept_whenever_a_layout_keeps_them():
    """Examples the law's oracle decides: keeping is possible, so None is wrong."""
    model = require_gpu_model("A100-SXM4-80GB")
    busy = MigInstance(Placement(4, 1), "1g.10gb")
    layout = fit_layout(model, {"1g.10gb": 2, "3g.40gb": 1}, keep=[busy])
    assert layout is not None and busy in layout
    assert brute_force_fits(model, {"1g.10gb": 2, "3g.40gb": 1}, fixed=[busy])
    # A 1g in use at slot 0 leaves no start for 4g.40gb (slot 0 only): None, though a fresh
    # layout with the same counts exists.
    blocker = MigInstance(Placement(0, 1), "1g.10gb")
    counts = {"1g.10gb": 1, "4g.40gb": 1}
    assert fit_layout(model, counts, keep=[blocker]) is None
    assert not brute_force_fits(model, counts, fixed=[blocker])
    assert fit_layout(model, counts) is not None


@given(occupied_gpu())
def test_law_prefer_never_loses_to_a_fresh_solution(case):
    model, current, _, counts = case
    fresh = fit_layout(model, counts)
    preferred = fit_layout(model, counts, prefer=current)
    assert (fresh is None) == (preferred is None)
    if preferred is not None:
        assert len(set(preferred) & set(current)) >= len(set(fresh) & set(current))
