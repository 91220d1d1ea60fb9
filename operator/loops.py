"""When passes and rounds run: wake-ups debounced (one `Debounce` for both loops), each run in a worker thread.

`ReconcileLoop` runs partition passes and tells deletion what each saw; `DemandLoop` runs
dynamic MIG rounds. kopf's handlers only wake them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Protocol

import kopf

from gpupart import logs
from gpupart.kubeconfig import describe_api_error
from gpupart_operator.reconciler import PassResult

log = logging.getLogger("gpupart.operator")


class Debounce:
    """Wake-ups coalesced: `due()` returns once they have been quiet `idle` seconds, or `most`
    seconds after the first of a burst; with `every`, also that long after the last run without
    any wake-up (work that is due without an event)."""

    def __init__(self, *, idle: float, most: float, every: float | None = None) -> None:
        self._idle, self._most, self._every = idle, most, every
        self._event = asyncio.Event()
        self._first: float | None = None
        self._last = 0.0

    def wake(self) -> None:
        self._last = time.monotonic()
        if self._first is None:
            self._first = self._last
        self._event.set()

    async def due(self) -> None:
        if self._every is None:
            await self._event.wait()
        else:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._event.wait(), timeout=self._every)
        first = self._first if self._first is not None else time.monotonic()
        while True:
            due = min(self._last + self._idle, first + self._most)
            left = due - time.monotonic()
            if left <= 0:
                break
            self._event.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._event.wait(), timeout=left)
        self._event.clear()
        self._first = None


class Reconciles(Protocol):
    """What the loop needs of a reconciler: one full pass, safe to call from a worker thread."""

    def reconcile_all(self) -> PassResult: ...


class ReconcileLoop:
    """Coalesces wake-ups into reconcile passes, one at a time, each in a worker thread.

    `wake()` asks for a pass that starts after the call; a burst of wakes inside the debounce
    window becomes one pass. `settle()` wakes and waits for such a pass, returning what it saw.
    A failed pass (API errors) is retried after `retry_seconds`.
    """

    def __init__(self, reconciler: Reconciles, *, debounce: float, retry_seconds: float) -> None:
        self._reconciler = reconciler
        # A pass starts `debounce` after the first wake of a burst, whatever follows.
        self._debounce = Debounce(idle=debounce, most=debounce)
        self._retry_seconds = retry_seconds
        self._done = asyncio.Condition()
        self._requested = 0
        self._completed = 0
        self._result: PassResult | None = None
        self._error: BaseException | None = None
        self.passes = 0
        """Passes completed so far (failed ones included)."""
        self.last_success: float | None = None
        """time.monotonic() of the last pass that succeeded."""

    def wake(self) -> None:
        self._requested += 1
        self._debounce.wake()

    async def settle(self) -> PassResult:
        self.wake()
        target = self._requested
        async with self._done:
            await self._done.wait_for(lambda: self._completed >= target)
        if self._result is None or self._error is not None:
            raise kopf.TemporaryError(
                f"reconcile pass failed: {self._error}", delay=self._retry_seconds
            )
        return self._result

    async def next_pass(self, seen: int, timeout: float) -> PassResult | None:
        """The result of the first pass to end after the `seen`-th, within `timeout` seconds;
        asks for none (node events and the drift timer bring them). None: none ended, or it
        failed."""
        async with self._done:
            try:
                await asyncio.wait_for(self._done.wait_for(lambda: self.passes > seen), timeout)
            except TimeoutError:
                return None
            return self._result if self._error is None else None

    async def run(self) -> None:
        while True:
            await self._debounce.due()
            serving = self._requested
            result: PassResult | None = None
            error: BaseException | None = None
            try:
                result = await asyncio.to_thread(self._reconciler.reconcile_all)
                self.last_success = time.monotonic()
            except Exception as problem:  # noqa: BLE001 - any failure: log, retry the pass
                error = problem
                log.warning(
                    "Failed reconcile pass; retrying",
                    extra=logs.kv(
                        retryAfter=f"{self._retry_seconds:g}s", err=describe_api_error(problem)
                    ),
                )
                asyncio.get_running_loop().call_later(self._retry_seconds, self.wake)
            async with self._done:
                self._completed = serving
                self.passes += 1
                self._result, self._error = result, error
                self._done.notify_all()


class DemandLoop:
    """Dynamic MIG rounds, debounced: a round starts once wake-ups have been quiet for `idle`
    seconds, or `most` seconds after the first of a burst, and at least every `every` seconds
    (reservations expire, failed plans are retried, without any event)."""

    def __init__(
        self, run_round: Callable[[], object], *, idle: float, most: float, every: float
    ) -> None:
        self._run_round = run_round
        self._debounce = Debounce(idle=idle, most=most, every=every)

    def wake(self) -> None:
        self._debounce.wake()

    async def run(self) -> None:
        while True:
            await self._debounce.due()
            try:
                await asyncio.to_thread(self._run_round)
            except Exception as problem:  # noqa: BLE001 - any failure: log, the next round retries
                log.warning(
                    "Failed dynamic MIG round", extra=logs.kv(err=describe_api_error(problem))
                )
