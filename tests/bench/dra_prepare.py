"""Benchmark: DRA claims on the real kubelet: creation -> Running and the kubelet's Prepare time, per driver.

Run: python tests/bench/dra_prepare.py [--pods 200] [--burst 20] [--bursts 1]  (last line: one
JSON object; progress on stderr). Needs the binaries from scripts/build-k8s-bins.sh.

One control plane with kube-controller-manager (the resourceclaim controller makes each pod's
claim from its ResourceClaimTemplate) and the real kube-scheduler; per driver a fresh
real-kubelet node (tests/support/kubelet.py) with that driver's kubelet plugin and a
DeviceClass of its devices. Each pod asks one device through a claim template. Two phases:
- one by one (`--pods`): a pod is created, seen Running, deleted, gone with its claim and the
  claim unprepared before the next; its prepare time is the change of the kubelet's own
  `dra_grpc_operations_duration_seconds_sum` for NodePrepareResources over that pod (the
  histogram's lowest bucket is 0.1 s, too coarse for its quantiles; the sum is exact); a pod
  whose Prepare took more than one call is counted in `retried_prepares` instead;
- at once (`--burst` pods, `--bursts` times): created together from threads, all seen Running,
  then deleted; the kubelet's sum over count gives the mean prepare time.
creation -> Running: from just before the create call to the pod seen Running by a watch.
mismatches: containers whose CDI devices (from the fake runtime's record) are not exactly the
devices their claim was allocated.

Drivers: `example_driver` (sigs.k8s.io/dra-example-driver v0.4.0's kubelet plugin, the reference
Go driver, `--burst` devices) and `gpupart` (`gpupart node --dra`: `--burst` simulated whole
A100s, so no NVML time in Prepare; the desired annotation and the pool are the test bed's
stand-ins, `gpupart_testsupport.dra.start_gpupart_dra`), both in the same run on the same kubelet build.
A driver left out (`--driver`) is null. `prepare_ratio`: ours over the Go driver's (issue 30's
goals: p50 <= 1.5, p99 <= 2). `dynamic_mig_running_p95_s` and `leaked_instances` (dynamic MIG,
the fault runs) are not measured yet: null.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes import client, watch

from gpupart.core.dra import names
from gpupart.core.dra.prepare import CDI_KIND, cdi_device_name
from gpupart_testsupport.cluster import ControlPlane, bin_dir_from_env, missing_binaries, parallel
from gpupart_testsupport.dra import (
    EXAMPLE_DRIVER,
    GPUPART_GPU_CLASS,
    GROUP,
    PREPARE,
    UNPREPARE,
    VERSION,
    ExampleDriver,
    claim_pod,
    claim_template,
    device_class,
    grpc_seconds,
    install_gpupart_device_classes,
    pod_claim_name,
    start_dra_node,
    start_gpupart_dra,
)
from gpupart_testsupport.kubelet import KubeletNode
from gpupart_testsupport.polling import wait_for
from gpupart_testsupport.stack import Stack

WAIT_S = 120


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def quantile(values: list[float], q: float) -> float | None:
    """The q-quantile (nearest rank), None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]


def p50_p99(values: list[float], scale: float = 1.0) -> dict[str, float | None]:
    def at(q: float) -> float | None:
        v = quantile(values, q)
        return None if v is None else round(v * scale, 3)

    return {"p50": at(0.5), "p99": at(0.99)}


class RunningWatch:
    """The moment (perf_counter) each pod of a namespace is first seen Running, from a watch."""

    def __init__(self, api: Any, namespace: str) -> None:
        self.core = client.CoreV1Api(api)
        self.namespace = namespace
        self.seen: dict[str, float] = {}
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopping.is_set():
            w = watch.Watch()
            with contextlib.suppress(Exception):  # a dropped watch is opened again
                for event in w.stream(
                    self.core.list_namespaced_pod, self.namespace, timeout_seconds=30
                ):
                    pod = event["object"]
                    if pod.status and pod.status.phase == "Running":
                        with self.lock:
                            self.seen.setdefault(pod.metadata.name, time.perf_counter())
                    if self.stopping.is_set():
                        break

    def running_at(self, name: str) -> float | None:
        with self.lock:
            return self.seen.get(name)

    def stop(self) -> None:
        self.stopping.set()


@dataclass
class Run:
    """What one driver's run measured."""

    prepare_s: list[float] = field(default_factory=list)
    running_s: list[float] = field(default_factory=list)
    burst_prepare_mean_s: list[float] = field(default_factory=list)
    burst_running_s: list[float] = field(default_factory=list)
    mismatches: int = 0
    retried_prepares: int = 0

    def figures(self) -> dict[str, Any]:
        mean = (
            round(statistics.fmean(self.burst_prepare_mean_s) * 1000, 3)
            if self.burst_prepare_mean_s
            else None
        )
        return {
            "prepare_ms": p50_p99(self.prepare_s, 1000),
            "running_s": p50_p99(self.running_s),
            "burst_prepare_mean_ms": mean,
            "burst_running_s": p50_p99(self.burst_running_s),
            "mismatches": self.mismatches,
            "retried_prepares": self.retried_prepares,
        }


Matches = Callable[[dict[str, Any], dict[str, Any]], bool]
"""Whether a container's record (the fake runtime's) holds exactly what its claim was allocated."""


@dataclass
class Target:
    """One driver on one node: the class its pods' templates name, the node, the driver's name."""

    node: KubeletNode
    driver: str
    device_class: str
    matches: Matches


def measure(cp: ControlPlane, target: Target, pods: int, burst: int, bursts: int) -> Run:
    """The two phases on the target's node, in a namespace of their own."""
    api = cp.api_client()
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    ns = f"bench-{uuid.uuid4().hex[:6]}"
    core.create_namespace({"metadata": {"name": ns}})
    cp.wait_namespace_ready(ns)
    custom.create_namespaced_custom_object(
        GROUP, VERSION, ns, "resourceclaimtemplates", claim_template("one", target.device_class)
    )
    running = RunningWatch(api, ns)
    run = Run()

    def create(name: str) -> float:
        started = time.perf_counter()
        core.create_namespaced_pod(ns, claim_pod(name, "one", target.node.name))
        return started

    def wait_running(names: list[str]) -> None:
        wait_for(
            lambda: all(running.running_at(n) is not None for n in names),
            WAIT_S,
            f"{len(names)} pod(s) Running",
            interval=0.02,
            detail=target.node.tails,
        )

    def check(name: str) -> None:
        """The container got exactly the devices its claim was allocated (CDI record)."""
        pod = api.sanitize_for_serialization(core.read_namespaced_pod(name, ns))
        claim = custom.get_namespaced_custom_object(
            GROUP, VERSION, ns, "resourceclaims", pod_claim_name(pod) or ""
        )
        got = target.node.container(ns, name, "app-0") or {}
        if (got.get("cdi") or {}).get("unresolved") or not target.matches(got, claim):
            run.mismatches += 1

    def delete(names: list[str]) -> None:
        """The pods deleted, gone with their claims, and each claim unprepared by the kubelet.

        The last wait matters: the API may forget a pod and its claim before the kubelet has
        unprepared it, and a plugin that keeps devices exact (ours) refuses the device's next
        claim until then (the kubelet retries).
        """
        unprepared, _ = grpc_seconds(target.node, target.driver, UNPREPARE)
        for n in names:
            core.delete_namespaced_pod(n, ns, grace_period_seconds=0)

        def gone() -> bool:
            left = {p.metadata.name for p in core.list_namespaced_pod(ns).items}
            claims = custom.list_namespaced_custom_object(GROUP, VERSION, ns, "resourceclaims")
            done = grpc_seconds(target.node, target.driver, UNPREPARE)[0] - unprepared
            return not (left & set(names)) and not claims["items"] and done >= len(names)

        wait_for(gone, WAIT_S, "pods and their claims gone, claims unprepared", interval=0.05)

    try:
        for i in range(pods):
            name = f"one-{i}"
            count0, sum0 = grpc_seconds(target.node, target.driver, PREPARE)
            started = create(name)
            wait_running([name])
            count1, sum1 = grpc_seconds(target.node, target.driver, PREPARE)
            run.running_s.append((running.running_at(name) or 0.0) - started)
            # A pod whose Prepare was refused and retried is counted, not timed: its sum holds
            # more than one call.
            if count1 - count0 == 1:
                run.prepare_s.append(sum1 - sum0)
            else:
                run.retried_prepares += 1
            check(name)
            delete([name])
            if (i + 1) % 20 == 0:
                log(f"  {target.driver}: {i + 1}/{pods} one by one")
        for b in range(bursts):
            names = [f"burst-{b}-{i}" for i in range(burst)]
            count0, sum0 = grpc_seconds(target.node, target.driver, PREPARE)
            starts = dict(zip(names, parallel(create, names, workers=burst), strict=True))
            wait_running(names)
            count1, sum1 = grpc_seconds(target.node, target.driver, PREPARE)
            run.burst_running_s += [(running.running_at(n) or 0.0) - starts[n] for n in names]
            if count1 > count0:
                run.burst_prepare_mean_s.append((sum1 - sum0) / (count1 - count0))
            for n in names:
                check(n)
            delete(names)
            log(f"  {target.driver}: burst {b + 1}/{bursts} of {burst}")
        if run.retried_prepares:
            failed = [
                line
                for line in target.node.kubelet_log().splitlines()
                if "Error syncing pod" in line or "PrepareDynamicResources" in line
            ]
            log(f"  {target.driver}: {run.retried_prepares} prepare(s) retried; the kubelet said:")
            for line in failed[:3]:
                log(f"    {line[:600]}")
            for event in core.list_namespaced_event(ns).items:
                if event.type == "Warning":
                    log(
                        f"    event {event.involved_object.name}: {event.reason}: {event.message[:400]}"
                    )
    finally:
        running.stop()
        api.close()
    return run


def allocated(claim: dict[str, Any]) -> set[str]:
    return {r["device"] for r in claim["status"]["allocation"]["devices"]["results"]}


def example_matches(got: dict[str, Any], claim: dict[str, Any]) -> bool:
    """The example driver's claim devices are `<claim uid>-<device>`; its `common` is shared."""
    uid = claim["metadata"]["uid"]
    named = {i.split("=", 1)[1].removeprefix(f"{uid}-") for i in got.get("cdiDevices", [])}
    return named - {"common"} == allocated(claim)


@contextlib.contextmanager
def example_driver(cp: ControlPlane, devices: int) -> Iterator[Target]:
    """The reference Go driver's kubelet plugin on a node of its own."""
    node = start_dra_node(cp, f"bench-example-{uuid.uuid4().hex[:4]}")
    drv = ExampleDriver(node, cp.kubeconfig, devices=devices)
    try:
        api = cp.api_client()
        custom = client.CustomObjectsApi(api)
        with contextlib.suppress(client.ApiException):  # made by an earlier run: same spec
            custom.create_cluster_custom_object(
                GROUP, VERSION, "deviceclasses", device_class(EXAMPLE_DRIVER, EXAMPLE_DRIVER)
            )
        drv.start()

        def published() -> bool:
            found = custom.list_cluster_custom_object(
                GROUP, VERSION, "resourceslices", field_selector=f"spec.nodeName={node.name}"
            )["items"]
            return sum(len(s["spec"].get("devices") or []) for s in found) == devices

        wait_for(published, WAIT_S, "the example driver's ResourceSlice", detail=drv.tail)
        api.close()
        yield Target(node, EXAMPLE_DRIVER, EXAMPLE_DRIVER, example_matches)
    finally:
        drv.stop()
        node.stop()


@contextlib.contextmanager
def gpupart_driver(cp: ControlPlane, devices: int) -> Iterator[Target]:
    """Our DRA kubelet plugin (`gpupart node --dra`) on a node of its own: `devices` simulated
    whole GPUs, as many as the example driver's devices (whole GPUs: no NVML time in Prepare)."""
    node = start_dra_node(cp, f"bench-gpupart-{uuid.uuid4().hex[:4]}")
    api = cp.api_client()
    stack = Stack(cp, api, Path(tempfile.mkdtemp(prefix="gpupart-bench-dra-agent-")))
    try:
        install_gpupart_device_classes(cp)
        uuids = start_gpupart_dra(stack, node, devices, wait_s=WAIT_S)

        def matches(got: dict[str, Any], claim: dict[str, Any]) -> bool:
            """Our one CDI device of the request, and the allocated GPU's UUID in its env."""
            (device,) = allocated(claim)
            own = f"{CDI_KIND}={cdi_device_name(claim['metadata']['uid'], 'gpu')}"
            env = got.get("env") or {}
            index = int(device.removeprefix("gpu-"))
            return (
                got.get("cdiDevices") == [own] and env.get("NVIDIA_VISIBLE_DEVICES") == uuids[index]
            )

        yield Target(node, names.DRIVER, GPUPART_GPU_CLASS, matches)
    finally:
        stack.stop()
        node.stop()
        api.close()
        shutil.rmtree(stack.work, ignore_errors=True)


DRIVERS: dict[str, Callable[[ControlPlane, int], contextlib.AbstractContextManager[Target]]] = {
    "gpupart": gpupart_driver,
    "example_driver": example_driver,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--pods", type=int, default=200, help="pods one by one (default 200)")
    parser.add_argument("--burst", type=int, default=20, help="pods at once (default 20)")
    parser.add_argument("--bursts", type=int, default=1, help="how many bursts (default 1)")
    parser.add_argument("--driver", choices=sorted(DRIVERS), action="append", help="(default: all)")
    args = parser.parse_args()
    bin_dir = bin_dir_from_env()
    if missing := missing_binaries(bin_dir):
        sys.exit(f"missing {', '.join(missing)} in {bin_dir}: run scripts/build-k8s-bins.sh")
    workdir = Path(tempfile.mkdtemp(prefix="gpupart-bench-dra-"))
    cp = ControlPlane(bin_dir=bin_dir, workdir=workdir, controller_manager=True)
    figures: dict[str, dict[str, Any]] = {}
    try:
        cp.start()
        for name in args.driver or list(DRIVERS):
            log(f"{name}: {args.pods} pods one by one, {args.bursts} x {args.burst} at once")
            with DRIVERS[name](cp, max(args.burst, 1)) as target:
                figures[name] = measure(cp, target, args.pods, args.burst, args.bursts).figures()
    finally:
        cp.stop()
        shutil.rmtree(workdir, ignore_errors=True)

    def per_driver(key: str) -> dict[str, Any]:
        return {n: (figures[n][key] if n in figures else None) for n in DRIVERS}

    def ratio(q: str) -> float | None:
        ours, theirs = (figures.get(n, {}).get("prepare_ms", {}).get(q) for n in DRIVERS)
        return round(ours / theirs, 3) if ours is not None and theirs else None

    measured = list(figures.values())
    print(
        json.dumps(
            {
                "prepare_ms": per_driver("prepare_ms"),
                "prepare_ratio": {"p50": ratio("p50"), "p99": ratio("p99")},
                "running_s": per_driver("running_s"),
                "burst": {
                    "prepare_mean_ms": per_driver("burst_prepare_mean_ms"),
                    "running_s": per_driver("burst_running_s"),
                },
                "dynamic_mig_running_p95_s": None,
                "mismatches": sum(f["mismatches"] for f in measured) if measured else None,
                "leaked_instances": None,
                "retried_prepares": per_driver("retried_prepares"),
                "pods": args.pods,
                "burst_size": args.burst,
                "bursts": args.bursts,
            }
        )
    )


if __name__ == "__main__":
    main()
