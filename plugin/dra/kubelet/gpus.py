"""This node's GPUs as prepare reads them: NVML via the actuator's view, each GPU's target from the desired state."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping

from gpupart.core.api.spec import GpuConfig, Interface, Mode
from gpupart.core.dra.prepare import DraGpuNow
from gpupart.core.errors import GpupartError
from gpupart_plugin.actuator import Actuator
from gpupart_plugin.backend import GpuBackend

Targets = Callable[[], Mapping[int, GpuConfig] | None]
"""Each GPU's target from the desired annotation last read (None: none read yet)."""


GpuRead = Callable[[Collection[int] | None], dict[int, DraGpuNow]]
"""The GPUs of these indices (None: every GPU) as they are now; an index not on the node is absent."""


def gpu_source(backend: GpuBackend, actuator: Actuator, targets: Targets) -> GpuRead:
    """Reads GPUs now, every one or those asked (a claim's own: prepare reads no other). A GPU
    is DRA's only while the agent serves it through DRA (its view's interface: not while it
    moves there from the device plugin, nor back); its MIG model is NVML's, None when not
    stated."""

    def read(indices: Collection[int] | None = None) -> dict[int, DraGpuNow]:
        wanted = targets() or {}
        found: dict[int, DraGpuNow] = {}
        if indices is None:
            infos = backend.gpus()
        else:
            # Each GPU alone: on a real node every GPU read is a few NVML calls.
            infos = tuple(i for i in map(backend.gpu, sorted(indices)) if i is not None)
        for info in infos:
            target = wanted.get(info.index)
            model = None
            if info.mig_enabled:
                try:
                    model = backend.model(info.index)
                except GpupartError:
                    model = None
            dynamic = target is not None and target.mode is Mode.MIG and target.dynamic
            view = actuator.view(info.index, info)
            found[info.index] = DraGpuNow(
                view,
                model,
                dynamic=dynamic,
                warm=target.mig if target is not None and dynamic else (),
                served=view.interface is Interface.DRA,
            )
        return found

    return read
