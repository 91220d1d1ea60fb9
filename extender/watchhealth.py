"""Watch health, kept by the watcher, read by /readyz: per kind, the failures since it last worked.

The readiness rule (docs/extender.md, "Readiness"): the extender answers from a fresh relist.
It is ready once every kind it answers from has been listed into the cache, and as long as no
kind's list or watch has failed `FAILING_AFTER` times in a row since it last worked. What
counts as working: a list that succeeded (the cache then holds exactly what the API server has,
so readiness returns at once, within one list of the API server coming back, whether or not
the kind has any events), or a watch period that ended cleanly. Events alone do not count: a
watch that delivers events and then breaks is followed by a relist, which does.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

FAILING_AFTER = 3
"""Consecutive failures of one kind's list or watch after which the extender is not ready."""


class WatchHealth:
    """Per kind: consecutive failed lists or watches, and the last error (the watch threads
    write it, /readyz reads it: one lock, held for a dict operation only)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._failures: dict[str, tuple[int, str]] = {}

    def failed(self, kind: str, error: str) -> None:
        """The list or watch of `kind` failed (the watcher retries it)."""
        with self._lock:
            count = self._failures.get(kind, (0, ""))[0] + 1
            self._failures[kind] = (count, error[:500])

    def worked(self, kind: str) -> None:
        """The list of `kind` succeeded, or its watch period ended cleanly: healthy at once."""
        with self._lock:
            self._failures.pop(kind, None)

    def failing(self) -> dict[str, tuple[int, str]]:
        """Kinds whose list or watch failed `FAILING_AFTER` times or more in a row, with the
        last error: the cache may be stale, so the extender is not ready."""
        with self._lock:
            return {k: f for k, f in self._failures.items() if f[0] >= FAILING_AFTER}


def unready_reason(synced: Mapping[str, bool], health: WatchHealth | None) -> str:
    """Why the extender is not ready ("" when it is): kinds not listed yet, kinds failing.
    `health` None: no watcher feeds the cache (tests), only the lists count."""
    waiting = ", ".join(kind for kind, done in synced.items() if not done)
    failing = "; ".join(
        f"watch of {kind} failed {count} times in a row: {error}"
        for kind, (count, error) in (health.failing() if health is not None else {}).items()
    )
    return "; ".join(
        part for part in (waiting and f"watch cache not synced: {waiting}", failing) if part
    )
