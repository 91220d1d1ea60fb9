"""The chart's DRA DeviceClasses: off by default, one per kind and per catalogued MIG profile, CEL on our driver."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from gpupart.core.api.resources import mig_resource_name
from gpupart.core.api.spec import Interface, Mode, parse_partition
from gpupart.core.dra import names
from gpupart.core.mig.catalogue import catalogue
from gpupart_testsupport.chart import IMAGE_FLAGS

from .conftest import CHART, Render

EXAMPLES = CHART / "examples" / "dra"


def classes(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == "DeviceClass"}


def test_no_device_class_by_default(render: Render) -> None:
    assert classes(render()) == {}


def test_one_class_per_kind_and_per_catalogued_profile(render: Render) -> None:
    found = classes(render({"dra.enabled": True}))
    profiles = sorted({p.name for m in catalogue() for p in m.profiles})
    expected = {"gpu.gpupart.io", "mig.gpupart.io", "shared.gpupart.io"} | {
        f"mig-{names.profile_label(p)}.gpupart.io" for p in profiles
    }
    assert set(found) == expected
    assert found["gpu.gpupart.io"]["spec"]["extendedResourceName"] == "nvidia.com/gpu"
    for profile in profiles:
        spec = found[f"mig-{names.profile_label(profile)}.gpupart.io"]["spec"]
        assert spec["extendedResourceName"] == mig_resource_name(profile)
        (selector,) = spec["selectors"]
        expression = selector["cel"]["expression"]
        assert f'device.driver == "{names.DRIVER}"' in expression
        assert f'.profile == "{profile}"' in expression
    names_ = [c["spec"].get("extendedResourceName") for c in found.values()]
    assert len([n for n in names_ if n]) == len({n for n in names_ if n})  # never twice


def test_extended_resources_can_be_left_out(render: Render) -> None:
    found = classes(render({"dra.enabled": True, "dra.extendedResources": False}))
    assert found and all("extendedResourceName" not in c["spec"] for c in found.values())


def test_the_profile_file_is_the_catalogue() -> None:
    """files/dra-mig-profiles.json is written from the core: it must not drift from it."""
    rows = json.loads((CHART / "files" / "dra-mig-profiles.json").read_text())["profiles"]
    profiles = sorted({p.name for m in catalogue() for p in m.profiles})
    assert [r["profile"] for r in rows] == profiles
    for row in rows:
        assert row["label"] == names.profile_label(row["profile"])
        assert row["extendedResourceName"] == mig_resource_name(row["profile"])


def test_the_examples_name_only_classes_the_chart_installs(render: Render) -> None:
    installed = set(classes(render({"dra.enabled": True})))
    used: set[str] = set()

    def walk(node: object) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "deviceClassName":
                    used.add(value)
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    files = sorted(p for p in Path(EXAMPLES).glob("*.yaml") if p.name not in PARTITIONS)
    assert {f.name for f in files} == {"whole-gpu.yaml", "mig.yaml", "shared.yaml"}
    for path in files:
        for doc in yaml.safe_load_all(path.read_text()):
            walk(doc)
    assert used and used <= installed


PARTITIONS = {
    "partition-whole.yaml": (Mode.NONE, False),
    "partition-mig.yaml": (Mode.MIG, False),
    "partition-mig-dynamic.yaml": (Mode.MIG, True),
    "partition-mps.yaml": (Mode.MPS, False),
}
"""The GpuPartition examples with `interface: dra`: one per kind of DRA device (docs/dra.md)."""


def test_one_dra_partition_example_per_kind_and_each_parses() -> None:
    found = {p.name for p in Path(EXAMPLES).glob("partition-*.yaml")}
    assert found == set(PARTITIONS)
    for name, (mode, dynamic) in PARTITIONS.items():
        (doc,) = yaml.safe_load_all((EXAMPLES / name).read_text())
        spec = parse_partition(doc)
        assert spec.config.interface is Interface.DRA, name
        assert (spec.config.mode, spec.dynamic is not None) == (mode, dynamic), name


def test_helm_lint_passes_with_dra_on_and_strict(helm: Callable[..., Any]) -> None:
    """The offline schemas do not know DeviceClass; the e2e test applies them to a real API server."""
    result = helm("lint", "--strict", str(CHART), *IMAGE_FLAGS, "--set-json", "dra.enabled=true")
    assert "0 chart(s) failed" in result.stdout
