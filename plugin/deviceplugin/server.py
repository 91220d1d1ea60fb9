"""The kubelet DevicePlugin gRPC servicer for one resource name (thin: parse, call the allocator, convert)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from concurrent import futures

import grpc

from gpupart import logs
from gpupart.core.errors import GpupartError
from gpupart.core.node.allocation import ContainerAllocation
from gpupart.core.node.devices import HEALTHY, UNHEALTHY
from gpupart_plugin.deviceplugin.allocator import Allocator
from gpupart_plugin.deviceplugin.api import deviceplugin_pb2 as api
from gpupart_plugin.deviceplugin.api import deviceplugin_pb2_grpc as api_grpc
from gpupart_plugin.deviceplugin.hub import DeviceHub
from gpupart_plugin.metrics import NodeMetrics

log = logging.getLogger(__name__)


def _response(allocation: ContainerAllocation) -> api.ContainerAllocateResponse:
    return api.ContainerAllocateResponse(
        envs=dict(allocation.envs),
        mounts=[
            api.Mount(container_path=m.container_path, host_path=m.host_path, read_only=m.read_only)
            for m in allocation.mounts
        ],
        devices=[
            api.DeviceSpec(container_path=d.path, host_path=d.path, permissions=d.permissions)
            for d in allocation.devices
        ],
        cdi_devices=[api.CDIDevice(name=n) for n in allocation.cdi_devices],
    )


class ResourceServicer(api_grpc.DevicePluginServicer):
    """DevicePlugin for one resource; ListAndWatch re-sends the full list on every change."""

    def __init__(
        self,
        resource: str,
        hub: DeviceHub,
        allocator: Allocator,
        metrics: NodeMetrics,
        *,
        poll_s: float = 0.5,
    ) -> None:
        self.resource = resource
        self.hub = hub
        self.allocator = allocator
        self.metrics = metrics
        self.poll_s = poll_s
        self.stopped = False

    def _listing(self) -> api.ListAndWatchResponse:
        return api.ListAndWatchResponse(
            devices=[
                api.Device(
                    ID=device.id,
                    health=HEALTHY if healthy else UNHEALTHY,
                    topology=None
                    if device.gpu.numa_node is None
                    else api.TopologyInfo(nodes=[api.NUMANode(ID=device.gpu.numa_node)]),
                )
                for device, healthy in self.hub.listing(self.resource)
            ]
        )

    def GetDevicePluginOptions(  # noqa: N802 (gRPC method names)
        self, _request: api.Empty, _context: grpc.ServicerContext
    ) -> api.DevicePluginOptions:
        return api.DevicePluginOptions(get_preferred_allocation_available=True)

    def ListAndWatch(  # noqa: N802
        self, _request: api.Empty, context: grpc.ServicerContext
    ) -> Iterator[api.ListAndWatchResponse]:
        version = self.hub.version
        sent = self._listing()
        yield sent
        while context.is_active() and not self.stopped:
            latest = self.hub.wait(version, self.poll_s)
            if latest == version:
                continue  # timed out: the listing is what was sent (every change bumps the version)
            version = latest
            listing = self._listing()
            if listing != sent:
                sent = listing
                yield listing

    def GetPreferredAllocation(  # noqa: N802
        self, request: api.PreferredAllocationRequest, context: grpc.ServicerContext
    ) -> api.PreferredAllocationResponse:
        responses = []
        for item in request.container_requests:
            try:
                ids = self.allocator.preferred(
                    self.resource,
                    list(item.available_deviceIDs),
                    list(item.must_include_deviceIDs),
                    item.allocation_size,
                )
            except GpupartError as error:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
            responses.append(api.ContainerPreferredAllocationResponse(deviceIDs=list(ids)))
        return api.PreferredAllocationResponse(container_responses=responses)

    def Allocate(  # noqa: N802
        self, request: api.AllocateRequest, context: grpc.ServicerContext
    ) -> api.AllocateResponse:
        responses = []
        for item in request.container_requests:
            try:
                allocation = self.allocator.allocate(self.resource, list(item.devices_ids))
            except GpupartError as error:
                self.metrics.allocated(self.resource, ok=False)
                log.warning(
                    "Refused allocation",
                    extra=logs.kv(
                        resource=self.resource, devices=",".join(item.devices_ids), err=error
                    ),
                )
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
            self.metrics.allocated(self.resource, ok=True)
            responses.append(_response(allocation))
        return api.AllocateResponse(container_responses=responses)

    def PreStartContainer(  # noqa: N802
        self, _request: api.PreStartContainerRequest, _context: grpc.ServicerContext
    ) -> api.PreStartContainerResponse:
        return api.PreStartContainerResponse()


def start_server(servicer: ResourceServicer, socket_path: str) -> grpc.Server:
    """Serve the servicer on a unix socket (stale file removed first); started before Register."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="dp"))
    api_grpc.add_DevicePluginServicer_to_server(servicer, server)
    server.add_insecure_port(f"unix://{socket_path}")
    server.start()
    return server
