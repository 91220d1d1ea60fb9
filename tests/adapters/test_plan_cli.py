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


# NVML names of every catalogued product, as `--product` takes them
NVML_NAMES = [
    "NVIDIA A30",
    "NVIDIA A100-SXM4-40GB",
    "NVIDIA A100-PCIE-40GB",
    "NVIDIA A100-SXM4-80GB",
    "NVIDIA A100-SXM-80GB",
    "NVIDIA A100 80GB PCIe",
    "NVIDIA A800 40GB Active",
    "NVIDIA A800-SXM4-80GB",
    "NVIDIA A800 80GB PCIe",
    "NVIDIA PG506-232",
    "NVIDIA H100 80GB HBM3",
    "NVIDIA H100 PCIe",
    "NVIDIA H100 NVL",
    "NVIDIA H800",
    "NVIDIA H800 PCIe",
    "NVIDIA H800 NVL",
    "NVIDIA GH200 480GB",
    "NVIDIA GH200 120GB",
    "NVIDIA H20",
    "NVIDIA H200",
    "NVIDIA H200 NVL",
    "NVIDIA GH200 144G HBM3e",
    "NVIDIA B200",
    "NVIDIA GB200",
    "NVIDIA B300 SXM6 AC",
    "NVIDIA GB300",
    "NVIDIA RTX PRO 6000 Blackwell Server Edition",
]


def standard_layouts(product: str) -> dict[str, dict[str, int]]:
    """mig-parted's standard configurations for the product: all-<profile> for every profile
    (the +me, +me.all, +gfx and -me variants among them), all-balanced, and one +me with
    plain 1g instances filling the GPU."""
    from gpupart.core.mig.catalogue import require_gpu_model

    model = require_gpu_model(product)
    plain = {
        (p.compute_slices, p.memory_slices): p.name
        for p in model.profiles
        if "+" not in p.name and "-" not in p.name
    }
    layouts = {f"all-{p.name}": {p.name: p.max_count} for p in model.profiles}
    balanced = {plain[(1, 1)]: 2, plain[(2, 2)]: 1}
    if model.memory_slices == 8:
        balanced[plain[(3, 4)]] = 1
    layouts["all-balanced"] = balanced
    (media,) = [p.name for p in model.profiles if p.name.endswith("+me") and p.compute_slices == 1]
    layouts["1g-me-and-1g"] = {media: 1, plain[(1, 1)]: model.compute_slices - 1}
    return layouts


@pytest.mark.parametrize("product", NVML_NAMES)
def test_plan_accepts_the_standard_layouts_on_every_product(tmp_path, product):
    layouts = standard_layouts(product)
    path = tmp_path / "standard.yaml"
    path.write_text(
        "\n---\n".join(
            "apiVersion: gpupart.io/v1alpha1\nkind: GpuPartition\n"
            f"metadata: {{name: {name}}}\nspec:\n  mode: MIG\n  mig:\n"
            f"    devices: {json.dumps(devices)}\n"
            for name, devices in layouts.items()
        )
    )
    result = plan("--product", product, "--json", str(path))
    assert result.returncode == 0, result.stderr
    answers = [json.loads(line) for line in result.stdout.splitlines()]
    assert [a["partition"] for a in answers] == list(layouts)
    for answer in answers:
        counts: dict[str, int] = {}
        for instance in answer["layout"]:
            counts[instance["profile"]] = counts.get(instance["profile"], 0) + 1
        assert counts == layouts[answer["partition"]]


@pytest.mark.parametrize(
    ("product", "devices", "memory"),
    [
        ("NVIDIA A100-SXM4-40GB", {"3g.20gb": 1, "4g.20gb": 0}, {"3g.20gb": 19968}),
        ("NVIDIA A100-PCIE-40GB", {"4g.20gb": 1}, {"4g.20gb": 19968}),
        ("NVIDIA A100-SXM4-40GB", {"7g.40gb": 1}, {"7g.40gb": 40192}),
        (
            "NVIDIA H100 NVL",
            {"1g.12gb": 1, "1g.12gb+me": 1, "1g.24gb": 1, "2g.24gb": 1},
            {"1g.12gb": 11008, "1g.12gb+me": 11008, "1g.24gb": 22144, "2g.24gb": 22144},
        ),
        (
            "NVIDIA GH200 480GB",
            {"1g.12gb": 1, "1g.24gb": 1, "3g.48gb": 1},
            {"1g.12gb": 11264, "1g.24gb": 23552, "3g.48gb": 47616},
        ),
        ("NVIDIA GH200 480GB", {"2g.24gb": 1}, {"2g.24gb": 23552}),
        ("NVIDIA GH200 480GB", {"4g.48gb": 1}, {"4g.48gb": 47616}),
        ("NVIDIA GH200 480GB", {"7g.96gb": 1}, {"7g.96gb": 95232}),
        ("NVIDIA B200", {"1g.23gb": 1}, {"1g.23gb": 20992}),
    ],
)
def test_plan_json_prints_nvmls_memory_figures(tmp_path, product, devices, memory):
    result = plan("--product", product, "--json", str(partition(tmp_path, json.dumps(devices))))
    assert result.returncode == 0, result.stderr
    printed = {i["profile"]: i["memoryMiB"] for i in json.loads(result.stdout)["layout"]}
    assert printed == memory


def test_two_media_extension_instances_are_refused_naming_the_media_engines(tmp_path):
    devices = '{"1g.6gb+me": 1, "2g.12gb+me": 1}'
    result = plan("--product", "NVIDIA A30", str(partition(tmp_path, devices)))
    assert result.returncode == 2
    assert "media engines" in result.stderr and "too few JPEG and OFA" in result.stderr


@pytest.mark.parametrize("example", ["mig-a100.yaml", "mps-h100.yaml"])
def test_each_shipped_example_fits_the_gpu_its_selector_names(example):
    # mps-h100 once asked 8 x 10Gi of an H100-SXM5-80GB's 81559 MiB: refused on every node.
    path = EXAMPLE.with_name(example)
    product = next(
        line.split(":", 1)[1].strip()
        for line in path.read_text().splitlines()
        if "nvidia.com/gpu.product:" in line
    )
    result = plan("--product", product, str(path))
    assert result.returncode == 0, result.stderr


SHIPPED = sorted((EXAMPLE.parent).glob("*.yaml"))
PLANS = {
    "mig-a100.yaml": "GpuPartition mig-a100: MIG on A100-SXM4-80GB, every GPU of each node\n",
    "mig-dynamic-h100.yaml": (
        "GpuPartition mig-dynamic-h100: MIG on H100-SXM5-80GB, every GPU of each node\n"
    ),
    "mps-h100.yaml": (
        "GpuPartition mps-h100: MPS on H100-SXM5-80GB, every GPU of each node\n"
        "  up to 8 MPS clients per GPU (nvidia.com/gpu.shared), 9216 MiB each by default, "
        "25% of SMs each\n"
    ),
    "timeslicing-l4.yaml": (
        "GpuPartition timeslicing-l4: TimeSlicing on NVIDIA-L4, GPU 0, 1 of each node\n"
        "  4 time-sliced replicas per GPU (nvidia.com/gpu.shared)\n"
    ),
    "whole-gpus.yaml": (
        "GpuPartition whole-gpus: None on any GPU product, every GPU of each node\n"
        "  whole GPUs, no partitioning (nvidia.com/gpu)\n"
    ),
}
"""What `gpupart plan FILE` prints for each shipped example (its first line, or all of it)."""


def test_every_shipped_example_is_covered():
    assert sorted(p.name for p in SHIPPED) == sorted(PLANS)


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_plan_takes_every_shipped_example_as_written(path):
    # no --product: the nodeSelector's nvidia.com/gpu.product names it, or the mode needs none
    result = plan(str(path))
    assert (result.returncode, result.stderr) == (0, ""), result.stderr
    assert result.stdout.startswith(PLANS[path.name])
    assert json.loads(plan("--json", str(path)).stdout)["feasible"] is True


@pytest.mark.parametrize("path", sorted((EXAMPLE.parents[3] / "docs" / "examples").glob("*.yaml")))
def test_plan_refuses_the_pod_examples_naming_what_they_are(path):
    result = plan(str(path))
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == (
        f"gpupart plan: {path}: apiVersion/kind: expected gpupart.io/v1alpha1 GpuPartition, "
        "got v1 Pod\n"
    )


def test_a_mig_partition_without_a_product_anywhere_is_refused_saying_what_to_give(tmp_path):
    path = partition(tmp_path, "{1g.10gb: 1}")
    result = plan(str(path))
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == (
        f"gpupart plan: {path}: spec.nodeSelector: names no nvidia.com/gpu.product, and MIG "
        "layouts depend on the GPU: give --product NAME\n"
    )


def test_a_selector_naming_several_products_plans_each(tmp_path):
    path = tmp_path / "two.yaml"
    path.write_text(
        "apiVersion: gpupart.io/v1alpha1\nkind: GpuPartition\nmetadata: {name: two}\nspec:\n"
        "  nodeSelector:\n    matchExpressions:\n      - key: nvidia.com/gpu.product\n"
        "        operator: In\n        values: [NVIDIA-A100-SXM4-80GB, NVIDIA-A100-SXM4-40GB]\n"
        "  mode: MPS\n  mps: {maxClients: 4, defaultMemory: 12Gi}\n"
    )
    result = plan(str(path))
    assert result.returncode == 2  # fits the 80 GB GPU, not the 40 GB one
    assert result.stdout == (
        "GpuPartition two: MPS on A100-SXM4-80GB, every GPU of each node\n"
        "  up to 4 MPS clients per GPU (nvidia.com/gpu.shared), 12288 MiB each by default\n"
    )
    assert result.stderr == (
        f"gpupart plan: {path}: spec.mps: 4 clients × 12288 MiB = 49152 MiB, more than the "
        "40960 MiB of a A100-SXM4-40GB\n"
    )


def test_mps_memory_on_a_product_without_figures_is_refused_not_guessed(tmp_path):
    path = tmp_path / "l4.yaml"
    path.write_text(
        "apiVersion: gpupart.io/v1alpha1\nkind: GpuPartition\nmetadata: {name: l4}\nspec:\n"
        "  nodeSelector: {matchLabels: {nvidia.com/gpu.product: NVIDIA-L4}}\n"
        "  mode: MPS\n  mps: {maxClients: 4, defaultMemory: 4Gi}\n"
    )
    result = plan(str(path))
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == (
        f"gpupart plan: {path}: spec.mps.defaultMemory: gpupart knows no memory size of a "
        "'NVIDIA-L4' to check 4 clients × defaultMemory against; leave defaultMemory out, or "
        "plan for a catalogued product (--product)\n"
    )


def test_readme_plan_example_prints_what_the_readme_shows():
    readme = (EXAMPLE.parents[3] / "README.md").read_text()
    block = readme.split("```console\n$ gpupart plan ", 1)[1].split("```", 1)[0]
    command, _, shown = block.partition("\n")
    root = EXAMPLE.parents[3]
    result = plan(*(str(root / a) if a.endswith(".yaml") else a for a in command.split()))
    assert result.returncode == 0, result.stderr
    assert result.stdout == shown


@pytest.mark.parametrize(
    "path",
    sorted((EXAMPLE.parent / "dra").glob("partition-*.yaml")),
    ids=lambda p: p.name,
)
def test_plan_says_a_dra_partition_is_served_through_dra(path):
    result = plan(str(path))
    assert (result.returncode, result.stderr) == (0, ""), result.stderr
    first, *rest = result.stdout.splitlines()
    assert first.endswith(", through DRA (driver gpu.gpupart.io)"), first
    if "dynamic" in path.name:  # no warm mix, no MIG plan: the scheduler allocates placements
        assert "dynamic MIG through DRA: every placement of 1g.10gb" in "\n".join(rest)
        assert "warm mix" not in result.stdout
    assert json.loads(plan("--json", str(path)).stdout)["interface"] == "dra"
    assert json.loads(plan("--json", str(EXAMPLE)).stdout)["interface"] == "devicePlugin"
