"""GPU catalogue: every product's MIG table is self-consistent, and product names match as NVML and GFD spell them.

Aspects: table shape per product, name matching (NVML names, GFD labels, -SHARED and -MIG-
suffixes), unknown products and profiles raise errors that name them.
"""

import pytest

from gpupart.core.catalogue import (
    catalogue,
    find_gpu_model,
    parse_profile_name,
    require_gpu_model,
)
from gpupart.core.errors import InvalidInput, UnknownProduct, UnknownProfile

# product -> (memory slices, max instances, profile names) as the MIG user guide lists them
EXPECTED = {
    "A30-24GB": (4, 4, {"1g.6gb", "1g.6gb+me", "2g.12gb", "2g.12gb+me", "4g.24gb"}),
    "A100-SXM4-40GB": (
        8,
        7,
        {"1g.5gb", "1g.5gb+me", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"},
    ),
    "A100-PCIE-40GB": (
        8,
        7,
        {"1g.5gb", "1g.5gb+me", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"},
    ),
    "A100-SXM4-80GB": (
        8,
        7,
        {"1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"},
    ),
    "A100-PCIE-80GB": (
        8,
        7,
        {"1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"},
    ),
    "H100-SXM5-80GB": (
        8,
        7,
        {"1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"},
    ),
    "H100-PCIE-80GB": (
        8,
        7,
        {"1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"},
    ),
    "H100-NVL-94GB": (
        8,
        7,
        {"1g.12gb", "1g.12gb+me", "1g.24gb", "2g.24gb", "3g.47gb", "4g.47gb", "7g.94gb"},
    ),
    "H100-96GB": (
        8,
        7,
        {"1g.12gb", "1g.12gb+me", "1g.24gb", "2g.24gb", "3g.48gb", "4g.48gb", "7g.96gb"},
    ),
    "H20-96GB": (
        8,
        7,
        {"1g.12gb", "1g.12gb+me", "1g.24gb", "2g.24gb", "3g.48gb", "4g.48gb", "7g.96gb"},
    ),
    "H200-141GB": (
        8,
        7,
        {"1g.18gb", "1g.18gb+me", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"},
    ),
    "B200-180GB": (
        8,
        7,
        {"1g.23gb", "1g.23gb+me", "1g.45gb", "2g.45gb", "3g.90gb", "4g.90gb", "7g.180gb"},
    ),
}


def test_catalogue_lists_every_expected_product():
    assert {m.product for m in catalogue()} == set(EXPECTED)


@pytest.mark.parametrize("product", sorted(EXPECTED))
def test_profiles_match_the_mig_guide(product):
    model = require_gpu_model(product)
    slices, max_instances, names = EXPECTED[product]
    assert (model.memory_slices, model.max_instances) == (slices, max_instances)
    assert set(model.profile_names) == names
    for profile in model.profiles:
        compute, gpu_slices, _, suffix = parse_profile_name(profile.name)
        assert compute == gpu_slices == profile.compute_slices
        assert all(s + profile.memory_slices <= slices for s in profile.starts)
        assert all(
            s % profile.memory_slices == 0 or profile.memory_slices == 1 for s in profile.starts
        )
        assert 0 < profile.memory_mib <= model.memory_mib
        # memory grows with memory slices; +me variants match their plain twin
        assert profile.media_extensions == (suffix == "+me")
    by_slices = {}
    for profile in model.profiles:
        by_slices.setdefault(profile.memory_slices, set()).add(profile.memory_mib)
    assert all(len(v) == 1 for v in by_slices.values())
    ordered = [next(iter(by_slices[k])) for k in sorted(by_slices)]
    assert ordered == sorted(ordered)


@pytest.mark.parametrize(
    ("name", "product"),
    [
        ("NVIDIA A100-SXM4-80GB", "A100-SXM4-80GB"),  # NVML
        ("NVIDIA-A100-SXM4-80GB", "A100-SXM4-80GB"),  # GFD label
        ("NVIDIA-A100-SXM4-80GB-SHARED", "A100-SXM4-80GB"),  # GFD, shared GPU
        ("NVIDIA-A100-SXM4-40GB-MIG-1g.5gb", "A100-SXM4-40GB"),  # GFD, single strategy
        ("NVIDIA A100 80GB PCIe", "A100-PCIE-80GB"),
        ("NVIDIA-A100-80GB-PCIe", "A100-PCIE-80GB"),
        ("NVIDIA A100-PCIE-40GB", "A100-PCIE-40GB"),
        ("NVIDIA H100 80GB HBM3", "H100-SXM5-80GB"),
        ("NVIDIA-H100-80GB-HBM3", "H100-SXM5-80GB"),
        ("NVIDIA H100 PCIe", "H100-PCIE-80GB"),
        ("NVIDIA H100 NVL", "H100-NVL-94GB"),
        ("NVIDIA GH200 480GB", "H100-96GB"),
        ("NVIDIA H20", "H20-96GB"),
        ("NVIDIA H200", "H200-141GB"),
        ("NVIDIA-H200-NVL", "H200-141GB"),
        ("NVIDIA B200", "B200-180GB"),
        ("NVIDIA A30", "A30-24GB"),
        ("a100-sxm4-80gb", "A100-SXM4-80GB"),
    ],
)
def test_products_match_nvml_and_gfd_names(name, product):
    assert require_gpu_model(name).product == product


@pytest.mark.parametrize(
    "name", ["NVIDIA T4", "Tesla V100-SXM2-16GB", "NVIDIA-A100", "", "A100-SXM4"]
)
def test_unknown_product_is_an_error_naming_it(name):
    assert find_gpu_model(name) is None
    with pytest.raises(UnknownProduct, match="unknown GPU product") as error:
        require_gpu_model(name)
    assert repr(name) in str(error.value)


def test_unknown_profile_names_the_product_and_what_it_offers():
    with pytest.raises(UnknownProfile) as error:
        require_gpu_model("A30").require_profile("3g.40gb")
    assert "3g.40gb" in str(error.value) and "A30-24GB" in str(error.value)
    assert "2g.12gb" in str(error.value)


@pytest.mark.parametrize(
    "name", ["1g", "8g.10gb", "1g.10", "1g.10gb+xx", "g.10gb", "1g.10gb ", "mig-1g.10gb"]
)
def test_malformed_profile_names_are_rejected(name):
    with pytest.raises(InvalidInput, match="not a MIG profile name"):
        parse_profile_name(name, where="spec.mig.devices")


def test_profile_names_parse_compute_and_suffixes():
    assert parse_profile_name("1c.3g.40gb") == (1, 3, 40, "")
    assert parse_profile_name("1g.10gb+me") == (1, 1, 10, "+me")
    assert parse_profile_name("1g.24gb+me.all") == (1, 1, 24, "+me.all")


def test_compare_models_names_every_difference_from_nvml() -> None:
    from dataclasses import replace

    from gpupart.core.catalogue import compare_models, require_gpu_model

    known = require_gpu_model("A100-SXM4-80GB")
    assert compare_models(known, known) == []
    first, *rest = known.profiles
    moved = replace(first, starts=first.starts[:-1], memory_mib=first.memory_mib + 1)
    extra = replace(first, name="9g.999gb")
    nvml = replace(known, profiles=(moved, *rest[1:], extra))
    differences = {(d.profile, d.field): d for d in compare_models(nvml, known)}
    assert set(differences) == {
        (first.name, "starts"),
        (first.name, "memory_mib"),
        (rest[0].name, "present"),
        ("9g.999gb", "present"),
    }
    assert not differences[(first.name, "memory_mib")].structural
    assert differences[(rest[0].name, "present")].nvml is False
    assert f"{first.name}: starts is" in str(differences[(first.name, "starts")])
