"""DRA as a view sink: the GPUs whose view says DRA, published as this node's pool of ResourceSlices.

Each offer (a pass, or a MIG instance made mid-pass), each change of our claims in this pool
(the order follows what is allocated) and each deletion of one of the pool's slices that we
did not make (the kubelet's startup wipe) publishes again: the pool's slices are read, the
wanted ones built by the core (`gpu_devices`, `pool_slices`; a slice whose re-order changes
no next pick keeps its order, `keep_choices`) and only the difference written (`publish_plan`:
a re-order is an update in place at the same generation). The first publish after a
restart of the agent therefore writes only what changed while it was down. Nothing here
stops the agent: a failed publish is logged and done again on the next trigger.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

from gpupart import logs
from gpupart.core.api.spec import Interface, Mode
from gpupart.core.dra.claims import PoolUse, claimed_placements, pool_use
from gpupart.core.dra.devices import DraGpu, GpuDevices, GpuFacts, gpu_devices
from gpupart.core.dra.pool import keep_choices, pool_slices, publish_plan
from gpupart.core.dra.read import ClaimView, read_claim, read_slices
from gpupart.core.dra.taints import TaintEffect, taint_devices
from gpupart.core.errors import GpupartError, InvalidInput
from gpupart.core.mig.catalogue import GpuModel
from gpupart.core.mig.layout import MigInstance
from gpupart.core.node.devices import OfferedGpu
from gpupart.core.node.faults import GpuFault
from gpupart.core.node.interface import ClaimUse
from gpupart.watch import Event, Listed
from gpupart_plugin.agent import Offer
from gpupart_plugin.dra.publisher import DraNotServed, PoolClient

log = logging.getLogger(__name__)

Raw = Mapping[str, Any]
Models = Callable[[int], GpuModel]
"""A GPU's MIG geometry by index (the backend's `model`)."""


class ClaimsNotListed(GpupartError):
    """The claims were never listed yet (the watch has not started)."""


class DraSink:
    """Publishes the DRA GPUs of each offer; keeps our claims in this node's pool from the claim watch."""

    def __init__(
        self,
        pool: PoolClient,
        models: Models,
        *,
        wake: Callable[[], None] | None = None,
        taint_effect: TaintEffect = TaintEffect.NO_SCHEDULE,
    ) -> None:
        """`wake`: asks the agent for a pass (a claim left a GPU that waits to leave DRA);
        `taint_effect`: of the taint a faulty GPU's devices carry (ADR 028)."""
        self.pool = pool
        self.models = models
        self.wake = wake
        self.taint_effect = taint_effect
        self._faults: tuple[GpuFault, ...] = ()
        """The health monitor's GPU faults now (the `FaultBoard` side)."""
        self._fault_gpus: tuple[OfferedGpu, ...] = ()
        self._fault_lock = threading.Lock()
        self._faults_changed = threading.Event()
        self._fault_thread: threading.Thread | None = None
        self._lock = threading.RLock()
        self._views: tuple[OfferedGpu, ...] | None = None
        """The views last offered (None: no offer yet, nothing to publish)."""
        self._claims: dict[str, ClaimView] | None = None
        """Our claims allocated from any pool, by uid (None: never listed)."""
        self._claim_problem = ""
        self._served = True
        """False once the API server said it serves no `resource.k8s.io/v1`."""
        self.writes = 0
        """Slice writes made (creates, updates, deletes), for tests and metrics."""

    # ---- the agent's side ----

    def offer(self, offer: Offer) -> None:
        with self._lock:
            self._views = offer.views
            self._fault_gpus = tuple(v for v in offer.views if v.interface is Interface.DRA)
            self.publish()

    def claim_use(self) -> ClaimUse:
        """What our claims hold in this pool per GPU (the actuator's `ClaimSource`)."""
        with self._lock:
            if self._claims is None:
                self._list_claims()
            return self._use().claim_use()

    # ---- the health monitor's side (its `FaultBoard`) ----

    def fault_gpus(self) -> tuple[OfferedGpu, ...]:
        """The GPUs this pool publishes, as last offered: their faults taint their devices.

        Read without the publish lock: the monitor also serves the device plugin's health,
        which must not wait on a slow API server."""
        return self._fault_gpus

    def set_faults(self, faults: tuple[GpuFault, ...]) -> None:
        """The faults now. They are published on the sink's own thread, so that a fault's
        devices carry the taint from then on and lose it when it clears (one slice update per
        GPU changed), and the monitor never waits on the API server."""
        with self._fault_lock:
            if faults == self._faults:
                return
            log.info(
                "Saw GPU faults change",
                extra=logs.kv(faults=",".join(_fault_text(f) for f in faults) or "none"),
            )
            self._faults = faults
            if self._fault_thread is None:
                self._fault_thread = threading.Thread(
                    target=self._publish_faults, name="dra-faults", daemon=True
                )
                self._fault_thread.start()
        self._faults_changed.set()

    def _publish_faults(self) -> None:
        """Publish after each change of the faults (the latest ones: changes coalesce)."""
        while True:
            self._faults_changed.wait()
            self._faults_changed.clear()
            self.publish()

    # ---- the watches' side ----

    def claims_seen(self, item: Listed | Event[Raw]) -> None:
        """One item of the claim watch: a (re)list or a change."""
        if isinstance(item, Listed):
            self.claims_listed(item.items)
        else:
            self.claim_event(item.type, item.object)

    def claims_listed(self, objects: tuple[Raw, ...]) -> None:
        with self._lock:
            before = self._use() if self._claims is not None else None
            self._claims = {}
            for obj in objects:
                self._read_claim(obj)
            self._changed(before)

    def claim_event(self, kind: str, obj: Raw) -> None:
        with self._lock:
            if self._claims is None:
                return  # the list that starts the watch comes first
            before = self._use()
            if kind == "DELETED":
                self._claims.pop(_uid(obj), None)
            else:
                self._read_claim(obj)
            self._changed(before)

    def slice_deleted(self, obj: Raw | None) -> None:
        """A slice of the pool was deleted (or the watch relisted: None); publish again if
        something we want is now missing."""
        with self._lock:
            if obj is not None:
                log.info(
                    "Saw ResourceSlice deleted",
                    extra=logs.kv(slice=str((obj.get("metadata") or {}).get("name", "?"))[:253]),
                )
            self.publish()

    # ---- publishing ----

    def publish(self) -> None:
        """Make the pool's slices the wanted ones; never raises (logged, done again later)."""
        with self._lock:
            if self._views is None or not self._served:
                return
            try:
                self._publish(self._views)
            except DraNotServed as error:
                self._served = False
                log.warning(
                    "Not publishing DRA devices: the API server does not serve them",
                    extra=logs.kv(err=error),
                )
            except Exception as error:  # noqa: BLE001 - the next trigger publishes again
                log.warning("Failed to publish ResourceSlices", extra=logs.kv(err=error))

    def _publish(self, views: tuple[OfferedGpu, ...]) -> None:
        dra = [v for v in views if v.interface is Interface.DRA]
        if self._claims is None and any(v.dynamic for v in dra):
            # Its placements in use are not known: publishing now could re-order them wrongly.
            raise ClaimsNotListed(self._claim_problem or "the claims are not listed yet")
        use = self._use() if self._claims is not None else PoolUse()
        gpus = [g for g in (self._devices(v, use) for v in dra) if g is not None]
        listed = read_slices(self.pool.list_slices())
        for bad in listed.skipped:
            # One of our names we cannot read: it would block its own re-creation.
            log.warning(
                "Deleting unreadable ResourceSlice", extra=logs.kv(slice=bad.name, err=bad.reason)
            )
            self.pool.delete(bad.name)
            self.writes += 1
        existing = [s for s in listed.items if s.node == self.pool.node]
        wanted = pool_slices(self.pool.node, self.pool.node_uid(), gpus) if gpus else ()
        if self._claims is not None:
            # a re-order is written only where it changes a profile's next pick (ADR 032)
            wanted = keep_choices(existing, wanted, tuple(self._claims.values()))
        plan = publish_plan(existing, wanted)
        if plan.empty:
            return
        self.writes += self.pool.write(plan, existing)
        log.info(
            "Published ResourceSlices",
            extra=logs.kv(
                node=self.pool.node,
                generation=plan.generation,
                created=len(plan.creates),
                updated=len(plan.updates),
                deleted=len(plan.deletes),
                gpus=",".join(str(g.index) for g in gpus) or "none",
            ),
        )

    def _devices(self, view: OfferedGpu, use: PoolUse) -> GpuDevices | None:
        """One GPU's devices; a GPU that cannot be published is logged and left out."""
        try:
            model = self.models(view.index) if view.mode is Mode.MIG else self._known(view)
            in_use: tuple[MigInstance, ...] = ()
            if view.dynamic and model is not None:
                in_use = claimed_placements(model, view.index, use.device_names(view.index))
            foreign = tuple(m.instance for m in view.mig if m.instance not in in_use)
            found = gpu_devices(
                DraGpu(
                    view,
                    model,
                    dynamic=view.dynamic,
                    profiles=view.dynamic_profiles,
                    in_use=in_use,
                    foreign=foreign if view.dynamic else (),
                    facts=GpuFacts(pci_bus_id=view.pci_bus_id),
                )
            )
            return taint_devices(view, found, self._faults, effect=self.taint_effect)
        except GpupartError as error:
            log.warning(
                "Left GPU out of the ResourceSlices", extra=logs.kv(gpu=view.index, err=error)
            )
            return None

    def _known(self, view: OfferedGpu) -> GpuModel | None:
        """A whole or shared GPU's model where NVML states one (it names the architecture)."""
        try:
            return self.models(view.index)
        except GpupartError:
            return None

    # ---- claims ----

    def _list_claims(self) -> None:
        try:
            self.claims_listed(tuple(self.pool.list_claims()))
        except DraNotServed:
            self._claims = {}  # no claim can exist
        except GpupartError as error:
            self._claim_problem = str(error)
            raise ClaimsNotListed(str(error)) from error

    def _read_claim(self, obj: Raw) -> None:
        assert self._claims is not None
        uid = _uid(obj)
        try:
            claim = read_claim(obj)
        except InvalidInput as error:
            log.warning("Skipped unreadable ResourceClaim", extra=logs.kv(err=error))
            self._claims.pop(uid, None)
            return
        if claim is None:
            self._claims.pop(uid, None)
        else:
            self._claims[uid] = claim

    def _use(self) -> PoolUse:
        assert self._claims is not None
        return pool_use(self._claims.values(), self.pool.node)

    def _changed(self, before: PoolUse | None) -> None:
        """After our claims changed: publish again when this pool's use changed (the order
        follows it), and ask for a pass when a GPU waits to move."""
        self._claim_problem = ""
        after = self._use()
        for bad in set(after.skipped) - set(before.skipped if before else ()):
            log.warning("Skipped claim result", extra=logs.kv(claim=bad.name, err=bad.reason))
        if before is not None and after.devices == before.devices:
            return
        # Only a dynamic GPU's devices follow what its claims hold (the order, ADR 021): the
        # others' slices would come out the same, and a publish reads every slice back, in the
        # process that is answering the kubelet's NodePrepareResources for the same claim.
        dynamic = [v.index for v in self._views or () if v.dynamic and v.interface is Interface.DRA]
        if before is None or any(after.device_names(i) != before.device_names(i) for i in dynamic):
            self.publish()
        if self.wake is not None and any(v.interface is None for v in self._views or ()):
            self.wake()


def _fault_text(fault: GpuFault) -> str:
    part = "gpu" if fault.gpu_instance_id is None else f"gi {fault.gpu_instance_id}"
    return f"{fault.gpu_uuid} {part} {'unresponsive' if fault.xid is None else fault.xid}"


def _uid(obj: Raw) -> str:
    metadata = obj.get("metadata")
    if not isinstance(metadata, Mapping):
        return ""
    return str(metadata.get("uid") or f"{metadata.get('namespace')}/{metadata.get('name')}")
