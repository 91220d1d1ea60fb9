"""Node agent test fixtures: fake `nvidia-cuda-mps-control`, socket directories, a started fake kubelet."""

from __future__ import annotations

import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from plugin_fakes import FakeKubelet

FAKE_MPS_CONTROL = """#!{python}
# Stands in for nvidia-cuda-mps-control: -d starts (writes the pid file), stdin carries one command.
import os, pathlib, sys
pipe = pathlib.Path(os.environ["CUDA_MPS_PIPE_DIRECTORY"])
pid = pipe / "nvidia-cuda-mps-control.pid"
log = pipe / "commands.log"
if "-d" in sys.argv:
    pid.write_text(str(os.getpid()))
    with log.open("a") as f:
        f.write("start " + os.environ["CUDA_VISIBLE_DEVICES"] + "\\n")
    sys.exit(0)
command = sys.stdin.read().strip()
if not pid.exists():
    print("Cannot find MPS control daemon process", file=sys.stderr)
    sys.exit(1)
with log.open("a") as f:
    f.write(command + "\\n")
if command == "quit":
    pid.unlink()
elif command.startswith("get_default_active_thread_percentage"):
    print("100.0")
"""


@pytest.fixture
def mps_command(tmp_path: Path) -> list[str]:
    script = tmp_path / "nvidia-cuda-mps-control"
    script.write_text(FAKE_MPS_CONTROL.format(python=sys.executable))
    script.chmod(0o755)
    return [str(script)]


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    """A short directory for unix sockets (their paths may not exceed ~107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="gp-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def kubelet(sock_dir: Path) -> Iterator[FakeKubelet]:
    fake = FakeKubelet(sock_dir)
    fake.start()
    yield fake
    fake.stop()
