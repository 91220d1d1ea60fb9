"""`gpupart plan` as a user runs it: a real subprocess, exit codes, stdout/stderr, every bad input path."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).parents[2] / "charts" / "gpupart" / "examples" / "mig-a100.yaml"


def plan(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpupart.cli", "plan", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def partition(tmp_path: Path, devices: str, name: str = "p") -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(
        "apiVersion: gpupart.io/v1alpha1\nkind: GpuPartition\n"
        f"metadata: {{name: {name}}}\nspec:\n  mode: MIG\n  mig:\n    devices: {devices}\n"
    )
    return path


def test_plan_prints_the_layout_per_gpu():
    result = plan("--product", "NVIDIA-A100-SXM4-80GB", str(EXAMPLE))
    assert result.returncode == 0, result.stderr
    assert "4-7    3g.40gb" in result.stdout
    assert "nvidia.com/mig-1g.10gb" in result.stdout


@pytest.mark.parametrize("product", ["NVIDIA H100 80GB HBM3", "NVIDIA-H100-80GB-HBM3", "H100-PCIe"])
def test_plan_json_for_machines(product):
    result = plan("--product", product, "--json", str(EXAMPLE))
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout)
    assert answer["feasible"] is True and answer["partition"] == "mig-a100"
    assert sorted((i["profile"], i["start"]) for i in answer["layout"]) == [
        ("1g.10gb", 0),
        ("1g.10gb", 1),
        ("2g.20gb", 2),
        ("3g.40gb", 4),
    ]


@pytest.mark.parametrize(
    ("product", "devices", "words"),
    [
        ("Tesla T4", "{1g.10gb: 1}", "unknown GPU product 'Tesla T4'"),
        ("A30", "{3g.40gb: 1}", "MIG profile '3g.40gb' is not offered by A30-24GB"),
        ("A100-SXM4-80GB", "{3g.40gb: 3}", "3 × 3g.40gb requested, at most 2"),
        ("A100-SXM4-80GB", "{1g.10gb: -2}", "spec.mig.devices.1g.10gb: must be ≥ 0"),
        ("A100-SXM4-80GB", "{4g.40gb: 1, 2g.20gb: 2}", "8 compute slices"),
        ("A100-SXM4-80GB", "{1g.10gb: 1, 7g.80gb: 1}", "9 memory slices"),
    ],
)
def test_bad_input_exits_2_with_the_reason_on_stderr(tmp_path, product, devices, words):
    result = plan("--product", product, str(partition(tmp_path, devices)))
    assert result.returncode == 2
    assert words in result.stderr
    assert result.stdout == ""


def test_malformed_yaml_names_file_and_line(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text(
        "apiVersion: gpupart.io/v1alpha1\nkind: GpuPartition\nspec:\n  mig: {devices: {1g.10gb: 1}\n"
    )
    result = plan("--product", "A100-SXM4-80GB", str(path))
    assert result.returncode == 2
    assert f"{path}:" in result.stderr and "malformed YAML" in result.stderr


def test_missing_file_and_non_mapping_document(tmp_path):
    assert "cannot read" in plan("--product", "A100-SXM4-80GB", str(tmp_path / "none.yaml")).stderr
    listing = tmp_path / "list.yaml"
    listing.write_text("- 1\n- 2\n")
    result = plan("--product", "A100-SXM4-80GB", str(listing))
    assert result.returncode == 2 and "must be a mapping" in result.stderr


def test_json_infeasible_answer_still_exits_2(tmp_path):
    result = plan("--product", "H200", "--json", str(partition(tmp_path, "{7g.141gb: 2}")))
    assert result.returncode == 2
    assert json.loads(result.stdout)["feasible"] is False
