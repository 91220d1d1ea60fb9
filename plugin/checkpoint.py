"""The node agent's own admission records on disk: atomic writes, read back after a restart."""

from __future__ import annotations

import logging
import os
import tempfile
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
        try:
            with open(self.path, "rb") as f:
                data = f.read(MAX_CHECKPOINT_BYTES + 1)
        except FileNotFoundError:
            return {}
        except OSError as error:
            raise InvalidInput(str(self.path), f"cannot read: {error.strerror}") from None
        if len(data) > MAX_CHECKPOINT_BYTES:
            raise InvalidInput(str(self.path), f"more than {MAX_CHECKPOINT_BYTES} bytes")
        try:
            text = data.decode()
        except UnicodeDecodeError:
            raise InvalidInput(str(self.path), "not UTF-8") from None
        return decode_records(text, node=self.node, where=str(self.path))

    def save(self, records: Iterable[AdmissionRecord]) -> None:
        """Replace the file with `records` (fsynced, then renamed); GpupartError when it cannot."""
        kept = {r.uid: r for r in records}
        text = encode_records(self.node, kept.values()).encode()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".admission-", dir=self.path.parent)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(text)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self.path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
            dir_fd = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        except OSError as error:
            raise InvalidInput(str(self.path), f"cannot write: {error.strerror}") from None
        self.records = kept
