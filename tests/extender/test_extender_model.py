"""The watch cache and memo against an independent model of the cluster: a dict of the objects the API holds.

A Hypothesis state machine sends random watch events (Pods and Nodes ADDED, MODIFIED, DELETED,
pods finishing, relists, changes the watch missed and a relist repairs) to one long-lived
cache and service, memo on, and applies the same changes to a plain dict of API objects. After
every step, filter and prioritize through the public service must answer exactly what a fresh
cache built from the dict's objects alone answers: the reference is the objects, not the
cache under test. Nodes carry MIG plans reserving slices for bound pods (whose reservations
then count for nothing) and for the asked MIG pod, expiring as the clock moves. A cache that
ignored DELETED, or patched the memo on the wrong node, would answer from what the dict no
longer holds.
"""

from __future__ import annotations

from typing import Any

from extender_objects import FakeBinder
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from gpupart.core.api.wire import ASSIGNMENT_ANNOTATION, PodAssignment
from gpupart_extender.cache import NODE, POD, ClusterCache
from gpupart_extender.metrics import Metrics
from gpupart_extender.service import ExtenderService
from gpupart_extender.settings import ExtenderSettings
from gpupart_testsupport.objects import (
    keys,
    mig_gpu,
    node,
    pod,
    reserve,
    shared,
    shared_gpu,
    whole_gpu,
)

NODES = ["n0", "n1", "n2"]
PODS = [f"p{k}" for k in range(6)]
MEMORY = 40000


def _inventory(kind: int) -> list[Any]:
    if kind == 0:
        return [shared_gpu(0, memory=MEMORY, clients=3), shared_gpu(1, memory=MEMORY, clients=3)]
    if kind == 1:
        return [mig_gpu(0, [("3g.40gb", 0, 4), ("3g.40gb", 4, 4)]), whole_gpu(1)]
    return [whole_gpu(0), whole_gpu(1)]


_resources = st.sampled_from(
    [
        shared(10000),
        shared(25000, 50),
        {"nvidia.com/mig-3g.40gb": 1},
        {"nvidia.com/gpu": 1},
        {"cpu": "2"},
        {**shared(20000), "cpu": "3"},
    ]
)
ASKED = [
    shared(20000),
    {**shared(10000), "cpu": "4"},
    {"nvidia.com/mig-3g.40gb": 1},
    {"nvidia.com/gpu": 2},
]
"""The pods kube-scheduler asks about after every step (a few shapes: the memo is hit often)."""


class _Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def _pod_object(name: str, node_name: str, resources: Any, gpu: int | None, app: str) -> Any:
    assignment = None
    if gpu is not None and "nvidia.com/gpu.shared" in resources:
        memory = int(resources.get("gpupart.io/gpu-memory", 0))
        compute = int(resources.get("gpupart.io/gpu-compute", 0))
        assignment = PodAssignment(node_name, gpu, f"GPU-{gpu:04d}", memory, compute)
    return pod(name, resources, node=node_name, labels={"app": app}, assignment=assignment)


def _as_written(old: Any, new: Any) -> Any:
    """`new` as the API server would hold it after `old`: an assignment is written once, at
    bind, and nobody removes it (the cache keeps counting a verified one a tenant removes, by
    design: a fresh cache could not know it, so the model never removes one)."""
    key = ASSIGNMENT_ANNOTATION
    kept = (old or {}).get("metadata", {}).get("annotations", {}).get(key)
    same_node = old is not None and old["spec"].get("nodeName") == new["spec"].get("nodeName")
    if kept is not None and same_node and key not in new["metadata"]["annotations"]:
        new["metadata"]["annotations"][key] = kept
    return new


class WatchedCluster(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.nodes: dict[str, Any] = {}
        self.pods: dict[str, Any] = {}
        self.clock = _Clock()
        self.scoring = ExtenderSettings().scoring()
        self.cache = ClusterCache(keys=keys, wall=self.clock)
        self.cache.replace(NODE, [])
        self.cache.replace(POD, [])
        # refresh 0: both services look at the mix on every request, so their models agree.
        self.service = self._service(self.cache)

    def _service(self, cache: ClusterCache) -> ExtenderService:
        return ExtenderService(
            cache,
            self.scoring,
            keys=keys,
            binder=FakeBinder(),
            metrics=Metrics(),
            refresh_seconds=0,
            clock=self.clock,
        )

    # -- the watch, as the API server would send it --

    @rule(
        name=st.sampled_from(NODES),
        kind=st.integers(0, 2),
        cpu=st.sampled_from([None, "8"]),
        plan=st.lists(
            st.tuples(
                st.sampled_from(["team-a/p0", "team-a/p1", "team-a/new-2"]),  # new-2: MIG, asked
                st.sampled_from([0, 4]),
                st.sampled_from([2.0, 5.0, 1e6]),
            ),
            max_size=2,
            unique_by=lambda r: r[1],
        ),
    )
    def put_node(
        self, name: str, kind: int, cpu: str | None, plan: list[tuple[str, int, float]]
    ) -> None:
        event = "MODIFIED" if name in self.nodes else "ADDED"
        held = [
            reserve(who, 0, "3g.40gb", start, 4, expires=self.clock.now + t)
            for who, start, t in plan
        ]
        self.nodes[name] = node(name, _inventory(kind), cpu=cpu, reservations=held)
        self.cache.apply(NODE, event, self.nodes[name])

    @rule(name=st.sampled_from(NODES))
    def delete_node(self, name: str) -> None:
        if name in self.nodes:
            self.cache.apply(NODE, "DELETED", self.nodes.pop(name))

    @rule(
        name=st.sampled_from(PODS),
        node_name=st.sampled_from(NODES),
        resources=_resources,
        gpu=st.sampled_from([None, 0, 1]),
        app=st.sampled_from("ab"),
    )
    def put_pod(self, name: str, node_name: str, resources: Any, gpu: int | None, app: str) -> None:
        event = "MODIFIED" if name in self.pods else "ADDED"
        fresh = _pod_object(name, node_name, resources, gpu, app)
        self.pods[name] = _as_written(self.pods.get(name), fresh)
        self.cache.apply(POD, event, self.pods[name])

    @rule(name=st.sampled_from(PODS))
    def delete_pod(self, name: str) -> None:
        if name in self.pods:
            self.cache.apply(POD, "DELETED", self.pods.pop(name))

    @rule(name=st.sampled_from(PODS))
    def finish_pod(self, name: str) -> None:
        if name in self.pods:
            self.pods[name]["status"]["phase"] = "Succeeded"
            self.cache.apply(POD, "MODIFIED", self.pods[name])

    @rule(
        name=st.sampled_from(PODS),
        node_name=st.sampled_from(NODES),
        resources=_resources,
        drop=st.booleans(),
    )
    def missed_then_relist(self, name: str, node_name: str, resources: Any, drop: bool) -> None:
        """The watch broke: a change it never sent, repaired by the relist that follows."""
        if drop:
            self.pods.pop(name, None)
        else:
            fresh = _pod_object(name, node_name, resources, None, "a")
            self.pods[name] = _as_written(self.pods.get(name), fresh)
        self.relist()

    @rule()
    def relist(self) -> None:
        self.cache.replace(NODE, list(self.nodes.values()))
        self.cache.replace(POD, list(self.pods.values()))

    # -- what kube-scheduler would be told --

    @invariant()
    def answers_equal_a_fresh_cache_of_the_objects(self) -> None:
        fresh_cache = ClusterCache(keys=keys, wall=self.clock)
        fresh_cache.replace(NODE, list(self.nodes.values()))
        fresh_cache.replace(POD, list(self.pods.values()))
        fresh = self._service(fresh_cache)
        names = [*reversed(NODES), "ghost"]
        for k, resources in enumerate(ASKED):
            asked = pod(f"new-{k}", resources, labels={"app": "a"})
            want, got = fresh.filter(asked, names), self.service.filter(asked, names)
            assert (set(got.passed), got.failed, got.unresolvable) == (
                set(want.passed),
                want.failed,
                want.unresolvable,
            ), (resources, self.nodes.keys(), self.pods.keys())
            assert dict(self.service.prioritize(asked, names)) == dict(
                fresh.prioritize(asked, names)
            )
            survivors = list(want.passed)
            assert dict(self.service.prioritize(asked, survivors)) == dict(
                fresh.prioritize(asked, survivors)
            )
        self.clock.now += 1


WatchedCluster.TestCase.settings = settings(
    max_examples=150, stateful_step_count=30, deadline=None, suppress_health_check=list(HealthCheck)
)
test_the_cache_answers_as_a_fresh_cache_of_the_objects = WatchedCluster.TestCase
