"""Allocate and GetPreferredAllocation decisions for one node: core choices plus the pod lookup for shared slots."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from gpupart import logs
from gpupart.core.api.resources import GPU_SHARED
from gpupart.core.api.spec import Mode
from gpupart.core.api.wire import GivenContainer
from gpupart.core.errors import GpupartError
from gpupart.core.node.admission import (
    AdmissionRecord,
    AdmissionRefused,
    SharedPod,
    admit_shared,
    awaiting_pod,
    slot_gpu,
)
from gpupart.core.node.allocation import (
    ContainerAllocation,
    exclusive_allocation,
    shared_allocation,
)
from gpupart.core.node.devices import OfferedGpu, preferred_allocation, resolve_devices
from gpupart.core.node.mps import MpsLimits, client_limits
from gpupart_plugin.checkpoint import Checkpoint
from gpupart_plugin.deviceplugin.hub import DeviceHub

log = logging.getLogger(__name__)

PodSource = Callable[[], tuple[SharedPod, ...]]
"""Pods bound to this node (any live phase) that carry an assignment annotation, verified or not."""
Recorder = Callable[[SharedPod, tuple[GivenContainer, ...]], None]
"""Writes a pod's allocation record (its `gpupart.io/SharedGpuAllocated` condition, the
extender's gate); raises GpupartError
when it cannot."""
Warn = Callable[[SharedPod, str], None]
"""Tells a pod why its Allocate was refused (a Warning Event); raises nothing."""
MAX_WARNED = 4096


class Allocator:
    """Turns the kubelet's device ids into container allocations; a request it cannot honour raises InvalidInput."""

    def __init__(
        self,
        hub: DeviceHub,
        node: str,
        pods: PodSource,
        record: Recorder,
        checkpoint: Checkpoint,
        *,
        warn: Warn | None = None,
        cdi: bool = True,
    ) -> None:
        self.hub = hub
        self.node = node
        self.pods = pods
        self.record = record
        self.checkpoint = checkpoint
        self.warn = warn
        self.cdi = cdi
        self._lock = threading.Lock()
        self._warned: set[tuple[str, str]] = set()
        """(pod uid, message) already told: a kubelet retrying says the same thing once."""

    def allocate(self, resource: str, ids: Sequence[str]) -> ContainerAllocation:
        devices = resolve_devices(ids, self.hub.devices(resource))
        if resource != GPU_SHARED:
            return exclusive_allocation(devices, cdi=self.cdi)
        # One shared Allocate at a time (the kubelet sends them one by one anyway): the record
        # of one must be written before the next is paired.
        with self._lock:
            listed = self.pods()
            try:
                given = self._admit(listed, ids, slot_gpu(devices))
            except AdmissionRefused as refusal:
                self._tell(listed, refusal)
                raise
        gpu = self.hub.gpu(given.gpu_uuid)
        assert gpu is not None  # slot_gpu found it among the hub's devices
        return shared_allocation(
            gpu, memory_mib=given.memory_mib, compute_percent=given.compute_percent, cdi=self.cdi
        )

    def _admit(
        self, listed: tuple[SharedPod, ...], ids: Sequence[str], gpu: OfferedGpu
    ) -> GivenContainer:
        if self.checkpoint.problem:
            raise AdmissionRefused(
                f"the node agent's admission checkpoint is unreadable ({self.checkpoint.problem}); "
                "it cannot tell what it gave the pods running here, so it serves no shared GPU "
                "slot until an admin moves the file away (after draining this node's shared-GPU pods)"
            )
        records = self._prune(listed)
        admission = admit_shared(listed, records, node=self.node, ids=ids, gpu=gpu)
        if admission.repeat is not None:
            return admission.repeat
        pod, container = admission.pod, admission.container
        assert container is not None
        memory = compute = 0
        if gpu.mode is Mode.MPS:
            memory, compute = client_limits(
                container.memory_mib,
                container.compute_percent,
                defaults=MpsLimits(gpu.replicas, gpu.mps_memory_mib, gpu.mps_compute_percent),
                gpu_memory_mib=gpu.memory_mib,
            )
        given = GivenContainer(container.name, tuple(sorted(ids)), gpu.uuid, memory, compute)
        before = records.get(pod.uid)
        after = AdmissionRecord(
            pod.uid,
            pod.key,
            gpu.uuid,
            pod.assignment.memory_mib,
            pod.assignment.compute_percent,
            (*(before.given if before is not None else ()), given),
        )
        # Ours first (what a restarted agent answers from), then the pod's annotation, which
        # the extender waits for before binding the next shared pod here. Both before the answer.
        self._save({**records, pod.uid: after})
        try:
            self.record(pod, after.given)
        except GpupartError:
            self._save(records)  # not served: the kubelet fails the pod
            raise
        return given

    def _prune(self, listed: tuple[SharedPod, ...]) -> dict[str, AdmissionRecord]:
        """The checkpoint's records of pods still listed; gone or finished pods' are dropped."""
        uids = {p.uid for p in listed if p.phase not in ("Succeeded", "Failed")}
        records = {uid: r for uid, r in self.checkpoint.records.items() if uid in uids}
        if len(records) != len(self.checkpoint.records):
            self._save(records)
        self._warned = {w for w in self._warned if w[0] in uids}
        return records

    def _save(self, records: dict[str, AdmissionRecord]) -> None:
        try:
            self.checkpoint.save(records.values())
        except GpupartError as error:
            raise AdmissionRefused(f"cannot write the admission checkpoint: {error}") from None

    def _tell(self, listed: tuple[SharedPod, ...], refusal: AdmissionRefused) -> None:
        log.warning("Refused shared-GPU Allocate", extra=logs.kv(err=refusal))
        if self.warn is None:
            return
        by_key = {p.key: p for p in listed}
        for key in refusal.pods:
            pod = by_key.get(key)
            if pod is None or len(self._warned) >= MAX_WARNED:
                continue
            told = (pod.uid, str(refusal))
            if told not in self._warned:
                self._warned.add(told)
                self.warn(pod, str(refusal))

    def preferred(
        self, resource: str, available: Sequence[str], must_include: Sequence[str], size: int
    ) -> tuple[str, ...]:
        prefer = None
        if resource == GPU_SHARED:
            with self._lock:
                listed = self.pods()
                pod = awaiting_pod(listed, self.checkpoint.records, node=self.node)
            prefer = pod.assignment.gpu_uuid if pod is not None else None
        return preferred_allocation(
            available, must_include, size, self.hub.devices(resource), prefer_gpu=prefer
        )
