"""Allocate and GetPreferredAllocation decisions for one node: core choices plus the pod lookup for shared slots."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from gpupart.core.allocation import ContainerAllocation, exclusive_allocation, shared_allocation
from gpupart.core.devices import (
    AssignedPod,
    choose_shared_pod,
    preferred_allocation,
    resolve_devices,
)
from gpupart.core.errors import InvalidInput
from gpupart.core.mps import MpsLimits, client_limits
from gpupart.core.resources import GPU_SHARED
from gpupart.core.spec import Mode
from gpupart_plugin.devices import DeviceHub

PodSource = Callable[[], tuple[AssignedPod, ...]]
"""Pending pods on this node that carry the extender's assignment annotation."""


class Allocator:
    """Turns the kubelet's device ids into container allocations; a request it cannot honour raises InvalidInput."""

    def __init__(self, hub: DeviceHub, node: str, pods: PodSource, *, cdi: bool = True) -> None:
        self.hub = hub
        self.node = node
        self.pods = pods
        self.cdi = cdi
        self._lock = threading.Lock()
        self._served: set[str] = set()
        """Pods already given a shared slot while still pending (the kubelet may call again)."""

    def allocate(self, resource: str, ids: Sequence[str]) -> ContainerAllocation:
        devices = resolve_devices(ids, self.hub.devices(resource))
        if resource != GPU_SHARED:
            return exclusive_allocation(devices, cdi=self.cdi)
        pending = self.pods()
        with self._lock:
            self._served &= {p.uid for p in pending}
            pod = choose_shared_pod(pending, node=self.node, count=len(ids), taken=self._served)
            if pod is None:
                raise InvalidInput(
                    "Allocate",
                    f"no pending pod on node {self.node} has a gpupart.io/assignment for "
                    f"{len(ids)} shared slot(s); is the gpupart scheduler extender configured?",
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
            with self._lock:
                served = set(self._served)
            pod = choose_shared_pod(self.pods(), node=self.node, count=size, taken=served)
            prefer = pod.assignment.gpu_uuid if pod is not None else None
        return preferred_allocation(
            available, must_include, size, self.hub.devices(resource), prefer_gpu=prefer
        )
