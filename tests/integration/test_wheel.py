"""The project installs as a built wheel, not only editable: every import root is inside it and imports from it."""

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).parents[2]
IMPORT_ROOTS = ("gpupart", "gpupart.core", "gpupart_operator", "gpupart_plugin", "gpupart_extender")


def test_wheel_holds_every_package_and_imports_from_it(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
        timeout=300,
        cwd=tmp_path,
    )
    (wheel,) = tmp_path.glob("gpupart-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for root in IMPORT_ROOTS:
        assert f"{root.replace('.', '/')}/__init__.py" in names, root
    assert not any(n.startswith(("operator/", "plugin/", "extender/", "tests/")) for n in names)
    assert any(n.endswith("entry_points.txt") for n in names)
    # Import from the wheel alone (zip import), with the checkout off the path.
    probe = (
        "; ".join(f"import {r}" for r in IMPORT_ROOTS)
        + "; import gpupart.core.mig.layout as m; print(m.__file__)"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe],
        env={"PYTHONPATH": str(wheel), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=60,
        check=True,
    )
    assert result.stdout.strip().startswith(str(wheel))
