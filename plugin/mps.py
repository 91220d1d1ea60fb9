"""MPS control daemons, one per shared GPU, each with its pipe and log directory under the host MPS root."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from gpupart import logs
from gpupart.core.node.mps import LOG_ENV, PIPE_ENV, MpsLimits, daemon_commands
from gpupart_plugin.backend import NvmlError, NvmlFailure

log = logging.getLogger(__name__)

MARKER = ".started"
"""Written after the daemon is up and configured; holds the limits it was given."""


class MpsDaemons:
    """Starts, configures, checks and stops `nvidia-cuda-mps-control` daemons (command injectable)."""

    def __init__(self, root: Path, command: Sequence[str], *, timeout_s: float = 10.0) -> None:
        self.root = root
        self.command = tuple(command)
        self.timeout_s = timeout_s

    def directory(self, gpu_uuid: str) -> Path:
        return self.root / gpu_uuid

    def pipe_directory(self, gpu_uuid: str) -> Path:
        return self.directory(gpu_uuid) / "pipe"

    def running(self) -> frozenset[str]:
        """GPU UUIDs with a started marker (checked for liveness by `ensure`)."""
        if not self.root.is_dir():
            return frozenset()
        return frozenset(p.parent.name for p in self.root.glob(f"*/{MARKER}"))

    def limits(self, gpu_uuid: str) -> MpsLimits | None:
        """The limits the GPU's daemon was configured with, None when it was not started."""
        try:
            return MpsLimits(**json.loads((self.directory(gpu_uuid) / MARKER).read_text()))
        except (OSError, ValueError, TypeError):
            return None

    def serving(self, gpu_uuid: str) -> MpsLimits | None:
        """The limits of the GPU's daemon when it was started and answers now, else None."""
        limits = self.limits(gpu_uuid)
        return limits if limits is not None and self._alive(gpu_uuid) else None

    def ensure(self, gpu_uuid: str, limits: MpsLimits) -> None:
        """The GPU's daemon runs with `limits`; idempotent (no command when already so)."""
        marker = self.directory(gpu_uuid) / MARKER
        wanted = json.dumps(asdict(limits), sort_keys=True)
        if marker.exists() and self._alive(gpu_uuid):
            if marker.read_text() == wanted:
                return
        else:
            pipe, log_dir = self.pipe_directory(gpu_uuid), self.directory(gpu_uuid) / "log"
            pipe.mkdir(parents=True, exist_ok=True, mode=0o755)
            # Mounted as the clients' /dev/shm (MPS shares memory through it); a tmpfs in production.
            (self.root / "shm").mkdir(exist_ok=True)
            log_dir.mkdir(parents=True, exist_ok=True, mode=0o755)
            marker.unlink(missing_ok=True)
            self._run(gpu_uuid, ["-d"], None)
            log.info("Started MPS control daemon", extra=logs.kv(gpu=gpu_uuid, pipe=pipe))
        for command in daemon_commands(limits):
            self._run(gpu_uuid, [], command)
        marker.write_text(wanted)
        log.info(
            "Configured MPS defaults",
            extra=logs.kv(
                gpu=gpu_uuid, memoryMiB=limits.memory_mib, computePercent=limits.compute_percent
            ),
        )

    def stop(self, gpu_uuid: str) -> None:
        directory = self.directory(gpu_uuid)
        if not directory.exists():
            return
        if self._alive(gpu_uuid):
            self._run(gpu_uuid, [], "quit")
            log.info("Stopped MPS control daemon", extra=logs.kv(gpu=gpu_uuid))
        (directory / MARKER).unlink(missing_ok=True)
        shutil.rmtree(directory / "log", ignore_errors=True)

    def _alive(self, gpu_uuid: str) -> bool:
        try:
            self._run(gpu_uuid, [], "get_default_active_thread_percentage")
        except NvmlError:
            return False
        return True

    def _run(self, gpu_uuid: str, flags: list[str], stdin: str | None) -> str:
        env = {
            **os.environ,
            PIPE_ENV: str(self.pipe_directory(gpu_uuid)),
            LOG_ENV: str(self.directory(gpu_uuid) / "log"),
            # The daemon sees only its GPU, as ordinal 0 (daemon_commands relies on it).
            "CUDA_VISIBLE_DEVICES": gpu_uuid,
        }
        what = f"MPS control {' '.join(flags) or stdin} for GPU {gpu_uuid}"
        try:
            done = subprocess.run(
                [*self.command, *flags],
                input=None if stdin is None else stdin + "\n",
                env=env,
                capture_output=True,
                text=True,
                timeout=self.timeout_s,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as error:
            raise NvmlError(NvmlFailure.OTHER, f"{what}: {error}") from error
        if done.returncode != 0:
            detail = (done.stderr or done.stdout).strip()[-300:]
            raise NvmlError(NvmlFailure.OTHER, f"{what} exited {done.returncode}: {detail}")
        return done.stdout
