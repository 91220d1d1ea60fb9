"""Client of the kubelet PodResources API (unix socket): which pod holds which device, what the kubelet holds."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import grpc

from gpupart.core.errors import GpupartError
from gpupart.core.node.devices import SLOT_SEPARATOR
from gpupart_plugin.api import podresources_pb2, podresources_pb2_grpc


class PodResourcesUnavailable(GpupartError):
    """The kubelet's PodResources socket did not answer."""


class AllocatableUnimplemented(PodResourcesUnavailable):
    """The kubelet does not serve GetAllocatableResources (older than 1.23, or its gate off)."""


@dataclass(frozen=True, slots=True)
class PodDevices:
    pod: str
    """namespace/name"""
    resource: str
    device_ids: tuple[str, ...]


UsageSource = Callable[[], tuple[PodDevices, ...]]
"""Lists the devices pods hold (the kubelet PodResources API); raises GpupartError when it cannot."""


@dataclass(frozen=True, slots=True)
class DeviceUsage:
    """Pods per device-owning UUID (GPU or MIG); `known` is False when the kubelet did not answer."""

    pods: Mapping[str, frozenset[str]]
    known: bool
    problem: str = ""
    shared: Mapping[str, int] = field(default_factory=dict)
    """GPU UUID -> client slots held on it (a shared GPU, even when the agent restarted)."""

    def of(self, *uuids: str) -> tuple[str, ...]:
        return tuple(sorted({pod for u in uuids for pod in self.pods.get(u, ())}))


def device_usage(source: UsageSource) -> DeviceUsage:
    """What the kubelet says pods hold now; unknown (every device counts as held) when it does not answer."""
    try:
        listed = source()
    except GpupartError as error:
        return DeviceUsage({}, known=False, problem=str(error))
    pods: dict[str, set[str]] = {}
    shared: dict[str, int] = {}
    for entry in listed:
        for device_id in entry.device_ids:
            owner, slot, _ = device_id.partition(SLOT_SEPARATOR)
            pods.setdefault(owner, set()).add(entry.pod)
            if slot:
                shared[owner] = shared.get(owner, 0) + 1
    return DeviceUsage({k: frozenset(v) for k, v in pods.items()}, known=True, shared=shared)


class PodResourcesClient:
    """One channel to the kubelet, reused; every call has a deadline."""

    def __init__(self, socket_path: str, *, timeout_s: float = 2.0) -> None:
        self.socket_path = socket_path
        self.timeout_s = timeout_s
        self._channel = grpc.insecure_channel(f"unix://{socket_path}")
        self._stub = podresources_pb2_grpc.PodResourcesListerStub(self._channel)

    def list(self) -> tuple[PodDevices, ...]:
        try:
            response = self._stub.List(
                podresources_pb2.ListPodResourcesRequest(), timeout=self.timeout_s
            )
        except grpc.RpcError as error:
            raise PodResourcesUnavailable(
                f"kubelet PodResources at {self.socket_path}: {error.code().name}"
            ) from error
        return tuple(
            PodDevices(
                f"{pod.namespace}/{pod.name}", devices.resource_name, tuple(devices.device_ids)
            )
            for pod in response.pod_resources
            for container in pod.containers
            for devices in container.devices
        )

    def allocatable(self) -> dict[str, frozenset[str]]:
        """The device ids the kubelet's device manager holds healthy, per resource name.

        The kubelet answers one entry per device (with its NUMA node); they are merged here.
        """
        try:
            response = self._stub.GetAllocatableResources(
                podresources_pb2.AllocatableResourcesRequest(), timeout=self.timeout_s
            )
        except grpc.RpcError as error:
            problem = f"kubelet PodResources at {self.socket_path}: {error.code().name}"
            if error.code() is grpc.StatusCode.UNIMPLEMENTED:
                raise AllocatableUnimplemented(problem) from error
            raise PodResourcesUnavailable(problem) from error
        held: dict[str, set[str]] = {}
        for devices in response.devices:
            held.setdefault(devices.resource_name, set()).update(devices.device_ids)
        return {resource: frozenset(ids) for resource, ids in held.items()}

    def close(self) -> None:
        self._channel.close()
