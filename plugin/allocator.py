"""Allocate and GetPreferredAllocation decisions for one node: core choices plus the pod lookup for shared slots."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import replace

from gpupart.core.api.resources import GPU_SHARED
from gpupart.core.api.spec import Mode
from gpupart.core.api.wire import GivenContainer
from gpupart.core.errors import InvalidInput
from gpupart.core.node.admission import AssignedPod, admit_shared, awaiting_pod
from gpupart.core.node.allocation import (
    ContainerAllocation,
    exclusive_allocation,
    shared_allocation,
)
from gpupart.core.node.devices import OfferedGpu, preferred_allocation, resolve_devices
from gpupart.core.node.mps import MpsLimits, client_limits
from gpupart_plugin.devices import DeviceHub

PodSource = Callable[[], tuple[AssignedPod, ...]]
"""Pods bound to this node (any live phase) that carry the extender's assignment annotation."""
Recorder = Callable[[AssignedPod, tuple[GivenContainer, ...]], None]
"""Writes a pod's `gpupart.io/allocation` record; raises GpupartError when it cannot."""


class Allocator:
    """Turns the kubelet's device ids into container allocations; a request it cannot honour raises InvalidInput."""

    def __init__(
        self,
        hub: DeviceHub,
        node: str,
        pods: PodSource,
        record: Recorder,
        *,
        cdi: bool = True,
    ) -> None:
        self.hub = hub
        self.node = node
        self.pods = pods
        self.record = record
        self.cdi = cdi
        self._lock = threading.Lock()
        self._given: dict[str, tuple[GivenContainer, ...]] = {}
        """Records this process wrote, by pod uid: a pod list read just after a write may not
        show it yet, and a record is never shortened."""

    def allocate(self, resource: str, ids: Sequence[str]) -> ContainerAllocation:
        devices = resolve_devices(ids, self.hub.devices(resource))
        if resource != GPU_SHARED:
            return exclusive_allocation(devices, cdi=self.cdi)
        # One shared Allocate at a time (the kubelet sends them one by one anyway): the record
        # of one must be written before the next is paired.
        with self._lock:
            admission = admit_shared(self._listed(), node=self.node, ids=ids)
            pod = admission.pod
            if admission.repeat is not None:
                given = admission.repeat
                gpu = self._shared_gpu(pod, given.gpu_uuid)
            else:
                container = admission.container
                assert container is not None
                gpu = self._shared_gpu(pod, pod.assignment.gpu_uuid)
                memory = compute = 0
                if gpu.mode is Mode.MPS:
                    memory, compute = client_limits(
                        container.memory_mib,
                        container.compute_percent,
                        defaults=MpsLimits(
                            gpu.replicas, gpu.mps_memory_mib, gpu.mps_compute_percent
                        ),
                        gpu_memory_mib=gpu.memory_mib,
                    )
                given = GivenContainer(
                    container.name, tuple(sorted(ids)), gpu.uuid, memory, compute
                )
                record = (*pod.given, given)
                self.record(pod, record)  # before answering: the extender binds the next pod on it
                self._given[pod.uid] = record
        return shared_allocation(
            gpu, memory_mib=given.memory_mib, compute_percent=given.compute_percent, cdi=self.cdi
        )

    def _shared_gpu(self, pod: AssignedPod, uuid: str) -> OfferedGpu:
        gpu = self.hub.gpu(uuid)
        if gpu is None or not gpu.mode.is_shared:
            raise InvalidInput(
                "Allocate",
                f"pod {pod.key} was given GPU {uuid}, which is not a shared GPU on this node now",
            )
        return gpu

    def _listed(self) -> tuple[AssignedPod, ...]:
        listed = self.pods()
        uids = {p.uid for p in listed}
        for uid in [u for u in self._given if u not in uids]:
            del self._given[uid]  # the pod is gone
        return tuple(
            replace(p, given=self._given[p.uid])
            if len(self._given.get(p.uid, ())) > len(p.given)
            else p
            for p in listed
        )

    def preferred(
        self, resource: str, available: Sequence[str], must_include: Sequence[str], size: int
    ) -> tuple[str, ...]:
        prefer = None
        if resource == GPU_SHARED:
            with self._lock:
                pod = awaiting_pod(self._listed(), node=self.node)
            prefer = pod.assignment.gpu_uuid if pod is not None else None
        return preferred_allocation(
            available, must_include, size, self.hub.devices(resource), prefer_gpu=prefer
        )
