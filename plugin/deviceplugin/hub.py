"""The node's current devices and their health, shared by the gRPC servicers, the health loop and the agent."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping

from gpupart.core.node.devices import Device, Listing, OfferedGpu, node_devices


class DeviceHub:
    """Thread-safe holder of the devices per resource; `version` grows on every visible change."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._devices: dict[str, dict[str, Device]] = {}
        self._gpus: dict[str, OfferedGpu] = {}
        self._unhealthy: frozenset[str] = frozenset()
        self.version = 0

    def set_gpus(self, views: Iterable[OfferedGpu]) -> None:
        views = tuple(views)
        devices = {
            resource: {d.id: d for d in listed} for resource, listed in node_devices(views).items()
        }
        with self._changed:
            # Resources that disappeared stay with no device, so their plugins report zero.
            for resource in self._devices:
                devices.setdefault(resource, {})
            if devices != self._devices:
                self._devices = devices
                self._bump()
            self._gpus = {v.uuid: v for v in views}

    def set_unhealthy(self, ids: frozenset[str]) -> None:
        with self._changed:
            if ids != self._unhealthy:
                self._unhealthy = ids
                self._bump()

    def _bump(self) -> None:
        self.version += 1
        self._changed.notify_all()

    def wait(self, version: int, timeout_s: float) -> int:
        """Block until the version differs from `version` (or timeout); the current version."""
        with self._changed:
            self._changed.wait_for(lambda: self.version != version, timeout=timeout_s)
            return self.version

    def resources(self) -> tuple[str, ...]:
        with self._changed:
            return tuple(sorted(self._devices))

    def devices(self, resource: str) -> Mapping[str, Device]:
        with self._changed:
            return self._devices.get(resource, {})

    def all_devices(self) -> tuple[Device, ...]:
        with self._changed:
            return tuple(d for listed in self._devices.values() for d in listed.values())

    def listing(self, resource: str) -> tuple[tuple[Device, bool], ...]:
        """(device, healthy) pairs for ListAndWatch."""
        with self._changed:
            return tuple(
                (d, d.id not in self._unhealthy) for d in self._devices.get(resource, {}).values()
            )

    def listings(self) -> dict[str, Listing]:
        """Every resource's device ids and healthy ones, as ListAndWatch sends them now."""
        with self._changed:
            return {
                resource: Listing(frozenset(listed), frozenset(listed) - self._unhealthy)
                for resource, listed in self._devices.items()
            }

    def gpu(self, uuid: str) -> OfferedGpu | None:
        with self._changed:
            return self._gpus.get(uuid)

    @property
    def unhealthy(self) -> frozenset[str]:
        with self._changed:
            return self._unhealthy
