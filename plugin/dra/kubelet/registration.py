"""The plugin's two sockets, the DRA services and Registration, served again when the kubelet removes them.

The DRA services listen under the kubelet's plugins directory, Registration in its plugins_registry.

The kubelet's plugin watcher finds `<registry>/<driver>-reg.sock`, calls GetInfo, dials the
endpoint it names, and reports back through NotifyRegistrationStatus. A kubelet that restarts
(or cleans its registry) removes the socket; `check` serves a new one, and the kubelet
registers the plugin again (part 1's publisher republishes the slices it wiped).
"""

from __future__ import annotations

import logging
import threading
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

from gpupart import logs
from gpupart.core.dra.names import DRIVER
from gpupart_plugin.dra.api.registration import api_pb2 as reg_api
from gpupart_plugin.dra.api.registration import api_pb2_grpc as reg_grpc
from gpupart_plugin.dra.kubelet.driver import DraDriver
from gpupart_plugin.dra.kubelet.server import SERVICES, ResourceHealth, start_server

log = logging.getLogger(__name__)

PLUGIN_TYPE = "DRAPlugin"


class Registration(reg_grpc.RegistrationServicer):
    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.registered = threading.Event()
        self.error = ""

    def GetInfo(self, _request: Any, _context: Any) -> Any:  # noqa: N802 - gRPC's name
        return reg_api.PluginInfo(
            type=PLUGIN_TYPE, name=DRIVER, endpoint=self.endpoint, supported_versions=SERVICES
        )

    def NotifyRegistrationStatus(self, request: Any, _context: Any) -> Any:  # noqa: N802
        if request.plugin_registered:
            self.error = ""
            self.registered.set()
            log.info("Registered DRA plugin", extra=logs.kv(driver=DRIVER))
        else:
            self.error = request.error
            self.registered.clear()
            log.error("Kubelet refused DRA plugin", extra=logs.kv(driver=DRIVER, err=request.error))
        return reg_api.RegistrationStatusResponse()


class DraPluginSockets:
    """Serves the DRA services and Registration; `check` re-serves a socket that is gone."""

    def __init__(
        self,
        driver: DraDriver,
        health: ResourceHealth,
        *,
        registry_dir: Path,
        plugins_dir: Path,
    ) -> None:
        self.driver = driver
        self.health = health
        self.registry_socket = registry_dir / f"{DRIVER}-reg.sock"
        self.plugin_socket = plugins_dir / DRIVER / "dra.sock"
        self.registration = Registration(str(self.plugin_socket))
        self._lock = threading.Lock()
        self._plugin: grpc.Server | None = None
        self._registry: grpc.Server | None = None

    def start(self) -> None:
        with self._lock:
            self._serve_plugin()
            self._serve_registry()

    def check(self) -> bool:
        """Serves again whichever socket the kubelet removed; True when one was."""
        with self._lock:
            again = False
            if not self.plugin_socket.exists():
                self._serve_plugin()
                again = True
            if not self.registry_socket.exists():
                self._serve_registry()
                again = True
            return again

    def stop(self) -> None:
        with self._lock:
            self.health.stopped = True
            for server in (self._registry, self._plugin):
                if server is not None:
                    server.stop(grace=0.5).wait(5.0)
            self._registry = self._plugin = None
            self.registry_socket.unlink(missing_ok=True)
            self.plugin_socket.unlink(missing_ok=True)

    def _serve_plugin(self) -> None:
        if self._plugin is not None:
            self._plugin.stop(grace=0.5).wait(5.0)
        self.plugin_socket.parent.mkdir(parents=True, exist_ok=True)
        self.plugin_socket.unlink(missing_ok=True)
        self._plugin = start_server(self.driver, self.health, str(self.plugin_socket))
        log.info("Serving DRA plugin", extra=logs.kv(socket=self.plugin_socket))

    def _serve_registry(self) -> None:
        if self._registry is not None:
            self._registry.stop(grace=0.5).wait(5.0)
        self.registration.registered.clear()
        self.registry_socket.parent.mkdir(parents=True, exist_ok=True)
        self.registry_socket.unlink(missing_ok=True)
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="dra-reg")
        )
        reg_grpc.add_RegistrationServicer_to_server(self.registration, server)
        server.add_insecure_port(f"unix://{self.registry_socket}")
        server.start()
        self._registry = server
        log.info("Serving DRA registration", extra=logs.kv(socket=self.registry_socket))
