"""The watched DRA objects (ResourceSlices, ResourceClaims, DeviceClasses), read bounded: a bad one affects only itself.

Written by the cluster state's writer (through `index.Index`), under its lock. Each object is read
once per event into the core's views (`gpupart.core.dra.read`, `requests`); one that cannot be read
is left out and listed in `problems` with its reason, and the others go on. `picture()` is an
immutable copy grouped as the reasons read it (slices by node, allocated claims by pool), made
when a DRA pod is explained and kept until the next change: a burst of claim events costs no
copy per event.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from gpupart.core.dra.read import ClaimView, SliceView, read_claim, read_slice
from gpupart.core.dra.requests import ClaimSpec, ClassView, read_claim_spec, read_class

from ..objects import DEVICE_CLASS, RESOURCE_CLAIM, RESOURCE_SLICE, key_of, meta_of, problem_of
from ..snapshot import DraPicture
from .changes import ChangeLog
from .problems import Problems


class DraIndex:
    """Our slices by name, claims by `namespace/name` (their spec and our allocation), classes
    by name."""

    def __init__(self, changes: ChangeLog, problems: Problems) -> None:
        self.changes = changes
        self.problems = problems
        self.slices: dict[str, SliceView] = {}
        self.claims: dict[str, tuple[ClaimSpec, ClaimView | None]] = {}
        self.classes: dict[str, ClassView] = {}
        self._picture: DraPicture | None = None
        """The last picture, while nothing changed since."""

    def apply(self, kind: str, event: str, obj: Mapping[str, Any]) -> None:
        if kind == RESOURCE_SLICE:
            self._put(kind, self.slices, _name(obj), event, obj, read_slice)
        elif kind == RESOURCE_CLAIM:
            self._put(kind, self.claims, key_of(obj), event, obj, _read_claim)
        elif kind == DEVICE_CLASS:
            self._put(kind, self.classes, _name(obj), event, obj, read_class)

    def replace(self, kind: str, listed: list[Mapping[str, Any]]) -> set[str]:
        """A full list: what is absent is gone; returns the keys listed (for `problems`)."""
        stores: dict[str, dict[str, Any]] = {
            RESOURCE_SLICE: self.slices,
            RESOURCE_CLAIM: self.claims,
            DEVICE_CLASS: self.classes,
        }
        store = stores[kind]
        keys = {key_of(o) if kind == RESOURCE_CLAIM else _name(o) for o in listed}
        for gone in set(store) - keys:
            del store[gone]
        for obj in listed:
            self.apply(kind, "ADDED", obj)
        self._picture = None
        return keys

    def _put(
        self,
        kind: str,
        store: dict[str, Any],
        key: str,
        event: str,
        obj: Mapping[str, Any],
        read: Callable[[object], Any],
    ) -> None:
        if not key:
            return
        self._picture = None
        if event == "DELETED":
            store.pop(key, None)
            self.problems.readable(kind, key)
            return
        try:
            found = read(obj)
        except Exception as error:  # noqa: BLE001 - this object's problem: left out, said why
            store.pop(key, None)
            self.problems.seen(kind, key, key, obj, problem_of(error))
            return
        self.problems.readable(kind, key)
        if found is None:
            store.pop(key, None)  # another driver's slice
        else:
            store[key] = found

    def picture(self) -> DraPicture:
        if self._picture is None:
            self._picture = self._take()
        return self._picture

    def _take(self) -> DraPicture:
        by_node: dict[str, list[SliceView]] = {}
        for view in self.slices.values():
            if view.node:
                by_node.setdefault(view.node, []).append(view)
        by_pool: dict[str, list[ClaimView]] = {}
        allocated: dict[str, ClaimView] = {}
        for key, (_, claim) in self.claims.items():
            if claim is not None:
                allocated[key] = claim
                for pool in {r.pool for r in claim.results}:
                    by_pool.setdefault(pool, []).append(claim)
        return DraPicture(
            slices={n: tuple(sorted(v, key=lambda s: s.name)) for n, v in by_node.items()},
            claims_on={p: tuple(c) for p, c in by_pool.items()},
            allocated=allocated,
            specs={key: spec for key, (spec, _) in self.claims.items()},
            classes=dict(self.classes),
        )


def _name(obj: Mapping[str, Any]) -> str:
    return str(meta_of(obj).get("name") or "")


def _read_claim(obj: object) -> tuple[ClaimSpec, ClaimView | None]:
    return read_claim_spec(obj), read_claim(obj)
