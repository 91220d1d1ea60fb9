"""Device health from NVML Xid events: only the affected devices go Unhealthy, and come back when the GPU recovers."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

from gpupart import logs
from gpupart.core.node.devices import (
    DEFAULT_IGNORED_XIDS,
    Device,
    HealthBook,
    OfferedGpu,
    affected_devices,
)
from gpupart.core.node.faults import FaultBook, GpuFault
from gpupart_plugin.backend import GpuBackend, NvmlError

log = logging.getLogger(__name__)


class HealthBoard(Protocol):
    """Where the devices to watch are and their health goes (the device plugin's `DeviceHub`)."""

    def all_devices(self) -> tuple[Device, ...]: ...
    def set_unhealthy(self, ids: frozenset[str]) -> None: ...


class FaultBoard(Protocol):
    """Where GPU faults go, whatever holds the GPU (the DRA publisher: it taints devices)."""

    def fault_gpus(self) -> tuple[OfferedGpu, ...]: ...
    def set_faults(self, faults: tuple[GpuFault, ...]) -> None: ...


class Boards:
    """Several boards behind one monitor (NVML has one event stream): each gets back its own ids."""

    def __init__(self, *boards: HealthBoard) -> None:
        self.boards = boards

    def all_devices(self) -> tuple[Device, ...]:
        return tuple(d for board in self.boards for d in board.all_devices())

    def set_unhealthy(self, ids: frozenset[str]) -> None:
        for board in self.boards:
            board.set_unhealthy(ids & {d.id for d in board.all_devices()})


class HealthMonitor:
    """Waits on NVML events; a GPU that answers again and stays quiet `quiet_s` gets its devices back."""

    def __init__(
        self,
        backend: GpuBackend,
        board: HealthBoard,
        *,
        ignored: frozenset[int] = DEFAULT_IGNORED_XIDS,
        quiet_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        faults: FaultBoard | None = None,
        wall: Callable[[], float] = time.time,
    ) -> None:
        """`faults`: also keeps GPU faults (for GPUs it names, held by a pod or not) and gives
        each change to it; `wall` dates them."""
        self.backend = backend
        self.board = board
        self.ignored = ignored
        self.quiet_s = quiet_s
        self.clock = clock
        self.book = HealthBook()
        self.faults = faults
        self.wall = wall
        self.fault_book = FaultBook()

    def step(self, timeout_s: float) -> bool:
        """One wait for an event plus one recovery check; True when the unhealthy set changed."""
        before, faults_before = self.book.unhealthy, self.fault_book.faults
        try:
            event = self.backend.wait_xid(timeout_s)
        except NvmlError as error:
            # NVIDIA's plugin marks everything unhealthy here; gpupart narrows it to GPUs that stop answering.
            log.error("Failed to wait for GPU events", extra=logs.kv(err=error))
            event = None
        # The devices as they are when the event came: one prepared during the wait is hit too.
        devices = self.board.all_devices()
        now = self.clock()
        fault_gpus = self.faults.fault_gpus() if self.faults is not None else ()
        if event is not None:
            hit = affected_devices(event, devices, ignored=self.ignored)
            if hit:
                log.warning(
                    "Marked devices unhealthy",
                    extra=logs.kv(xid=event.xid, gpu=event.gpu_uuid, devices=len(hit)),
                )
            self.book = self.book.record((d for d in devices if d.id in hit), self.clock())
        if event is not None and self.faults is not None:
            self.fault_book = self.fault_book.record_xid(
                event, fault_gpus, wall=self.wall(), now=self.clock(), ignored=self.ignored
            )
        gpus = {d.gpu.uuid for d in devices}
        watched = {g.uuid for g in fault_gpus}
        silent = {uuid for uuid in gpus | watched if not self.backend.responsive(uuid)}
        if silent:
            self.book = self.book.record((d for d in devices if d.gpu.uuid in silent), now)
            self.fault_book = self.fault_book.record_silent(
                silent & watched, wall=self.wall(), now=now
            )
        answering = (gpus | self.book.sick_gpus()) - silent
        self.book = self.book.recover(answering, self.clock(), quiet_s=self.quiet_s)
        self.book = self.book.forget_missing(d.id for d in devices)
        self.fault_book = self.fault_book.recover(
            (gpus | watched | self.fault_book.gpus()) - silent, self.clock(), quiet_s=self.quiet_s
        )
        if self.faults is not None and self.fault_book.faults != faults_before:
            self.faults.set_faults(self.fault_book.faults)
        if self.book.unhealthy == before:
            return False
        if len(self.book.unhealthy) < len(before):
            log.info(
                "Marked devices healthy again",
                extra=logs.kv(devices=len(before - self.book.unhealthy)),
            )
        self.board.set_unhealthy(self.book.unhealthy)
        return True

    def run(self, stop: threading.Event, *, timeout_s: float = 1.0) -> None:
        while not stop.is_set():
            self.step(timeout_s)
