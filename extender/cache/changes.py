"""The cluster state's change log: which nodes changed (each change numbered), and which other snapshot parts."""

from __future__ import annotations

_LOG_SIZE = 100_000
"""Node changes remembered for `changed_since` (a few MB of name references at most)."""

STALE_PARTS = frozenset(
    {"nominations", "budgets", "namespaces", "unreadable", "proposals", "counts"}
)
"""The parts of a snapshot besides its nodes that a change can make stale."""


class ChangeLog:
    """Which nodes changed (each change numbered: the node's version) and which other parts."""

    def __init__(self) -> None:
        self.clock = 0
        self.versions: dict[str, int] = {}
        self.log: list[str] = []
        self.log_start = 0
        self.dirty: set[str] = set()
        """Nodes changed since the last publish."""
        self.stale: set[str] = set()
        """What else changed since the last publish (of `STALE_PARTS`; the rest is reused)."""

    def touch(self, node: str) -> None:
        self.clock += 1
        self.versions[node] = self.clock
        self.dirty.add(node)
        self.log.append(node)
        if len(self.log) > _LOG_SIZE:
            # A new list: published snapshots keep reading the old one, which no longer grows.
            # Callers further behind than this start over (changed_since answers None).
            drop = len(self.log) // 2
            self.log = self.log[drop:]
            self.log_start += drop

    def mark(self, part: str) -> None:
        assert part in STALE_PARTS, part
        self.stale.add(part)
