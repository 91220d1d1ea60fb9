"""The core's tests: pure code, so each has a tight time bound; one that hangs fails instead of stalling the run."""

import faulthandler
import sys
from collections.abc import Iterator

import pytest
from _pytest.faulthandler import fault_handler_stderr_fd_key

CORE_TIMEOUT_S = 120
"""Seconds a core test may take: far above the slowest (the reference comparisons, ~30 s on a
loaded 2-core machine), far below a hang (a parser computing 10^99999999 takes hours)."""
BACKSTOP_S = 30
"""Past its timeout, seconds more before the run itself is ended."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # A session-wide hook: it sees every collected test, so it picks the core's by path.
    for item in items:
        if item.nodeid.startswith("tests/core/") and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(CORE_TIMEOUT_S))


@pytest.fixture(autouse=True)
def _backstop(request: pytest.FixtureRequest) -> Iterator[None]:
    """pytest-timeout fails a test that runs past its time, but it cannot stop one long C call
    (a bigint power such as 10**-99999999 holds the interpreter until it returns): faulthandler's
    watchdog is a C thread that can, so past the timeout it prints every thread's stack and
    ends the run with exit status 1."""
    marker = request.node.get_closest_marker("timeout")
    seconds = marker.args[0] if marker is not None and marker.args else CORE_TIMEOUT_S
    # pytest's faulthandler plugin keeps a copy of the terminal's stderr, past any capture.
    stderr = request.config.stash.get(fault_handler_stderr_fd_key, None)
    faulthandler.dump_traceback_later(
        seconds + BACKSTOP_S, exit=True, file=stderr if stderr is not None else sys.__stderr__
    )
    yield
    faulthandler.cancel_dump_traceback_later()
