"""One pass of the node agent: desired and MIG plan in, GPUs changed, devices re-advertised, state and inventory out."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace

from gpupart import logs
from gpupart.core.api.spec import Mode
from gpupart.core.api.wire import (
    GpuState,
    Inventory,
    MigPlan,
    PlanReport,
    decode_desired,
    decode_inventory,
    decode_mig_plan,
    encode_inventory,
    encode_report,
)
from gpupart.core.errors import WireFormatError
from gpupart.core.node.devices import OfferedGpu, managed_capacity
from gpupart_plugin.actuator import Actuator, PassResult, Progress, inventory
from gpupart_plugin.advertise import EarlyStatus
from gpupart_plugin.devices import DeviceHub
from gpupart_plugin.metrics import NodeMetrics
from gpupart_plugin.registration import DevicePlugins

log = logging.getLogger(__name__)

Publish = Callable[[str, str, Mapping[str, int]], None]
"""Writes (state annotation, inventory annotation, extender-managed capacity) on this node's Node."""
Published = Callable[[], str | None]
"""Reads back the inventory annotation on this node's Node (None: none there)."""


class NodeAgent:
    """Ties the actuator, the device hub, the device plugins and the Node annotations together."""

    def __init__(
        self,
        actuator: Actuator,
        hub: DeviceHub,
        plugins: DevicePlugins | None,
        publish: Publish,
        metrics: NodeMetrics,
        *,
        clock: Callable[[], float] = time.monotonic,
        published: Published | None = None,
        status: EarlyStatus | None = None,
    ) -> None:
        """`published`: read once before the first pass, to resume what NVML cannot tell.
        `status`: writes the MIG counts a pass changed in the Node's status (None: the kubelet's
        node-status sync alone does)."""
        self.actuator = actuator
        self.hub = hub
        self.plugins = plugins
        self.publish = publish
        self.metrics = metrics
        self.clock = clock
        self.last_pass: float | None = None
        self._published = published
        self.status = status
        self._offering = threading.Lock()
        """Held by every offer: a plan's GPU threads offer their new instances concurrently."""
        self._offered: tuple[tuple[OfferedGpu, ...], frozenset[str]] | None = None
        """The views in the hub and the MIG device UUIDs in use, as last offered."""
        self._state: str | None = None
        """The state annotation last published at the end of a pass."""

    def resume(self, read: Published) -> None:
        """Take back the modes this agent published before it restarted (`Actuator.resume`).

        A missing, unreadable or unreachable inventory is logged and changes nothing: the pass
        then infers time-slicing from the client slots pods hold, as a first start does.
        """
        try:
            text = read()
            if text is None:
                log.info("Found no earlier inventory on the node; nothing to resume")
                return
            self.actuator.resume(decode_inventory(text))
        except Exception as error:  # noqa: BLE001 - a bad annotation never stops the agent
            log.warning("Failed to read the last inventory; not resumed", extra=logs.kv(err=error))

    def reconcile(self, desired: str | None, plan: str | None = None) -> PassResult:
        """One pass over the desired and MIG plan annotations' texts (None: not on the Node)."""
        started = self.clock()
        if self._published is not None:
            read, self._published = self._published, None
            self.resume(read)
        followed: MigPlan | None = None
        unreadable = ""
        if plan is not None:
            try:
                followed = decode_mig_plan(plan)
            except WireFormatError as error:
                # Unreadable plan: no dynamic GPU follows it; static GPUs still get their pass.
                log.error("Failed to read MIG plan", extra=logs.kv(err=error))
                unreadable = str(error)
        try:
            groups = None if desired is None else decode_desired(desired)
        except WireFormatError as error:
            # Unreadable wish: change nothing, and say so on every GPU.
            log.error("Failed to read desired layout", extra=logs.kv(err=error))
            result = self.actuator.refuse(str(error), plan=followed)
        else:
            progress = None if followed is None else self._progress()
            result = self.actuator.reconcile(groups, followed, progress)
        if unreadable:
            answer = PlanReport("", GpuState.FAILED, unreadable)
            result = replace(result, report=replace(result.report, plan=answer))
        state = encode_report(result.report)
        with self._offering:
            self._offer(state, result.views, result.used)
        self._state = state
        self.metrics.apply_seconds.observe(self.clock() - started)
        self.metrics.apply_failures.inc(result.failed)
        self.metrics.count_devices(self.hub)
        self.last_pass = self.clock()
        log.info(
            "Reconciled node",
            extra=logs.kv(
                gpus=len(result.views),
                failed=result.failed,
                modes=",".join(sorted({v.mode.value for v in result.views})) or Mode.NONE.value,
            ),
        )
        return result

    def _offer(self, state: str, views: Iterable[OfferedGpu], used: frozenset[str]) -> None:
        """Devices to the hub (ListAndWatch) and plugins, state and inventory to the Node, and
        the MIG counts that changed to the Node's status (`EarlyStatus`); under `_offering`."""
        views = tuple(views)
        before = self.hub.listings()
        self.hub.set_gpus(views)
        self._offered = (views, used)
        if self.plugins is not None:
            self.plugins.sync()
        self.publish(
            state,
            encode_inventory(Inventory(inventory(views, used), serial_admission=True)),
            managed_capacity(views),
        )
        if self.status is not None:
            self.status.after_pass(before, self.hub.listings())

    def _progress(self) -> Progress | None:
        """Offers each instance a plan creates as soon as it exists, before the pass ends.

        The state annotation stays the last one published: the plan's answer goes out only at
        the end of the pass, since the operator takes an answered plan's missing instances for
        failed ones (`gpupart.core.dynamic.live`). The other GPUs stay as last offered.
        None before the first published pass: there is no state to keep yet.
        """
        state = self._state
        if state is None or self._offered is None:
            return None

        def made(view: OfferedGpu, used: frozenset[str]) -> None:
            try:
                with self._offering:
                    # On the last offer, which may be another GPU's in this pass.
                    offered, in_use = self._offered or ((), frozenset[str]())
                    views = {v.index: v for v in offered}
                    old = views.get(view.index)
                    views[view.index] = view
                    left = in_use - {m.uuid for m in old.mig} if old is not None else in_use
                    self._offer(state, views.values(), left | used)
            except Exception as error:  # noqa: BLE001 - the pass goes on; its end offers again
                log.warning(
                    "Failed to offer a new MIG instance before the pass ends",
                    extra=logs.kv(gpu=view.index, err=error),
                )

        return made
