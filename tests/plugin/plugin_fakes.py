"""The node agent tests' fakes: the kubelet's Registration and PodResources servers, a PodResources answer."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent import futures
from pathlib import Path

import grpc

from gpupart_plugin.api import podresources_pb2 as pr
from gpupart_plugin.api import podresources_pb2_grpc as pr_grpc
from gpupart_plugin.deviceplugin.api import deviceplugin_pb2 as api
from gpupart_plugin.deviceplugin.api import deviceplugin_pb2_grpc as api_grpc
from gpupart_plugin.podresources import PodDevices, PodResourcesUnavailable


class FakeKubelet(api_grpc.RegistrationServicer):
    """Serves Registration on <dir>/kubelet.sock; on Register dials the plugin and streams ListAndWatch."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.registrations: queue.Queue[api.RegisterRequest] = queue.Queue()
        self.lists: dict[str, queue.Queue[list[tuple[str, str]]]] = {}
        self.stubs: dict[str, api_grpc.DevicePluginStub] = {}
        self.options: dict[str, api.DevicePluginOptions] = {}
        self.current: dict[str, list[tuple[str, str]]] = {}
        """The newest list each plugin sent: what the kubelet's device manager holds."""
        self._channels: list[grpc.Channel] = []
        self._server: grpc.Server | None = None

    @property
    def socket(self) -> Path:
        return self.directory / "kubelet.sock"

    def start(self) -> None:
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        api_grpc.add_RegistrationServicer_to_server(self, self._server)
        self._server.add_insecure_port(f"unix://{self.socket}")
        self._server.start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=None).wait(5)
        for channel in self._channels:
            channel.close()
        self._channels.clear()

    def restart(self) -> None:
        """As a new kubelet does: delete every socket in the directory, serve a new kubelet.sock."""
        self.stop()
        for path in self.directory.glob("*.sock"):
            path.unlink()
        self.start()

    def Register(self, request: api.RegisterRequest, _context: object) -> api.Empty:  # noqa: N802
        assert request.version == "v1beta1"
        self.registrations.put(request)
        threading.Thread(target=self._dial, args=(request,), daemon=True).start()
        return api.Empty()

    def _dial(self, request: api.RegisterRequest) -> None:
        channel = grpc.insecure_channel(f"unix://{self.directory / request.endpoint}")
        self._channels.append(channel)
        stub = api_grpc.DevicePluginStub(channel)
        self.options[request.resource_name] = stub.GetDevicePluginOptions(api.Empty(), timeout=5)
        self.stubs[request.resource_name] = stub
        lists = self.lists.setdefault(request.resource_name, queue.Queue())
        try:
            for response in stub.ListAndWatch(api.Empty(), timeout=60):
                listed = [(d.ID, d.health) for d in response.devices]
                self.current[request.resource_name] = listed
                lists.put(listed)
        except grpc.RpcError:
            pass  # plugin stopped or channel closed

    def registered(self, timeout_s: float = 5.0) -> set[str]:
        """Resource names registered within the timeout (drains the queue)."""
        names = set()
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                left = max(0.0, deadline - time.monotonic())
                names.add(self.registrations.get(timeout=min(left, 0.3)).resource_name)
            except queue.Empty:
                if names or time.monotonic() >= deadline:
                    return names

    def latest(self, resource: str, timeout_s: float = 5.0) -> list[tuple[str, str]]:
        """Wait for the stream to send, then the newest list."""
        deadline = time.monotonic() + timeout_s
        while resource not in self.lists and time.monotonic() < deadline:
            time.sleep(0.01)
        lists = self.lists[resource]
        item = lists.get(timeout=timeout_s)
        while True:
            try:
                item = lists.get(timeout=0.2)
            except queue.Empty:
                return item

    def wait_for(
        self, resource: str, check: Callable[[list[tuple[str, str]]], bool], timeout_s: float = 5.0
    ) -> list[tuple[str, str]]:
        deadline = time.monotonic() + timeout_s
        while resource not in self.lists and time.monotonic() < deadline:
            time.sleep(0.01)
        lists = self.lists[resource]
        while True:
            item = lists.get(timeout=max(0.01, deadline - time.monotonic()))
            if check(item):
                return item


class FakePodResources(pr_grpc.PodResourcesListerServicer):
    """The kubelet's PodResources on <dir>/pr.sock: GetAllocatableResources lists the healthy
    devices the fake kubelet received over ListAndWatch; while `pause()`d, those it had then
    (a device manager that has not taken in the newer lists yet).

    `implements_allocatable=False` answers it as a kubelet older than 1.23 does: UNIMPLEMENTED.
    """

    def __init__(self, kubelet: FakeKubelet, *, implements_allocatable: bool = True) -> None:
        self.kubelet = kubelet
        self.implements_allocatable = implements_allocatable
        self._frozen: dict[str, set[str]] | None = None
        self.answers: list[dict[str, set[str]]] = []
        """Every GetAllocatableResources answer, oldest first."""
        self._server: grpc.Server | None = None

    @property
    def socket(self) -> Path:
        return self.kubelet.directory / "pr.sock"

    def start(self) -> None:
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        pr_grpc.add_PodResourcesListerServicer_to_server(self, self._server)
        self._server.add_insecure_port(f"unix://{self.socket}")
        self._server.start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=None).wait(5)

    def pause(self) -> None:
        self._frozen = self._held()

    def resume(self) -> None:
        self._frozen = None

    def _held(self) -> dict[str, set[str]]:
        return {
            resource: {i for i, health in listed if health == "Healthy"}
            for resource, listed in list(self.kubelet.current.items())
        }

    def GetAllocatableResources(  # noqa: N802 (gRPC method name)
        self, request: pr.AllocatableResourcesRequest, context: grpc.ServicerContext
    ) -> pr.AllocatableResourcesResponse:
        if not self.implements_allocatable:
            return super().GetAllocatableResources(request, context)  # UNIMPLEMENTED
        held = self._held() if self._frozen is None else self._frozen
        self.answers.append(held)
        # One entry per device, as the kubelet answers (each with its own topology).
        return pr.AllocatableResourcesResponse(
            devices=[
                pr.ContainerDevices(resource_name=resource, device_ids=[i])
                for resource, ids in held.items()
                for i in sorted(ids)
            ]
        )


class Pods:
    """A stand-in kubelet PodResources answer that tests edit."""

    def __init__(self) -> None:
        self.held: list[PodDevices] = []
        self.down = False

    def __call__(self) -> tuple[PodDevices, ...]:
        if self.down:
            raise PodResourcesUnavailable("kubelet PodResources: UNAVAILABLE")
        return tuple(self.held)
