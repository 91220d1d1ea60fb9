"""One pass of the node agent: desired and MIG plan in, GPUs changed, the views offered to every sink in turn."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from gpupart import logs
from gpupart.core.api.spec import Mode
from gpupart.core.api.wire import (
    GpuState,
    MigPlan,
    NodeReport,
    PlanReport,
    decode_desired,
    decode_inventory,
    decode_mig_plan,
)
from gpupart.core.errors import WireFormatError
from gpupart.core.node.devices import OfferedGpu
from gpupart_plugin.actuator import Actuator, NodePass, Progress
from gpupart_plugin.metrics import NodeMetrics

log = logging.getLogger(__name__)

Published = Callable[[], str | None]
"""Reads back the inventory annotation on this node's Node (None: none there)."""


@dataclass(frozen=True, slots=True)
class Offer:
    """What the node offers now: every GPU's view, the MIG devices in use, and the report that goes with them."""

    views: tuple[OfferedGpu, ...]
    used: frozenset[str]
    """MIG device UUIDs a pod or process holds (`NodePass.used`)."""
    report: NodeReport
    """The pass's report; while a MIG plan's instances are offered mid-pass, the one last
    offered at the end of a pass (the plan's answer goes out only at the end of its pass)."""


class ViewSink(Protocol):
    """Takes each offer of the node's views: a kubelet interface, the Node's annotations or status.

    Offers come one at a time, in the sinks' order, from the pass's thread or (a MIG plan's new
    instance) from a GPU's thread. A sink that fails raises: the later sinks are skipped and
    the pass fails (its loop logs it); the next pass offers everything again.
    """

    def offer(self, offer: Offer) -> None: ...


class NodeAgent:
    """Ties the actuator to the sinks: each pass's views, and a plan's instances as made, offered in order."""

    def __init__(
        self,
        actuator: Actuator,
        sinks: Sequence[ViewSink],
        metrics: NodeMetrics,
        *,
        clock: Callable[[], float] = time.monotonic,
        published: Published | None = None,
    ) -> None:
        """`sinks`: in the order they are offered to (a device must reach the kubelet before
        the inventory names it). `published`: read once before the first pass, to resume what
        NVML cannot tell."""
        self.actuator = actuator
        self.sinks = tuple(sinks)
        self.metrics = metrics
        self.clock = clock
        self.last_pass: float | None = None
        self._published = published
        self._offering = threading.Lock()
        """Held by every offer: a plan's GPU threads offer their new instances concurrently."""
        self._offered: Offer | None = None
        """What the sinks were last offered."""
        self._report: NodeReport | None = None
        """The report last offered at the end of a pass."""

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

    def reconcile(self, desired: str | None, plan: str | None = None) -> NodePass:
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
        with self._offering:
            self._offer(Offer(result.views, result.used, result.report))
        self._report = result.report
        self.metrics.apply_seconds.observe(self.clock() - started)
        self.metrics.apply_failures.inc(result.failed)
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

    def _offer(self, offer: Offer) -> None:
        """To every sink in order; under `_offering`."""
        self._offered = offer
        for sink in self.sinks:
            sink.offer(offer)

    def _progress(self) -> Progress | None:
        """Offers each instance a plan creates as soon as it exists, before the pass ends.

        The report stays the last one offered: the plan's answer goes out only at the end of
        the pass, since the operator takes an answered plan's missing instances for failed ones
        (`gpupart.core.dynamic.live`). The other GPUs stay as last offered. None before the
        first pass's offer: there is no report to keep yet.
        """
        report = self._report
        if report is None or self._offered is None:
            return None

        def made(view: OfferedGpu, used: frozenset[str]) -> None:
            try:
                with self._offering:
                    # On the last offer, which may be another GPU's in this pass.
                    last = self._offered
                    offered, in_use = (last.views, last.used) if last else ((), frozenset[str]())
                    views = {v.index: v for v in offered}
                    old = views.get(view.index)
                    views[view.index] = view
                    left = in_use - {m.uuid for m in old.mig} if old is not None else in_use
                    self._offer(Offer(tuple(views.values()), left | used, report))
            except Exception as error:  # noqa: BLE001 - the pass goes on; its end offers again
                log.warning(
                    "Failed to offer a new MIG instance before the pass ends",
                    extra=logs.kv(gpu=view.index, err=error),
                )

        return made
