"""The core's tests: pure code, so each has a tight time bound; one that hangs fails instead of stalling the run."""

import pytest

CORE_TIMEOUT_S = 120
"""Seconds a core test may take: far above the slowest (the reference comparisons, ~30 s on a
loaded 2-core machine), far below a hang (a parser computing 10^99999999 takes hours)."""
METHOD = "thread"
"""A hang in the core is one long C call (a bigint power): no signal handler runs until it
returns, so the timeout's thread ends the run with every thread's stack instead."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # A session-wide hook: it sees every collected test, so it picks the core's by path.
    for item in items:
        if item.nodeid.startswith("tests/core/") and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(CORE_TIMEOUT_S, method=METHOD))
