"""The DRA kubelet plugin assembled for `gpupart node --dra`: API reads, GPUs, checkpoint, CDI, services, sockets."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType

from kubernetes import client

from gpupart import logs
from gpupart.core.api.spec import GpuConfig
from gpupart.core.api.wire import decode_desired
from gpupart.core.errors import GpupartError
from gpupart.core.node.targets import gpu_targets
from gpupart_plugin.actuator import Actuator
from gpupart_plugin.backend import GpuBackend
from gpupart_plugin.dra.kubelet.cdi import CdiSpecs
from gpupart_plugin.dra.kubelet.claims import ClaimReader
from gpupart_plugin.dra.kubelet.driver import DraDriver
from gpupart_plugin.dra.kubelet.gpus import gpu_source
from gpupart_plugin.dra.kubelet.health import DraHealth
from gpupart_plugin.dra.kubelet.registration import DraPluginSockets
from gpupart_plugin.dra.kubelet.server import ResourceHealth
from gpupart_plugin.dra.kubelet.state import ClaimCheckpoint
from gpupart_plugin.kube import NodePods

log = logging.getLogger(__name__)


class DesiredTargets:
    """Each GPU's target from the desired annotation the agent last read (`read` sets it)."""

    def __init__(self, backend: GpuBackend) -> None:
        self.backend = backend
        self._lock = threading.Lock()
        self._text: str | None = None
        self._decoded: tuple[str, tuple[int, ...], Mapping[int, GpuConfig]] | None = None
        """The last answer, for the same text and GPU indices: decoding is pure, and a
        prepare asks on every claim."""

    def read(self, desired: str | None) -> None:
        with self._lock:
            self._text = desired

    def __call__(self) -> Mapping[int, GpuConfig] | None:
        with self._lock:
            text, decoded = self._text, self._decoded
        if text is None:
            return None
        indices = self.backend.indices()
        if decoded is not None and decoded[:2] == (text, indices):
            return decoded[2]
        try:
            found = gpu_targets(decode_desired(text), indices)
        except GpupartError as error:
            # No GPU is DRA's while the wish is unreadable: prepare refuses rather than guesses.
            log.warning("Failed to read desired layout for DRA", extra=logs.kv(err=error))
            return None
        answer = MappingProxyType(found)
        with self._lock:
            self._decoded = (text, indices, answer)
        return answer


class DraKubeletPlugin:
    """Everything the node agent starts for DRA; `check` re-serves sockets the kubelet removed."""

    def __init__(
        self,
        api: client.ApiClient,
        node: str,
        backend: GpuBackend,
        actuator: Actuator,
        targets: Callable[[], Mapping[int, GpuConfig] | None],
        pods: NodePods,
        *,
        state_dir: Path,
        registry_dir: Path,
        plugins_dir: Path,
        cdi_root: Path,
    ) -> None:
        """`pods`: the agent's watch of this node's pods, which the pod check asks first;
        InvalidInput when the checkpoint cannot be read (the plugin cannot serve then)."""
        self.health = DraHealth()
        self.driver = DraDriver(
            node,
            ClaimReader(api, node, pods=pods),
            gpu_source(backend, actuator, targets),
            actuator.apply_instances,
            ClaimCheckpoint(state_dir, node),
            CdiSpecs(cdi_root),
            changed=self.health.update,
        )
        self.sockets = DraPluginSockets(
            self.driver,
            ResourceHealth(self.health),
            registry_dir=registry_dir,
            plugins_dir=plugins_dir,
        )

    def start(self) -> None:
        self.driver.refresh()
        self.sockets.start()

    def check(self) -> None:
        if self.sockets.check():
            log.info("Detected kubelet plugin cleanup; DRA sockets served again")

    def stop(self) -> None:
        self.sockets.stop()
