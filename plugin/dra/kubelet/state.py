"""The kubelet plugin's checkpoint file: what it prepared for each claim, read back after a restart."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from gpupart.core.dra.prepared import PreparedClaim, decode_checkpoint, encode_checkpoint
from gpupart_plugin.checkpoint import read_bounded, write_atomically

CHECKPOINT_NAME = "dra-checkpoint.json"
MAX_BYTES = 16 * 1024 * 1024


class ClaimCheckpoint:
    """`<state_dir>/dra-checkpoint.json`, replaced whole on every change (fsync, rename).

    It lives in the agent's state directory, not in the kubelet's plugin directory, which the
    kubelet may empty. An unreadable file raises InvalidInput naming it when the plugin starts:
    the plugin then does not serve (it cannot tell what it prepared) rather than guess.
    """

    def __init__(self, state_dir: Path, node: str) -> None:
        self.path = state_dir / CHECKPOINT_NAME
        self.node = node

    def load(self) -> dict[str, PreparedClaim]:
        text = read_bounded(self.path, MAX_BYTES)
        if text is None:
            return {}
        return decode_checkpoint(text, node=self.node, where=str(self.path))

    def save(self, claims: Iterable[PreparedClaim], *, sync_dir: bool = True) -> None:
        """`sync_dir=False` for a write whose loss in a power cut leaves nothing wrong (the
        driver's last write of a prepare, ADR 029): the file is fsynced, the rename not."""
        write_atomically(
            self.path, encode_checkpoint(self.node, claims).encode(), sync_dir=sync_dir
        )
