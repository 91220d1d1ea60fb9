"""Client of the kubelet PodResources API (List over its unix socket): which pod holds which device."""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from gpupart.core.errors import GpupartError
from gpupart_plugin.api import podresources_pb2, podresources_pb2_grpc


class PodResourcesUnavailable(GpupartError):
    """The kubelet's PodResources socket did not answer."""


@dataclass(frozen=True, slots=True)
class PodDevices:
    pod: str
    """namespace/name"""
    resource: str
    device_ids: tuple[str, ...]


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

    def close(self) -> None:
        self._channel.close()
