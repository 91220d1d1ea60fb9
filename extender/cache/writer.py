"""The one writer of the extender's picture of the cluster: watch events and reservations in, immutable snapshots out.

Fed by events (`apply`) and relists (`replace`) from the watch threads in `kube.py` (or tests),
and by the service's reservations that change node views (`assume`, `forget`, `propose`,
`expire`); no I/O here. Every change goes to the `Index` under the one writer lock, then the
`Publisher` rebuilds the nodes it touched and a new `Snapshot` is published by swapping one
reference: requests read `snapshot` without any lock, so a burst of watch events never makes
a filter request wait (the lock is taken by writers only, and by bind, which must evaluate and
reserve as one step).

Reservations (`reservations.Reservations`) are one store: filter's holds change no view and are
kept there directly by the service (`reservations`); assumed pods and proposals change views,
so they change only through this writer, and each assumed pod that goes (watched bound, bind
failed, expired, replaced) is dropped by the store and un-counted by the index, once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from ..objects import NAMESPACE, NODE, POD, KeySource, PodEntry
from ..reservations import Proposal, Reservations
from ..snapshot import DraPicture, Snapshot
from .changes import ChangeLog
from .index import Index
from .publish import Publisher


class ClusterCache:
    """Nodes, pods, budgets, namespaces and reservations, changed under one writer lock, read as
    `snapshot`."""

    def __init__(
        self,
        *,
        keys: KeySource | None = None,
        max_states: int = 200_000,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        """Notified after every publish, for binds that wait for a node's admission to finish."""
        self.keys = keys
        """The shared assignment keys pods' assignments are verified with (None: none is)."""
        self.wall = wall
        """Unix seconds, the clock MIG reservations expire by (tests pass their own)."""
        self.reservations = Reservations()
        changes = ChangeLog()
        self._index = Index(changes, self.reservations, keys)
        self._publisher = Publisher(changes, max_states=max_states)
        self._listed: dict[str, bool] = {NODE: False, POD: False, NAMESPACE: False}
        self.snapshot = Snapshot.empty()
        """The current picture: replaced, never changed."""

    @property
    def synced(self) -> dict[str, bool]:
        """Per kind needed to answer, whether a full list of it has been read yet."""
        return dict(self._listed)

    # -- feeding --

    def apply(self, kind: str, event: str, obj: Mapping[str, Any]) -> None:
        """One watch event: ADDED, MODIFIED, DELETED (BOOKMARK and others change nothing)."""
        with self._lock:
            self._index.apply(kind, event, obj)
            self._publish()

    def replace(self, kind: str, objects: Iterable[Mapping[str, Any]]) -> None:
        """A full list (start, or relist after 410 Gone): what is absent is gone."""
        with self._lock:
            self._index.replace(kind, [o for o in objects if isinstance(o, Mapping)])
            self._listed[kind] = True
            self._publish()

    def recheck_assignments(self, *, wait: bool = True) -> int:
        """Count the assignments that could not be checked for want of a readable key, now
        that one may be readable; returns how many were checked. A check of one set when
        there are none (requests call it); `wait=False`: nothing while a writer holds the lock."""
        if not self._index.awaits_key() or not self._lock.acquire(blocking=wait):
            return 0
        try:
            checked = self._index.recheck_assignments()
            if checked:
                self._publish()
            return checked
        finally:
            self._lock.release()

    # -- reservations that change node views (bind, preempt) --

    def assume(self, entry: PodEntry, *, expires: float) -> None:
        """Count a pod we bound on its node until the watch shows it (or `expires` passes)."""
        with self._lock:
            old = self.reservations.assume(entry, expires)
            if old is not None:
                self._index.unassumed(old)
            self._index.assumed(entry)
            self._publish()

    def forget(self, uid: str) -> None:
        """Drop an assumed pod (its bind failed)."""
        with self._lock:
            if self._index.drop_assumed(uid):
                self._publish()

    def expire(self, now: float, *, wait: bool = True) -> int:
        """Drop every reservation whose time has passed (holds, assumed pods, proposals), in
        one sweep; returns how many assumed pods went. `wait=False`: do nothing (0) when a
        writer holds the lock now, for callers on the event loop (the next call sweeps)."""
        if not self._lock.acquire(blocking=wait):
            return 0
        try:
            expired = self.reservations.expire(now)
            for entry in expired.assumed:
                self._index.unassumed(entry)
            if expired.proposals:
                self._index.changes.mark("proposals")
            self._publish()
            return len(expired.assumed)
        finally:
            self._lock.release()

    def expire_mig_reservations(self, *, wait: bool) -> None:
        """Rebuild the nodes whose MIG reservations have expired by now and publish; a check
        of one number when none has (requests call it before reading `snapshot`).
        `wait=False`: skipped while a writer holds the lock (its publish expires them)."""
        if not self._publisher.expiry_due(self.wall()) or not self._lock.acquire(blocking=wait):
            return
        try:
            self._publish()
        finally:
            self._lock.release()

    def propose(
        self, uid: str, node: str, gpu: int, victims: Iterable[str], *, expires: float
    ) -> None:
        """The preempt verb freed GPU `gpu` of `node` for pod `uid` by evicting `victims`: if
        kube-scheduler nominates the pod there, its reservation goes on that GPU."""
        with self._lock:
            self.reservations.propose(uid, node, Proposal(gpu, tuple(victims), expires))
            self._index.changes.mark("proposals")
            self._index.renominate(uid, node)
            self._publish()

    # -- publishing --

    def _publish(self) -> None:
        fresh = self._publisher.publish(self.snapshot, self._index, self.reservations, self.wall())
        if fresh is not None:
            self.snapshot = fresh
            self._changed.notify_all()

    def dra(self) -> DraPicture:
        """The DRA objects as they are now (a copy made under the writer lock when one changed
        since the last call): only the words for DRA pods read them."""
        with self._lock:
            return self._index.dra.picture()

    # -- bind: evaluate and reserve as one step --

    @contextmanager
    def lock(self) -> Iterator[None]:
        """The writer lock: no change is published while it is held (bind only: a request on
        the event loop reads `snapshot` instead)."""
        with self._lock:
            yield

    def wait_for_change(self, timeout: float) -> None:
        """Block until the next publish or `timeout` seconds; call under `lock()`."""
        self._changed.wait(timeout)
