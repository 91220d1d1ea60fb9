"""The assignment key file shared by the extender and the node agents, re-read when it changes."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from gpupart.core.api.provenance import MAX_KEY_FILE_BYTES, AssignmentKeys, parse_keys
from gpupart.core.errors import InvalidInput

DEFAULT_KEY_FILE = "/etc/gpupart/assignment-key/keys"
"""Where the chart mounts its Secret (key `keys`) in the extender and every node agent."""


class KeyFile:
    """`keys()` answers the file's keys, re-reading it when its size, mtime or inode change.

    A Secret volume is updated by the kubelet swapping a symlink, so rotation needs no restart.
    An unreadable or invalid file raises InvalidInput naming the path: callers refuse what
    needs a key and say why, never serve without one.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._seen: tuple[int, int, int] | None = None
        self._keys: AssignmentKeys | None = None

    def keys(self) -> AssignmentKeys:
        with self._lock:
            try:
                info = os.stat(self.path)
            except OSError as error:
                raise InvalidInput(
                    str(self.path), f"cannot read the assignment key: {error.strerror}"
                ) from None
            seen = (info.st_ino, info.st_size, info.st_mtime_ns)
            if self._keys is None or seen != self._seen:
                try:
                    with open(self.path, "rb") as f:
                        text = f.read(MAX_KEY_FILE_BYTES + 1)
                except OSError as error:
                    raise InvalidInput(
                        str(self.path), f"cannot read the assignment key: {error.strerror}"
                    ) from None
                self._keys = parse_keys(text, where=str(self.path))
                self._seen = seen
            return self._keys
