"""NodePrepareResources and NodeUnprepareResources carried out: per claim read, decided, made, checkpointed."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from gpupart import logs
from gpupart.core.dra.prepare import (
    DraGpuNow,
    cdi_spec,
    claim_gpus,
    instances_to_make,
    layout_with,
    layouts_after_release,
    plan_claim,
    read_for_prepare,
)
from gpupart.core.dra.prepared import ClaimRef, PreparedClaim
from gpupart.core.dra.read import Consumer
from gpupart.core.errors import ClaimRefused, GpupartError
from gpupart.core.mig.layout import Layout, MigInstance
from gpupart_plugin.dra.kubelet.cdi import CdiSpecs
from gpupart_plugin.dra.kubelet.state import ClaimCheckpoint

log = logging.getLogger(__name__)

GpuSource = Callable[[Collection[int] | None], Mapping[int, DraGpuNow]]
"""This node's GPUs of these indices (None: all) as they are now, by index (NVML read at the
call); an index not on the node is absent."""
MigApplier = Callable[[int, Layout], str]
"""Brings one GPU's MIG instances to exactly the layout: '' or what failed and the rollback
(`Actuator.apply_instances`)."""


class ClaimSource(Protocol):
    """The API reads of prepare (`ClaimReader`); failures raise GpupartError."""

    def claim(self, namespace: str, name: str) -> object: ...
    def pods_here(self, namespace: str, consumers: tuple[Consumer, ...]) -> frozenset[str]: ...


@dataclass(frozen=True, slots=True)
class PrepareAnswer:
    """One claim's answer: its prepared devices, or the error the kubelet shows on the pod."""

    claim: PreparedClaim | None = None
    error: str = ""


Changed = Callable[[tuple[PreparedClaim, ...], Mapping[int, DraGpuNow]], None]
"""Told of the prepared claims after each change, with the GPUs as last read (the health
stream lists their devices)."""


class DraDriver:
    """The claims this node prepared, and the work to prepare and release them."""

    def __init__(
        self,
        pool: str,
        claims: ClaimSource,
        gpus: GpuSource,
        apply: MigApplier,
        checkpoint: ClaimCheckpoint,
        cdi: CdiSpecs,
        *,
        changed: Changed | None = None,
    ) -> None:
        """InvalidInput when the checkpoint cannot be read: the caller must not serve then."""
        self.pool = pool
        self.claims = claims
        self.gpus = gpus
        self.apply = apply
        self.checkpoint = checkpoint
        self.cdi = cdi
        self.changed = changed
        self._state = threading.Lock()
        """Held while deciding and checkpointing: every plan sees every other claim's devices."""
        self._claim_locks: dict[str, threading.Lock] = {}
        self._gpu_locks: dict[int, threading.Lock] = {}
        self._views: Mapping[int, DraGpuNow] = {}
        self._prepared: dict[str, PreparedClaim] = checkpoint.load()
        for orphan in cdi.claims() - set(self._prepared):
            # A spec written just before a crash, whose claim never reached the checkpoint.
            cdi.remove(orphan)
            log.info("Removed CDI spec of an unknown claim", extra=logs.kv(claim=orphan))

    def prepared(self) -> tuple[PreparedClaim, ...]:
        with self._state:
            return tuple(self._prepared.values())

    # ---- NodePrepareResources ----

    def prepare(self, refs: Sequence[ClaimRef]) -> dict[str, PrepareAnswer]:
        """Each claim's answer, by uid; no claim's failure reaches another's."""
        answers: dict[str, PrepareAnswer] = {}
        for ref in refs:
            try:
                answers[ref.uid] = PrepareAnswer(self._prepare_one(ref))
            except GpupartError as error:
                log.warning("Refused to prepare claim", extra=logs.kv(claim=ref.key, err=error))
                answers[ref.uid] = PrepareAnswer(error=str(error))
            except Exception as error:  # noqa: BLE001 - one claim never fails the batch
                log.exception("Failed to prepare claim", extra=logs.kv(claim=ref.key))
                answers[ref.uid] = PrepareAnswer(
                    error=f"claim {ref.key}: internal error ({type(error).__name__}: {error})"
                )
        return answers

    def _prepare_one(self, ref: ClaimRef) -> PreparedClaim:
        with self._claim_lock(ref.uid):
            with self._state:
                known = self._prepared.get(ref.uid)
            if known is not None and known.complete:
                # A retry: answered as before, nothing made again; its CDI spec (not fsynced)
                # written again if a crash lost it.
                if not self.cdi.intact(ref.uid):
                    gpus = self._now({d.gpu_index for d in known.devices})
                    self.cdi.write(ref.uid, cdi_spec(known, gpus))
                    log.info("Rewrote CDI spec of prepared claim", extra=logs.kv(claim=ref.key))
                return known
            try:
                obj = self.claims.claim(ref.namespace, ref.name)
            except GpupartError as error:
                raise ClaimRefused(ref.key, str(error)) from None
            view = read_for_prepare(ref, obj)
            here = self.claims.pods_here(ref.namespace, view.reserved_for)
            with self._state:
                # Only the claim's GPUs: nothing in the plan or the spec looks at another.
                gpus = self._now(claim_gpus(view))
                plan = plan_claim(
                    ref,
                    view,
                    pool=self.pool,
                    gpus=gpus,
                    pods_here=here,
                    held=self._prepared.values(),
                )
                if not plan.complete:
                    self._save({**self._prepared, ref.uid: plan})
            if not plan.complete:
                gpus = self._make(plan)
                plan = plan.with_instances(_uuids(gpus))
            self.cdi.write(ref.uid, cdi_spec(plan, gpus))
            with self._state:
                # Not waited for on disk: lost in a power cut, the file still holds this claim
                # as planned before any instance was made (that write was), or not at all when
                # it made none, and instances do not outlive the reboot either way.
                self._save({**self._prepared, ref.uid: plan}, sync_dir=False)
            log.info(
                "Prepared claim",
                extra=logs.kv(claim=ref.key, devices=",".join(d.device for d in plan.devices)),
            )
            return plan

    def _make(self, plan: PreparedClaim) -> Mapping[int, DraGpuNow]:
        """Makes the claim's missing MIG instances, GPU by GPU; the GPUs after. A failed step
        is rolled back by the actuator, and what this attempt made on other GPUs is destroyed:
        ClaimRefused with the reason, the claim's entry gone."""
        made: list[tuple[int, MigInstance]] = []
        for index, instances in sorted(instances_to_make(plan).items()):
            with self._gpu_lock(index):
                now = self._now({index}).get(index)
                if now is None:
                    problem = f"GPU {index} is not on this node now"
                else:
                    problem = self.apply(index, layout_with(now.gpu, instances))
            if problem:
                self._abandon(plan, made)
                raise ClaimRefused(plan.ref.key, f"could not create its MIG instance: {problem}")
            made.extend((index, i) for i in instances)
        return self._now({d.gpu_index for d in plan.devices})

    def _abandon(self, plan: PreparedClaim, made: Iterable[tuple[int, MigInstance]]) -> None:
        """Destroys what a failed prepare made and forgets the claim."""
        made = set(made)
        partial = replace(
            plan,
            devices=tuple(d for d in plan.devices if (d.gpu_index, d.instance) in made),
        )
        try:
            self._release(partial, warm=False)
        finally:
            with self._state:
                self._save({k: v for k, v in self._prepared.items() if k != plan.ref.uid})

    # ---- NodeUnprepareResources ----

    def unprepare(self, refs: Sequence[ClaimRef]) -> dict[str, str]:
        """Each claim's error ('' when released, or never prepared here), by uid."""
        errors: dict[str, str] = {}
        for ref in refs:
            try:
                self._unprepare_one(ref)
                errors[ref.uid] = ""
            except GpupartError as error:
                log.warning("Failed to unprepare claim", extra=logs.kv(claim=ref.key, err=error))
                errors[ref.uid] = f"claim {ref.key}: {error}"
            except Exception as error:  # noqa: BLE001 - one claim never fails the batch
                log.exception("Failed to unprepare claim", extra=logs.kv(claim=ref.key))
                errors[ref.uid] = f"claim {ref.key}: internal error ({type(error).__name__})"
        return errors

    def _unprepare_one(self, ref: ClaimRef) -> None:
        with self._claim_lock(ref.uid):
            with self._state:
                claim = self._prepared.get(ref.uid)
            if claim is not None:
                self._release(claim, warm=True)
            self.cdi.remove(ref.uid)
            with self._state:
                if ref.uid in self._prepared:
                    self._save({k: v for k, v in self._prepared.items() if k != ref.uid})
            with self._state:
                self._claim_locks.pop(ref.uid, None)
            if claim is not None:
                log.info("Unprepared claim", extra=logs.kv(claim=ref.key))

    def _release(self, claim: PreparedClaim, *, warm: bool) -> None:
        """Destroys the claim's dynamic instances (unless `warm` and its GPU's warm mix keeps
        them); GpupartError with what failed (the kubelet asks again)."""
        indices = sorted({d.gpu_index for d in claim.devices if d.dynamic})
        for index in indices:
            with self._gpu_lock(index):
                gpus = dict(self._now({d.gpu_index for d in claim.devices}))
                if not warm and index in gpus:
                    gpus[index] = replace(gpus[index], warm=())
                with self._state:
                    others = tuple(self._prepared.values())
                layout = layouts_after_release(claim, others, gpus).get(index)
                if layout is None:
                    continue
                problem = self.apply(index, layout)
            if problem:
                raise GpupartError(f"could not destroy its MIG instance: {problem}")

    # ---- helpers ----

    def _save(self, claims: dict[str, PreparedClaim], *, sync_dir: bool = True) -> None:
        """Under `_state`: the checkpoint first, then memory (a failed write changes nothing)."""
        self.checkpoint.save(claims.values(), sync_dir=sync_dir)
        self._prepared = claims
        if self.changed is not None:
            self.changed(tuple(claims.values()), self._views)

    def _now(self, indices: Collection[int] | None = None) -> Mapping[int, DraGpuNow]:
        """The GPUs of `indices` (None: all) read now; the last read of each GPU is kept for
        `changed` (the health stream's devices)."""
        read = self.gpus(indices)
        if indices is None:
            self._views = read
        else:
            kept = {k: v for k, v in self._views.items() if k not in indices}
            self._views = {**kept, **read}
        return read

    def refresh(self) -> None:
        """Tells `changed` of the claims on the GPUs as they are now (after a pass moved them)."""
        with self._state:
            if self.changed is not None:
                self.changed(tuple(self._prepared.values()), self._now())

    def _claim_lock(self, uid: str) -> threading.Lock:
        with self._state:
            return self._claim_locks.setdefault(uid, threading.Lock())

    def _gpu_lock(self, index: int) -> threading.Lock:
        with self._state:
            return self._gpu_locks.setdefault(index, threading.Lock())


def _uuids(gpus: Mapping[int, DraGpuNow]) -> dict[tuple[int, MigInstance], str]:
    return {(index, m.instance): m.uuid for index, g in gpus.items() for m in g.gpu.mig}
