"""The node agent's own records on disk (the admission checkpoint): atomic writes, bounded reads after a restart."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable
from pathlib import Path

from gpupart import logs
from gpupart.core.errors import GpupartError, InvalidInput
from gpupart.core.node.admission import AdmissionRecord, decode_records, encode_records

log = logging.getLogger(__name__)

CHECKPOINT_NAME = "admission-checkpoint.json"
MAX_CHECKPOINT_BYTES = 16 * 1024 * 1024
"""Far above MAX_RECORDS pods' worth; a larger file is not ours."""


class Checkpoint:
    """What the agent gave each shared-GPU pod, kept in `<state_dir>/admission-checkpoint.json`.

    The file lives outside the kubelet's device-plugin directory (the kubelet empties that one
    when it starts) and is replaced whole with a rename, so a crash leaves the old or the new
    records, never half of them. An unreadable file is kept as it is and named in `problem`:
    the allocator then refuses shared Allocates (it cannot tell what it gave) rather than
    serve from a guess, and everything else on the node goes on.
    """

    def __init__(self, state_dir: Path, node: str) -> None:
        self.path = state_dir / CHECKPOINT_NAME
        self.node = node
        self.problem = ""
        self.records: dict[str, AdmissionRecord] = {}
        try:
            self.records = self._load()
        except GpupartError as error:
            self.problem = str(error)
            log.error(
                "Unreadable admission checkpoint; shared-GPU Allocates are refused until it is "
                "moved away",
                extra=logs.kv(path=str(self.path), err=error),
            )

    def _load(self) -> dict[str, AdmissionRecord]:
        text = read_bounded(self.path, MAX_CHECKPOINT_BYTES)
        if text is None:
            return {}
        return decode_records(text, node=self.node, where=str(self.path))

    def save(self, records: Iterable[AdmissionRecord]) -> None:
        """Replace the file with `records` (fsynced, then renamed); GpupartError when it cannot."""
        kept = {r.uid: r for r in records}
        write_atomically(self.path, encode_records(self.node, kept.values()).encode())
        self.records = kept


def write_atomically(
    path: Path, data: bytes, *, sync_file: bool = True, sync_dir: bool = True
) -> None:
    """Replace `path` with `data`: written to a temporary file, fsynced, renamed, and the
    directory fsynced, so a crash leaves the old or the new file, never half; InvalidInput
    naming the file when it cannot. `sync_dir=False`: the rename is not waited for (after a
    power loss the old file may be back, still whole). `sync_file=False` (implies no directory
    sync): nothing is waited for; readers never see half a file, but a power loss may leave
    an empty or short one, which the caller must detect.

    The temporary file is named after the path and the writing thread, so two threads never
    share one; the directory is made only when it is missing (this runs on the kubelet's
    clock at every DRA prepare, ADR 031)."""
    tmp = path.parent / f".{path.name}.{threading.get_ident()}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW
    try:
        try:
            fd = os.open(tmp, flags, 0o600)
        except FileNotFoundError:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(tmp, flags, 0o600)
        try:
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                if sync_file:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        if not (sync_file and sync_dir):
            return
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError as error:
        raise InvalidInput(str(path), f"cannot write: {error.strerror}") from None


def read_bounded(path: Path, limit: int) -> str | None:
    """The file's text, None when it does not exist; InvalidInput naming it when it cannot be
    read, is larger than `limit` bytes or is not UTF-8."""
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except FileNotFoundError:
        return None
    except OSError as error:
        raise InvalidInput(str(path), f"cannot read: {error.strerror}") from None
    if len(data) > limit:
        raise InvalidInput(str(path), f"more than {limit} bytes")
    try:
        return data.decode()
    except UnicodeDecodeError:
        raise InvalidInput(str(path), "not UTF-8") from None
