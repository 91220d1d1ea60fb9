"""Waiting for something to become true: one polling helper with a deadline and a named reason."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(
    check: Callable[[], T | None],
    timeout: float,
    what: str,
    interval: float = 0.2,
    *,
    detail: Callable[[], str] | None = None,
) -> T:
    """Poll check() until it returns a truthy value and return it; fail after timeout seconds.

    Exceptions from check() count as "not yet" so a server that is still starting does not
    abort the wait; the last one is reported when time runs out, with `detail()` (a log tail).
    """
    deadline = time.monotonic() + timeout
    last_error: BaseException | None = None
    while True:
        try:
            result = check()
            if result:
                return result
        except Exception as e:  # noqa: BLE001 - any failure means "not ready yet"
            last_error = e
        if time.monotonic() >= deadline:
            error = f" (last error: {last_error!r})" if last_error else ""
            more = f"\n{detail()}" if detail is not None else ""
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}{error}{more}")
        time.sleep(interval)
