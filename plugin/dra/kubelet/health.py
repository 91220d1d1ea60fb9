"""Health of prepared DRA devices: a board for the health monitor, and the lists the kubelet's health stream carries."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from gpupart.core.dra.prepare import DraGpuNow
from gpupart.core.dra.prepared import DeviceKind, PreparedClaim
from gpupart.core.node.devices import Device


@dataclass(frozen=True, slots=True)
class DeviceHealth:
    pool: str
    device: str
    healthy: bool
    since: float
    """Unix seconds of the last change."""


class DraHealth:
    """The devices of prepared claims (one id per published device, `<pool>/<device>`) and their health.

    The health monitor (`gpupart_plugin.health.HealthMonitor`) maps Xids to these devices as it
    does for the device plugin's: a MIG instance's Xid hits only that instance, a GPU's hits
    every device on it. Streams wait on `wait` and send `snapshot` whole.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._devices: dict[str, Device] = {}
        self._names: dict[str, tuple[str, str]] = {}
        self._unhealthy: frozenset[str] = frozenset()
        self._since: dict[str, float] = {}
        self.version = 0

    def update(self, claims: Iterable[PreparedClaim], gpus: Mapping[int, DraGpuNow]) -> None:
        """The prepared claims' devices, on the GPUs as last read."""
        devices: dict[str, Device] = {}
        names: dict[str, tuple[str, str]] = {}
        for claim in claims:
            for prepared in claim.devices:
                now = gpus.get(prepared.gpu_index)
                if now is None or now.gpu.uuid != prepared.gpu_uuid:
                    continue
                mig = None
                if prepared.kind is DeviceKind.MIG:
                    mig = next((m for m in now.gpu.mig if m.uuid == prepared.mig_uuid), None)
                    if mig is None:
                        continue
                key = f"{prepared.pool}/{prepared.device}"
                devices[key] = Device(key, "dra", now.gpu, mig)
                names[key] = (prepared.pool, prepared.device)
        with self._cond:
            if set(devices) != set(self._devices):
                self._bump()
            self._devices, self._names = devices, names

    def all_devices(self) -> tuple[Device, ...]:
        with self._cond:
            return tuple(self._devices.values())

    def set_unhealthy(self, ids: frozenset[str]) -> None:
        with self._cond:
            if ids == self._unhealthy:
                return
            now = time.time()
            for changed in ids ^ self._unhealthy:
                self._since[changed] = now
            self._unhealthy = ids
            self._bump()

    def snapshot(self) -> tuple[DeviceHealth, ...]:
        with self._cond:
            return tuple(
                DeviceHealth(pool, device, key not in self._unhealthy, self._since.get(key, 0.0))
                for key, (pool, device) in sorted(self._names.items())
            )

    def wait(self, version: int, timeout_s: float) -> int:
        """Blocks until the version differs from `version` (or timeout); the current version."""
        with self._cond:
            self._cond.wait_for(lambda: self.version != version, timeout=timeout_s)
            return self.version

    def _bump(self) -> None:
        self.version += 1
        self._cond.notify_all()
