"""GPU faults the health monitor holds, by GPU or GPU instance, from the first Xid until a clean window passes.

The device plugin's and the kubelet plugin's health (`HealthBook`) is kept per advertised or
prepared device, so it knows nothing of a GPU that no pod holds. A fault is kept per part of
the hardware instead: the whole GPU (an Xid that names no GPU instance, or a GPU that stops
answering) or one GPU instance (an Xid that names it). What a fault covers on the devices
published from that GPU is decided where they are built (`gpupart.core.dra.taints`).

Two clocks come in as arguments: `wall` (Unix seconds) for when a fault began, which is shown
to users and must not move while the fault lasts, and `now` (the monitor's monotonic clock)
for the clean window, which must not jump with the wall clock.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from gpupart.core.node.devices import DEFAULT_IGNORED_XIDS, OfferedGpu, XidEvent


@dataclass(frozen=True, slots=True, order=True)
class GpuFault:
    """One part of a GPU that is faulty now: the whole GPU, or one GPU instance."""

    gpu_uuid: str
    gpu_instance_id: int | None = None
    """None: the whole GPU."""
    mig_uuid: str = ""
    """The instance's MIG UUID when it was known at the first Xid (empty: match by id only).
    It pins the fault to that instance: a new instance that gets the same id is not faulty."""
    xid: int | None = None
    """The first Xid of this fault; None: the GPU stopped answering."""
    since: float = 0.0
    """Unix seconds of the first Xid (or silence) of this fault; kept while the fault lasts."""

    @property
    def key(self) -> tuple[str, int | None, str]:
        return (self.gpu_uuid, self.gpu_instance_id, self.mig_uuid)


@dataclass(frozen=True, slots=True)
class FaultBook:
    """The faults held now, each with the monotonic time of its latest Xid (or silence)."""

    held: Mapping[tuple[str, int | None, str], tuple[GpuFault, float]] = field(default_factory=dict)

    @property
    def faults(self) -> tuple[GpuFault, ...]:
        return tuple(sorted(fault for fault, _ in self.held.values()))

    def gpus(self) -> frozenset[str]:
        return frozenset(key[0] for key in self.held)

    def record_xid(
        self,
        event: XidEvent,
        gpus: Iterable[OfferedGpu],
        *,
        wall: float,
        now: float,
        ignored: frozenset[int] = DEFAULT_IGNORED_XIDS,
    ) -> FaultBook:
        """The book after an Xid; `gpus` name the instances (their MIG UUIDs) the Xid may hit.

        An application's Xid (`ignored`) is no fault of the GPU.
        """
        if event.xid in ignored:
            return self
        mig_uuid = ""
        if event.gpu_instance_id is not None:
            for gpu in gpus:
                if gpu.uuid != event.gpu_uuid:
                    continue
                for mig in gpu.mig:
                    if mig.gpu_instance_id == event.gpu_instance_id:
                        mig_uuid = mig.uuid
        fault = GpuFault(event.gpu_uuid, event.gpu_instance_id, mig_uuid, event.xid, wall)
        return self._record(fault, now)

    def record_silent(self, gpu_uuids: Iterable[str], *, wall: float, now: float) -> FaultBook:
        """The book after these GPUs did not answer (a GPU-wide fault each)."""
        book = self
        for uuid in gpu_uuids:
            book = book._record(GpuFault(uuid, since=wall), now)
        return book

    def recover(self, answering: Iterable[str], now: float, *, quiet_s: float) -> FaultBook:
        """Faults dropped whose GPU answers and had no Xid on that part for `quiet_s`."""
        ok = frozenset(answering)
        keep = {
            key: (fault, last)
            for key, (fault, last) in self.held.items()
            if key[0] not in ok or now - last < quiet_s
        }
        return self if len(keep) == len(self.held) else FaultBook(keep)

    def _record(self, fault: GpuFault, now: float) -> FaultBook:
        """A fault already held keeps its first Xid and start; only its latest time moves."""
        known = self.held.get(fault.key)
        first = known[0] if known is not None else fault
        return FaultBook({**self.held, fault.key: (first, now)})
