"""One pass of the node agent: desired and MIG plan in, GPUs changed, devices re-advertised, state and inventory out."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
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
from gpupart.core.node.devices import managed_capacity
from gpupart_plugin.actuator import Actuator, PassResult, inventory
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
            result = self.actuator.reconcile(groups, followed)
        if unreadable:
            answer = PlanReport("", GpuState.FAILED, unreadable)
            result = replace(result, report=replace(result.report, plan=answer))
        before = self.hub.listings()
        self.hub.set_gpus(result.views)
        if self.plugins is not None:
            self.plugins.sync()
        self.publish(
            encode_report(result.report),
            encode_inventory(
                Inventory(inventory(result.views, result.used), serial_admission=True)
            ),
            managed_capacity(result.views),
        )
        if self.status is not None:
            self.status.after_pass(before, self.hub.listings())
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
