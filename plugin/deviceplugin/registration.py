"""One gRPC server and one kubelet Register per resource name; re-registers when the kubelet restarts.

Order matters (kubelet docs): the plugin serves on its socket before it calls Register. A kubelet
restart deletes every socket in the device-plugin directory and re-creates kubelet.sock, so a
changed kubelet.sock inode, or our own socket gone, restarts the servers and registers again.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import grpc

from gpupart import logs
from gpupart_plugin.deviceplugin.allocator import Allocator
from gpupart_plugin.deviceplugin.api import deviceplugin_pb2 as api
from gpupart_plugin.deviceplugin.api import deviceplugin_pb2_grpc as api_grpc
from gpupart_plugin.deviceplugin.hub import DeviceHub
from gpupart_plugin.deviceplugin.server import ResourceServicer, start_server
from gpupart_plugin.metrics import NodeMetrics

log = logging.getLogger(__name__)

VERSION = "v1beta1"


def socket_name(resource: str) -> str:
    """`gpupart-nvidia.com_mig-1g.10gb.sock`: file names may not contain '/' nor start with '.'."""
    return "gpupart-" + resource.replace("/", "_") + ".sock"


@dataclass
class _Plugin:
    servicer: ResourceServicer
    server: grpc.Server
    registered: bool = False


class DevicePlugins:
    """The set of running device plugins, kept in step with the hub's resources."""

    def __init__(
        self,
        hub: DeviceHub,
        allocator: Allocator,
        metrics: NodeMetrics,
        *,
        plugin_dir: Path,
        kubelet_socket: Path,
        timeout_s: float = 5.0,
        poll_s: float = 0.5,
    ) -> None:
        self.hub = hub
        self.allocator = allocator
        self.metrics = metrics
        self.plugin_dir = plugin_dir
        self.kubelet_socket = kubelet_socket
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self._lock = threading.RLock()
        self._plugins: dict[str, _Plugin] = {}
        self._kubelet_id = self._kubelet_identity()

    def sync(self) -> None:
        """Serve every resource the hub knows (withdrawn ones list no device) and register."""
        with self._lock:
            for resource in self.hub.resources():
                if resource not in self._plugins:
                    self._start(resource)
            self._register_pending()

    def check_kubelet(self) -> bool:
        """Restart and re-register everything if the kubelet restarted; True when it did."""
        with self._lock:
            identity = self._kubelet_identity()
            lost = [r for r in self._plugins if not (self.plugin_dir / socket_name(r)).exists()]
            if identity == self._kubelet_id and not lost:
                if any(not p.registered for p in self._plugins.values()):
                    self._register_pending()
                return False
            log.info(
                "Detected kubelet restart",
                extra=logs.kv(socket=self.kubelet_socket, lost=len(lost)),
            )
            self._kubelet_id = identity
            resources = list(self._plugins)
            self.stop()
            for resource in resources:
                self._start(resource)
            self._register_pending()
            return True

    def stop(self) -> None:
        with self._lock:
            for resource, plugin in self._plugins.items():
                plugin.servicer.stopped = True
                plugin.server.stop(grace=0.5).wait(self.timeout_s)
                (self.plugin_dir / socket_name(resource)).unlink(missing_ok=True)
            self._plugins.clear()

    def _kubelet_identity(self) -> tuple[int, int] | None:
        try:
            stat = os.stat(self.kubelet_socket)
        except OSError:
            return None
        return stat.st_ino, stat.st_ctime_ns

    def _start(self, resource: str) -> None:
        path = self.plugin_dir / socket_name(resource)
        path.unlink(missing_ok=True)
        servicer = ResourceServicer(
            resource, self.hub, self.allocator, self.metrics, poll_s=self.poll_s
        )
        self._plugins[resource] = _Plugin(servicer, start_server(servicer, str(path)))
        log.info("Started device plugin", extra=logs.kv(resource=resource, socket=path))

    def _register_pending(self) -> None:
        """Register every resource not yet registered, all at once over one channel.

        After a kubelet restart the node shows capacity 0 for a resource until its Register
        reaches the kubelet: concurrent calls keep that window as short as the kubelet allows
        (one channel and one Register after another took ~200 ms per resource).
        """
        if self._kubelet_identity() is None:
            return  # no kubelet socket yet; the watch registers once it appears
        pending = [r for r, p in self._plugins.items() if not p.registered]
        if not pending:
            return
        with grpc.insecure_channel(f"unix://{self.kubelet_socket}") as channel:
            try:
                grpc.channel_ready_future(channel).result(timeout=self.timeout_s)
            except grpc.FutureTimeoutError:
                log.warning(
                    "Failed to register device plugins",
                    extra=logs.kv(resources=",".join(pending), err="kubelet not reachable"),
                )
                return
            stub = api_grpc.RegistrationStub(channel)
            calls = {
                resource: stub.Register.future(
                    api.RegisterRequest(
                        version=VERSION,
                        endpoint=socket_name(resource),
                        resource_name=resource,
                        options=api.DevicePluginOptions(get_preferred_allocation_available=True),
                    ),
                    timeout=self.timeout_s,
                )
                for resource in pending
            }
            for resource, call in calls.items():
                try:
                    call.result()
                except grpc.RpcError as error:
                    log.warning(
                        "Failed to register device plugin",
                        extra=logs.kv(resource=resource, err=error.code().name),
                    )
                    continue
                self._plugins[resource].registered = True
                log.info("Registered device plugin", extra=logs.kv(resource=resource))
