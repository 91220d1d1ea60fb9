"""The kubelet-facing gRPC services on the plugin's socket: DRAPlugin v1 and v1beta1, and DRAResourceHealth v1alpha1."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc

from gpupart.core.dra.prepare import cdi_ids
from gpupart.core.dra.prepared import ClaimRef
from gpupart_plugin.dra.api.health import api_pb2 as health_api
from gpupart_plugin.dra.api.health import api_pb2_grpc as health_grpc
from gpupart_plugin.dra.api.v1 import api_pb2 as v1
from gpupart_plugin.dra.api.v1 import api_pb2_grpc as v1_grpc
from gpupart_plugin.dra.api.v1beta1 import api_pb2 as v1beta1
from gpupart_plugin.dra.api.v1beta1 import api_pb2_grpc as v1beta1_grpc
from gpupart_plugin.dra.kubelet.driver import DraDriver, PrepareAnswer
from gpupart_plugin.dra.kubelet.health import DraHealth

log = logging.getLogger(__name__)

SERVICES = ("v1.DRAPlugin", "v1beta1.DRAPlugin", "v1alpha1.DRAResourceHealth")
"""The service names registration lists (the kubelet picks the newest DRAPlugin it knows)."""
HEALTH_TIMEOUT_S = 60
"""What each health message says it stays valid for: the kubelet marks a device Unknown when
no message came for this long, so the stream repeats the list well within it."""
HEALTH_REPEAT_S = 10.0


def _refs(claims: Any) -> list[ClaimRef]:
    return [ClaimRef(c.namespace, c.name, c.uid) for c in claims]


def _devices(api: Any, answer: PrepareAnswer, *, share_ids: bool) -> list[Any]:
    claim = answer.claim
    if claim is None:
        return []
    found = []
    for device, ids in zip(claim.devices, cdi_ids(claim), strict=True):
        fields: dict[str, Any] = {
            "request_names": [device.request],
            "pool_name": device.pool,
            "device_name": device.device,
            "cdi_device_ids": list(ids),
        }
        if share_ids and device.share_id:
            fields["share_id"] = device.share_id
        found.append(api.Device(**fields))
    return found


class DraPluginV1(v1_grpc.DRAPluginServicer):
    def __init__(self, driver: DraDriver) -> None:
        self.driver = driver

    def NodePrepareResources(self, request: Any, _context: Any) -> Any:  # noqa: N802 - gRPC's name
        answers = self.driver.prepare(_refs(request.claims))
        return v1.NodePrepareResourcesResponse(
            claims={
                uid: v1.NodePrepareResourceResponse(
                    devices=_devices(v1, a, share_ids=True), error=a.error
                )
                for uid, a in answers.items()
            }
        )

    def NodeUnprepareResources(self, request: Any, _context: Any) -> Any:  # noqa: N802
        errors = self.driver.unprepare(_refs(request.claims))
        return v1.NodeUnprepareResourcesResponse(
            claims={uid: v1.NodeUnprepareResourceResponse(error=e) for uid, e in errors.items()}
        )


class DraPluginV1beta1(v1beta1_grpc.DRAPluginServicer):
    """The same answers for a kubelet that speaks v1beta1 only (no share ids there)."""

    def __init__(self, driver: DraDriver) -> None:
        self.driver = driver

    def NodePrepareResources(self, request: Any, _context: Any) -> Any:  # noqa: N802
        answers = self.driver.prepare(_refs(request.claims))
        return v1beta1.NodePrepareResourcesResponse(
            claims={
                uid: v1beta1.NodePrepareResourceResponse(
                    devices=_devices(v1beta1, a, share_ids=False), error=a.error
                )
                for uid, a in answers.items()
            }
        )

    def NodeUnprepareResources(self, request: Any, _context: Any) -> Any:  # noqa: N802
        errors = self.driver.unprepare(_refs(request.claims))
        return v1beta1.NodeUnprepareResourcesResponse(
            claims={
                uid: v1beta1.NodeUnprepareResourceResponse(error=e) for uid, e in errors.items()
            }
        )


class ResourceHealth(health_grpc.DRAResourceHealthServicer):
    """NodeWatchResources: the whole list of prepared devices at once, on each change, and again
    every `repeat_s` so the kubelet never times a device out."""

    def __init__(self, health: DraHealth, *, repeat_s: float = HEALTH_REPEAT_S) -> None:
        self.health = health
        self.repeat_s = repeat_s
        self.stopped = False

    def NodeWatchResources(self, _request: Any, context: Any) -> Iterator[Any]:  # noqa: N802
        version = -1
        while not self.stopped and context.is_active():
            version = self.health.wait(version, self.repeat_s if version >= 0 else 0)
            yield health_api.NodeWatchResourcesResponse(
                devices=[
                    health_api.DeviceHealth(
                        device=health_api.DeviceIdentifier(pool_name=d.pool, device_name=d.device),
                        health=health_api.HEALTHY if d.healthy else health_api.UNHEALTHY,
                        last_updated_time=int(d.since),
                        health_check_timeout_seconds=HEALTH_TIMEOUT_S,
                        message=""
                        if d.healthy
                        else "NVML reported a critical Xid or the GPU stopped answering",
                    )
                    for d in self.health.snapshot()
                ]
            )


def start_server(
    driver: DraDriver, health: ResourceHealth, socket_path: str, *, workers: int = 16
) -> grpc.Server:
    """Serves the three services on a unix socket; started before the registration socket."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="dra"))
    v1_grpc.add_DRAPluginServicer_to_server(DraPluginV1(driver), server)
    v1beta1_grpc.add_DRAPluginServicer_to_server(DraPluginV1beta1(driver), server)
    health_grpc.add_DRAResourceHealthServicer_to_server(health, server)
    server.add_insecure_port(f"unix://{socket_path}")
    server.start()
    return server
