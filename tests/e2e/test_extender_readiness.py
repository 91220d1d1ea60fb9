"""The extender's readiness across a kube-apiserver restart: back from a fresh relist, not a watch period later.

Its own control plane (etcd, kube-apiserver, kwok; restarting the session's would disturb the
other tests): the extender's watcher follows it with the default 300 s watch period, the API
server stops until /readyz says the watches are failing, then starts again on the same port.
No PodDisruptionBudget exists and nothing changes, so no watch sees an event: readiness must
come from the relists alone (docs/extender.md, "Readiness"). It used to take a whole watch
period (about 300 s); the wait here is bounded by the watcher's longest backoff (30 s) plus
one list.
"""

from __future__ import annotations

import time
from collections.abc import Generator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from gpupart_extender.app import create_app
from gpupart_extender.cache import ClusterCache
from gpupart_extender.kube import Watcher
from gpupart_extender.metrics import Metrics
from gpupart_extender.service import ExtenderService
from gpupart_extender.settings import ExtenderSettings
from gpupart_testsupport.cluster import ControlPlane, wait_for

pytestmark = pytest.mark.e2e

WATCH_PERIOD = 300
"""The default (setting resync_seconds): far longer than readiness may take to come back."""
BACK_WITHIN = 60.0
"""Seconds from the API server ready again to /readyz 200: the longest backoff (30 s), one
list per kind, and room for a loaded machine; a watch period is five times as long."""


@pytest.fixture
def control_plane(k8s_bin_dir: Path, tmp_path: Path) -> Generator[ControlPlane, None, None]:
    cp = ControlPlane(bin_dir=k8s_bin_dir, workdir=tmp_path / "control-plane")
    try:
        cp.start(scheduler=False)
        yield cp
    finally:
        cp.stop()


def test_readyz_returns_within_seconds_of_the_api_server_coming_back(
    control_plane: ControlPlane,
) -> None:
    api = control_plane.api_client()
    cache = ClusterCache()
    settings = ExtenderSettings()
    service = ExtenderService(cache, settings.scoring(), binder=_NoBinder(), metrics=Metrics())
    watcher = Watcher(api, cache, period_seconds=WATCH_PERIOD)
    watcher.start()
    try:
        with TestClient(create_app(settings, service, watcher.health)) as http:
            wait_for(lambda: http.get("/readyz").status_code == 200, 60, "the first lists")
            with control_plane.apiserver_stopped():
                not_ready = wait_for(
                    lambda: (res := http.get("/readyz")).status_code == 503 and res.text,
                    120,
                    "/readyz to report the failing watches",
                )
                assert "failed" in not_ready and "times in a row" in not_ready, not_ready
            back = time.monotonic()
            wait_for(
                lambda: http.get("/readyz").status_code == 200,
                BACK_WITHIN,
                "/readyz 200 after the API server came back (without waiting a watch period)",
                detail=lambda: http.get("/readyz").text,
            )
            took = time.monotonic() - back
            assert took < BACK_WITHIN, f"readiness took {took:.1f} s"
            print(f"\nreadiness back {took:.1f} s after the API server")
    finally:
        watcher.stop()
        api.close()


class _NoBinder:
    """Nothing is bound here: only readiness is asked."""

    def pod(self, namespace: str, name: str) -> dict[str, object]:
        raise AssertionError(f"no bind expected ({namespace}/{name})")

    def bind(self, *_: object) -> None:
        raise AssertionError("no bind expected")
