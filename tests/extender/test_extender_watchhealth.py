"""The readiness rule: a kind is failing after FAILING_AFTER failures in a row, and healthy again at
once when its list succeeds (a fresh relist), whether or not any event follows.

The watcher is driven through a fake lister (the generated client method's contract: a list
call answers JSON in `.data`, a watch call answers a response to stream), so the rule is
checked where it is applied: in the watcher, as the API server fails and comes back.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from kubernetes import client as kube

from gpupart_extender.cache import NAMESPACE, NODE, PDB, POD, ClusterCache
from gpupart_extender.kube import Watcher
from gpupart_extender.objects import RESOURCE_CLAIM
from gpupart_extender.watchhealth import FAILING_AFTER, WatchHealth, unready_reason
from gpupart_testsupport.polling import wait_for


def test_failures_in_a_row_make_a_kind_failing_and_one_success_clears_it() -> None:
    health = WatchHealth()
    for _ in range(FAILING_AFTER - 1):
        health.failed(PDB, "connection refused")
    assert health.failing() == {}, "fewer failures than FAILING_AFTER: still ready"
    health.failed(PDB, "connection refused")
    assert health.failing() == {PDB: (FAILING_AFTER, "connection refused")}
    health.worked(PDB)
    assert health.failing() == {}


def test_the_reason_names_kinds_not_listed_and_kinds_failing() -> None:
    health = WatchHealth()
    for _ in range(FAILING_AFTER):
        health.failed(NODE, "boom")
    synced = {NODE: True, POD: False, NAMESPACE: True}
    assert unready_reason(synced, health) == (
        f"watch cache not synced: Pod; watch of Node failed {FAILING_AFTER} times in a row: boom"
    )
    assert unready_reason(dict.fromkeys(synced, True), None) == ""


class _Stream:
    """A watch response that sends nothing until the test ends (a kind without events)."""

    def __init__(self, done: threading.Event) -> None:
        self.done = done

    def stream(self, **_: Any) -> Iterator[bytes]:
        self.done.wait(30)
        return iter(())

    def release_conn(self) -> None:
        pass


class _Listed:
    data = b'{"items": [], "metadata": {"resourceVersion": "7"}}'


class _ApiServer:
    """Refuses every call until `back` is set; then lists nothing and watches in silence."""

    def __init__(self) -> None:
        self.back = threading.Event()
        self.done = threading.Event()
        self.watching = threading.Event()

    def list_pod_disruption_budget_for_all_namespaces(self, **kwargs: Any) -> object:
        if not self.back.is_set():
            raise ConnectionRefusedError("connection refused")
        if kwargs.get("watch"):
            self.watching.set()
            return _Stream(self.done)
        return _Listed()


def test_a_kind_without_events_is_healthy_as_soon_as_its_relist_succeeds() -> None:
    api = _ApiServer()
    failures = []

    def sleep(_: float) -> None:  # the backoff: past FAILING_AFTER, until the API server is back
        failures.append(1)
        if len(failures) >= FAILING_AFTER:
            api.back.wait(30)

    watcher = Watcher(kube.ApiClient(), ClusterCache(), sleep=sleep)
    lister = api.list_pod_disruption_budget_for_all_namespaces
    thread = threading.Thread(target=watcher._run, args=(PDB, lister), daemon=True)
    thread.start()
    try:
        wait_for(lambda: watcher.health.failing(), 30, "the PDB watch to count as failing")
        api.back.set()  # the API server is back; no PodDisruptionBudget exists, none will
        wait_for(api.watching.is_set, 30, "the watch after the relist")
        assert watcher.health.failing() == {}, "healthy at the relist, not after a watch period"
    finally:
        watcher.stop()
        api.done.set()
        api.back.set()
        thread.join(30)


def test_a_dra_kind_failing_does_not_make_the_extender_unready() -> None:
    """A cluster without `resource.k8s.io/v1` keeps the device-plugin path ready."""
    failures = []
    gone = threading.Event()

    def sleep(_: float) -> None:
        failures.append(1)
        if len(failures) >= FAILING_AFTER:
            gone.set()
            watcher.stopping.wait(30)

    def refused(**_: Any) -> object:
        raise kube.exceptions.ApiException(status=404, reason="Not Found")

    watcher = Watcher(kube.ApiClient(), ClusterCache(), sleep=sleep)
    thread = threading.Thread(target=watcher._run, args=(RESOURCE_CLAIM, refused), daemon=True)
    thread.start()
    try:
        wait_for(gone.is_set, 30, f"{FAILING_AFTER} failed lists of ResourceClaims")
        assert watcher.health.failing() == {}
        assert RESOURCE_CLAIM in watcher.dra_health.failing()
        assert unready_reason(dict.fromkeys((NODE, POD, NAMESPACE), True), watcher.health) == ""
    finally:
        watcher.stop()
        thread.join(30)
