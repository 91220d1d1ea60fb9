"""The poison corpus through the core's parser and `gpupart plan`: every case refused, naming its field.

Aspects: each bad spec is InvalidInput naming the field, with a short message; specs at the
bounds still parse; `gpupart plan` on one file holding every case answers each document with
its reason and exit code 2 (a real subprocess), and refuses non-UTF-8, duplicate keys and a
100,000-digit integer at their line.
"""

import subprocess
import sys

import pytest
import yaml
from poison import GOOD_SPECS, PARTITION_CASES, partition

from gpupart.core.api.spec import parse_partition
from gpupart.core.errors import InvalidInput


@pytest.mark.parametrize(
    ("spec", "field"), [(s, f) for _, s, f in PARTITION_CASES], ids=[c[0] for c in PARTITION_CASES]
)
def test_each_poison_spec_is_refused_naming_its_field(spec, field):
    with pytest.raises(InvalidInput) as refused:
        parse_partition(partition(spec))
    assert field in str(refused.value), refused.value
    assert len(str(refused.value)) < 500, "a message never echoes the whole input"


@pytest.mark.parametrize("spec", GOOD_SPECS)
def test_specs_at_the_bounds_still_parse(spec):
    assert parse_partition(partition(spec)).name == "poison"


def plan(*args):
    return subprocess.run(
        [sys.executable, "-m", "gpupart.cli", "plan", "--product", "A100-SXM4-80GB", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_plan_answers_every_poison_document_with_its_field(tmp_path):
    path = tmp_path / "poison.yaml"
    documents = [partition(spec, name=f"p{n}") for n, (_, spec, _) in enumerate(PARTITION_CASES)]
    path.write_text(yaml.safe_dump_all([*documents, partition(GOOD_SPECS[0], name="good")]))
    result = plan(str(path))
    assert result.returncode == 2
    lines = result.stderr.splitlines()
    assert len(lines) == len(PARTITION_CASES), result.stderr[-2000:]
    for number, ((case, _, field), line) in enumerate(zip(PARTITION_CASES, lines, strict=True)):
        assert line.startswith(f"gpupart plan: {path} (document {number + 1}): "), (case, line)
        assert field in line, (case, line)
        assert len(line) < 600, (case, line[:600])
    assert "GpuPartition good" in result.stdout, "the good document after them is still planned"


@pytest.mark.parametrize(
    ("content", "words"),
    [
        (b"apiVersion: gpupart.io/v1alpha1\nkind: \xff\xfe\n", "is not UTF-8 text (byte 38"),
        (
            b"spec:\n  mode: MIG\n  mode: MPS\n",
            "poison.yaml:3: malformed YAML: duplicate key 'mode'",
        ),
        (
            b"spec:\n  priority: " + b"9" * 100_000 + b"\n",
            "poison.yaml:2: malformed YAML: an integer",
        ),
    ],
)
def test_plan_refuses_unreadable_files_at_their_place(tmp_path, content, words):
    path = tmp_path / "poison.yaml"
    path.write_bytes(content)
    result = plan(str(path))
    assert result.returncode == 2
    assert words in result.stderr, result.stderr[:500]
    assert result.stdout == ""
