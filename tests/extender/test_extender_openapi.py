"""Schemathesis against the app's own OpenAPI: generated bodies never get a 500 (bounded run).

The Pod's OpenAPI marks every place a quantity is read (format `quantity`); the strategy for
that format draws Kubernetes quantities, absurd ones (`1E`, `1e99999999`, 100,000 digits) and
any text, so generated pods reach the quantity parser with what a hostile user could write.
Every verb is covered, preempt included (node1's GPU holds a low-priority pod, for bodies that
happen to name it; most generated node names are unknown and dropped).
"""

from __future__ import annotations

import schemathesis
from extender_objects import FakeBinder
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from poison import ABSURD_QUANTITIES

from gpupart.core.api.wire import PodAssignment
from gpupart_extender.app import create_app
from gpupart_extender.cache import NAMESPACE, NODE, POD, ClusterCache
from gpupart_extender.metrics import Metrics
from gpupart_extender.service import ExtenderService
from gpupart_extender.settings import ExtenderSettings
from gpupart_testsupport.objects import keys, node, pod, shared, shared_gpu


def _app() -> object:
    cache = ClusterCache(keys=keys)
    cache.replace(NODE, [node("node1", [shared_gpu(0)])])
    low = pod(
        "low",
        shared(memory=40000),
        node="node1",
        priority=0,
        assignment=PodAssignment("node1", 0, "GPU-0000", 40000),
    )
    cache.replace(POD, [low])
    cache.replace(NAMESPACE, [])
    config = ExtenderSettings()
    service = ExtenderService(
        cache, config.scoring(), keys=keys, binder=FakeBinder(), metrics=Metrics()
    )
    return create_app(config, service)


QUANTITIES = (
    st.sampled_from(ABSURD_QUANTITIES)
    | st.from_regex(
        r"\A[+-]?[0-9]{0,25}(\.[0-9]{0,12})?([numkMGTPE]|[KMGTPE]i|[eE][+-]?[0-9]{1,12})?\Z"
    )
    | st.text(max_size=30)
)
schemathesis.openapi.format("quantity", QUANTITIES)
schema = schemathesis.openapi.from_asgi("/openapi.json", _app())
# Valid-shaped bodies only: these reach the quantity parser (negative ones mostly stop at the
# body's shape).
shaped = schemathesis.openapi.from_asgi("/openapi.json", _app())
shaped.config.generation.update(modes=[schemathesis.GenerationMode.POSITIVE])


@schema.parametrize()
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_no_server_errors(case: schemathesis.Case) -> None:
    response = case.call()
    assert response.status_code < 500, response.text


@shaped.parametrize()
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_generated_pods_with_absurd_quantities_get_no_server_error(case: schemathesis.Case) -> None:
    response = case.call()
    assert response.status_code < 500, response.text
