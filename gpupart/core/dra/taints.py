"""The taints of one GPU's published DRA devices after a fault: which devices, what value, since when.

Rules (docs/adr-028-dra-device-taints.md):

- A fault of the whole GPU (an Xid naming no GPU instance, or the GPU not answering) taints
  every device of that GPU: the whole GPU, each MIG device (existing instance or placement),
  the shared device. New claims then do not land on a broken GPU, prepared or not.
- A fault of one GPU instance taints the MIG device of that instance (found by its MIG UUID
  when the monitor knew it, else by its GPU instance id); a GPU in MIG mode publishes no
  whole-GPU device (ADR 030) to cover it. Other placements are untouched: counters keep
  them off the instance's memory slices while it exists, and a new instance is a fresh one.
- One taint a device, key `gpu.gpupart.io/unhealthy`, value the fault's Xid (`xid-79`, or
  `unresponsive`), effect NoSchedule unless told, `timeAdded` the start of the earliest fault
  on the device. A republish with the same faults writes the same taint, so nothing changes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from datetime import UTC, datetime
from enum import StrEnum

from gpupart.core.api.spec import Mode
from gpupart.core.dra import names
from gpupart.core.dra.devices import Device, GpuDevices
from gpupart.core.errors import InvalidInput
from gpupart.core.node.devices import OfferedGpu, OfferedMigDevice
from gpupart.core.node.faults import GpuFault


class TaintEffect(StrEnum):
    """What a device taint does to claims that do not tolerate it (the API's names)."""

    NO_SCHEDULE = "NoSchedule"
    """No new allocation; claims already allocated keep the device and their pods run."""
    NO_EXECUTE = "NoExecute"
    """Also evicts the running pods (kube-controller-manager's device-taint-eviction)."""


def time_added(since: float) -> str:
    """Unix seconds as the API's `metav1.Time` (RFC 3339, whole seconds, UTC), as it reads back."""
    return datetime.fromtimestamp(int(since), tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def device_faults(gpu: OfferedGpu, device: Device, faults: Iterable[GpuFault]) -> list[GpuFault]:
    """The faults that hit one published device of `gpu`."""
    attributes = device.get("attributes", {})
    kind = attributes.get(names.TYPE, {}).get("string")
    start = attributes.get(names.PLACEMENT_START, {}).get("int")
    profile = attributes.get(names.PROFILE, {}).get("string")
    hit = []
    for fault in faults:
        if fault.gpu_uuid != gpu.uuid:
            continue
        if fault.gpu_instance_id is None or kind != names.TYPE_MIG or gpu.mode is not Mode.MIG:
            hit.append(fault)
            continue
        if any(
            _is_instance(mig, fault)
            and mig.instance.placement.start == start
            and mig.instance.profile == profile
            for mig in gpu.mig
        ):
            hit.append(fault)
    return hit


def _is_instance(mig: OfferedMigDevice, fault: GpuFault) -> bool:
    """Whether the fault is this instance's: by MIG UUID when pinned, else by GPU instance id."""
    if fault.mig_uuid:
        return mig.uuid == fault.mig_uuid
    return mig.gpu_instance_id == fault.gpu_instance_id


def taint_devices(
    gpu: OfferedGpu,
    found: GpuDevices,
    faults: Iterable[GpuFault],
    *,
    effect: TaintEffect = TaintEffect.NO_SCHEDULE,
) -> GpuDevices:
    """`found` (the devices of `gpu`) with the taint on each device a fault hits; the others
    unchanged. InvalidInput if a device would carry more taints than the API allows."""
    faults = tuple(f for f in faults if f.gpu_uuid == gpu.uuid)
    if not faults:
        return found
    devices = []
    for device in found.devices:
        hit = device_faults(gpu, device, faults)
        if not hit:
            devices.append(device)
            continue
        first = min(hit, key=lambda f: (int(f.since), f.xid is None, f.xid or 0))
        taint = {
            "key": names.TAINT_UNHEALTHY,
            "value": names.xid_taint_value(first.xid),
            "effect": str(effect),
            "timeAdded": time_added(first.since),
        }
        taints = [*device.get("taints", ()), taint]
        if len(taints) > names.MAX_TAINTS:
            raise InvalidInput(
                f"gpu {gpu.index}.devices.{device.get('name')}.taints",
                f"{len(taints)} taints, the API allows {names.MAX_TAINTS}",
            )
        devices.append({**device, "taints": taints})
    return replace(found, devices=tuple(devices))
