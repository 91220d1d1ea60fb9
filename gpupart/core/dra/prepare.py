"""DRA claims prepared, decided: each result's device, the MIG instance to make, MPS limits, CDI spec, or a refusal."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Any

from gpupart.core.api.jsontext import check_size
from gpupart.core.api.records import Record
from gpupart.core.api.spec import Mode
from gpupart.core.dra import names
from gpupart.core.dra.prepared import ClaimRef, DeviceKind, PreparedClaim, PreparedDevice
from gpupart.core.dra.read import AllocationResult, ClaimView, read_claim
from gpupart.core.errors import ClaimRefused, GpupartError, InvalidInput, shown
from gpupart.core.mig.catalogue import GpuModel
from gpupart.core.mig.layout import Layout, MigInstance, Placement
from gpupart.core.node.allocation import (
    ContainerAllocation,
    exclusive_allocation,
    gpu_view_allocation,
    shared_allocation,
)
from gpupart.core.node.devices import Device, OfferedGpu
from gpupart.core.node.mps import MpsLimits, client_limits

CDI_VENDOR = "k8s.gpu.gpupart.io"
CDI_CLASS = "claim"
CDI_KIND = f"{CDI_VENDOR}/{CDI_CLASS}"
CDI_VERSION = "0.6.0"
CONFIG_API_VERSION = "gpu.gpupart.io/v1alpha1"
CONFIG_KIND = "GpuClaimConfig"
MAX_CONFIGS = 32
MAX_CONFIG_BYTES = 10_000
"""The API's limit on an opaque configuration's parameters."""
MIB = 2**20

_DEVICE = re.compile(r"gpu-(0|[1-9][0-9]?)(?:-(shared|mig-.+))?")


@dataclass(frozen=True, slots=True)
class DraGpuNow:
    """One GPU as prepare reads it now: its view, MIG model, and its partition's DRA policy."""

    gpu: OfferedGpu
    model: GpuModel | None = None
    """Required for MIG devices."""
    dynamic: bool = False
    """Instances are made at prepare and destroyed at unprepare (unless kept warm)."""
    warm: tuple[tuple[str, int], ...] = ()
    """Idle instances per profile a dynamic GPU keeps rather than destroys."""
    served: bool = True
    """The GPU's partition serves it through DRA now (never through both interfaces)."""


def read_for_prepare(ref: ClaimRef, obj: object) -> ClaimView:
    """The claim as read, checked against the kubelet's reference; ClaimRefused when it is not
    one of ours to prepare (malformed, another claim, not allocated from our driver, a bad
    opaque configuration of ours)."""
    try:
        view = read_claim(obj)
    except InvalidInput as error:
        raise ClaimRefused(ref.key, str(error)) from None
    if view is None:
        raise ClaimRefused(
            ref.key,
            f"holds no device of driver {names.DRIVER} (not allocated, or another driver's)",
        )
    if view.uid != ref.uid:
        raise ClaimRefused(
            ref.key, f"the API holds claim uid {shown(view.uid)}, the kubelet asked for {ref.uid}"
        )
    if (view.namespace, view.name) != (ref.namespace, ref.name):
        raise ClaimRefused(ref.key, f"the API returned claim {view.key}")
    try:
        check_opaque_config(obj)
    except InvalidInput as error:
        raise ClaimRefused(ref.key, str(error)) from None
    return view


def check_opaque_config(obj: object) -> None:
    """Our driver's opaque configurations in the claim's allocation (from its class or itself):
    each must be a `GpuClaimConfig` of a version we read, with no field we do not know.

    It holds no setting yet: what a claim gets comes from the partition and the scheduler,
    never from a tenant's parameters. Other drivers' configurations are theirs to read.
    """
    record = Record(obj, "ResourceClaim")
    status = record.optional_record("status")
    allocation = status.optional_record("allocation") if status is not None else None
    devices = allocation.optional_record("devices") if allocation is not None else None
    if devices is None:
        return
    configs = devices.items("config")
    if len(configs) > MAX_CONFIGS:
        raise InvalidInput(devices.path("config"), f"{len(configs)} entries, at most {MAX_CONFIGS}")
    for k, raw in enumerate(configs):
        entry = Record(raw, f"{devices.path('config')}[{k}]")
        opaque = entry.optional_record("opaque")
        if opaque is None or opaque.string("driver", "") != names.DRIVER:
            continue
        parameters_raw = opaque.value("parameters")
        # free-form JSON a tenant wrote: measured without recursion before anything walks it
        check_size(parameters_raw, opaque.path("parameters"), max_bytes=MAX_CONFIG_BYTES)
        parameters = Record(parameters_raw, opaque.path("parameters"))
        version = parameters.string("apiVersion")
        if version != CONFIG_API_VERSION:
            raise InvalidInput(
                parameters.path("apiVersion"),
                f"{shown(version)} is not a version this driver reads ({CONFIG_API_VERSION})",
            )
        kind = parameters.string("kind")
        if kind != CONFIG_KIND:
            raise InvalidInput(parameters.path("kind"), f"{shown(kind)} is not {CONFIG_KIND}")
        parameters.done()


def claim_gpus(view: ClaimView) -> frozenset[int]:
    """The GPU indices the claim's device names start with: the only GPUs `plan_claim` and
    `cdi_spec` read (a name that parses to no index is refused by `plan_claim` itself)."""
    found = (_DEVICE.fullmatch(r.device) for r in view.results)
    return frozenset(int(m.group(1)) for m in found if m is not None)


def plan_claim(
    ref: ClaimRef,
    view: ClaimView,
    *,
    pool: str,
    gpus: Mapping[int, DraGpuNow],
    pods_here: frozenset[str],
    held: Iterable[PreparedClaim],
) -> PreparedClaim:
    """What to prepare for the claim, or ClaimRefused with the reason.

    `pods_here`: the uids of the claim's `reservedFor` pods that the API says are bound to this
    node (the kubelet prepares a claim for such a pod only). `held`: every claim prepared on
    this node (this claim's own entry is ignored: a retry plans again from the GPUs as they
    are). `gpus` needs only the claim's own GPUs (`claim_gpus`). The result is `complete` when
    every device exists; else the MIG instances to make are its devices without a `mig_uuid`
    (`instances_to_make`).
    """
    reserved = {c.uid for c in view.reserved_for if c.resource == "pods"}
    if not reserved & pods_here:
        names_text = ", ".join(c.name for c in view.reserved_for) or "nobody"
        raise ClaimRefused(
            ref.key, f"is not reserved for a pod on this node (reservedFor: {names_text})"
        )
    taken = [d for c in held if c.ref.uid != ref.uid for d in c.devices]
    devices: list[PreparedDevice] = []
    for k, result in enumerate(view.results):
        where = f"status.allocation.devices.results[{k}]"
        device = _device(ref, result, where, pool=pool, gpus=gpus)
        for other in (*taken, *devices):
            if _conflict(device, other):
                owner = next(
                    (c.ref.key for c in held if other in c.devices and c.ref.uid != ref.uid),
                    ref.key,
                )
                raise ClaimRefused(
                    ref.key,
                    f"{where}: device {result.device} overlaps {other.device}, "
                    f"which claim {owner} holds",
                )
        devices.append(device)
    _check_requests(ref, devices)
    _check_one_consumer(ref, view, devices)
    return PreparedClaim(ref, tuple(devices), complete=all(_exists(d) for d in devices))


def _check_one_consumer(ref: ClaimRef, view: ClaimView, devices: Sequence[PreparedDevice]) -> None:
    """A shared device's amounts are one client's: the scheduler counts the claim's
    `consumedCapacity` once, however many pods use it, so a claim of one is for one pod."""
    pods = [c.name for c in view.reserved_for if c.resource == "pods"]
    if len(pods) > 1 and any(d.kind is DeviceKind.SHARED and not d.admin_access for d in devices):
        raise ClaimRefused(
            ref.key,
            f"is reserved for {len(pods)} pods ({', '.join(pods[:5])}); a shared GPU's memory "
            "and compute are counted once a claim, so each pod needs a claim of its own "
            "(a ResourceClaimTemplate)",
        )


def _exists(device: PreparedDevice) -> bool:
    return device.kind is not DeviceKind.MIG or bool(device.mig_uuid)


def _device(
    ref: ClaimRef,
    result: AllocationResult,
    where: str,
    *,
    pool: str,
    gpus: Mapping[int, DraGpuNow],
) -> PreparedDevice:
    if result.pool != pool:
        raise ClaimRefused(
            ref.key, f"{where}.pool: {shown(result.pool)} is not this node's pool {pool!r}"
        )
    match = _DEVICE.fullmatch(result.device)
    gpu = gpus.get(int(match.group(1))) if match is not None else None
    if match is None or gpu is None:
        raise ClaimRefused(
            ref.key, f"{where}.device: {shown(result.device)} is no device of this node"
        )
    if not gpu.served:
        raise ClaimRefused(
            ref.key,
            f"{where}.device: GPU {gpu.gpu.index} is not served through DRA now (its partition "
            "does not say interface: dra, it is still moving from the device plugin, or the "
            "node agent has not read its desired state yet)",
        )
    view = gpu.gpu
    base = PreparedDevice(
        request=result.request.split("/", 1)[0],
        pool=result.pool,
        device=result.device,
        gpu_index=view.index,
        gpu_uuid=view.uuid,
        kind=DeviceKind.GPU,
        share_id=result.share_id,
        admin_access=result.admin_access,
    )
    rest = match.group(2)
    if rest is None:
        if view.mode is not Mode.NONE:
            # Never published for a GPU in such a mode (ADR 030): an allocation from a slice of
            # before the GPU's mode changed. Serving it would take the GPU out of its mode.
            raise ClaimRefused(
                ref.key,
                f"{where}.device: {result.device} is a whole GPU, and GPU {view.index} is in "
                f"mode {view.mode}, which offers no whole-GPU device (no instance covers it)",
            )
        return base
    if rest == "shared":
        if base.admin_access:  # a view of the GPU, no MPS client and no share of it
            if not view.mode.is_shared:
                raise ClaimRefused(ref.key, f"{where}.device: GPU {view.index} is not shared now")
            return replace(base, kind=DeviceKind.SHARED)
        return _shared(ref, result, where, gpu, base)
    return _mig(ref, result, where, gpu, base)


def _mig(
    ref: ClaimRef, result: AllocationResult, where: str, gpu: DraGpuNow, base: PreparedDevice
) -> PreparedDevice:
    view, model = gpu.gpu, gpu.model
    if view.mode is not Mode.MIG or model is None:
        raise ClaimRefused(
            ref.key, f"{where}.device: GPU {view.index} is not in MIG mode with a known model"
        )
    wanted = next(
        (
            MigInstance(Placement(start, p.memory_slices), p.name)
            for p in model.profiles
            for start in p.starts
            if names.mig_device_name(view.index, p.name, start) == result.device
        ),
        None,
    )
    if wanted is None:
        raise ClaimRefused(
            ref.key,
            f"{where}.device: {shown(result.device)} names no placement of {model.product}",
        )
    found = next((m for m in view.mig if m.instance == wanted), None)
    if found is None and base.admin_access:
        raise ClaimRefused(
            ref.key,
            f"{where}: adminAccess to {result.device}, and no instance is at that placement: "
            "gpupart makes a MIG instance for a claim that uses it, never for one that watches it",
        )
    if found is None:
        blocking = [m.instance for m in view.mig if m.instance.placement.overlaps(wanted.placement)]
        if blocking:
            raise ClaimRefused(
                ref.key,
                f"{where}.device: {wanted} overlaps {blocking[0]} on GPU {view.index}",
            )
        if not gpu.dynamic:
            raise ClaimRefused(
                ref.key,
                f"{where}.device: GPU {view.index} has a static layout without {wanted}",
            )
    return replace(
        base,
        kind=DeviceKind.MIG,
        instance=wanted,
        mig_uuid=found.uuid if found is not None else "",
        dynamic=gpu.dynamic and not base.admin_access,  # an admin's view never destroys it
    )


def _shared(
    ref: ClaimRef, result: AllocationResult, where: str, gpu: DraGpuNow, base: PreparedDevice
) -> PreparedDevice:
    view = gpu.gpu
    if not view.mode.is_shared:
        raise ClaimRefused(ref.key, f"{where}.device: GPU {view.index} is not shared now")
    consumed = dict(result.consumed)
    memory_bytes = consumed.get(names.MEMORY)
    compute = consumed.get(names.COMPUTE)
    if memory_bytes is None or compute is None:
        raise ClaimRefused(
            ref.key,
            f"{where}.consumedCapacity: needs {names.MEMORY} and {names.COMPUTE} "
            "(the scheduler writes them for a shared device)",
        )
    memory = memory_bytes / MIB
    if memory.denominator != 1 or not 1 <= memory <= view.memory_mib:
        raise ClaimRefused(
            ref.key,
            f"{where}.consumedCapacity.{names.MEMORY}: {_text(memory)} MiB is not a whole "
            f"number of MiB in 1-{view.memory_mib}",
        )
    if compute.denominator != 1 or not 1 <= compute <= 100:
        raise ClaimRefused(
            ref.key,
            f"{where}.consumedCapacity.{names.COMPUTE}: {_text(compute)} is not a percentage "
            "of 1-100",
        )
    memory_mib, percent = int(memory), int(compute)
    if view.mode is Mode.MPS:
        if not view.mps_pipe_directory:
            raise ClaimRefused(ref.key, f"GPU {view.index} has no running MPS daemon")
        defaults = MpsLimits(view.replicas, view.mps_memory_mib, view.mps_compute_percent)
        try:
            client_limits(memory_mib, percent, defaults=defaults, gpu_memory_mib=view.memory_mib)
        except InvalidInput as error:
            raise ClaimRefused(ref.key, f"{where}: {error.problem}") from None
    return replace(
        base,
        kind=DeviceKind.SHARED,
        memory_mib=memory_mib,
        compute_percent=percent,
    )


def _text(value: Fraction) -> str:
    return str(value.numerator) if value.denominator == 1 else f"{float(value):.6g}"


def _conflict(a: PreparedDevice, b: PreparedDevice) -> bool:
    """Whether two devices cannot both be given: the same GPU, one of them whole or both MIG
    instances over a common memory slice. Shared devices are many claims' by design, and an
    admin access is a view that takes nothing."""
    if a.gpu_index != b.gpu_index or a.admin_access or b.admin_access:
        return False
    if DeviceKind.GPU in (a.kind, b.kind):
        return True
    if a.instance is not None and b.instance is not None:
        return a.instance.placement.overlaps(b.instance.placement)
    return False


def _check_requests(ref: ClaimRef, devices: Sequence[PreparedDevice]) -> None:
    """A container is the client of one MPS daemon: a request gets at most one MPS device."""
    by_request: dict[str, int] = {}
    for device in devices:
        if device.kind is DeviceKind.SHARED and not device.admin_access:
            by_request[device.request] = by_request.get(device.request, 0) + 1
    crowded = sorted(r for r, n in by_request.items() if n > 1)
    if crowded:
        raise ClaimRefused(
            ref.key,
            f"request {crowded[0]} was given {by_request[crowded[0]]} shared GPUs; a container "
            "can be served by one",
        )


def instances_to_make(claim: PreparedClaim) -> dict[int, tuple[MigInstance, ...]]:
    """Per GPU index, the MIG instances the claim needs that do not exist yet."""
    found: dict[int, list[MigInstance]] = {}
    for device in claim.devices:
        if device.kind is DeviceKind.MIG and device.instance is not None and not device.mig_uuid:
            found.setdefault(device.gpu_index, []).append(device.instance)
    return {index: tuple(sorted(items)) for index, items in found.items()}


def layout_with(gpu: OfferedGpu, made: Iterable[MigInstance]) -> Layout:
    """The GPU's instances now plus `made`: the layout a prepare reaches (nothing else moves)."""
    return tuple(sorted({m.instance for m in gpu.mig} | set(made)))


def layouts_after_release(
    claim: PreparedClaim, others: Iterable[PreparedClaim], gpus: Mapping[int, DraGpuNow]
) -> dict[int, Layout]:
    """Per GPU where the claim holds a dynamic instance: the layout once it is released.

    Its instances are destroyed unless the GPU's warm mix keeps one of that profile idle
    (instances no other claim holds); a static GPU's instances stay. The layout names whole
    instances only, so a half-built one at the claim's placement goes as well. A GPU gone from the node
    is left out (nothing there to destroy). Instances of other claims are always kept.
    """
    held = {
        (d.gpu_index, d.instance)
        for c in others
        if c.ref.uid != claim.ref.uid
        for d in c.devices
        if d.instance is not None and not d.admin_access  # a view keeps nothing alive
    }
    found: dict[int, Layout] = {}
    for device in claim.devices:
        if not device.dynamic or device.instance is None or device.gpu_index not in gpus:
            continue
        now = gpus[device.gpu_index]
        layout = set(found.get(device.gpu_index, layout_with(now.gpu, ())))
        # Not there as a whole instance: a kill mid-prepare may have left it half-built, which
        # the layout without it destroys too.
        idle = [
            i
            for i in layout
            if i != device.instance
            and i.profile == device.instance.profile
            and (device.gpu_index, i) not in held
        ]
        if len(idle) >= dict(now.warm).get(device.instance.profile, 0):
            layout.discard(device.instance)
        found[device.gpu_index] = tuple(sorted(layout))
    return found


# ---- CDI ----


def cdi_device_name(claim_uid: str, request: str) -> str:
    return f"{claim_uid}-{request}"


def cdi_ids(claim: PreparedClaim) -> tuple[tuple[str, ...], ...]:
    """Per device of the claim, the CDI IDs to return: the request's one CDI device on the
    first device of each request, none on the others (the kubelet gives a container every
    device of a request it names, so it gets the ID once)."""
    seen: set[str] = set()
    found: list[tuple[str, ...]] = []
    for device in claim.devices:
        if device.request in seen:
            found.append(())
            continue
        seen.add(device.request)
        found.append((f"{CDI_KIND}={cdi_device_name(claim.ref.uid, device.request)}",))
    return tuple(found)


def cdi_spec(claim: PreparedClaim, gpus: Mapping[int, DraGpuNow]) -> dict[str, Any]:
    """The claim's transient CDI spec: one device per request with its devices' edits.

    InvalidInput when a device is not on the GPUs as they are now (a MIG instance gone), so
    no spec names a device the container would not get.
    """
    requests: dict[str, list[PreparedDevice]] = {}
    for device in claim.devices:
        requests.setdefault(device.request, []).append(device)
    devices = []
    for request, prepared in requests.items():
        edits = _request_allocation(claim, prepared, gpus)
        devices.append(
            {"name": cdi_device_name(claim.ref.uid, request), "containerEdits": _edits(edits)}
        )
    return {"cdiVersion": CDI_VERSION, "kind": CDI_KIND, "devices": devices}


def _request_allocation(
    claim: PreparedClaim, prepared: Sequence[PreparedDevice], gpus: Mapping[int, DraGpuNow]
) -> ContainerAllocation:
    where = f"claim {claim.ref.key}"
    shared = [d for d in prepared if d.kind is DeviceKind.SHARED]
    if shared:
        device = shared[0]
        if len(prepared) > 1:
            raise InvalidInput(where, f"request {device.request} mixes a shared GPU with others")
        gpu = _gpu(gpus, device, where)
        if device.admin_access:
            return gpu_view_allocation(gpu)
        return shared_allocation(
            gpu,
            memory_mib=device.memory_mib if gpu.mode is Mode.MPS else 0,
            compute_percent=device.compute_percent if gpu.mode is Mode.MPS else 0,
            cdi=False,
        )
    found: list[Device] = []
    for device in prepared:
        gpu = _gpu(gpus, device, where)
        mig = None
        if device.kind is DeviceKind.MIG:
            mig = next((m for m in gpu.mig if m.uuid == device.mig_uuid), None)
            if mig is None or not device.mig_uuid:
                raise InvalidInput(
                    f"{where} device {device.device}",
                    f"MIG instance {shown(device.mig_uuid)} is not on GPU {device.gpu_index}",
                )
        found.append(Device(device.mig_uuid or gpu.uuid, "", gpu, mig))
    try:
        return exclusive_allocation(found, cdi=False)
    except GpupartError as error:
        raise InvalidInput(where, str(error)) from None


def _gpu(gpus: Mapping[int, DraGpuNow], device: PreparedDevice, where: str) -> OfferedGpu:
    now = gpus.get(device.gpu_index)
    if now is None or now.gpu.uuid != device.gpu_uuid:
        raise InvalidInput(
            f"{where} device {device.device}", f"GPU {device.gpu_uuid} is not on this node now"
        )
    return now.gpu


def _edits(allocation: ContainerAllocation) -> dict[str, Any]:
    edits: dict[str, Any] = {"env": [f"{k}={v}" for k, v in allocation.envs]}
    if allocation.devices:
        edits["deviceNodes"] = [
            {"path": d.path, "permissions": d.permissions} for d in allocation.devices
        ]
    if allocation.mounts:
        edits["mounts"] = [
            {
                "hostPath": m.host_path,
                "containerPath": m.container_path,
                "options": ["ro" if m.read_only else "rw", "rbind"],
            }
            for m in allocation.mounts
        ]
    return edits
