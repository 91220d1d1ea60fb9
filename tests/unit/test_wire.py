"""Annotation wire formats: decode(encode(x)) == x for each kind; unknown versions and bad payloads are errors."""

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpupart.core.api.spec import Disruption, Mode, MpsSettings
from gpupart.core.api.wire import (
    DesiredGroup,
    GivenContainer,
    GpuReport,
    GpuState,
    Inventory,
    InventoryGpu,
    MigDevice,
    NodeReport,
    PodAssignment,
    decode_allocation,
    decode_assignment,
    decode_desired,
    decode_inventory,
    decode_report,
    encode_allocation,
    encode_assignment,
    encode_desired,
    encode_inventory,
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
mps = st.none() | st.builds(
    MpsSettings,
    st.integers(1, 48),
    st.none() | st.integers(1, 10**6),
    st.none() | st.integers(1, 100),
)
groups = st.builds(
    DesiredGroup,
    partition=names,
    generation=st.integers(0, 10**6),
    gpus=st.none() | st.lists(st.integers(0, 15), unique=True).map(tuple),
    mode=st.sampled_from(Mode),
    mig=st.dictionaries(st.sampled_from(["1g.10gb", "2g.20gb"]), st.integers(0, 7)).map(
        lambda d: tuple(sorted(d.items()))
    ),
    mps=mps,
    replicas=st.none() | st.integers(1, 64),
    disruption=st.sampled_from(Disruption),
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
            st.lists(st.builds(MigDevice, names, instances)).map(tuple),
            st.integers(0, 48),
        )
    ).map(tuple),
    st.booleans(),
)
assignments = st.builds(
    PodAssignment, names, st.integers(0, 15), names, st.integers(0, 10**6), st.integers(0, 100)
)


@given(st.lists(groups, max_size=3).map(tuple))
def test_law_desired_round_trips(value):
    assert decode_desired(encode_desired(value)) == value


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
