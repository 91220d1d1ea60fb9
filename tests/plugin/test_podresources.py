"""PodResources client against a fake kubelet PodResources server on a real unix socket."""

from __future__ import annotations

from concurrent import futures
from pathlib import Path

import grpc
import pytest

from gpupart_plugin.api import podresources_pb2 as pr
from gpupart_plugin.api import podresources_pb2_grpc as pr_grpc
from gpupart_plugin.podresources import PodDevices, PodResourcesClient, PodResourcesUnavailable


class FakeLister(pr_grpc.PodResourcesListerServicer):
    def List(  # noqa: N802 (gRPC method name)
        self, _request: pr.ListPodResourcesRequest, _context: object
    ) -> pr.ListPodResourcesResponse:
        devices = pr.ContainerDevices(resource_name="nvidia.com/mig-1g.18gb", device_ids=["MIG-a"])
        cpu_only = pr.ContainerResources(name="side", cpu_ids=[1, 2])
        return pr.ListPodResourcesResponse(
            pod_resources=[
                pr.PodResources(
                    name="train",
                    namespace="ml",
                    containers=[pr.ContainerResources(name="main", devices=[devices]), cpu_only],
                )
            ]
        )


def test_lists_the_devices_each_pod_holds(sock_dir: Path) -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pr_grpc.add_PodResourcesListerServicer_to_server(FakeLister(), server)
    server.add_insecure_port(f"unix://{sock_dir}/pr.sock")
    server.start()
    client = PodResourcesClient(str(sock_dir / "pr.sock"), timeout_s=5)
    try:
        assert client.list() == (PodDevices("ml/train", "nvidia.com/mig-1g.18gb", ("MIG-a",)),)
    finally:
        client.close()
        server.stop(None).wait(5)


def test_missing_kubelet_is_an_error_not_an_empty_answer(sock_dir: Path) -> None:
    client = PodResourcesClient(str(sock_dir / "absent.sock"), timeout_s=0.5)
    with pytest.raises(PodResourcesUnavailable):
        client.list()
    client.close()
