"""Fixtures for the extender tests: the assignment key file, a cache fed with events, a service, the app."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from extender_objects import FakeBinder
from fastapi.testclient import TestClient

from gpupart.core.api.wire import PodAssignment
from gpupart.keyfile import KeyFile
from gpupart_extender.app import create_app
from gpupart_extender.cache import NAMESPACE, NODE, POD, ClusterCache
from gpupart_extender.metrics import Metrics
from gpupart_extender.service import ExtenderService
from gpupart_extender.settings import ExtenderSettings
from gpupart_testsupport.objects import (
    keys,
    mig_gpu,
    namespace,
    node,
    pod,
    shared_gpu,
    whole_gpu,
    write_key_file,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def cache() -> ClusterCache:
    """node-mig: two MIG GPUs (3g.40gb each, both in use); node-mps: two MPS GPUs; node-whole;
    node-bare without inventory; namespaces team-a and team-b."""
    c = ClusterCache(keys=keys)
    c.replace(
        NODE,
        [
            node("node-mig", [mig_gpu(0, [("3g.40gb", 0, 4)]), mig_gpu(1, [("3g.40gb", 0, 4)])]),
            node("node-mps", [shared_gpu(0, memory=40000), shared_gpu(1, memory=40000)]),
            node("node-whole", [whole_gpu(0), whole_gpu(1)]),
            node("node-bare", None),
        ],
    )
    c.replace(
        POD,
        [
            pod("train-1", {"nvidia.com/mig-3g.40gb": 1}, node="node-mig"),
            pod("train-2", {"nvidia.com/mig-3g.40gb": 1}, node="node-mig", namespace="team-b"),
            pod(
                "infer-1",
                {"nvidia.com/gpu.shared": 1, "gpupart.io/gpu-memory": 30000},
                node="node-mps",
                labels={"app": "infer"},
                assignment=PodAssignment("node-mps", 0, "GPU-0000", 30000),
            ),
        ],
    )
    c.replace(NAMESPACE, [namespace("team-a"), namespace("team-b")])
    return c


@pytest.fixture
def binder() -> FakeBinder:
    return FakeBinder()


@pytest.fixture
def key_file(tmp_path: Path) -> Path:
    """The tests' assignment key (`extender_objects.KEY`) in a file."""
    return write_key_file(tmp_path / "assignment-keys")


@pytest.fixture
def settings(key_file: Path) -> ExtenderSettings:
    return ExtenderSettings(url_prefix="/gpupart", assignment_key_file=key_file)


@pytest.fixture
def service(
    cache: ClusterCache, binder: FakeBinder, clock: Clock, settings: ExtenderSettings
) -> ExtenderService:
    assert settings.assignment_key_file is not None
    return ExtenderService(
        cache,
        settings.scoring(),
        keys=KeyFile.private(settings.assignment_key_file).keys,
        binder=binder,
        metrics=Metrics(),
        ttl_seconds=30,
        clock=clock,
    )


@pytest.fixture
def client(settings: ExtenderSettings, service: ExtenderService) -> Iterator[TestClient]:
    with TestClient(create_app(settings, service)) as c:
        yield c
