"""The Node-status writer: an offer's new MIG counts in the Node status once the kubelet holds them (ADR 014)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping

from gpupart import logs
from gpupart.core.errors import GpupartError
from gpupart.core.node.devices import Listing, StatusChange, status_changes
from gpupart_plugin.agent import Offer
from gpupart_plugin.deviceplugin.hub import DeviceHub
from gpupart_plugin.podresources import AllocatableUnimplemented

log = logging.getLogger(__name__)

Held = Callable[[], Mapping[str, frozenset[str]]]
"""The healthy device ids the kubelet's device manager holds per resource (PodResources
GetAllocatableResources); raises GpupartError when it cannot tell."""
WriteStatus = Callable[[Mapping[str, int], Mapping[str, int]], None]
"""Patches (capacity, allocatable) amounts into this node's Node status; GpupartError on failure."""


class NodeStatusWriter:
    """After an offer, the MIG counts it changed go into the Node's status, not at the kubelet's
    next node-status sync (every nodeStatusUpdateFrequency): kube-scheduler sees a new MIG
    device now. A view sink after the device plugin's (`DevicePluginSink`), on the hub that one
    fills: it compares the hub's devices now with those of its last offer.

    The kubelet stays the owner: it writes the same counts at its sync, computed from the same
    devices. So nothing is written that the kubelet does not hold yet: an increase waits (up to
    `timeout_s`, polling every `poll_s`) until the kubelet lists every new device id, a decrease
    is written at once. Where the kubelet never confirms, the resource is left to its sync.
    """

    def __init__(
        self,
        hub: DeviceHub,
        held: Held,
        write: WriteStatus,
        *,
        timeout_s: float = 3.0,
        poll_s: float = 0.05,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.hub = hub
        self.held = held
        self.write = write
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self.clock = clock
        self.sleep = sleep
        self._unimplemented = False
        """Logged once that the kubelet lacks GetAllocatableResources."""
        self._offered: dict[str, frozenset[str]] = {}
        """The device ids per resource in the hub at the last offer (none before the first)."""

    def offer(self, _offer: Offer) -> None:
        """Write what the offer changed in the hub's devices, health as the hub says now."""
        after = self.hub.listings()
        unhealthy = self.hub.unhealthy
        before = {
            resource: Listing(ids, ids - unhealthy) for resource, ids in self._offered.items()
        }
        self._offered = {resource: listing.ids for resource, listing in after.items()}
        self.after_pass(before, after)

    def after_pass(self, before: Mapping[str, Listing], after: Mapping[str, Listing]) -> set[str]:
        """Write what changed from `before` to `after` (the hub's listings); the resources written."""
        changes, left = status_changes(before, after)
        for resource in left:
            log.info(
                "Left new MIG devices to the kubelet's node-status sync",
                extra=logs.kv(resource=resource, reason="a new device is unhealthy"),
            )
        written = self._write(c for c in changes if not c.awaited)
        pending = {c.resource: c for c in changes if c.awaited}
        if pending:
            written |= self._confirm(pending)
        return written

    def _confirm(self, pending: dict[str, StatusChange]) -> set[str]:
        """Write each change once the kubelet lists its new ids; give up on the rest at the deadline."""
        written: set[str] = set()
        deadline = self.clock() + self.timeout_s
        problem = "the kubelet did not list the new devices"
        while pending:
            try:
                held = self.held()
            except AllocatableUnimplemented as error:
                if not self._unimplemented:
                    self._unimplemented = True
                    log.warning(
                        "Left new MIG devices to the kubelet's node-status sync",
                        extra=logs.kv(resources=",".join(sorted(pending)), err=error),
                    )
                return written
            except GpupartError as error:
                held, problem = {}, str(error)
            ready = [c for c in pending.values() if c.awaited <= held.get(c.resource, frozenset())]
            written |= self._write(ready)
            for change in ready:
                del pending[change.resource]
            if pending and self.clock() >= deadline:
                log.warning(
                    "Left new MIG devices to the kubelet's node-status sync",
                    extra=logs.kv(
                        resources=",".join(sorted(pending)),
                        timeout=f"{self.timeout_s:g}s",
                        err=problem,
                    ),
                )
                return written
            if pending:
                self.sleep(self.poll_s)
        return written

    def _write(self, changes: Iterable[StatusChange]) -> set[str]:
        changes = tuple(changes)
        if not changes:
            return set()
        try:
            self.write(
                {c.resource: c.capacity for c in changes},
                {c.resource: c.allocatable for c in changes},
            )
        except GpupartError as error:
            log.warning(
                "Failed to write MIG counts in the Node status",
                extra=logs.kv(resources=",".join(c.resource for c in changes), err=error),
            )
            return set()
        for change in changes:
            log.info(
                "Advertised MIG devices",
                extra=logs.kv(
                    resource=change.resource,
                    capacity=change.capacity,
                    allocatable=change.allocatable,
                ),
            )
        return {c.resource for c in changes}
