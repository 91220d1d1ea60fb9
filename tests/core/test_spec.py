"""GpuPartition parsing: a valid object per mode, node selection, and every rejected field with its path."""

import copy

import pytest

from gpupart.core.api.spec import (
    Disruption,
    Interface,
    Mode,
    parse_partition,
    plan_gpu,
    plan_gpu_layout,
)
from gpupart.core.errors import InfeasibleLayout, InvalidInput, UnknownProfile
from gpupart.core.mig.catalogue import require_gpu_model

MIG = {
    "apiVersion": "gpupart.io/v1alpha1",
    "kind": "GpuPartition",
    "metadata": {"name": "mig", "generation": 3, "uid": "abc"},
    "spec": {
        "nodeSelector": {
            "matchLabels": {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"},
            "matchExpressions": [{"key": "pool", "operator": "In", "values": ["a", "b"]}],
        },
        "gpus": [1, 0],
        "mode": "MIG",
        "mig": {"devices": {"1g.10gb": 2, "3g.40gb": 1}},
        "priority": 5,
    },
}


def with_spec(**changes):
    document = copy.deepcopy(MIG)
    for key, value in changes.items():
        if value is None:
            document["spec"].pop(key, None)
        else:
            document["spec"][key] = value
    return document


def test_mig_partition_parses():
    spec = parse_partition(MIG)
    assert (spec.name, spec.generation, spec.config.mode, spec.priority) == ("mig", 3, Mode.MIG, 5)
    assert spec.gpus == (0, 1)
    assert spec.config.mig_counts == {"1g.10gb": 2, "3g.40gb": 1}
    assert spec.config.disruption is Disruption.WHEN_IDLE
    labels = {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB", "pool": "b"}
    assert spec.node_selector.matches(labels)
    assert not spec.node_selector.matches(labels | {"pool": "c"})


def test_restore_on_delete_is_off_unless_asked_and_must_be_a_boolean():
    assert parse_partition(MIG).restore_on_delete is False
    assert parse_partition(with_spec(restoreOnDelete=True)).restore_on_delete is True
    with pytest.raises(InvalidInput, match="spec.restoreOnDelete: must be true or false"):
        parse_partition(with_spec(restoreOnDelete="true"))


def test_interface_is_the_device_plugin_unless_dra_is_asked():
    assert parse_partition(MIG).config.interface is Interface.DEVICE_PLUGIN
    assert parse_partition(with_spec(interface="dra")).config.interface is Interface.DRA


@pytest.mark.parametrize(
    "blocks",
    [
        {"mode": "None", "mig": None},
        {},
        {"mig": {"dynamic": {"profiles": ["1g.10gb", "3g.40gb"], "minIdleSeconds": 0}}},
        {"mode": "MPS", "mig": None, "mps": {"maxClients": 4, "defaultMemory": "10Gi"}},
        {"mode": "TimeSlicing", "mig": None, "timeSlicing": {"replicas": 4}},
    ],
)
def test_dra_serves_every_mode(blocks):
    """docs/dra.md's device table: whole GPUs, static and dynamic MIG, MPS and time-slicing."""
    assert parse_partition(with_spec(interface="dra", **blocks)).config.interface is Interface.DRA


@pytest.mark.parametrize(
    ("dynamic", "where"),
    [
        ({"warm": {"1g.10gb": 1}}, "spec.mig.dynamic.warm"),
        ({"carveIdleGpus": False}, "spec.mig.dynamic.carveIdleGpus"),
    ],
)
def test_dynamic_mig_through_dra_refuses_what_only_mig_plans_honour(dynamic, where):
    document = with_spec(mig={"dynamic": dynamic})
    assert parse_partition(document).dynamic is not None  # through the device plugin: fine
    document["spec"]["interface"] = "dra"
    with pytest.raises(InvalidInput, match=rf"^{where}: .*use interface devicePlugin"):
        parse_partition(document)
    # A warm mix of zero counts asks for nothing, and true is the default: both accepted.
    fine = with_spec(
        interface="dra", mig={"dynamic": {"warm": {"1g.10gb": 0}, "carveIdleGpus": True}}
    )
    assert parse_partition(fine).dynamic is not None


def test_mps_and_time_slicing_and_none_parse():
    mps = parse_partition(
        with_spec(
            mode="MPS",
            mig=None,
            mps={"maxClients": 8, "defaultMemory": "10Gi", "defaultComputePercent": 25},
        )
    )
    assert mps.config.mps is not None and mps.config.mps.default_memory_mib == 10240
    assert (mps.config.replicas, mps.config.mps.default_compute_percent) == (8, 25)
    sliced = parse_partition(with_spec(mode="TimeSlicing", mig=None, timeSlicing={"replicas": 4}))
    assert sliced.config.replicas == 4 and sliced.config.mps is None
    plain = parse_partition(with_spec(mode="None", mig=None, gpus=None, nodeSelector=None))
    assert plain.gpus is None and plain.node_selector.matches({})


@pytest.mark.parametrize(
    ("changes", "where", "words"),
    [
        ({"mode": "Mig"}, "spec.mode", "not a mode"),
        ({"mode": "MPS"}, "spec.mig", "is set but mode is MPS"),
        ({"mig": {"devices": {"1g.10gb": -1}}}, "spec.mig.devices.1g.10gb", "≥ 0"),
        ({"mig": {"devices": {"1g.10gb": "two"}}}, "spec.mig.devices.1g.10gb", "whole number"),
        ({"mig": {"devices": {"1g.10gb": 0}}}, "spec.mig.devices", "no MIG instance"),
        ({"mig": {"devices": {"big": 1}}}, "spec.mig.devices.big", "not a MIG profile name"),
        ({"mig": {"device": {"1g.10gb": 1}}}, "spec.mig.devices", "is required"),
        ({"gpus": [0, 0]}, "spec.gpus", "twice"),
        ({"gpus": [-1]}, r"spec.gpus\[0\]", "GPU index"),
        ({"disruption": "Sometimes"}, "spec.disruption", "WhenIdle or Never"),
        ({"colour": "blue"}, "spec.colour", "unknown field"),
        ({"interface": "both"}, "spec.interface", "not an interface"),
        (
            {"nodeSelector": {"matchExpressions": [{"key": "a", "operator": "Near"}]}},
            "operator",
            "not In",
        ),
        (
            {"mode": "MPS", "mig": None, "mps": {"maxClients": 64}},
            "spec.mps.maxClients",
            "at most 48",
        ),
        (
            {"mode": "TimeSlicing", "mig": None, "timeSlicing": {"replicas": 0}},
            "spec.timeSlicing.replicas",
            "≥ 1",
        ),
    ],
)
def test_bad_fields_are_rejected_with_their_path(changes, where, words):
    with pytest.raises(InvalidInput, match=words) as error:
        parse_partition(with_spec(**changes))
    assert error.value.where.startswith(where.replace("\\", "")) or where in error.value.where


def test_wrong_kind_is_rejected():
    with pytest.raises(InvalidInput, match="expected gpupart.io/v1alpha1 GpuPartition"):
        parse_partition(MIG | {"kind": "Pod"})


def test_layout_per_product_and_its_errors():
    spec = parse_partition(MIG)
    assert len(plan_gpu_layout(spec, require_gpu_model("H100-SXM5-80GB"))) == 3
    with pytest.raises(UnknownProfile, match="A30-24GB"):
        plan_gpu_layout(spec, require_gpu_model("A30"))
    too_many = parse_partition(with_spec(mig={"devices": {"3g.40gb": 3}}))
    with pytest.raises(InfeasibleLayout, match="at most 2"):
        plan_gpu_layout(too_many, require_gpu_model("A100-SXM4-80GB"))


def test_mps_default_memory_reads_decimal_and_binary_units():
    for text, mib in (("4000M", 3815), ("4000Mi", 4000), ("4G", 3815), ("4Gi", 4096)):
        spec = parse_partition(
            with_spec(mode="MPS", mig=None, mps={"maxClients": 4, "defaultMemory": text})
        )
        assert spec.config.mps is not None and spec.config.mps.default_memory_mib == mib, text


def test_mps_defaults_must_fit_the_gpu():
    spec = parse_partition(
        with_spec(mode="MPS", mig=None, mps={"maxClients": 32, "defaultMemory": "4Gi"})
    )
    with pytest.raises(InvalidInput, match="32 clients × 4096 MiB"):
        plan_gpu(spec, require_gpu_model("A100-SXM4-80GB"))
    assert plan_gpu(spec, require_gpu_model("H200")) == ()


def test_dynamic_mig_defaults_and_fields():
    on = parse_partition(with_spec(mig={"dynamic": {}}))
    assert on.dynamic is not None and on.config.mig == ()
    assert (on.dynamic.profiles, on.dynamic.min_idle_s, on.dynamic.carve_idle_gpus) == (
        None,
        60,
        True,
    )
    full = parse_partition(
        with_spec(
            mig={
                "dynamic": {
                    "profiles": ["3g.40gb", "1g.10gb"],
                    "warm": {"1g.10gb": 2, "3g.40gb": 0},
                    "minIdleSeconds": 300,
                    "carveIdleGpus": False,
                }
            }
        )
    )
    assert full.dynamic is not None
    assert full.dynamic.profiles == ("1g.10gb", "3g.40gb")
    assert full.config.mig == (("1g.10gb", 2),) == full.dynamic.warm
    assert (full.dynamic.min_idle_s, full.dynamic.carve_idle_gpus) == (300, False)
    # the warm mix is what an otherwise idle GPU keeps, checked against the model like devices
    assert [i.profile for i in plan_gpu_layout(full, require_gpu_model("A100-SXM4-80GB"))] == [
        "1g.10gb",
        "1g.10gb",
    ]
    assert parse_partition(MIG).dynamic is None


@pytest.mark.parametrize(
    ("mig", "where", "words"),
    [
        ({"devices": {"1g.10gb": 1}, "dynamic": {}}, "spec.mig", "only one of devices"),
        ({"dynamic": {"minIdleSeconds": -1}}, "spec.mig.dynamic.minIdleSeconds", "≥ 0"),
        ({"dynamic": {"minIdleSeconds": 10**6}}, "spec.mig.dynamic.minIdleSeconds", "≤ 86400"),
        ({"dynamic": {"carveIdleGpus": "yes"}}, "spec.mig.dynamic.carveIdleGpus", "true or false"),
        ({"dynamic": {"profiles": []}}, "spec.mig.dynamic.profiles", "1 to 16"),
        ({"dynamic": {"profiles": ["big"]}}, "spec.mig.dynamic.profiles[0]", "not a MIG profile"),
        ({"dynamic": {"profiles": ["1g.10gb", "1g.10gb"]}}, "spec.mig.dynamic.profiles", "twice"),
        ({"dynamic": {"warm": {"1g.10gb": 9}}}, "spec.mig.dynamic.warm.1g.10gb", "≤ 7"),
        (
            {"dynamic": {"profiles": ["1g.10gb"], "warm": {"3g.40gb": 1}}},
            "spec.mig.dynamic.warm.3g.40gb",
            "not among",
        ),
        ({"dynamic": {"colour": 1}}, "spec.mig.dynamic.colour", "unknown field"),
    ],
)
def test_bad_dynamic_fields_are_rejected_with_their_path(mig, where, words):
    with pytest.raises(InvalidInput, match=words) as error:
        parse_partition(with_spec(mig=mig))
    assert error.value.where == where


def test_dynamic_profiles_reach_the_gpu_config_only_through_dra():
    mig = {"dynamic": {"profiles": ["3g.40gb", "1g.10gb"]}}
    dra = parse_partition(with_spec(mode="MIG", mig=mig, interface="dra")).config
    assert dra.dynamic_profiles == ("1g.10gb", "3g.40gb")
    assert parse_partition(with_spec(mode="MIG", mig=mig)).config.dynamic_profiles is None
