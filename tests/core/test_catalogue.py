"""GPU catalogue: every product's MIG table is self-consistent, and product names match as NVML and GFD spell them.

Aspects: table shape per product, name matching (NVML names, GFD labels, -SHARED and -MIG-
suffixes), unknown products and profiles raise errors that name them.
"""

import pytest

from gpupart.core.errors import InvalidInput, UnknownProduct, UnknownProfile
from gpupart.core.mig.catalogue import (
    MediaEngines,
    catalogue,
    find_gpu_model,
    parse_profile_name,
    require_gpu_model,
)

# product -> (memory slices, max instances, profile names) as the MIG user guide and
# mig-parted's default configuration list them
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
    "PG506-232": (
        8,
        7,
        {"1g.12gb", "1g.12gb+me", "1g.24gb", "2g.24gb", "3g.48gb", "4g.48gb", "7g.96gb"},
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
    "GH200-144GB": (
        8,
        7,
        {"1g.18gb", "1g.18gb+me", "1g.36gb", "2g.36gb", "3g.72gb", "4g.72gb", "7g.144gb"},
    ),
    "B200-180GB": (
        8,
        7,
        {"1g.23gb", "1g.23gb+me", "1g.45gb", "2g.45gb", "3g.90gb", "4g.90gb", "7g.180gb"},
    ),
    "GB200-186GB": (
        8,
        7,
        {"1g.23gb", "1g.23gb+me", "1g.47gb", "2g.47gb", "3g.93gb", "4g.93gb", "7g.186gb"},
    ),
    "B300-269GB": (
        8,
        7,
        {"1g.34gb", "1g.34gb+me", "1g.67gb", "2g.67gb", "3g.135gb", "4g.135gb", "7g.269gb"},
    ),
    "GB300-278GB": (
        8,
        7,
        {"1g.35gb", "1g.35gb+me", "1g.70gb", "2g.70gb", "3g.139gb", "4g.139gb", "7g.278gb"},
    ),
    "RTX-PRO-6000-96GB": (
        4,
        4,
        {
            *(f"1g.24gb{s}" for s in ("", "+me", "+gfx", "+me.all", "-me")),
            *(f"2g.48gb{s}" for s in ("", "+gfx", "+me.all", "-me")),
            "4g.96gb",
            "4g.96gb+gfx",
        },
    ),
}

# NVML's memorySizeMB as published -lgip outputs show it (issue 16's figures among them)
SEEN_MIB = {
    "A100-SXM4-40GB": {
        "1g.5gb": 4864,
        "2g.10gb": 9856,
        "3g.20gb": 19968,
        "4g.20gb": 19968,
        "7g.40gb": 40192,
    },
    "A100-PCIE-40GB": {"3g.20gb": 19968, "4g.20gb": 19968, "7g.40gb": 40192},
    "H100-SXM5-80GB": {"1g.10gb": 9984, "2g.20gb": 20096, "3g.40gb": 40448, "7g.80gb": 81152},
    "H100-NVL-94GB": {
        "1g.12gb": 11008,
        "1g.12gb+me": 11008,
        "1g.24gb": 22144,
        "2g.24gb": 22144,
        "4g.47gb": 47488,
        "7g.94gb": 95360,
    },
    "H100-96GB": {
        "1g.12gb": 11264,
        "1g.24gb": 23552,
        "2g.24gb": 23552,
        "3g.48gb": 47616,
        "4g.48gb": 47616,
        "7g.96gb": 95232,
    },
    "H200-141GB": {"1g.18gb": 16384, "2g.35gb": 33024, "3g.71gb": 71168, "7g.141gb": 143104},
    "GH200-144GB": {"1g.18gb": 17920, "2g.36gb": 36096},
    "B200-180GB": {"1g.23gb": 20992, "2g.45gb": 45312},
    "GB200-186GB": {"1g.23gb": 22528, "2g.47gb": 46592},
    "RTX-PRO-6000-96GB": {"1g.24gb": 24192, "2g.48gb": 48512, "4g.96gb": 97280},
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
        # only +me and +me.all profiles (and the whole GPU) take the OFA; -me takes nothing
        whole = profile.memory_slices == slices and profile.compute_slices == model.compute_slices
        assert (profile.engines.ofa > 0) == (suffix in ("+me", "+me.all") or whole), profile
        if suffix == "-me":
            assert profile.engines.within(MediaEngines())
        assert profile.engines.within(model.engines)
    by_slices = {}
    for profile in model.profiles:
        by_slices.setdefault(profile.memory_slices, set()).add(profile.memory_mib)
    assert all(len(v) == 1 for v in by_slices.values())
    ordered = [next(iter(by_slices[k])) for k in sorted(by_slices)]
    assert ordered == sorted(ordered)


@pytest.mark.parametrize("product", sorted(SEEN_MIB))
def test_memory_is_what_nvml_reported(product):
    model = require_gpu_model(product)
    assert {n: model.require_profile(n).memory_mib for n in SEEN_MIB[product]} == SEEN_MIB[product]


def test_rtx_pro_6000_profile_ids_and_engines_are_nvidias():
    model = require_gpu_model("NVIDIA RTX PRO 6000 Blackwell Server Edition")
    ids = {p.name: p.profile_id for p in model.profiles}
    assert ids == {
        "1g.24gb": 14,
        "1g.24gb+me": 21,
        "1g.24gb+gfx": 47,
        "1g.24gb+me.all": 65,
        "1g.24gb-me": 67,
        "2g.48gb": 5,
        "2g.48gb+gfx": 35,
        "2g.48gb+me.all": 64,
        "2g.48gb-me": 66,
        "4g.96gb": 0,
        "4g.96gb+gfx": 32,
    }
    assert model.engines == MediaEngines(decoders=4, encoders=4, jpeg=4, ofa=1)
    assert model.require_profile("1g.24gb+me.all").engines == model.engines
    assert model.require_profile("2g.48gb").starts == (0, 2)


# Every NVML name issue 16 lists (and those before it), with the entry it belongs to.
NVML_NAMES = {
    "NVIDIA A30": "A30-24GB",
    "NVIDIA A100-SXM4-40GB": "A100-SXM4-40GB",
    "NVIDIA A100-PCIE-40GB": "A100-PCIE-40GB",
    "NVIDIA A100-SXM4-80GB": "A100-SXM4-80GB",
    "NVIDIA A100-SXM-80GB": "A100-SXM4-80GB",
    "NVIDIA A100 80GB PCIe": "A100-PCIE-80GB",
    "NVIDIA A800 40GB Active": "A100-PCIE-40GB",
    "NVIDIA A800-SXM4-80GB": "A100-SXM4-80GB",
    "NVIDIA A800 80GB PCIe": "A100-PCIE-80GB",
    "NVIDIA PG506-232": "PG506-232",
    "NVIDIA H100 80GB HBM3": "H100-SXM5-80GB",
    "NVIDIA H100 PCIe": "H100-PCIE-80GB",
    "NVIDIA H100 NVL": "H100-NVL-94GB",
    "NVIDIA H800": "H100-SXM5-80GB",
    "NVIDIA H800 PCIe": "H100-PCIE-80GB",
    "NVIDIA H800 NVL": "H100-NVL-94GB",
    "NVIDIA GH200 480GB": "H100-96GB",
    "NVIDIA GH200 120GB": "H100-96GB",
    "NVIDIA H20": "H20-96GB",
    "NVIDIA H200": "H200-141GB",
    "NVIDIA H200 NVL": "H200-141GB",
    "NVIDIA GH200 144G HBM3e": "GH200-144GB",
    "NVIDIA B200": "B200-180GB",
    "NVIDIA GB200": "GB200-186GB",
    "NVIDIA B300 SXM6 AC": "B300-269GB",
    "NVIDIA GB300": "GB300-278GB",
    "NVIDIA RTX PRO 6000 Blackwell Server Edition": "RTX-PRO-6000-96GB",
}


@pytest.mark.parametrize(("nvml", "product"), sorted(NVML_NAMES.items()))
def test_every_nvml_name_and_its_gfd_labels_match(nvml, product):
    model = require_gpu_model(nvml)
    assert model.product == product
    label = nvml.replace(" ", "-")  # GFD's nvidia.com/gpu.product
    labels = [label, f"{label}-SHARED", *(f"{label}-MIG-{p}" for p in model.profile_names)]
    labels += [f"{label}-MIG-{model.profiles[0].name}-SHARED", label.lower()]
    assert {require_gpu_model(name).product for name in labels} == {product}


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

    from gpupart.core.mig.catalogue import compare_models, require_gpu_model

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


def test_every_profile_name_flows_through_resource_names_and_pod_requests():
    import re

    from gpupart.core.api.pods import parse_pod_request
    from gpupart.core.api.resources import find_mig_profile, mig_resource_name

    # Kubernetes: an extended resource's name after the prefix is a qualified name (no '+')
    qualified = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
    for model in catalogue():
        for profile in model.profiles:
            resource = mig_resource_name(profile.name)
            assert qualified.match(resource.removeprefix("nvidia.com/")), resource
            assert find_mig_profile(resource) == profile.name
            parse_profile_name(profile.name)
            pod = {"spec": {"containers": [{"resources": {"limits": {resource: 1}}}]}}
            assert parse_pod_request(pod).mig == ((profile.name, 1),)
    assert mig_resource_name("1g.24gb+me.all") == "nvidia.com/mig-1g.24gb.me.all"
    assert mig_resource_name("2g.48gb-me") == "nvidia.com/mig-2g.48gb-me"
