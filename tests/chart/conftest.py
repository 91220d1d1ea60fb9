"""Fixtures for the chart tests: the helm binary and a `helm template` that returns parsed objects."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpupart_testsupport.chart import IMAGE_FLAGS

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "gpupart"
BUILD_SCRIPT = REPO / "scripts" / "build-k8s-bins.sh"

Render = Callable[..., list[dict[str, Any]]]


def find_helm() -> Path | None:
    """GPUPART_HELM, else helm in GPUPART_K8S_BIN or the build script's cache, else on PATH."""
    if os.environ.get("GPUPART_HELM"):
        return Path(os.environ["GPUPART_HELM"])
    candidates = []
    if os.environ.get("GPUPART_K8S_BIN"):
        candidates.append(Path(os.environ["GPUPART_K8S_BIN"]) / "helm")
    try:
        out = subprocess.run(
            [str(BUILD_SCRIPT), "--print-dir"], capture_output=True, text=True, timeout=30
        ).stdout.strip()
        if out:
            candidates.append(Path(out) / "helm")
    except (OSError, subprocess.SubprocessError):
        pass
    on_path = shutil.which("helm")
    if on_path:
        candidates.append(Path(on_path))
    return next((c for c in candidates if os.access(c, os.X_OK)), None)


@pytest.fixture(scope="session")
def helm(
    tmp_path_factory: pytest.TempPathFactory,
) -> Callable[..., subprocess.CompletedProcess[str]]:
    path = find_helm()
    if path is None:
        pytest.skip("no helm: build it with scripts/build-k8s-bins.sh or set GPUPART_HELM")
    home = tmp_path_factory.mktemp("helm-home")
    env = dict(os.environ)
    for var in ("HELM_CACHE_HOME", "HELM_CONFIG_HOME", "HELM_DATA_HOME"):
        env[var] = str(home / var.lower())

    def run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [str(path), *args], capture_output=True, text=True, env=env, timeout=120
        )
        if check and result.returncode != 0:
            raise AssertionError(
                f"helm {' '.join(args)} exited {result.returncode}:\n{result.stderr}"
            )
        return result

    return run


def set_flags(values: Mapping[str, Any]) -> list[str]:
    """--set-json key=value for each (so booleans and numbers keep their JSON type)."""
    import json

    return [arg for k, v in values.items() for arg in ("--set-json", f"{k}={json.dumps(v)}")]


@pytest.fixture(scope="session")
def render(helm: Callable[..., subprocess.CompletedProcess[str]]) -> Render:
    """`helm template` of the chart with the given values (after the test images); the rendered
    objects, CRDs included."""

    def run(
        values: Mapping[str, Any] | None = None,
        extra: Sequence[str] = (),
        namespace: str = "gpupart-system",
    ) -> list[dict[str, Any]]:
        result = helm(
            "template",
            "gp",
            str(CHART),
            "--namespace",
            namespace,
            "--include-crds",
            *IMAGE_FLAGS,
            *set_flags(values or {}),
            *extra,
        )
        return [doc for doc in yaml.safe_load_all(result.stdout) if doc]

    return run
