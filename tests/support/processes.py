"""Helper processes of the tests (control plane, kubelets, gpupart components): start, log to a file, stop."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path


def _set_parent_death_signal() -> None:
    """In the child before exec: die with SIGKILL if pytest itself dies (Linux only).

    atexit and fixture finalizers do not run when pytest is SIGKILLed; this makes sure the
    processes we started do not outlive it even then.
    """
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        with contextlib.suppress(OSError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


@dataclass
class Proc:
    """One process we started: its Popen and the file its output goes to."""

    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, lines: int = 40) -> str:
        try:
            text = self.log.read_text(errors="replace")
        except OSError as e:
            return f"(no log: {e})"
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, grace: float = 10) -> None:
        """SIGTERM the process group we created, SIGKILL it after grace seconds."""
        if self.popen.poll() is not None:
            return
        pgid = self.popen.pid  # start_new_session made the child its own group leader
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        try:
            self.popen.wait(grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
            self.popen.wait(5)


def spawn(
    name: str,
    args: list[str],
    log_dir: Path,
    *,
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
) -> Proc:
    """Start a process whose output goes to `<log_dir>/<name>.log` (appended).

    Own session: a Ctrl-C in the terminal reaches the test runner only, which then stops these
    in order, and `Proc.stop` signals the whole group we created, nothing else. It dies with
    the process that started it (Linux), even when that one is SIGKILLed.
    """
    log = log_dir / f"{name}.log"
    with log.open("ab") as out:
        out.write(f"\n=== {' '.join(args)}\n".encode())
        out.flush()
        popen = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            env=None if env is None else {**os.environ, **env},
            start_new_session=True,
            preexec_fn=_set_parent_death_signal,  # noqa: PLW1509 - only prctl, before exec
        )
    return Proc(name, popen, log)
