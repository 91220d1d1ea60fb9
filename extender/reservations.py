"""The one store of reservations, each with its expiry: filter decisions, binds not yet watched, preemption proposals.

- a *hold*: filter's decision for a pod (the pod as kube-scheduler sent it and its demand), kept
  until bind uses it;
- an *assumed* pod: bound by us, not yet shown bound by the watch; it counts against its node's
  capacity (the cluster state puts it in the node's view) until the watch confirms it;
- a *proposal*: the GPU the preempt verb freed for a pod on a node, and the victims it chose;
  if kube-scheduler nominates the pod there, its reservation goes on that GPU.

Each reservation carries its expiry (the service makes them all with the one
`reservation_ttl_seconds`), and one sweep drops them all (`expire`). The
cluster state (`cache.ClusterCache`) owns the store and changes assumed pods and proposals
under its writer lock, since they change node views; holds change on every filter request,
so the store guards its dicts with a lock of its own that no one holds for longer than a dict
operation (the event loop never waits on the watch threads through it).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpupart.core.scheduling.demand import PodDemand

from .objects import PodEntry


@dataclass(frozen=True, slots=True)
class Hold:
    """A filter decision kept until bind: the pod as the scheduler sent it and its demand."""

    pod: Mapping[str, Any]
    demand: PodDemand
    expires: float


@dataclass(frozen=True, slots=True)
class Assumed:
    entry: PodEntry
    expires: float


@dataclass(frozen=True, slots=True)
class Proposal:
    """The GPU the preempt verb freed for a pod on one node, and the victims it evicts there."""

    gpu: int
    victims: tuple[str, ...]
    expires: float


@dataclass(frozen=True, slots=True)
class Expired:
    """What one sweep dropped that the snapshot shows: assumed pods and proposals."""

    assumed: tuple[PodEntry, ...]
    proposals: tuple[str, ...]
    """Uids of the pods that lost a proposal."""


class Reservations:
    """Holds, assumed pods and proposals by pod uid (or `namespace/name`), each with its expiry."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holds: dict[str, Hold] = {}
        self._assumed: dict[str, Assumed] = {}
        self._assumed_on: dict[str, dict[str, PodEntry]] = {}
        """The assumed pods by node: a node's view reads its own only."""
        self._proposals: dict[str, dict[str, Proposal]] = {}

    # -- holds --

    def hold(self, uid: str, hold: Hold) -> None:
        with self._lock:
            self._holds[uid] = hold

    def held(self, uid: str) -> Hold | None:
        with self._lock:
            return self._holds.get(uid)

    def release_hold(self, uid: str) -> None:
        with self._lock:
            self._holds.pop(uid, None)

    # -- assumed pods (the cluster state calls these under its writer lock) --

    def assume(self, entry: PodEntry, expires: float) -> PodEntry | None:
        """Reserve `entry` on its node; returns the assumed pod it replaces, if any."""
        with self._lock:
            old = self._drop_assumed(entry.uid)
            self._assumed[entry.uid] = Assumed(entry, expires)
            self._assumed_on.setdefault(entry.node, {})[entry.uid] = entry
            return old

    def release_assumed(self, uid: str) -> PodEntry | None:
        """Drop the assumed pod `uid` (the watch shows it, its bind failed, it is gone)."""
        with self._lock:
            return self._drop_assumed(uid)

    def _drop_assumed(self, uid: str) -> PodEntry | None:
        assumed = self._assumed.pop(uid, None)
        if assumed is None:
            return None
        node = assumed.entry.node
        on_node = self._assumed_on[node]
        del on_node[uid]
        if not on_node:
            del self._assumed_on[node]
        return assumed.entry

    def is_assumed(self, uid: str) -> bool:
        return uid in self._assumed

    def assumed_on(self, node: str) -> list[PodEntry]:
        with self._lock:
            return list(self._assumed_on.get(node, {}).values())

    def assumed_count(self) -> int:
        return len(self._assumed)

    # -- proposals (under the writer lock too: they move nominated reservations) --

    def propose(self, uid: str, node: str, proposal: Proposal) -> None:
        with self._lock:
            self._proposals.setdefault(uid, {})[node] = proposal

    def proposal(self, uid: str, node: str) -> Proposal | None:
        with self._lock:
            return self._proposals.get(uid, {}).get(node)

    def proposals(self) -> dict[str, dict[str, Proposal]]:
        """A copy, for a snapshot."""
        with self._lock:
            return {uid: dict(by_node) for uid, by_node in self._proposals.items()}

    # -- the one expiry --

    def expire(self, now: float) -> Expired:
        """Drop every reservation whose time has come."""
        with self._lock:
            holds = [u for u, h in self._holds.items() if h.expires <= now]
            for uid in holds:
                del self._holds[uid]
            lapsed = []
            for uid, by_node in list(self._proposals.items()):
                gone = [n for n, p in by_node.items() if p.expires <= now]
                for node in gone:
                    del by_node[node]
                if not by_node:
                    del self._proposals[uid]
                if gone:
                    lapsed.append(uid)
            assumed = [u for u, a in self._assumed.items() if a.expires <= now]
            dropped = tuple(e for u in assumed if (e := self._drop_assumed(u)) is not None)
            return Expired(dropped, tuple(lapsed))
