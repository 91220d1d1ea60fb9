"""Annotation wire formats: decode(encode(x)) == x for each kind; unknown versions and bad payloads are errors."""

import json
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpupart.core.api.spec import Disruption, GpuConfig, Interface, Mode, MpsSettings
from gpupart.core.api.wire import (
    DesiredGroup,
    GivenContainer,
    GpuReport,
    GpuState,
    Inventory,
    InventoryGpu,
    MigDevice,
    MigPlan,
    MigReservation,
    NodeReport,
    PlannedGpu,
    PlanReport,
    PodAssignment,
    decode_allocation,
    decode_assignment,
    decode_desired,
    decode_inventory,
    decode_mig_plan,
    decode_report,
    encode_allocation,
    encode_assignment,
    encode_desired,
    encode_inventory,
    encode_mig_plan,
    encode_report,
)
from gpupart.core.errors import WireFormatError
from gpupart.core.mig.layout import MigInstance, Placement

names = st.text("abcdefghijklmnopqrstuvwxyz-0123456789", min_size=1, max_size=20)
instances = st.builds(
    lambda start, size, profile: MigInstance(Placement(start, size), profile),
    st.integers(0, 7),
    st.integers(1, 8),
    st.sampled_from(["1g.10gb", "3g.40gb", "7g.80gb"]),
)
layouts = st.lists(instances, max_size=4).map(lambda xs: tuple(sorted(xs)))
mig_counts = st.dictionaries(st.sampled_from(["1g.10gb", "2g.20gb"]), st.integers(0, 7)).map(
    lambda d: tuple(sorted(d.items()))
)
mps_settings = st.builds(
    MpsSettings, st.none() | st.integers(1, 10**6), st.none() | st.integers(1, 100)
)
disruptions = st.sampled_from(Disruption)
# Each mode with the settings the operator writes for it (spec parsing gives no other shape).
configs = st.one_of(
    st.builds(GpuConfig, st.just(Mode.MIG), mig_counts, disruption=disruptions),
    st.builds(
        GpuConfig,
        st.just(Mode.MPS),
        mps=mps_settings,
        replicas=st.integers(1, 48),
        disruption=disruptions,
    ),
    st.builds(
        GpuConfig, st.just(Mode.TIME_SLICING), replicas=st.integers(1, 64), disruption=disruptions
    ),
    st.builds(GpuConfig, st.just(Mode.NONE), disruption=disruptions),
    st.builds(
        GpuConfig,
        st.just(Mode.MIG),
        mig_counts,
        disruption=disruptions,
        dynamic=st.just(True),
        # As `spec.mig.dynamic.profiles` parses: sorted, distinct, 1 to 16; or all (None).
        dynamic_profiles=st.none()
        | st.sets(st.sampled_from(["1g.10gb", "1g.10gb+me", "2g.20gb", "3g.40gb", "7g.80gb"]))
        .filter(bool)
        .map(lambda p: tuple(sorted(p))),
    ),
).flatmap(
    lambda c: st.sampled_from(Interface).map(
        # The profiles go with DRA only (parse_partition drops them otherwise).
        lambda i: replace(
            c,
            interface=i,
            dynamic_profiles=c.dynamic_profiles if i is Interface.DRA else None,
        )
    )
)
groups = st.builds(
    DesiredGroup,
    partition=names,
    generation=st.integers(0, 10**6),
    gpus=st.none() | st.lists(st.integers(0, 15), unique=True).map(tuple),
    config=configs,
)
reports = st.builds(
    NodeReport,
    observed=st.lists(st.tuples(names, st.integers(0, 99))).map(tuple),
    gpus=st.lists(
        st.builds(
            GpuReport,
            st.integers(0, 15),
            st.sampled_from(GpuState),
            st.sampled_from(Mode),
            layouts,
            names,
            st.lists(names).map(tuple),
        )
    ).map(tuple),
    plan=st.none() | st.builds(PlanReport, names, st.sampled_from(GpuState), names),
)
inventories = st.builds(
    Inventory,
    st.lists(
        st.builds(
            InventoryGpu,
            st.integers(0, 15),
            names,
            names,
            st.integers(0, 200_000),
            st.sampled_from(Mode),
            st.lists(st.builds(MigDevice, names, instances, st.booleans())).map(tuple),
            st.integers(0, 48),
            interface=st.none() | st.sampled_from(Interface),
        )
    ).map(tuple),
    st.booleans(),
)
assignments = st.builds(
    PodAssignment, names, st.integers(0, 15), names, st.integers(0, 10**6), st.integers(0, 100)
)


plans = st.builds(
    MigPlan,
    names,
    st.lists(st.builds(PlannedGpu, st.integers(0, 15), layouts), unique_by=lambda g: g.index).map(
        tuple
    ),
    st.lists(
        st.builds(
            MigReservation,
            names,
            names,
            st.integers(0, 15),
            instances,
            st.integers(0, 2 * 10**9).map(lambda ms: ms / 1000),
        ),
        max_size=4,
    ).map(tuple),
)


@given(plans)
def test_law_mig_plan_round_trips(value):
    assert decode_mig_plan(encode_mig_plan(value)) == value


@pytest.mark.parametrize(
    ("payload", "words"),
    [
        ({"id": "a", "gpus": [{"index": 0}]}, r"gpus\[0\]\.layout: is required"),
        (
            {"id": "a", "gpus": [{"index": 1, "layout": []}, {"index": 1, "layout": []}]},
            "names a GPU twice",
        ),
        (
            {
                "id": "a",
                "reservations": [
                    {
                        "pod": "a/b",
                        "gpu": 0,
                        "profile": "1g.10gb",
                        "start": 0,
                        "size": 1,
                        "expires": "soon",
                    }
                ],
            },
            r"expires: must be a number",
        ),
        (
            {
                "id": "a",
                "reservations": [
                    {
                        "pod": "a/b",
                        "gpu": 0,
                        "profile": "1g.10gb",
                        "start": 0,
                        "size": 1,
                        "expires": 1e400,
                    }
                ],
            },
            r"expires",
        ),
        ({"id": "a", "gpus": [], "owner": "me"}, "owner: unknown field"),
        (
            {
                "id": "a",
                "reservations": [
                    {
                        "pod": "a/b",
                        "gpu": 0,
                        "profile": "1g.10gb",
                        "start": 0,
                        "size": 1,
                        "expires": 1,
                    }
                ]
                * 513,
            },
            "at most 512",
        ),
    ],
)
def test_malformed_mig_plans_are_refused_naming_the_field(payload, words):
    text = json.dumps({"version": "v1", **payload}).replace("Infinity", "1e400")
    with pytest.raises(WireFormatError, match=words):
        decode_mig_plan(text)


@given(st.lists(groups, max_size=3).map(tuple))
def test_law_desired_round_trips(value):
    assert decode_desired(encode_desired(value)) == value


def test_desired_bytes_are_the_wire_format_v1():
    """The per-GPU configuration is flat in each group, MPS client slots as `mps.maxClients`
    and time-slicing's as `replicas`, exactly as nodes running older agents read it."""
    groups = (
        DesiredGroup("m", 2, (0,), GpuConfig(Mode.MIG, (("1g.10gb", 0), ("3g.40gb", 2)))),
        DesiredGroup("s", 1, None, GpuConfig(Mode.MPS, mps=MpsSettings(4096, None), replicas=8)),
        DesiredGroup("t", 1, (1, 2), GpuConfig(Mode.TIME_SLICING, replicas=4)),
    )
    text = encode_desired(groups)
    assert json.loads(text) == {
        "version": "v1",
        "groups": [
            {"partition": "m", "generation": 2, "gpus": [0], "mode": "MIG",
             "mig": {"1g.10gb": 0, "3g.40gb": 2}, "mps": None, "replicas": None,
             "disruption": "WhenIdle"},
            {"partition": "s", "generation": 1, "gpus": None, "mode": "MPS", "mig": {},
             "mps": {"maxClients": 8, "defaultMemoryMiB": 4096}, "replicas": None,
             "disruption": "WhenIdle"},
            {"partition": "t", "generation": 1, "gpus": [1, 2], "mode": "TimeSlicing", "mig": {},
             "mps": None, "replicas": 4, "disruption": "WhenIdle"},
        ],
    }  # fmt: skip
    assert decode_desired(text) == groups


def test_desired_settings_of_another_mode_are_read_and_dropped():
    raw = {"partition": "p", "generation": 1, "mode": "MIG", "mig": {}, "replicas": 3,
           "mps": {"maxClients": 2}, "disruption": "Never"}  # fmt: skip
    (group,) = decode_desired(json.dumps({"version": "v1", "groups": [raw]}))
    assert group.config == GpuConfig(Mode.MIG, disruption=Disruption.NEVER)


@given(reports)
def test_law_report_round_trips(value):
    assert decode_report(encode_report(value)) == value


@given(inventories)
def test_law_inventory_round_trips(value):
    assert decode_inventory(encode_inventory(value)) == value


@given(assignments)
def test_law_assignment_round_trips(value):
    assert decode_assignment(encode_assignment(value)) == value


allocations = st.lists(
    st.builds(
        GivenContainer,
        names,
        st.lists(names, min_size=1, max_size=3).map(lambda ids: tuple(sorted(ids))),
        names,
        st.integers(0, 10**6),
        st.integers(0, 100),
    ),
    min_size=1,
    max_size=3,
).map(tuple)


@given(allocations)
def test_law_allocation_round_trips(value):
    assert decode_allocation(encode_allocation(value)) == value


def test_inventory_without_serial_admission_reads_as_false():
    text = json.dumps({"version": "v1", "gpus": []})
    assert decode_inventory(text) == Inventory((), serial_admission=False)
    with pytest.raises(WireFormatError, match="serialAdmission: must be true or false"):
        decode_inventory(json.dumps({"version": "v1", "gpus": [], "serialAdmission": "yes"}))


def test_unknown_version_is_refused_with_the_annotation_name():
    text = json.dumps({"version": "v9", "groups": []})
    with pytest.raises(WireFormatError, match=r"gpupart.io/desired: unknown format version 'v9'"):
        decode_desired(text)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("{", "not JSON"),
        ("[]", "JSON object"),
        ("[" * 20_000 + "]" * 20_000, "JSON object"),  # deeper than `json` walks: cut, read
        ('{"version":"v1","groups":[{"partition":"a"}]}', "generation: is required"),
        ('{"version":"v1","groups":[],"extra":1}', "extra: unknown field"),
        (
            '{"version":"v1","groups":[{"partition":"a","generation":1,"mode":"Fast","disruption":"Never"}]}',
            "not one of",
        ),
    ],
)
def test_malformed_payloads_are_refused(text, words):
    with pytest.raises(WireFormatError, match=words):
        decode_desired(text)


def test_interface_is_written_only_when_not_the_device_plugin():
    plain = DesiredGroup("p", 1, None, GpuConfig(Mode.NONE))
    dra = DesiredGroup("d", 1, None, GpuConfig(Mode.NONE, interface=Interface.DRA))
    assert "interface" not in encode_desired((plain,))
    assert json.loads(encode_desired((dra,)))["groups"][0]["interface"] == "dra"
    gpu = InventoryGpu(0, "GPU-0", "A100", 1, Mode.NONE)
    assert "interface" not in encode_inventory(Inventory((gpu,)))
    moving = decode_inventory(encode_inventory(Inventory((replace(gpu, interface=None),))))
    assert moving.gpus[0].interface is None


def test_an_unknown_interface_is_refused_naming_the_field():
    text = encode_desired(
        (DesiredGroup("d", 1, None, GpuConfig(Mode.NONE, interface=Interface.DRA)),)
    )
    with pytest.raises(WireFormatError, match="interface"):
        decode_desired(text.replace('"dra"', '"both"'))


def test_dynamic_profiles_are_written_only_when_set_and_bad_ones_refused():
    dyn = GpuConfig(
        Mode.MIG,
        (),
        dynamic=True,
        interface=Interface.DRA,
        dynamic_profiles=("1g.10gb", "3g.40gb"),
    )
    text = encode_desired((DesiredGroup("d", 1, None, dyn),))
    assert json.loads(text)["groups"][0]["profiles"] == ["1g.10gb", "3g.40gb"]
    assert decode_desired(text)[0].config == dyn
    every = encode_desired((DesiredGroup("d", 1, None, replace(dyn, dynamic_profiles=None)),))
    assert "profiles" not in every
    with pytest.raises(WireFormatError, match=r"profiles\[1\]"):
        decode_desired(text.replace('"3g.40gb"', '"3x.40gb"'))
