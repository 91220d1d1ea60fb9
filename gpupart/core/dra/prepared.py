"""What the DRA kubelet plugin prepared for each claim, and its checkpoint's versioned wire format.

The checkpoint is the plugin's own memory across restarts: a retried NodePrepareResources
answers from it, and NodeUnprepareResources releases exactly what it names. A claim is written
before any MIG instance is made for it (`complete` False) and again once they exist, so an
agent killed in between knows on restart which placements it was making and for whom.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from enum import StrEnum

from gpupart.core.api.jsontext import loads
from gpupart.core.api.records import Record
from gpupart.core.errors import InvalidInput
from gpupart.core.mig.layout import MigInstance, Placement

CHECKPOINT_VERSION = 1
MAX_CLAIMS = 4096
"""Far more claims than one node prepares at once; a larger checkpoint is not ours."""
MAX_DEVICES_PER_CLAIM = 32
"""The API's limit of allocation results per claim."""


class DeviceKind(StrEnum):
    """What a prepared DRA device is (the `type` attribute of its published device)."""

    GPU = "gpu"
    MIG = "mig"
    SHARED = "shared"


@dataclass(frozen=True, slots=True)
class ClaimRef:
    """A claim as the kubelet names it in NodePrepareResources / NodeUnprepareResources."""

    namespace: str
    name: str
    uid: str

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True, slots=True)
class PreparedDevice:
    """One allocation result of a claim, as prepared on this node."""

    request: str
    """The request's name without a `firstAvailable` subrequest (the kubelet matches on it)."""
    pool: str
    device: str
    gpu_index: int
    gpu_uuid: str
    kind: DeviceKind
    share_id: str = ""
    instance: MigInstance | None = None
    """MIG: the placement the scheduler allocated (the device name says which)."""
    mig_uuid: str = ""
    """MIG: the instance's UUID once it exists ('' while it is being made)."""
    dynamic: bool = False
    """MIG on a dynamic GPU: the instance is the claim's, destroyed at unprepare unless kept warm."""
    memory_mib: int = 0
    """Shared: the claim's `consumedCapacity.memory` (MPS pinned device memory limit)."""
    compute_percent: int = 0
    """Shared: the claim's `consumedCapacity.compute` (MPS active thread percentage)."""
    admin_access: bool = False
    """A view of a device that exists (`adminAccess`): it conflicts with nothing, makes and
    destroys no instance, and on a shared GPU is no MPS client."""


@dataclass(frozen=True, slots=True)
class PreparedClaim:
    """A claim's prepared devices; `complete` False while its MIG instances are being made."""

    ref: ClaimRef
    devices: tuple[PreparedDevice, ...]
    complete: bool = True

    def with_instances(self, uuids: Mapping[tuple[int, MigInstance], str]) -> PreparedClaim:
        """The claim with each MIG device's UUID from `uuids` ((GPU index, instance) → UUID);
        InvalidInput naming the device when one is missing (never a guessed instance)."""
        devices = []
        for device in self.devices:
            if device.kind is DeviceKind.MIG and device.instance is not None:
                found = uuids.get((device.gpu_index, device.instance), "")
                if not found:
                    raise InvalidInput(
                        f"claim {self.ref.key} device {device.device}",
                        f"no MIG instance at {device.instance} on GPU {device.gpu_index}",
                    )
                device = replace(device, mig_uuid=found)
            devices.append(device)
        return replace(self, devices=tuple(devices), complete=True)


def encode_checkpoint(node: str, claims: Iterable[PreparedClaim]) -> str:
    """The checkpoint document: version, node, and each claim (sorted by uid)."""
    return json.dumps(
        {
            "version": CHECKPOINT_VERSION,
            "node": node,
            "claims": [_claim_json(c) for c in sorted(claims, key=lambda c: c.ref.uid)],
        },
        sort_keys=True,
        separators=(",", ":"),
    )


def decode_checkpoint(text: str, *, node: str, where: str) -> dict[str, PreparedClaim]:
    """Claims by uid; InvalidInput naming `where` and the field when the document is not ours
    (another version, another node, malformed): never a partial read."""
    record = Record(loads(text, where), where)
    version = record.integer("version", minimum=0)
    if version != CHECKPOINT_VERSION:
        raise InvalidInput(
            record.path("version"), f"{version} is not a version this build reads (1)"
        )
    if record.string("node") != node:
        raise InvalidInput(record.path("node"), f"is for another node, not {node!r}")
    items = record.items("claims")
    if len(items) > MAX_CLAIMS:
        raise InvalidInput(record.path("claims"), f"{len(items)} claims, at most {MAX_CLAIMS}")
    claims: dict[str, PreparedClaim] = {}
    for k, item in enumerate(items):
        claim = _read_claim(Record(item, f"{record.path('claims')}[{k}]"))
        if claim.ref.uid in claims:
            raise InvalidInput(f"{where}.claims[{k}]", f"claim {claim.ref.uid} appears twice")
        claims[claim.ref.uid] = claim
    return claims


def _claim_json(claim: PreparedClaim) -> dict[str, object]:
    return {
        "namespace": claim.ref.namespace,
        "name": claim.ref.name,
        "uid": claim.ref.uid,
        "complete": claim.complete,
        "devices": [_device_json(d) for d in claim.devices],
    }


def _device_json(device: PreparedDevice) -> dict[str, object]:
    found: dict[str, object] = {
        "request": device.request,
        "pool": device.pool,
        "device": device.device,
        "gpuIndex": device.gpu_index,
        "gpuUUID": device.gpu_uuid,
        "kind": device.kind.value,
        "shareID": device.share_id,
        "migUUID": device.mig_uuid,
        "dynamic": device.dynamic,
        "memoryMiB": device.memory_mib,
        "computePercent": device.compute_percent,
        "adminAccess": device.admin_access,
    }
    if device.instance is not None:
        found["instance"] = {
            "profile": device.instance.profile,
            "start": device.instance.placement.start,
            "size": device.instance.placement.size,
        }
    return found


def _read_claim(record: Record) -> PreparedClaim:
    ref = ClaimRef(record.string("namespace"), record.string("name"), record.string("uid"))
    items = record.items("devices")
    if len(items) > MAX_DEVICES_PER_CLAIM:
        raise InvalidInput(record.path("devices"), f"{len(items)} devices, at most 32")
    devices = tuple(
        _read_device(Record(item, f"{record.path('devices')}[{k}]")) for k, item in enumerate(items)
    )
    return PreparedClaim(ref, devices, record.boolean("complete", False))


def _read_device(record: Record) -> PreparedDevice:
    kind_text = record.string("kind")
    try:
        kind = DeviceKind(kind_text)
    except ValueError:
        raise InvalidInput(record.path("kind"), f"{kind_text!r} is not a device kind") from None
    instance = None
    placed = record.optional_record("instance")
    if placed is not None:
        instance = MigInstance(
            Placement(placed.integer("start", minimum=0), placed.integer("size", minimum=1)),
            placed.string("profile"),
        )
    if (kind is DeviceKind.MIG) != (instance is not None):
        raise InvalidInput(record.path("instance"), "a MIG device, and only one, has an instance")
    return PreparedDevice(
        request=record.string("request"),
        pool=record.string("pool"),
        device=record.string("device"),
        gpu_index=record.integer("gpuIndex", minimum=0),
        gpu_uuid=record.string("gpuUUID"),
        kind=kind,
        share_id=record.string("shareID", ""),
        instance=instance,
        mig_uuid=record.string("migUUID", ""),
        dynamic=record.boolean("dynamic", False),
        memory_mib=record.integer("memoryMiB", 0, minimum=0),
        compute_percent=record.integer("computePercent", 0, minimum=0, maximum=100),
        admin_access=record.boolean("adminAccess", False),
    )
