"""Assignment key files, re-read when they change: the extender's private keys, an agent's public ones."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Generic, Protocol, TypeVar

from gpupart.core.api.provenance import MAX_KEY_FILE_BYTES, AssignmentKeys
from gpupart.core.errors import InvalidInput
from gpupart.signing import PrivateKeys, PublicKeys, private_keys, public_keys

DEFAULT_KEY_FILE = "/etc/gpupart/assignment-key/keys"
"""Where the chart mounts its Secret (key `keys`, the private key) in the extender."""

K = TypeVar("K", bound=PublicKeys)


class PublicKeySource(Protocol):
    """Where a node agent's public keys come from: a `KeyFile` or the extender's ConfigMap
    (`gpupart.publickeys.PublishedKeys`). `keys()` raises InvalidInput saying why there are
    none."""

    def keys(self) -> AssignmentKeys: ...


class KeyFile(Generic[K]):
    """`keys()` answers the file's keys, re-reading it when its size, mtime or inode change.

    A Secret volume is updated by the kubelet swapping a symlink, so rotation needs no restart.
    An unreadable or invalid file raises InvalidInput naming the path: callers refuse what
    needs a key and say why, never serve without one.
    """

    def __init__(self, path: Path, load: Callable[..., K]) -> None:
        self.path = path
        self.load = load
        """`private_keys` or `public_keys` (`gpupart.signing`): text, where= -> keys."""
        self._lock = threading.Lock()
        self._seen: tuple[int, int, int] | None = None
        self._keys: K | None = None

    @classmethod
    def private(cls, path: Path) -> KeyFile[PrivateKeys]:
        """The extender's: PEM private keys (the first signs) and any public keys."""
        return KeyFile(path, private_keys)

    @classmethod
    def public(cls, path: Path) -> KeyFile[PublicKeys]:
        """A node agent's: PEM public keys only (a private key is refused)."""
        return KeyFile(path, public_keys)

    def keys(self) -> K:
        with self._lock:
            try:
                info = os.stat(self.path)
            except OSError as error:
                raise _unreadable(self.path, error) from None
            seen = (info.st_ino, info.st_size, info.st_mtime_ns)
            if self._keys is None or seen != self._seen:
                try:
                    with open(self.path, "rb") as f:
                        text = f.read(MAX_KEY_FILE_BYTES + 1)
                except OSError as error:
                    raise _unreadable(self.path, error) from None
                self._keys = self.load(text, where=str(self.path))
                self._seen = seen
            return self._keys


class KeyFileUnreadable(InvalidInput):
    """The key file cannot be read (not there yet: a Secret being mounted), as opposed to one
    that reads and is not a valid key file."""


def _unreadable(path: Path, error: OSError) -> KeyFileUnreadable:
    return KeyFileUnreadable(str(path), f"cannot read the assignment key: {error.strerror}")
