"""Schemathesis against the app's own OpenAPI: generated bodies never get a 500 (bounded run)."""

from __future__ import annotations

import schemathesis
from extender_objects import FakeBinder, node, shared_gpu
from hypothesis import HealthCheck, settings

from gpupart_extender.app import create_app
from gpupart_extender.cache import NODE, POD, ClusterCache
from gpupart_extender.metrics import Metrics
from gpupart_extender.service import ExtenderService
from gpupart_extender.settings import ExtenderSettings


def _app() -> object:
    cache = ClusterCache()
    cache.replace(NODE, [node("node1", [shared_gpu(0)])])
    cache.replace(POD, [])
    config = ExtenderSettings()
    service = ExtenderService(cache, config.scoring(), binder=FakeBinder(), metrics=Metrics())
    return create_app(config, service)


schema = schemathesis.openapi.from_asgi("/openapi.json", _app())


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_no_server_errors(case: schemathesis.Case) -> None:
    response = case.call()
    assert response.status_code < 500, response.text
