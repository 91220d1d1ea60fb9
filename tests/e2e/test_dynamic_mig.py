"""Dynamic MIG on the full stack: pods ask for profiles no node offers, are served in seconds, nothing in use disturbed.

Real etcd, kube-apiserver, kube-scheduler (the chart's gpupart-scheduler configuration), real
kubelets with the fake CRI runtime; `gpupart operator`, `gpupart node --simulate` (H100s whose
instance creates and destroys take time, as NVML's do) and `gpupart extender` as processes.
Throughout, a sampler reads every node's inventory and fails the test if an instance a pod uses
disappears while that pod is still there.
"""

from __future__ import annotations

import threading
from collections.abc import Generator
from typing import Any

import pytest
from kubernetes import client

from gpupart.core.api.wire import MIG_PLAN_ANNOTATION, decode_mig_plan
from gpupart_testsupport.stack import Stack

from .test_full_stack import GROUP, PLURAL, VERSION, Cluster, partition, pod, remove

pytestmark = pytest.mark.e2e

SCENARIO = "dynamic"
H100 = "NVIDIA-H100-80GB-HBM3"
NODES = ("stack-dyn-0", "stack-dyn-1")
GPUS_PER_NODE = 3
CREATE_S, DESTROY_S = 0.3, 0.1
"""Simulated NVML latencies per instance: long enough to kill an agent mid-plan."""


class UseSampler:
    """Samples pods and inventories; records every MIG device a live pod was given (by the
    kubelet, as the runtime saw it) that an inventory of its node listed and a later one lacks:
    an instance in use destroyed. (A device new enough to be allocated before the node agent
    published the inventory listing it is not a violation: the final check of the test sees it
    listed.)"""

    def __init__(self, c: Cluster, namespace: str) -> None:
        self.c, self.namespace = c, namespace
        self.violations: list[str] = []
        self.samples = 0
        self.listed: set[tuple[str, str]] = set()
        """(node, MIG device UUID) pairs some sampled inventory has listed."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> UseSampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.wait(0.25):
            try:
                self._sample()
            except client.ApiException:
                continue

    def _given(self) -> dict[str, tuple[str, str]]:
        """Live pods' (node, MIG device) as the runtime gave them, by pod UID."""
        given: dict[str, tuple[str, str]] = {}
        for name, placed in self.c.pods(self.namespace).items():
            if placed.metadata.deletion_timestamp or placed.spec.node_name not in NODES:
                continue
            env = (self.c.allocated(self.namespace, name) or {}).get("main", {})
            if env.get("NVIDIA_VISIBLE_DEVICES"):
                given[placed.metadata.uid] = (placed.spec.node_name, env["NVIDIA_VISIBLE_DEVICES"])
        return given

    def _sample(self) -> None:
        # Pods before and after the inventories: a device given to a pod live throughout, and
        # listed by an earlier sample, must be listed still.
        given = self._given()
        inventories = {
            node: {d.uuid for g in self.c.inventory(node) for d in g.mig_devices} for node in NODES
        }
        still = self._given()
        for uid, (node, uuid) in given.items():
            if still.get(uid) != (node, uuid):
                continue
            if (node, uuid) in self.listed and uuid not in inventories[node]:
                self.violations.append(f"pod UID {uid}: its {uuid} left {node}")
        self.listed |= {(node, uuid) for node, uuids in inventories.items() for uuid in uuids}
        self.samples += 1


@pytest.fixture(scope="module")
def dyn(stack: Stack) -> Generator[Cluster, None, None]:
    labels = {
        "gpupart.io/e2e-stack": SCENARIO,
        "nvidia.com/gpu.product": H100,
        "nvidia.com/gpu.count": str(GPUS_PER_NODE),
    }
    for name in NODES:
        stack.start_real_node(
            name,
            f"{GPUS_PER_NODE}xH100-SXM5-80GB",
            labels,
            create_s=CREATE_S,
            destroy_s=DESTROY_S,
        )
    c = Cluster(stack)
    spec = {"mode": "MIG", "mig": {"dynamic": {"minIdleSeconds": 0}}}
    c.custom.create_cluster_custom_object(
        GROUP, VERSION, PLURAL, partition("stack-dyn", SCENARIO, spec)
    )
    try:
        c.until(
            lambda: all(
                c.node_states("stack-dyn").get(n, {}).get("state") == "Applied" for n in NODES
            ),
            90,
            "both dynamic nodes Applied",
        )
        yield c
    finally:
        remove(stack, "stack-dyn", list(NODES))


def mig_pod(name: str, profile: str) -> dict[str, Any]:
    return pod(name, SCENARIO, {f"nvidia.com/mig-{profile}": "1"})


def bound(c: Cluster, namespace: str) -> dict[str, str]:
    return {n: p.spec.node_name for n, p in c.pods(namespace).items() if p.spec.node_name}


def plan_of(c: Cluster, node: str) -> Any:
    text = (c.core.read_node(node).metadata.annotations or {}).get(MIG_PLAN_ANNOTATION)
    return decode_mig_plan(text) if text else None


def clear(c: Cluster, namespace: str) -> None:
    c.core.delete_collection_namespaced_pod(namespace, grace_period_seconds=0)
    c.until(lambda: not c.pods(namespace), 60, "pods gone")


def test_a_pod_asking_for_a_profile_no_node_offers_becomes_bound(
    dyn: Cluster, namespace: str
) -> None:
    c = dyn
    assert all(c.capacity(n, "nvidia.com/mig-3g.40gb") == 0 for n in NODES)
    c.core.create_namespaced_pod(namespace, mig_pod("big", "3g.40gb"))
    c.until(lambda: "big" in c.running(namespace), 60, "big Running")
    # The round that wrote the plan posted the Event and then the status: wait for each.
    planned = c.until(
        lambda: [e for e in c.events(namespace, "big") if e.startswith("MigSlicePlanned")],
        30,
        "a MigSlicePlanned Event on big",
    )
    assert "creating 3g.40gb on stack-dyn-" in planned[0], planned
    assert "for this pod" in planned[0]
    node = bound(c, namespace)["big"]
    assert c.capacity(node, "nvidia.com/mig-3g.40gb") >= 1
    env = c.env(namespace, "big")
    assert env.get("NVIDIA_VISIBLE_DEVICES", "").startswith("MIG-"), env

    def created() -> list[str]:
        status = c.custom.get_cluster_custom_object(GROUP, VERSION, PLURAL, "stack-dyn")["status"]
        entry = status.get("dynamicMig", {}).get("nodes", {}).get(node, {})
        return [text for text in entry.get("created", []) if text.startswith("3g.40gb")]

    c.until(created, 30, f"3g.40gb in {node}'s dynamicMig status")
    # Bound: its reservation ends (the instance is in use now).
    c.until(
        lambda: not (plan_of(c, node) and plan_of(c, node).reservations), 30, "reservation ended"
    )
    clear(c, namespace)


def test_a_burst_of_20_mixed_pods_is_served_without_disturbing_pods_in_use(
    dyn: Cluster, namespace: str
) -> None:
    c = dyn
    # Two pods already running, holding slices made for them.
    for name, profile in (("keep-a", "2g.20gb"), ("keep-b", "1g.10gb")):
        c.core.create_namespaced_pod(namespace, mig_pod(name, profile))
    c.until(lambda: {"keep-a", "keep-b"} <= c.running(namespace), 60, "keepers Running")
    kept = {n: c.env(namespace, n)["NVIDIA_VISIBLE_DEVICES"] for n in ("keep-a", "keep-b")}
    profiles = ["1g.10gb"] * 8 + ["2g.20gb"] * 6 + ["3g.40gb"] * 4 + ["1g.20gb"] * 2
    with UseSampler(c, namespace) as sampler:
        for i, profile in enumerate(profiles):
            c.core.create_namespaced_pod(namespace, mig_pod(f"burst-{i:02}", profile))
        c.until(lambda: len(c.running(namespace)) == len(profiles) + 2, 180, "all 22 pods Running")
    assert sampler.samples > 3 and sampler.violations == []
    # The keepers still hold exactly the instances they had, and they still exist.
    for name, uuid in kept.items():
        assert c.env(namespace, name)["NVIDIA_VISIBLE_DEVICES"] == uuid
        node = bound(c, namespace)[name]
        assert uuid in {d.uuid for g in c.inventory(node) for d in g.mig_devices}
    # Every container got a distinct MIG device of its own profile.
    given = [c.env(namespace, f"burst-{i:02}")["NVIDIA_VISIBLE_DEVICES"] for i in range(20)]
    assert len(set(given) | set(kept.values())) == 22
    for i, profile in enumerate(profiles):
        node = bound(c, namespace)[f"burst-{i:02}"]
        devices = {d.uuid: d.instance.profile for g in c.inventory(node) for d in g.mig_devices}
        assert devices.get(given[i]) == profile
    clear(c, namespace)


def test_a_pod_no_gpu_can_serve_waits_with_the_reason_then_is_served(
    dyn: Cluster, namespace: str
) -> None:
    c = dyn
    # One 1g pod per GPU: no GPU can hold a 7g.80gb while they run.
    fillers = [f"fill-{i}" for i in range(len(NODES) * GPUS_PER_NODE)]
    for name in fillers:
        c.core.create_namespaced_pod(namespace, mig_pod(name, "4g.40gb"))
    c.until(lambda: set(fillers) <= c.running(namespace), 90, "fillers Running")
    c.core.create_namespaced_pod(namespace, mig_pod("whole", "7g.80gb"))

    def refused() -> list[str]:
        return [e for e in c.events(namespace, "whole") if e.startswith("MigSliceUnavailable")]

    c.until(refused, 30, "MigSliceUnavailable event on the 7g pod")
    assert "GPU" in refused()[0], refused()
    assert "whole" not in bound(c, namespace)

    def waiting() -> list[str]:
        status = c.custom.get_cluster_custom_object(GROUP, VERSION, PLURAL, "stack-dyn")["status"]
        return [w["pod"] for w in status.get("dynamicMig", {}).get("waiting", [])]

    # The round posts its Events, then writes the status: wait for the status too.
    c.until(lambda: any(p.endswith("/whole") for p in waiting()), 30, "whole in status waiting")
    # Capacity frees up: one GPU's filler leaves, the 7g pod is served there.
    victim = fillers[0]
    c.core.delete_namespaced_pod(victim, namespace, grace_period_seconds=0)
    c.until(lambda: "whole" in c.running(namespace), 90, "7g pod Running once a GPU frees up")
    clear(c, namespace)


def test_operator_and_node_agent_killed_mid_plan_converge(
    stack: Stack, dyn: Cluster, namespace: str
) -> None:
    c = dyn
    for i in range(6):
        c.core.create_namespaced_pod(namespace, mig_pod(f"crash-{i}", "1g.10gb"))

    def planned() -> bool:
        return any(plan_of(c, n) and plan_of(c, n).reservations for n in NODES)

    c.until(planned, 30, "a plan with reservations written")
    with UseSampler(c, namespace) as sampler:
        # Kill the operator and one node agent while the plan is applied, then restart both.
        stack.restart_operator()
        node = next(n for n in NODES if plan_of(c, n) and plan_of(c, n).reservations)
        stack.restart_agent(node)
        c.until(lambda: len(c.running(namespace)) == 6, 120, "all 6 pods Running after restarts")
    assert sampler.violations == []
    # Converged: no reservation left, and no instance made twice: every 1g.10gb instance on
    # the nodes is either used by one of the 6 pods or idle, and the count matches the plans.
    c.until(
        lambda: not any(plan_of(c, n) and plan_of(c, n).reservations for n in NODES),
        30,
        "reservations ended",
    )
    given = [c.env(namespace, f"crash-{i}")["NVIDIA_VISIBLE_DEVICES"] for i in range(6)]
    assert len(set(given)) == 6
    slices = [d for n in NODES for g in c.inventory(n) for d in g.mig_devices]
    assert len({d.uuid for d in slices}) == len(slices)
    clear(c, namespace)
