"""Transient CDI spec files, one per prepared claim, in the container runtime's CDI directory."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from gpupart.core.dra.prepare import CDI_CLASS, CDI_KIND, CDI_VENDOR
from gpupart.core.errors import InvalidInput
from gpupart_plugin.checkpoint import write_atomically

_UID = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]{0,63}")
MAX_SPEC_BYTES = 1024 * 1024
"""A claim's spec names a few devices; a larger file is not one we wrote."""


class CdiSpecs:
    """`<root>/k8s.gpu.gpupart.io-claim_<claim uid>.json`: written whole (rename), removed at unprepare.

    The runtime reads every spec in the directory when a container is created, so a spec is
    in place before NodePrepareResources answers, and a half-written file is never seen.
    A spec is not fsynced (a prepare would wait on the disk twice): the checkpoint is the
    record that survives a crash, and a retry answered from it writes the spec again when
    `intact` says it did not survive (ADR 029).
    """

    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, claim_uid: str) -> Path:
        if not _UID.fullmatch(claim_uid):
            raise InvalidInput("claim.uid", f"{claim_uid[:80]!r} is not a claim uid")
        return self.root / f"{CDI_VENDOR}-{CDI_CLASS}_{claim_uid}.json"

    def write(self, claim_uid: str, spec: dict[str, Any]) -> Path:
        """Replaces the claim's spec: a temporary file renamed over it (no fsync)."""
        path = self.path(claim_uid)
        # Compact: json's C encoder serves only unindented output, and this is on the
        # kubelet's clock.
        data = json.dumps(spec, sort_keys=True, separators=(",", ":")).encode()
        write_atomically(path, data, sync_file=False)
        return path

    def intact(self, claim_uid: str) -> bool:
        """Whether the claim's spec is there and reads as a CDI spec of ours (not lost or cut
        short by a crash since it was written)."""
        try:
            with self.path(claim_uid).open("rb") as f:
                data = f.read(MAX_SPEC_BYTES + 1)
            spec = json.loads(data)
        except (OSError, ValueError):
            return False
        return (
            len(data) <= MAX_SPEC_BYTES
            and isinstance(spec, dict)
            and spec.get("kind") == CDI_KIND
            and isinstance(spec.get("devices"), list)
            and bool(spec["devices"])
        )

    def remove(self, claim_uid: str) -> None:
        try:
            self.path(claim_uid).unlink(missing_ok=True)
        except OSError as error:
            raise InvalidInput(
                str(self.path(claim_uid)), f"cannot remove: {error.strerror}"
            ) from None

    def claims(self) -> frozenset[str]:
        """The claim uids with a spec here."""
        prefix = f"{CDI_VENDOR}-{CDI_CLASS}_"
        if not self.root.is_dir():
            return frozenset()
        return frozenset(
            p.name[len(prefix) : -len(".json")] for p in self.root.glob(f"{prefix}*.json")
        )
