"""DRA reasons: classes, claims and pods read bounded; per-node words; the law that they agree with the allocator."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from gpupart.core.api.spec import Mode
from gpupart.core.dra import names
from gpupart.core.dra.allocator import DeviceRequest, first_fit
from gpupart.core.dra.devices import DraGpu, Order, gpu_devices
from gpupart.core.dra.pool import pool_slices
from gpupart.core.dra.read import ClaimView, Consumer, SliceView, read_slices
from gpupart.core.dra.reasons import (
    INCOMPLETE,
    NO_DEVICES,
    DraAsk,
    Wanted,
    ask_of,
    dra_message,
    free_devices,
    node_reason,
)
from gpupart.core.dra.requests import (
    ClassView,
    Selector,
    pod_claims,
    read_claim_spec,
    read_classes,
    read_selector,
)
from gpupart.core.dra.taints import taint_devices
from gpupart.core.errors import InvalidInput
from gpupart.core.mig.catalogue import require_gpu_model
from gpupart.core.node.devices import OfferedGpu
from gpupart.core.node.faults import GpuFault

H100 = require_gpu_model("H100-SXM5-80GB")
A30 = require_gpu_model("A30-24GB")
CHART = Path(__file__).resolve().parents[2] / "charts" / "gpupart"
DOMAIN = f'device.attributes["{names.DRIVER}"]'


def offered(index: int, mode: Mode = Mode.MIG, model: Any = H100, replicas: int = 0) -> OfferedGpu:
    return OfferedGpu(
        index, f"GPU-{index}", model.product, model.memory_mib, index, 0, mode, replicas=replicas
    )


def node_slices(node: str, gpus: Sequence[DraGpu], order: Order = Order.GPUPART) -> list[SliceView]:
    docs = pool_slices(node, f"uid-{node}", [gpu_devices(g, order=order) for g in gpus])
    reading = read_slices(docs)
    assert not reading.skipped
    return list(reading.items)


def mig(profile: str, count: int = 1, **extra: str | int) -> DeviceRequest:
    match = {names.TYPE: names.TYPE_MIG, names.PROFILE: profile, **extra}
    return DeviceRequest("dev", tuple(sorted(match.items())), count)


WHOLE = DeviceRequest("dev", ((names.TYPE, names.TYPE_GPU),))


def shared(memory_mib: int, compute: int) -> DeviceRequest:
    return DeviceRequest(
        "dev",
        ((names.TYPE, names.TYPE_SHARED),),
        capacity=((names.COMPUTE, Fraction(compute)), (names.MEMORY, Fraction(memory_mib * 2**20))),
    )


def one(request: DeviceRequest, words: str = "it") -> DraAsk:
    return DraAsk("team-b/p", (Wanted("dev/dev", (request,), (words,)),))


def take(
    slices: Sequence[SliceView], claims: list[ClaimView], request: DeviceRequest, pod: str
) -> None:
    found = first_fit(slices, claims, [request])
    assert found is not None, pod
    claims.append(
        ClaimView("team-a", f"{pod}-dev", f"uid-{pod}", found, (Consumer("pods", pod, "u"),))
    )


# -- reading --


def test_the_charts_class_selectors_read_as_equalities() -> None:
    rendered = (CHART / "templates" / "dra-deviceclasses.yaml").read_text()
    driver = f'"{names.DRIVER}"'
    # The template's expressions with the chart's values filled in (the chart test renders
    # them through helm; here the one shape they have).
    mig_expr = (
        f'device.driver == {driver} && {DOMAIN}.type == "mig" && {DOMAIN}.profile == "3g.40gb"'
    )
    assert "device.driver ==" in rendered and ".profile ==" in rendered
    assert read_selector(mig_expr) == Selector(
        names.DRIVER, ((names.PROFILE, "3g.40gb"), (names.TYPE, "mig"))
    )
    assert read_selector(f"{DOMAIN}.placementStart == 4 && {DOMAIN}['x'] == 1").problem
    assert read_selector(f'{DOMAIN}["placementStart"] == 4').match == (("placementStart", 4),)
    assert read_selector(
        'device.attributes["resource.kubernetes.io"].pciBusID == "0000:18:00.0"'
    ).match == (("resource.kubernetes.io/pciBusID", "0000:18:00.0"),)


@pytest.mark.parametrize(
    "expression",
    [
        f"{DOMAIN}.profile.startsWith('1g')",
        f'{DOMAIN}.profile == "1g.10gb" || {DOMAIN}.profile == "2g.20gb"',
        f"{DOMAIN}.placementStart >= 2",
        f'device.capacity["{names.DRIVER}"].memory.compareTo(quantity("10Gi")) >= 0',
        f'{DOMAIN}.profile == "1g.10gb" && {DOMAIN}.profile == "2g.20gb"',
        "x" * 5000,
    ],
)
def test_a_selector_gpupart_cannot_read_is_said_so_never_guessed(expression: str) -> None:
    found = read_selector(expression)
    assert found.problem and not found.match


def test_a_class_we_cannot_read_is_named_in_the_reason() -> None:
    classes = read_classes(
        [
            {
                "metadata": {"name": "odd.example.com"},
                "spec": {"selectors": [{"cel": {"expression": "device.attributes.size() > 2"}}]},
            },
            {"metadata": {"name": 7}},
        ]
    )
    assert [c.name for c in classes.items] == ["odd.example.com"]
    (skipped,) = classes.skipped
    assert "DeviceClass.metadata.name" in skipped.reason
    pod = _pod(claims=[{"name": "dev", "resourceClaimName": "c"}])
    spec = read_claim_spec(
        _claim("c", [{"name": "r", "exactly": {"deviceClassName": "odd.example.com"}}])
    )
    ask = ask_of(
        "ns/p",
        pod_claims(pod),
        {"ns/c": spec},
        {},
        {c.name: c for c in classes.items},
        namespace="ns",
    )
    assert "class odd.example.com's selector is not one gpupart reads" in ask.problem
    assert dra_message(ask, [], others={}).startswith("gpupart cannot explain this pod")


def _pod(
    claims: Sequence[dict[str, Any]] = (),
    statuses: Sequence[dict[str, Any]] = (),
    limits: dict[str, str] | None = None,
) -> dict[str, Any]:
    container: dict[str, Any] = {"name": "main", "image": "x"}
    if limits:
        container["resources"] = {"limits": limits}
    return {
        "metadata": {"name": "p", "namespace": "ns"},
        "spec": {"resourceClaims": list(claims), "containers": [container]},
        "status": {"resourceClaimStatuses": list(statuses)},
    }


def _claim(name: str, requests: list[dict[str, Any]], **devices: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": "ns"},
        "spec": {"devices": {"requests": requests, **devices}},
    }


def _chart_classes() -> dict[str, ClassView]:
    profiles = json.loads((CHART / "files" / "dra-mig-profiles.json").read_text())
    objects = []
    for kind in ("gpu", "mig", "shared"):
        expr = f'device.driver == "{names.DRIVER}" && {DOMAIN}.type == "{kind}"'
        objects.append(
            {
                "metadata": {"name": f"{kind}.gpupart.io"},
                "spec": {
                    "selectors": [{"cel": {"expression": expr}}],
                    **({"extendedResourceName": "nvidia.com/gpu"} if kind == "gpu" else {}),
                },
            }
        )
    for p in profiles["profiles"]:
        expr = (
            f'device.driver == "{names.DRIVER}" && {DOMAIN}.type == "mig" && '
            f'{DOMAIN}.profile == "{p["profile"]}"'
        )
        objects.append(
            {
                "metadata": {"name": f"mig-{p['label']}.gpupart.io"},
                "spec": {
                    "selectors": [{"cel": {"expression": expr}}],
                    "extendedResourceName": p["extendedResourceName"],
                },
            }
        )
    reading = read_classes(objects)
    assert not reading.skipped
    return {c.name: c for c in reading.items}


def test_the_examples_claims_resolve_to_the_models_requests() -> None:
    classes = _chart_classes()
    docs = list(yaml.safe_load_all((CHART / "examples" / "dra" / "mig.yaml").read_text()))
    claim = next(d for d in docs if d["kind"] == "ResourceClaim")
    claim["metadata"]["namespace"] = "ns"
    spec = read_claim_spec(claim)
    pod = _pod(claims=[{"name": "mig", "resourceClaimName": claim["metadata"]["name"]}])
    ask = ask_of("ns/p", pod_claims(pod), {spec.key: spec}, {}, classes, namespace="ns")
    assert not ask.problem
    (wanted,) = ask.wanted
    assert wanted.words == ("3g.40gb", "2g.20gb")
    assert [a.count for a in wanted.alternatives] == [1, 2]
    assert ask.constraints == ((frozenset({0}), names.PARENT_UUID),)
    # A template-made claim not made yet, and today's extended resource, mapped by its class.
    pod = _pod(
        claims=[{"name": "t", "resourceClaimTemplateName": "tpl"}],
        limits={"nvidia.com/mig-1g.10gb": "2"},
    )
    ask = ask_of("ns/p", pod_claims(pod), {}, {}, classes, namespace="ns")
    assert "its claim t is not made yet" in ask.notes[0]
    (wanted,) = ask.wanted
    assert wanted.alternatives[0].count == 2 and wanted.words == ("1g.10gb",)
    made = pod_claims(
        _pod(
            claims=[{"name": "t", "resourceClaimTemplateName": "tpl"}],
            statuses=[{"name": "t", "resourceClaimName": "p-t-abc"}],
        )
    )
    assert made.claims == (("t", "p-t-abc", "tpl"),)


def test_a_malformed_claim_or_pod_names_the_field() -> None:
    with pytest.raises(InvalidInput, match=r"ResourceClaim ns/c\.spec\.devices\.requests\[0\]"):
        read_claim_spec(_claim("c", [{"name": "r"}]))
    with pytest.raises(InvalidInput, match="count"):
        read_claim_spec(
            _claim("c", [{"name": "r", "exactly": {"deviceClassName": "x", "count": 10**6}}])
        )
    with pytest.raises(InvalidInput, match="resourceClaims"):
        pod_claims(_pod(claims=[{"name": f"c{k}", "resourceClaimName": "x"} for k in range(40)]))
    spec = read_claim_spec(
        _claim(
            "c",
            [
                {
                    "name": "r",
                    "exactly": {"deviceClassName": "gpu.gpupart.io", "allocationMode": "All"},
                }
            ],
        )
    )
    pod = _pod(claims=[{"name": "dev", "resourceClaimName": "c"}])
    ask = ask_of("ns/p", pod_claims(pod), {"ns/c": spec}, {}, _chart_classes(), namespace="ns")
    assert "allocationMode 'All' is not one gpupart models" in ask.problem


def test_the_newest_class_serves_a_clashing_extended_resource_name() -> None:
    from gpupart.core.dra.requests import extended_class

    older = ClassView("a", Selector(), "nvidia.com/gpu", created=1.0)
    newer = ClassView("b", Selector(), "nvidia.com/gpu", created=2.0)
    tie = ClassView("0", Selector(), "nvidia.com/gpu", created=2.0)
    assert extended_class("nvidia.com/gpu", {"a": older, "b": newer}) is newer
    assert extended_class("nvidia.com/gpu", {"a": older, "b": newer, "0": tie}) is tie
    assert extended_class("deviceclass.resource.kubernetes.io/a", {"a": older}) is older


# -- words --


def test_a_4g_blocked_by_a_1g_names_the_gpu_slots_and_holder() -> None:
    slices = node_slices("node-3", [DraGpu(offered(0), H100, dynamic=True)])
    claims: list[ClaimView] = []
    take(slices, claims, mig("1g.10gb", placementStart=2), "train-2")
    found = node_reason("node-3", slices, claims, one(mig("4g.40gb"), "4g.40gb"))
    assert not found.fits
    assert found.text == (
        "node-3: GPU 0 has 4g.40gb only at slots 0-3, taken by team-a/train-2 (1g.10gb at slot 2)"
    )
    assert found.summary == "node(s) had no free 4g.40gb device"


def test_a_3g_taken_at_both_placements_names_both_holders() -> None:
    slices = node_slices("node-3", [DraGpu(offered(0), H100, dynamic=True)])
    claims: list[ClaimView] = []
    take(slices, claims, mig("3g.40gb"), "train-1")
    take(slices, claims, mig("3g.40gb"), "train-2")
    found = node_reason("node-3", slices, claims, one(mig("3g.40gb"), "3g.40gb"))
    assert "GPU 0 has 3g.40gb only at slots" in found.text
    assert "team-a/train-1" in found.text and "team-a/train-2" in found.text


def test_the_full_size_instance_of_a_split_gpu_is_taken_by_its_pods() -> None:
    slices = node_slices("n", [DraGpu(offered(0), H100, dynamic=True)])
    claims: list[ClaimView] = []
    take(slices, claims, mig("1g.10gb"), "small")
    found = node_reason("n", slices, claims, one(mig("7g.80gb"), "7g.80gb"))
    assert re.fullmatch(
        r"n: GPU 0 has 7g\.80gb only at slots 0-7, taken by team-a/small \(1g\.10gb at slot [0-6]\)",
        found.text,
    )


def test_a_dynamic_gpu_offers_no_whole_gpu_device() -> None:
    slices = node_slices("n", [DraGpu(offered(0), H100, dynamic=True)])
    found = node_reason("n", slices, [], one(WHOLE, "whole GPU"))
    assert found.text == "n: no whole GPU device" and not found.fits


def test_shared_memory_left_against_the_amount_asked() -> None:
    slices = node_slices("n", [DraGpu(offered(0, Mode.MPS, replicas=4), H100)])
    claims: list[ClaimView] = []
    for k in range(2):
        take(slices, claims, shared(40000, 1), f"s{k}")
    found = node_reason("n", slices, claims, one(shared(40000, 1), "shared GPU"))
    left = H100.memory_mib - 80000
    assert found.text == (
        f"n: GPU 0 has {left} MiB of memory left, 40000 MiB of memory asked "
        "(held by team-a/s0, team-a/s1)"
    )
    too_big = node_reason("n", slices, [], one(shared(H100.memory_mib + 1, 1), "shared GPU"))
    assert f"gives at most {H100.memory_mib} MiB of memory to one claim" in too_big.text


def test_no_device_of_that_kind_and_an_incomplete_pool() -> None:
    slices = node_slices("n", [DraGpu(offered(0, Mode.NONE), H100)])
    found = node_reason("n", slices, [], one(mig("1g.10gb"), "1g.10gb"))
    assert found.text == "n: no 1g.10gb device" and not found.fits
    assert node_reason("n", [], [], one(WHOLE)).summary == NO_DEVICES
    two = node_slices(
        "n", [DraGpu(offered(0), H100, dynamic=True), DraGpu(offered(1), H100, dynamic=True)]
    )
    partial = node_reason("n", two[:-1], [], one(WHOLE))
    assert partial.summary == INCOMPLETE
    assert f"generation 0: {len(two) - 1} of {len(two)} slices" in partial.text


def test_the_message_details_three_nodes_and_counts_the_rest() -> None:
    reasons = [node_reason(f"n{k}", [], [], one(WHOLE)) for k in range(5)]
    slices = node_slices("m", [DraGpu(offered(0), H100, dynamic=True)])
    claims: list[ClaimView] = []
    take(slices, claims, mig("4g.40gb"), "big")
    reasons.append(node_reason("m", slices, claims, one(mig("4g.40gb"), "4g.40gb")))
    text = dra_message(one(WHOLE), reasons, others={"node(s) didn't match": 2})
    assert "m: GPU 0 has 4g.40gb only at slots 0-3, taken by team-a/big" in text
    assert text.startswith(f"0/8 nodes can take it (gpupart): 5 {NO_DEVICES}, ")
    assert "2 node(s) didn't match" in text


# -- the law: reasons agree with the allocator model --

PROFILES = ("1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb")


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[list[SliceView], list[ClaimView], DeviceRequest]:
    gpus = []
    for index in range(draw(st.integers(1, 3))):
        mode = draw(st.sampled_from([Mode.MIG, Mode.MIG, Mode.MPS, Mode.NONE]))
        replicas = 4 if mode is Mode.MPS else 0
        gpus.append(DraGpu(offered(index, mode, replicas=replicas), H100, dynamic=mode is Mode.MIG))
    order = draw(st.sampled_from(list(Order)))
    slices = node_slices("n", gpus, order)
    requests = st.one_of(
        st.sampled_from(PROFILES).map(mig),
        st.just(WHOLE),
        st.builds(shared, st.integers(1, H100.memory_mib), st.integers(1, 100)),
    )
    claims: list[ClaimView] = []
    for k in range(draw(st.integers(0, 10))):
        request = draw(requests)
        found = first_fit(slices, claims, [request])
        if found is not None:
            holder = Consumer("pods", f"p{k}", f"u{k}")
            claims.append(ClaimView("team-a", f"c{k}", f"u{k}", found, (holder,)))
    # Some GPUs faulty after those claims were allocated: their devices tainted (ADR 028).
    faulty = draw(st.sets(st.integers(0, len(gpus) - 1), max_size=len(gpus)))
    if faulty:
        faults = [GpuFault(gpus[i].gpu.uuid, xid=79, since=1.8e9) for i in faulty]
        tainted = [taint_devices(g.gpu, gpu_devices(g, order=order), faults) for g in gpus]
        slices = list(read_slices(pool_slices("n", "uid-n", tainted)).items)
    return slices, claims, draw(requests)


@settings(max_examples=150, deadline=None)
@given(scenarios())
def test_reasons_agree_with_the_allocator_model(
    scenario: tuple[list[SliceView], list[ClaimView], DeviceRequest],
) -> None:
    slices, claims, request = scenario
    model = first_fit(slices, claims, [request])
    found = node_reason("n", slices, claims, one(request))
    free = free_devices(slices, claims, request)
    assert found.fits == (model is not None)
    if model is None:
        assert found.text.startswith("n: ") and found.summary
        assert free == ()  # every device that matches has its reason
    else:
        assert not found.text
        assert model[0].device in free  # the device the scheduler would take is free in the words
    # And each free device does take it when it is the only one the request matches.
    for name in free[:3]:
        device = next(d for s in slices for d in s.devices if d.name == name)
        keys = (names.PARENT_INDEX, names.PLACEMENT_START, names.INDEX)
        pinned = dict(request.match)
        pinned.update({k: v for k in keys if (v := device.attribute(k)) is not None})
        alone = DeviceRequest("dev", tuple(sorted(pinned.items())), 1, request.capacity)
        taken = first_fit(slices, claims, [alone])
        assert taken is not None and taken[0].device == name


@settings(max_examples=60, deadline=None)
@given(scenarios(), st.sampled_from(PROFILES), st.integers(1, 3))
def test_first_available_fits_where_one_of_its_alternatives_fits(
    scenario: tuple[list[SliceView], list[ClaimView], DeviceRequest], profile: str, count: int
) -> None:
    slices, claims, request = scenario
    other = mig(profile, count)
    ask = DraAsk("team-b/p", (Wanted("dev/dev", (request, other), ("a", "b")),))
    found = node_reason("n", slices, claims, ask)
    alone = [first_fit(slices, claims, [r]) is not None for r in (request, other)]
    assert found.fits == any(alone)
    if not found.fits:
        assert "none of the alternatives fits" in found.text


@settings(max_examples=60, deadline=None)
@given(scenarios(), st.sampled_from(PROFILES[:4]))
def test_match_attribute_fits_where_one_gpu_holds_every_device(
    scenario: tuple[list[SliceView], list[ClaimView], DeviceRequest], profile: str
) -> None:
    """Two devices on one GPU (matchAttribute parentUUID) fit where one GPU index alone has them."""
    slices, claims, _ = scenario
    two = mig(profile, 2)
    ask = DraAsk(
        "team-b/p",
        (Wanted("dev/dev", (two,), (profile,)),),
        ((frozenset({0}), names.PARENT_UUID),),
    )
    per_gpu = [
        first_fit(slices, claims, [mig(profile, 2, parentIndex=g)]) is not None for g in range(3)
    ]
    assert node_reason("n", slices, claims, ask).fits == any(per_gpu)


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=12,
)


def _shaped(key: str) -> st.SearchStrategy[Any]:
    """Objects that look like a class, claim or pod, with anything in their fields."""
    return st.fixed_dictionaries(
        {"metadata": st.fixed_dictionaries({"name": st.text(max_size=8) | _JSON})},
        optional={
            "spec": st.fixed_dictionaries({}, optional={key: _JSON}) | _JSON,
            "status": _JSON,
        },
    )


@settings(max_examples=300, deadline=None)
@given(
    _shaped("selectors") | _JSON,
    _shaped("devices") | _JSON,
    _shaped("resourceClaims") | _JSON,
    st.text(max_size=80),
)
def test_no_input_makes_a_reader_raise_anything_but_invalid_input(
    device_class: Any, claim: Any, pod: Any, expression: str
) -> None:
    read_selector(expression)
    read_classes([device_class])
    for read, obj in ((read_claim_spec, claim), (pod_claims, pod)):
        with contextlib.suppress(InvalidInput):
            read(obj)
