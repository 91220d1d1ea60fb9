"""The Node's annotations as a view sink: state (the report), inventory (the views) and extender-managed capacity."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from gpupart.core.api.spec import Mode
from gpupart.core.api.wire import (
    Inventory,
    InventoryGpu,
    MigDevice,
    encode_inventory,
    encode_report,
)
from gpupart.core.node.devices import OfferedGpu, managed_capacity
from gpupart_plugin.agent import Offer

Publish = Callable[[str, str, Mapping[str, int]], None]
"""Writes (state annotation, inventory annotation, extender-managed capacity) on this node's Node."""


class NodeAnnotations:
    """Publishes each offer on the Node (`NodeClient.publish`); a failure raises (KubeUnavailable)."""

    def __init__(self, publish: Publish) -> None:
        self.publish = publish

    def offer(self, offer: Offer) -> None:
        self.publish(
            encode_report(offer.report),
            encode_inventory(Inventory(inventory(offer.views, offer.used), serial_admission=True)),
            managed_capacity(offer.views),
        )


def inventory(
    views: Iterable[OfferedGpu], used: frozenset[str] = frozenset()
) -> tuple[InventoryGpu, ...]:
    """The inventory annotation's content (core wire format) from the views; `used`: the MIG
    device UUIDs in use (`NodePass.used`)."""
    return tuple(
        InventoryGpu(
            index=v.index,
            uuid=v.uuid,
            product=v.product,
            memory_mib=v.memory_mib,
            mode=v.mode,
            mig_devices=tuple(MigDevice(m.uuid, m.instance, m.uuid in used) for m in v.mig),
            replicas=v.replicas,
            client_memory_mib=v.mps_memory_mib if v.mode is Mode.MPS else 0,
            client_compute_percent=v.mps_compute_percent if v.mode is Mode.MPS else 0,
            interface=v.interface,
        )
        for v in views
    )
