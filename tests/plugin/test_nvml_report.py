"""`gpupart nvml-report` (read-only NVML report) through the CLI, on simulated GPUs."""

from __future__ import annotations

import json

import pytest

from gpupart.cli import main
from gpupart.core.mig.catalogue import require_gpu_model


def test_report_lists_gpus_profiles_and_no_difference_for_catalogued_geometry(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["nvml-report", "--simulate", "2xA100-SXM4-80GB:mig-off,A30-24GB"]) == 0
    gpus = json.loads(capsys.readouterr().out)["gpus"]
    assert [g["catalogue_product"] for g in gpus] == ["A100-SXM4-80GB"] * 2 + ["A30-24GB"]
    assert [g["mig_enabled"] for g in gpus] == [False, False, True]
    for gpu in gpus:
        known = require_gpu_model(gpu["catalogue_product"])
        assert [p["name"] for p in gpu["profiles"]] == [p.name for p in known.profiles]
        assert gpu["differences"] == []
        starts = {p["name"]: tuple(p["starts"]) for p in gpu["profiles"]}
        assert starts == {p.name: p.starts for p in known.profiles}


def test_an_unknown_product_is_a_clear_error_and_exit_2(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["nvml-report", "--simulate", "H100-80GB"]) == 2
    err = capsys.readouterr().err
    assert "unknown GPU product 'H100-80GB'" in err and "H100-SXM5-80GB" in err
