"""Transient CDI spec files, one per prepared claim, in the container runtime's CDI directory."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from gpupart.core.dra.prepare import CDI_CLASS, CDI_VENDOR
from gpupart.core.errors import InvalidInput
from gpupart_plugin.checkpoint import write_atomically

_UID = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]{0,63}")


class CdiSpecs:
    """`<root>/k8s.gpu.gpupart.io-claim_<claim uid>.json`: written whole (rename), removed at unprepare.

    The runtime reads every spec in the directory when a container is created, so a spec is
    in place before NodePrepareResources answers, and a half-written file is never seen.
    """

    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, claim_uid: str) -> Path:
        if not _UID.fullmatch(claim_uid):
            raise InvalidInput("claim.uid", f"{claim_uid[:80]!r} is not a claim uid")
        return self.root / f"{CDI_VENDOR}-{CDI_CLASS}_{claim_uid}.json"

    def write(self, claim_uid: str, spec: dict[str, Any]) -> Path:
        path = self.path(claim_uid)
        write_atomically(path, json.dumps(spec, indent=1, sort_keys=True).encode())
        return path

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
