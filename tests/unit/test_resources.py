"""Resource names and pod requests: quantities, summing containers, and every malformed request.

Aspects: Kubernetes quantity grammar, effective request (sum of containers vs largest init
container), one kind of GPU per pod, extender-managed memory/compute, errors that name the field.
"""

from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpupart.core.errors import InvalidInput
from gpupart.core.resources import (
    GpuRequest,
    find_mig_profile,
    mig_resource_name,
    parse_memory_mib,
    parse_pod_request,
    parse_quantity,
)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1", 1),
        ("500m", Fraction(1, 2)),
        ("10Gi", 10 * 2**30),
        ("1k", 1000),
        ("1e3", 1000),
        ("2.5", Fraction(5, 2)),
        (".5", Fraction(1, 2)),
        ("128Mi", 128 * 2**20),
        (3, 3),
    ],
)
def test_quantities_parse_exactly(text, value):
    assert parse_quantity(text, where="x") == value


@pytest.mark.parametrize("text", ["", "ten", "1.2.3", "5 Gi", "1GB", None, True, [1]])
def test_malformed_quantities_name_the_field(text):
    with pytest.raises(InvalidInput, match="^limits.nvidia.com/gpu: "):
        parse_quantity(text, where="limits.nvidia.com/gpu")


def test_memory_rounds_up_to_whole_mib():
    assert parse_memory_mib("10Gi", where="m") == 10240
    assert parse_memory_mib("1", where="m") == 1
    with pytest.raises(InvalidInput, match="more than 0"):
        parse_memory_mib("0", where="m")


@given(
    st.sampled_from(
        [
            "1g.10gb",
            "3g.40gb",
            "1g.18gb+me",
            "7g.141gb",
            "1g.24gb+me.all",
            "1c.3g.40gb",
            "1g.23gb-me",
        ]
    )
)
def test_law_mig_resource_name_round_trips(profile):
    name = mig_resource_name(profile)
    assert "+" not in name, "extended-resource names allow no +"
    assert find_mig_profile(name) == profile
    assert find_mig_profile("nvidia.com/gpu") is None


def pod(*containers, init=()):
    return {"spec": {"containers": list(containers), "initContainers": list(init)}}


def container(limits=None, requests=None):
    resources = {}
    if limits is not None:
        resources["limits"] = limits
    if requests is not None:
        resources["requests"] = requests
    return {"name": "c", "resources": resources}


def test_mig_requests_sum_over_containers():
    request = parse_pod_request(
        pod(
            container({"nvidia.com/mig-1g.10gb": "1"}),
            container({"nvidia.com/mig-1g.10gb": 2, "cpu": "4"}),
        )
    )
    assert request == GpuRequest(mig=(("1g.10gb", 3),))


def test_media_extension_profiles_use_the_device_plugin_spelling():
    assert mig_resource_name("1g.10gb+me") == "nvidia.com/mig-1g.10gb.me"
    request = parse_pod_request(pod(container({"nvidia.com/mig-1g.10gb.me": 1})))
    assert request.mig == (("1g.10gb+me", 1),)


def test_init_container_counts_when_larger_than_the_sum():
    request = parse_pod_request(
        pod(container({"nvidia.com/gpu": 1}), init=[container({"nvidia.com/gpu": 2})])
    )
    assert request.whole_gpus == 2


def test_shared_gpu_with_memory_and_compute():
    request = parse_pod_request(
        pod(
            container(
                {
                    "nvidia.com/gpu.shared": 1,
                    "gpupart.io/gpu-memory": 10240,
                    "gpupart.io/gpu-compute": 25,
                }
            )
        )
    )
    assert (request.shared, request.memory_mib, request.compute_percent) == (1, 10240, 25)


def test_requests_alone_count_for_extended_resources():
    assert parse_pod_request(pod(container(requests={"nvidia.com/gpu": "2"}))).whole_gpus == 2


def test_pod_without_gpu_is_empty():
    assert parse_pod_request(pod(container({"cpu": "1"}))).empty


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        (
            pod(container({"nvidia.com/gpu": "1.5"})),
            r"containers\[0\].resources.limits.nvidia.com/gpu: must be a whole number",
        ),
        (pod(container({"nvidia.com/gpu": "-1"})), "whole number"),
        (pod(container({"nvidia.com/gpu": "lots"})), "not a Kubernetes quantity"),
        (pod(container({"nvidia.com/mig-9g.1tb": 1})), "not a MIG profile name"),
        (
            pod(container({"nvidia.com/gpu": 1}, {"nvidia.com/gpu": 2})),
            "requests .2. and limits .1. differ",
        ),
        (pod(container({"nvidia.com/gpu": 1, "nvidia.com/mig-1g.10gb": 1})), "at once"),
        (pod(container({"gpupart.io/gpu-memory": 1024})), "need nvidia.com/gpu.shared"),
        (
            pod(container({"nvidia.com/gpu.shared": 1, "gpupart.io/gpu-memory": "10Gi"})),
            "write 10240",
        ),
        (
            pod(container({"nvidia.com/gpu.shared": 1, "gpupart.io/gpu-compute": 150})),
            "at most 100",
        ),
        ({"spec": {"containers": "x"}}, "must be a list"),
        ({"spec": {"containers": [{"resources": "x"}]}}, "must be a mapping"),
    ],
)
def test_malformed_requests_are_rejected_with_the_field(spec, words):
    with pytest.raises(InvalidInput, match=words):
        parse_pod_request(spec)
