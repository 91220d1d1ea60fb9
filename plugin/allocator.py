"""Allocate and GetPreferredAllocation decisions for one node: core choices plus the pod lookup for shared slots."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from gpupart.core.allocation import ContainerAllocation, exclusive_allocation, shared_allocation
from gpupart.core.devices import (
    AssignedPod,
    choose_shared_pod,
    preferred_allocation,
    resolve_devices,
)
from gpupart.core.errors import GpupartError, InvalidInput
from gpupart.core.mps import MpsLimits, client_limits
from gpupart.core.resources import GPU_SHARED
from gpupart.core.spec import Mode
from gpupart_plugin.devices import DeviceHub
from gpupart_plugin.podresources import PodDevices

log = logging.getLogger(__name__)

PodSource = Callable[[], tuple[AssignedPod, ...]]
"""Pods bound to this node (any phase) that carry the extender's assignment annotation."""
HeldSource = Callable[[], tuple[PodDevices, ...]]
"""What the kubelet already allocated (PodResources List); raises GpupartError when it cannot say."""


class Allocator:
    """Turns the kubelet's device ids into container allocations; a request it cannot honour raises InvalidInput."""

    def __init__(
        self,
        hub: DeviceHub,
        node: str,
        pods: PodSource,
        *,
        held: HeldSource = lambda: (),
        cdi: bool = True,
    ) -> None:
        self.hub = hub
        self.node = node
        self.pods = pods
        self.held = held
        self.cdi = cdi
        self._lock = threading.Lock()
        self._served: set[str] = set()
        """Pods this process gave a shared slot (the kubelet lists them in PodResources soon after)."""

    def allocate(self, resource: str, ids: Sequence[str]) -> ContainerAllocation:
        devices = resolve_devices(ids, self.hub.devices(resource))
        if resource != GPU_SHARED:
            return exclusive_allocation(devices, cdi=self.cdi)
        listed, held = self.pods(), self._held()
        with self._lock:
            self._served &= {p.uid for p in listed}  # forget pods that are gone
            pod = choose_shared_pod(
                listed, node=self.node, count=len(ids), taken=self._served, held=held
            )
            if pod is None:
                raise InvalidInput(
                    "Allocate",
                    f"no pod bound to node {self.node} and not yet served has a "
                    f"gpupart.io/assignment for {len(ids)} shared slot(s); "
                    "is the gpupart scheduler extender configured?",
                )
            self._served.add(pod.uid)
        gpu = self.hub.gpu(pod.assignment.gpu_uuid)
        if gpu is None or gpu.mode not in (Mode.MPS, Mode.TIME_SLICING):
            raise InvalidInput(
                "Allocate",
                f"pod {pod.key} was assigned GPU {pod.assignment.gpu_uuid}, "
                "which is not a shared GPU on this node now",
            )
        if gpu.mode is Mode.TIME_SLICING:
            return shared_allocation(gpu, memory_mib=0, compute_percent=0, cdi=self.cdi)
        memory, compute = client_limits(
            pod.request.memory_mib or pod.assignment.memory_mib,
            pod.request.compute_percent or pod.assignment.compute_percent,
            defaults=MpsLimits(gpu.slots, gpu.mps_memory_mib, gpu.mps_compute_percent),
            gpu_memory_mib=gpu.memory_mib,
        )
        return shared_allocation(gpu, memory_mib=memory, compute_percent=compute, cdi=self.cdi)

    def preferred(
        self, resource: str, available: Sequence[str], must_include: Sequence[str], size: int
    ) -> tuple[str, ...]:
        prefer = None
        if resource == GPU_SHARED:
            listed, held = self.pods(), self._held()
            with self._lock:
                served = set(self._served)
            pod = choose_shared_pod(listed, node=self.node, count=size, taken=served, held=held)
            prefer = pod.assignment.gpu_uuid if pod is not None else None
        return preferred_allocation(
            available, must_include, size, self.hub.devices(resource), prefer_gpu=prefer
        )

    def _held(self) -> frozenset[str]:
        """Pods the kubelet holds shared slots for; empty (this process's memory only) when it cannot say."""
        try:
            entries = self.held()
        except GpupartError as error:
            log.warning("Failed to list kubelet pod resources err=%s", error)
            return frozenset()
        return frozenset(e.pod for e in entries if e.resource == GPU_SHARED)
