"""PodResources client against a fake kubelet PodResources server on a real unix socket."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from gpupart_plugin.api import podresources_pb2 as pr
from gpupart_plugin.api import podresources_pb2_grpc as pr_grpc
from gpupart_plugin.podresources import (
    AllocatableUnimplemented,
    PodDevices,
    PodResourcesClient,
    PodResourcesUnavailable,
)


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


class NewerLister(FakeLister):
    def GetAllocatableResources(  # noqa: N802 (gRPC method name)
        self, _request: pr.AllocatableResourcesRequest, _context: object
    ) -> pr.AllocatableResourcesResponse:
        one = pr.TopologyInfo(nodes=[pr.NUMANode(ID=1)])
        return pr.AllocatableResourcesResponse(
            devices=[
                pr.ContainerDevices(resource_name="nvidia.com/mig-1g.18gb", device_ids=["MIG-a"]),
                pr.ContainerDevices(
                    resource_name="nvidia.com/mig-1g.18gb", device_ids=["MIG-b"], topology=one
                ),
                pr.ContainerDevices(resource_name="nvidia.com/gpu", device_ids=["GPU-c"]),
            ],
            cpu_ids=[0, 1],
            memory=[pr.ContainerMemory(memory_type="memory", size=1 << 30)],
        )


@contextlib.contextmanager
def serving(
    lister: pr_grpc.PodResourcesListerServicer, sock_dir: Path
) -> Iterator[PodResourcesClient]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pr_grpc.add_PodResourcesListerServicer_to_server(lister, server)
    server.add_insecure_port(f"unix://{sock_dir}/pr.sock")
    server.start()
    client = PodResourcesClient(str(sock_dir / "pr.sock"), timeout_s=5)
    try:
        yield client
    finally:
        client.close()
        server.stop(None).wait(5)


def test_lists_the_devices_each_pod_holds(sock_dir: Path) -> None:
    with serving(FakeLister(), sock_dir) as client:
        assert client.list() == (PodDevices("ml/train", "nvidia.com/mig-1g.18gb", ("MIG-a",)),)


def test_allocatable_merges_the_kubelets_entries_per_resource(sock_dir: Path) -> None:
    with serving(NewerLister(), sock_dir) as client:
        assert client.allocatable() == {
            "nvidia.com/mig-1g.18gb": frozenset({"MIG-a", "MIG-b"}),
            "nvidia.com/gpu": frozenset({"GPU-c"}),
        }


def test_an_older_kubelet_without_allocatable_is_told_apart(sock_dir: Path) -> None:
    with (
        serving(FakeLister(), sock_dir) as client,
        pytest.raises(AllocatableUnimplemented, match="UNIMPLEMENTED"),
    ):
        client.allocatable()


def test_missing_kubelet_is_an_error_not_an_empty_answer(sock_dir: Path) -> None:
    client = PodResourcesClient(str(sock_dir / "absent.sock"), timeout_s=0.5)
    with pytest.raises(PodResourcesUnavailable):
        client.list()
    with pytest.raises(PodResourcesUnavailable) as error:
        client.allocatable()
    assert not isinstance(error.value, AllocatableUnimplemented)
    client.close()
