"""The fake runtime's CDI resolution (tests/k8s/kubernetes/fakeruntime/cdi.go): its Go tests, on the pinned modules.

The rules containerd's CDI cache follows and the runtime copies: edits merged in request order
(a spec's own edits once), a malformed file or a conflict fails only the IDs they would define,
changed files read again, bounded input. The e2e tests (test_dra_kubelet.py) show the same
through the real kubelet; these cover each rule without a cluster.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

MODULE = Path(__file__).resolve().parents[1] / "k8s" / "kubernetes"


def test_the_fake_runtimes_cdi_rules() -> None:
    go = shutil.which("go") or (
        "/usr/local/go/bin/go" if os.access("/usr/local/go/bin/go", os.X_OK) else None
    )
    if go is None:
        if os.environ.get("GPUPART_E2E_REQUIRED") == "1":
            pytest.fail("no `go` on PATH, which the Kubernetes binaries' build needs too")
        pytest.skip("no `go` on PATH (scripts/build-k8s-bins.sh needs it as well)")
    result = subprocess.run(
        [go, "test", "-count=1", "-vet=off", "-run", ".", "./fakeruntime"],
        cwd=MODULE,
        env={**os.environ, "CGO_ENABLED": "0", "GOFLAGS": "-mod=readonly"},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ok  \tgpupart.test/k8sbins/kubernetes/fakeruntime" in result.stdout, result.stdout
