"""The device plugin as a view sink: each offer's devices into the hub, one server and Register per resource."""

from __future__ import annotations

from gpupart_plugin.agent import Offer
from gpupart_plugin.deviceplugin.hub import DeviceHub
from gpupart_plugin.deviceplugin.registration import DevicePlugins
from gpupart_plugin.metrics import NodeMetrics


class DevicePluginSink:
    """The hub's devices (ListAndWatch) follow each offer; `plugins` None: no gRPC servers (tests)."""

    def __init__(self, hub: DeviceHub, plugins: DevicePlugins | None, metrics: NodeMetrics) -> None:
        self.hub = hub
        self.plugins = plugins
        self.metrics = metrics

    def offer(self, offer: Offer) -> None:
        self.hub.set_gpus(offer.views)
        if self.plugins is not None:
            self.plugins.sync()  # a new resource: serve it and register before the inventory names it
        self.metrics.count_devices(self.hub.listings())
