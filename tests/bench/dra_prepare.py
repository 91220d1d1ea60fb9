"""Benchmark: DRA claims on the real kubelet: creation -> Running and the kubelet's Prepare time, per driver.

Run: python tests/bench/dra_prepare.py [--pods 200] [--burst 20] [--bursts 1] [--mig-pods 60]
[--mig-burst 8] [--fault-pods 6] [--xid-rounds 20] [--skip-whole] [--skip-mig] [--skip-faults]
(last line: one JSON object; progress on stderr). Needs the binaries from scripts/build-k8s-bins.sh.

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

Xid to taint (`xid_to_taint_ms`, `--xid-rounds`, ours): after the two phases, an Xid 79 on
each of the node's GPUs in turn (through the faults file the simulated NVML reads; its event
wait looks at it every 20 ms, as a real GPU's event wakes NVML's wait at once), timed from just
before the file is written to the GPU's device first seen tainted by a watch of the node's
ResourceSlices (issue 43's goal: p95 <= 200 ms).

Per call (`call_ms`, `burst_call_ms`): each NodePrepareResources call as the kubelet's own
log times it (`--vmodule=dra_plugin=4`: its lines just before and after the call, by claim
UID), one by one and in the bursts, per driver. `burst20_p99_over_single` (ours) and
`burst20_p99_over_single_example_driver`: the burst's p99 call over the one-by-one p50 call,
what one call takes alone (issue 43's goal: <= 3 at `--burst 20`).

Drivers: `example_driver` (sigs.k8s.io/dra-example-driver v0.4.0's kubelet plugin, the reference
Go driver, `--burst` devices) and `gpupart` (`gpupart node --dra`: `--burst` simulated whole
A100s, so no NVML time in Prepare; the desired annotation and the pool are the test bed's
stand-ins, `gpupart_testsupport.dra.start_gpupart_dra`), both in the same run on the same kubelet build.
A driver left out (`--driver`, `--skip-whole`: both) is null. `prepare_ratio`: ours over the Go
driver's (issue 30's goals: p50 <= 1.5, p99 <= 2).

Dynamic MIG (`dynamic_mig`, `--skip-mig`): our agent on a node of its own with `--mig-gpus`
(two A100-SXM4-80GB and two H100-SXM5-80GB), every GPU dynamic MIG on DRA, the simulated NVML
taking `--create-seconds` (1.0, the dynamic MIG simulator's figure) for each GPU instance create
and `--destroy-seconds` (0.5, likewise) for each destroy, one MIG call at a time per GPU. The
same two phases with `--mig-pods` one by one and one burst of `--mig-burst`, the pods' claims
cycling through the chart's 1g.10gb, 2g.20gb and 3g.40gb classes; p50/p95/p99.
`dynamic_mig_running_p95_s` is the one-by-one creation -> Running p95 (issue 30's goal: <= 3 s),
as `running_s` is one by one; the burst's quantiles are beside it. A container matches when its
one CDI device is the claim's and its NVIDIA_VISIBLE_DEVICES is the UUID of the instance the
simulated GPU holds at the allocated placement.

Fault runs (`faults`, `--skip-faults`), on the same node, `--fault-pods` pods a round:
1. every compute instance create fails (injected through `--simulate-faults`) while the pods
   arrive; each pod shows FailedPrepareDynamicResources, a third of them are deleted, the fault
   is cleared and the rest run;
2. the next GPU instance creates and, after one success, compute instance creates fail a few
   times while the pods arrive together (the kubelet's retries succeed), and a third of the pods
   are deleted as soon as they are scheduled, mid-prepare; then every pod of rounds 1 and 2 is
   deleted, so round 3 finds room whatever placements the scheduler chose;
3. the agent killed (SIGKILL) while it prepares (a claim begun in its checkpoint, its instance
   not made yet) and started again, the pods Running after it;
4. round 3's pods deleted.
After each round, once the agent is done (waited for, so a rollback in flight is not counted),
each MIG instance on each GPU (the simulated state file) that no Running pod's claim was
allocated is a leak. `leaked_instances`: the distinct instances found so, in the fault runs and
at the end of the dynamic MIG phases (issue 30's goal: 0). `mismatches` counts every phase.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes import client, watch

from gpupart.core.api.spec import GpuConfig, Interface, Mode
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
    GpuMigInstance,
    claim_pod,
    claim_template,
    device_class,
    grpc_seconds,
    install_gpupart_device_classes,
    mig_device_placements,
    pod_claim_name,
    simulated_mig_instances,
    start_dra_node,
    start_gpupart_dra,
)
from gpupart_testsupport.kubelet import KubeletNode
from gpupart_testsupport.polling import wait_for
from gpupart_testsupport.stack import Stack

WAIT_S = 120
SETTLE_S = 60
"""How long the agent may take to finish a rollback or an unprepare before what is left counts."""
MIG_GPUS = "A100-SXM4-80GB,A100-SXM4-80GB,H100-SXM5-80GB,H100-SXM5-80GB"
MIG_CLASSES = ("mig-1g10gb.gpupart.io", "mig-2g20gb.gpupart.io", "mig-3g40gb.gpupart.io")
"""The chart's profile classes the dynamic MIG pods' claims cycle through (on both products)."""
DYNAMIC_DRA = GpuConfig(Mode.MIG, dynamic=True, interface=Interface.DRA)
REFUSED = "FailedPrepareDynamicResources"
"""The kubelet's event reason when a plugin's NodePrepareResources refused a pod's claim."""


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


def p50_p95_p99(values: list[float], scale: float = 1.0) -> dict[str, float | None]:
    p95 = quantile(values, 0.95)
    return {**p50_p99(values, scale), "p95": None if p95 is None else round(p95 * scale, 3)}


@dataclass
class Run:
    """What one driver's run measured."""

    prepare_s: list[float] = field(default_factory=list)
    running_s: list[float] = field(default_factory=list)
    call_s: list[float] = field(default_factory=list)
    """Each one-by-one NodePrepareResources call as the kubelet's log times it."""
    burst_call_s: list[float] = field(default_factory=list)
    """Each call of the bursts, likewise."""
    burst_prepare_mean_s: list[float] = field(default_factory=list)
    burst_running_s: list[float] = field(default_factory=list)
    burst_devices: list[str] = field(default_factory=list)
    """The devices the burst's claims were allocated (where the scheduler put them)."""
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
            "call_ms": p50_p99(self.call_s, 1000),
            "burst_call_ms": p50_p99(self.burst_call_s, 1000),
            "mismatches": self.mismatches,
            "retried_prepares": self.retried_prepares,
        }


Matches = Callable[[dict[str, Any], dict[str, Any]], bool]
"""Whether a container's record (the fake runtime's) holds exactly what its claim was allocated."""


class FirstSeen:
    """The moment (perf_counter) each name `names_of` finds in a watched object is first seen,
    from a watch (the events as the API server sends them: no polling lag)."""

    def __init__(
        self,
        lister: Callable[..., Any],
        names_of: Callable[[Any], Iterable[str]],
        *args: Any,
        **kwargs: Any,
    ) -> None:
        self.lister, self.names_of, self.args, self.kwargs = lister, names_of, args, kwargs
        self.seen: dict[str, float] = {}
        self.lock = threading.Lock()
        self.started = threading.Event()
        """Set at the watch's first event (the objects as they are)."""
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopping.is_set():
            w = watch.Watch()
            with contextlib.suppress(Exception):  # a dropped watch is opened again
                for event in w.stream(self.lister, *self.args, timeout_seconds=30, **self.kwargs):
                    now = time.perf_counter()
                    for name in self.names_of(event["object"]):
                        with self.lock:
                            self.seen.setdefault(name, now)
                    self.started.set()
                    if self.stopping.is_set():
                        break

    def at(self, name: str) -> float | None:
        with self.lock:
            return self.seen.get(name)

    def stop(self) -> None:
        self.stopping.set()


def running_watch(api: Any, namespace: str) -> FirstSeen:
    """Each pod of the namespace, first seen Running."""

    def running(pod: Any) -> list[str]:
        return [pod.metadata.name] if pod.status and pod.status.phase == "Running" else []

    return FirstSeen(client.CoreV1Api(api).list_namespaced_pod, running, namespace)


def taint_watch(api: Any, node: str) -> FirstSeen:
    """Each device of the node's pool, first seen tainted unhealthy in its ResourceSlice."""

    def tainted(found: Any) -> list[str]:
        return [
            d.name
            for d in found.spec.devices or []
            if any(t.key == names.TAINT_UNHEALTHY for t in d.taints or [])
        ]

    return FirstSeen(
        client.ResourceV1Api(api).list_resource_slice,
        tainted,
        field_selector=f"spec.nodeName={node}",
    )


@dataclass
class Target:
    """One driver on one node: the class its pods' templates name, the node, the driver's name."""

    node: KubeletNode
    driver: str
    device_class: str
    matches: Matches
    classes: tuple[str, ...] = ()
    """The classes pods cycle through (the i-th pod the i-th modulo); empty: `device_class`."""
    label: str = ""
    """The name in progress lines; empty: `driver`."""
    xid_to_taint: Callable[[int], list[float]] | None = None
    """Ours: `rounds` Xids, one GPU each, and the seconds from each to its device's taint."""


def measure(cp: ControlPlane, target: Target, pods: int, burst: int, bursts: int) -> Run:
    """The two phases on the target's node, in a namespace of their own."""
    api = cp.api_client()
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    ns = f"bench-{uuid.uuid4().hex[:6]}"
    core.create_namespace({"metadata": {"name": ns}})
    cp.wait_namespace_ready(ns)
    templates = [f"claim-{k}" for k, _ in enumerate(target.classes or (target.device_class,))]
    for template, cls in zip(templates, target.classes or (target.device_class,), strict=True):
        custom.create_namespaced_custom_object(
            GROUP, VERSION, ns, "resourceclaimtemplates", claim_template(template, cls)
        )
    running = running_watch(api, ns)
    run = Run()
    label = target.label or target.driver

    def create(name: str) -> float:
        """Pod `<phase>-<i>`, its claim from the i-th template modulo."""
        template = templates[int(name.rsplit("-", 1)[1]) % len(templates)]
        started = time.perf_counter()
        core.create_namespaced_pod(ns, claim_pod(name, template, target.node.name))
        return started

    def wait_running(names: list[str]) -> None:
        wait_for(
            lambda: all(running.at(n) is not None for n in names),
            WAIT_S,
            f"{len(names)} pod(s) Running",
            interval=0.02,
            detail=target.node.tails,
        )

    def check(name: str) -> set[str]:
        """The container got exactly the devices its claim was allocated (CDI record); those."""
        pod = api.sanitize_for_serialization(core.read_namespaced_pod(name, ns))
        claim = custom.get_namespaced_custom_object(
            GROUP, VERSION, ns, "resourceclaims", pod_claim_name(pod) or ""
        )
        got = target.node.container(ns, name, "app-0") or {}
        if (got.get("cdi") or {}).get("unresolved") or not target.matches(got, claim):
            run.mismatches += 1
            if run.mismatches <= 3:
                env = (got.get("env") or {}).get("NVIDIA_VISIBLE_DEVICES")
                log(
                    f"  {label}: mismatch {name}: {allocated(claim)} got {got.get('cdiDevices')} {env}"
                )
        return allocated(claim)

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
            run.running_s.append((running.at(name) or 0.0) - started)
            # A pod whose Prepare was refused and retried is counted, not timed: its sum holds
            # more than one call.
            if count1 - count0 == 1:
                run.prepare_s.append(sum1 - sum0)
            else:
                run.retried_prepares += 1
            check(name)
            delete([name])
            if (i + 1) % 20 == 0:
                log(f"  {label}: {i + 1}/{pods} one by one")
        timed = prepare_calls(target.node.kubelet_log())
        run.call_s = list(timed.values())
        for b in range(bursts):
            names = [f"burst-{b}-{i}" for i in range(burst)]
            count0, sum0 = grpc_seconds(target.node, target.driver, PREPARE)
            starts = dict(zip(names, parallel(create, names, workers=burst), strict=True))
            wait_running(names)
            count1, sum1 = grpc_seconds(target.node, target.driver, PREPARE)
            run.burst_running_s += [(running.at(n) or 0.0) - starts[n] for n in names]
            now = prepare_calls(target.node.kubelet_log())
            run.burst_call_s += [s for uid, s in now.items() if uid not in timed]
            timed = now
            if count1 > count0:
                run.burst_prepare_mean_s.append((sum1 - sum0) / (count1 - count0))
            for n in names:
                run.burst_devices += sorted(check(n))
            delete(names)
            log(f"  {label}: burst {b + 1}/{bursts} of {burst}")
        if run.retried_prepares:
            failed = [
                line
                for line in target.node.kubelet_log().splitlines()
                if "Error syncing pod" in line or "PrepareDynamicResources" in line
            ]
            log(f"  {label}: {run.retried_prepares} prepare(s) retried; the kubelet said:")
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


_KLOG = re.compile(r"^[IWE](\d{4}) (\d\d):(\d\d):(\d\d\.\d+)\s")
# The request and the response in protobuf text: `uid:\"<claim uid>\"`, `key:\"<claim uid>\"`.
_CALLED = re.compile(r'"Calling NodePrepareResources rpc".*?\buid:\\"([0-9a-f-]{36})\\"')
_DONE = re.compile(r'"Done calling NodePrepareResources rpc".*?\bkey:\\"([0-9a-f-]{36})\\"')


def prepare_calls(kubelet_log: str) -> dict[str, float]:
    """Each claim's NodePrepareResources call (one claim a call: one pod's), in seconds, from
    the kubelet's own log lines around it (`--vmodule=dra_plugin=4`), by claim UID; the same
    clock and the same place for every driver."""
    started: dict[str, float] = {}
    took: dict[str, float] = {}
    for line in kubelet_log.splitlines():
        stamp = _KLOG.match(line)
        if stamp is None:
            continue
        at = int(stamp[2]) * 3600 + int(stamp[3]) * 60 + float(stamp[4])
        if (called := _CALLED.search(line)) is not None:
            started[called[1]] = at
        elif (done := _DONE.search(line)) is not None and done[1] in started:
            took[done[1]] = (at - started.pop(done[1])) % 86400
    return took


def fresh_node(cp: ControlPlane, prefix: str, attempts: int = 3) -> KubeletNode:
    """A Ready real-kubelet node named `<prefix>-<random>`; tried again under another name when
    it does not come up (on a shared machine a port the test bed chose free can be taken before
    the kubelet binds it), so one lost port does not cost the whole run."""
    for attempt in range(1, attempts + 1):
        try:
            return start_dra_node(cp, f"{prefix}-{uuid.uuid4().hex[:4]}", vmodule="dra_plugin=4")
        except TimeoutError as error:
            if attempt == attempts:
                raise
            log(f"  {prefix}: node not Ready, trying again: {str(error).splitlines()[0]}")
    raise AssertionError("unreachable")


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
    node = fresh_node(cp, "bench-example")
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
    node = fresh_node(cp, "bench-gpupart")
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

        def xid_to_taint(rounds: int) -> list[float]:
            """An Xid 79 on GPU k (the faults file the simulated NVML reads, as an Xid event
            wakes NVML's wait) to the taint on `gpu-k` as the slice watch delivers it."""
            taints = taint_watch(api, node.name)
            seconds = []
            try:
                wait_for(taints.started.is_set, WAIT_S, "the slice watch")
                if taints.seen:
                    raise RuntimeError(f"devices tainted before any Xid: {sorted(taints.seen)}")
                for k in range(min(rounds, devices)):
                    raised = time.perf_counter()
                    stack.inject_faults(node.name, {"xid": 79, "gpu": k})
                    wait_for(lambda k=k: taints.at(f"gpu-{k}"), WAIT_S, f"gpu-{k} tainted")
                    seconds.append((taints.at(f"gpu-{k}") or raised) - raised)
            finally:
                taints.stop()
                stack.inject_faults(node.name)
            return seconds

        yield Target(node, names.DRIVER, GPUPART_GPU_CLASS, matches, xid_to_taint=xid_to_taint)
    finally:
        stack.stop()
        node.stop()
        api.close()
        shutil.rmtree(stack.work, ignore_errors=True)


DRIVERS: dict[str, Callable[[ControlPlane, int], contextlib.AbstractContextManager[Target]]] = {
    "gpupart": gpupart_driver,
    "example_driver": example_driver,
}


@dataclass
class MigNode:
    """Our agent on a node of dynamic MIG GPUs: the target the two phases measure, and what the
    fault runs need beside it."""

    target: Target
    stack: Stack
    state_file: Path
    """The simulated GPUs' state (`--simulate-state`): the MIG instances NVML would list."""
    placements: dict[str, GpuMigInstance]
    """Each dynamic MIG device name the node can publish, with the instance it names."""

    def instances(self) -> dict[GpuMigInstance, str]:
        return simulated_mig_instances(self.state_file)


@contextlib.contextmanager
def gpupart_mig_node(
    cp: ControlPlane, products: list[str], create_s: float, destroy_s: float
) -> Iterator[MigNode]:
    """`gpupart node --dra` on a node of its own, every GPU dynamic MIG on DRA, the simulated
    NVML taking `create_s` per GPU instance create and `destroy_s` per destroy."""
    node = fresh_node(cp, "bench-mig")
    api = cp.api_client()
    stack = Stack(cp, api, Path(tempfile.mkdtemp(prefix="gpupart-bench-dra-mig-")))
    try:
        install_gpupart_device_classes(cp)
        start_gpupart_dra(
            stack, node, len(products), wait_s=WAIT_S, configs=(DYNAMIC_DRA,) * len(products),
            products=products, create_s=create_s, destroy_s=destroy_s,
        )  # fmt: skip
        state_file = stack.work / f"simgpu-{node.name}.json"
        placements = mig_device_placements(products)

        def matches(got: dict[str, Any], claim: dict[str, Any]) -> bool:
            """Our one CDI device of the request, and in its env the UUID of the instance the
            GPU holds at the allocated placement."""
            (device,) = allocated(claim)
            where = placements.get(device)
            made = simulated_mig_instances(state_file).get(where) if where else None
            own = f"{CDI_KIND}={cdi_device_name(claim['metadata']['uid'], 'gpu')}"
            env = got.get("env") or {}
            return (
                made is not None
                and got.get("cdiDevices") == [own]
                and env.get("NVIDIA_VISIBLE_DEVICES") == made
            )

        target = Target(
            node, names.DRIVER, MIG_CLASSES[0], matches, classes=MIG_CLASSES, label="dynamic MIG"
        )
        yield MigNode(target, stack, state_file, placements)
    finally:
        stack.stop()
        node.stop()
        api.close()
        shutil.rmtree(stack.work, ignore_errors=True)


@dataclass
class Leaks:
    """MIG instances found at a settled moment that no Running pod's claim was allocated."""

    found: dict[str, str] = field(default_factory=dict)
    """UUID -> where it was seen (GPU index, profile, start, and the check's name)."""

    def check(self, mig: MigNode, api: Any, namespace: str, what: str) -> int:
        """Wait (SETTLE_S) for every instance to be held, then count the ones still not held."""
        core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)

        def unheld() -> dict[GpuMigInstance, str]:
            made = mig.instances()  # first: a pod Running meanwhile only adds to what is held
            running = {
                p.metadata.name
                for p in core.list_namespaced_pod(namespace).items
                if p.status.phase == "Running" and p.metadata.deletion_timestamp is None
            }
            claims = custom.list_namespaced_custom_object(
                GROUP, VERSION, namespace, "resourceclaims"
            )["items"]
            held = {
                mig.placements.get(device)
                for c in claims
                if (c.get("status") or {}).get("allocation")
                and {r.get("name") for r in c["status"].get("reservedFor") or []} & running
                for device in allocated(c)
            }
            return {k: u for k, u in made.items() if k not in held}

        with contextlib.suppress(TimeoutError):
            wait_for(lambda: not unheld(), SETTLE_S, f"no unheld MIG instance ({what})")
        left = unheld()
        for (gpu, instance), instance_uuid in left.items():
            self.found.setdefault(
                instance_uuid,
                f"GPU {gpu} {instance.profile}@{instance.placement.start} ({what})",
            )
        log(f"  leak check, {what}: {len(left)} instance(s) no Running pod's claim holds")
        return len(left)


@dataclass
class FaultRun:
    """What the fault runs counted."""

    pods: int = 0
    refused_pods: int = 0
    """Pods the kubelet showed FailedPrepareDynamicResources (our plugin's refusal)."""
    ran_under_fault: int = 0
    """Pods Running while every compute instance create failed (none should)."""
    mismatches: int = 0
    agent_kills: int = 0
    leaks_by_check: dict[str, int] = field(default_factory=dict)

    def figures(self, leaks: Leaks) -> dict[str, Any]:
        return {
            "pods": self.pods,
            "refused_pods": self.refused_pods,
            "ran_under_fault": self.ran_under_fault,
            "mismatches": self.mismatches,
            "agent_kills": self.agent_kills,
            "leaks_by_check": self.leaks_by_check,
            "leaked_instances": sum(1 for w in leaks.found.values() if "fault" in w),
        }


def fault_runs(cp: ControlPlane, mig: MigNode, pods: int, leaks: Leaks) -> FaultRun:
    """The four rounds of the module docstring on the dynamic MIG node, in a namespace of
    their own; the simulated NVML's faults cleared at the end, whatever happened."""
    api = cp.api_client()
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    node, target = mig.target.node, mig.target
    ns = f"bench-faults-{uuid.uuid4().hex[:6]}"
    core.create_namespace({"metadata": {"name": ns}})
    cp.wait_namespace_ready(ns)
    for k, cls in enumerate(MIG_CLASSES):
        custom.create_namespaced_custom_object(
            GROUP, VERSION, ns, "resourceclaimtemplates", claim_template(f"claim-{k}", cls)
        )
    run = FaultRun()

    def create(name: str) -> None:
        template = f"claim-{int(name.rsplit('-', 1)[1]) % len(MIG_CLASSES)}"
        core.create_namespaced_pod(ns, claim_pod(name, template, node.name))

    def pod(name: str) -> Any:
        return core.read_namespaced_pod(name, ns)

    def refused(name: str) -> str | None:
        """Our plugin's reason on the pod (the kubelet's event), None before it said one."""
        events = core.list_namespaced_event(ns, field_selector=f"involvedObject.name={name}")
        return next((e.message for e in events.items if e.reason == REFUSED), None)

    def detail() -> str:
        phases = {p.metadata.name: p.status.phase for p in core.list_namespaced_pod(ns).items}
        return f"{phases}\n{mig.stack.tails()}\n{node.tails()}"

    def wait_running(names: list[str], what: str) -> None:
        wait_for(
            lambda: all(pod(n).status.phase == "Running" for n in names),
            3 * WAIT_S, what, interval=0.1, detail=detail,
        )  # fmt: skip
        for n in names:
            got = node.container(ns, n, "app-0") or {}
            claim = custom.get_namespaced_custom_object(
                GROUP, VERSION, ns, "resourceclaims",
                pod_claim_name(api.sanitize_for_serialization(pod(n))) or "",
            )  # fmt: skip
            if (got.get("cdi") or {}).get("unresolved") or not target.matches(got, claim):
                run.mismatches += 1
                log(f"  faults: mismatch {n}: {allocated(claim)} got {got.get('cdiDevices')}")

    def delete(names: list[str]) -> None:
        """Deleted, and gone from the API with their claims (the kubelet unprepares on its own
        time: the leak check waits for it)."""
        for n in names:
            core.delete_namespaced_pod(n, ns, grace_period_seconds=0)

        def gone() -> bool:
            left = {p.metadata.name for p in core.list_namespaced_pod(ns).items}
            claims = custom.list_namespaced_custom_object(GROUP, VERSION, ns, "resourceclaims")
            mine = {
                r.get("name")
                for c in claims["items"]
                for r in (c.get("metadata") or {}).get("ownerReferences") or []
            }
            return not (left & set(names)) and not (mine & set(names))

        wait_for(gone, WAIT_S, f"{len(names)} pod(s) and their claims gone", interval=0.1)

    def check(what: str) -> None:
        run.leaks_by_check[what] = leaks.check(mig, api, ns, f"fault run: {what}")

    try:
        # 1. Every compute instance create fails while the pods arrive: each GPU instance made
        # for a claim must be rolled back, the pod told why.
        mig.stack.inject_faults(
            node.name,
            {"operation": "CreateComputeInstance", "kind": "InsufficientResources", "times": 10**6},
        )
        first = [f"ci-{i}" for i in range(pods)]
        parallel(create, first, workers=len(first))
        wait_for(
            lambda: all(refused(n) for n in first),
            3 * WAIT_S, f"{REFUSED} on every pod of round 1", interval=0.2, detail=detail,
        )  # fmt: skip
        run.ran_under_fault += sum(1 for n in first if pod(n).status.phase == "Running")
        log(f"  faults: round 1: {len(first)} pods refused, e.g. {refused(first[0])}")
        delete(first[::3])
        check("compute instance creates failing, a third of the pods deleted")
        mig.stack.inject_faults(node.name)
        kept = [n for n in first if n not in first[::3]]
        wait_running(kept, "round 1's pods Running once the fault is cleared")
        check("round 1's fault cleared, its pods Running")

        # 2. A few GPU instance creates fail, and after one success a few compute instance
        # creates; the kubelet's retries succeed. A third of the pods are deleted as soon as
        # they are scheduled, most of them mid-prepare (a create takes its simulated second).
        times = max(1, pods // 2)
        mig.stack.inject_faults(
            node.name,
            {"operation": "CreateGpuInstance", "kind": "InsufficientResources", "times": times},
            {"operation": "CreateComputeInstance", "kind": "Other", "after": 1, "times": times},
        )
        second = [f"tr-{i}" for i in range(pods)]
        parallel(create, second, workers=len(second))
        doomed = second[::3]
        wait_for(
            lambda: all(pod(n).spec.node_name for n in doomed),
            WAIT_S, "round 2's doomed pods scheduled", interval=0.05, detail=detail,
        )  # fmt: skip
        delete(doomed)
        kept2 = [n for n in second if n not in doomed]
        wait_running(kept2, "round 2's pods Running through the kubelet's retries")
        mig.stack.inject_faults(node.name)
        check("transient create failures, a third of the pods deleted mid-prepare")
        # Round 3 needs room on the GPUs: what rounds 1 and 2 left running may have filled them
        # (which placements remain depends on the scheduler's order).
        delete(kept + kept2)
        check("rounds 1 and 2 deleted")

        # 3. The agent killed (SIGKILL) while it prepares: a claim written to its checkpoint
        # as begun, its GPU instance not made yet (the create takes its simulated second).
        third = [f"kill-{i}" for i in range(max(1, pods // 2))]
        checkpoint = mig.stack.work / f"state-{node.name}" / "dra-checkpoint.json"

        def begun() -> bool:
            found = json.loads(checkpoint.read_text()) if checkpoint.exists() else {}
            return any(not c["complete"] for c in found.get("claims") or [])

        parallel(create, third, workers=len(third))
        wait_for(begun, WAIT_S, "a claim begun in the agent's checkpoint", interval=0.01)
        mig.stack.restart_agent(node.name)
        run.agent_kills += 1
        wait_running(third, "round 3's pods Running after the agent's restart")
        check("the agent killed mid-prepare and started again")

        # 4. Everything deleted: the GPUs must end empty.
        run.pods = len(first) + len(second) + len(third)
        run.refused_pods = sum(
            1 for n in first + second + third if refused(n)
        )  # events outlive their pods
        delete(third)
        check("every pod deleted")
        log(
            f"  faults: {run.refused_pods} of {run.pods} pods refused at least once, "
            f"{run.mismatches} mismatches"
        )
    finally:
        mig.stack.inject_faults(node.name)
        api.close()
    return run


def mig_phases(
    cp: ControlPlane, args: argparse.Namespace
) -> tuple[dict[str, Any] | None, dict[str, Any] | None, Leaks]:
    """The dynamic MIG phases and the fault runs on one node (either may be skipped)."""
    leaks = Leaks()
    products = [p.strip() for p in args.mig_gpus.split(",") if p.strip()]
    with gpupart_mig_node(cp, products, args.create_seconds, args.destroy_seconds) as mig:
        figures: dict[str, Any] | None = None
        faults: dict[str, Any] | None = None
        if not args.skip_mig:
            log(f"dynamic MIG: {args.mig_pods} pods one by one, 1 x {args.mig_burst} at once")
            run = measure(cp, mig.target, args.mig_pods, args.mig_burst, 1 if args.mig_burst else 0)
            api = cp.api_client()
            try:
                # measure's namespace is its own; every pod is gone: nothing may be left.
                leaks.check(mig, api, "default", "dynamic MIG phases done")
            finally:
                api.close()
            mean = run.figures()["burst_prepare_mean_ms"]
            figures = {
                "running_s": p50_p95_p99(run.running_s),
                "prepare_ms": p50_p95_p99(run.prepare_s, 1000),
                "burst": {
                    "running_s": p50_p95_p99(run.burst_running_s),
                    "prepare_mean_ms": mean,
                    # GPU index -> the burst's claims there: one MIG call at a time per GPU.
                    "claims_per_gpu": {
                        str(i): n
                        for i, n in sorted(
                            collections.Counter(
                                mig.placements[d][0]
                                for d in run.burst_devices
                                if d in mig.placements
                            ).items()
                        )
                    },
                },
                "mismatches": run.mismatches,
                "retried_prepares": run.retried_prepares,
                "leaked_instances": len(leaks.found),
                "pods": args.mig_pods,
                "burst_size": args.mig_burst,
                "gpus": products,
                "classes": list(MIG_CLASSES),
                "create_s": args.create_seconds,
                "destroy_s": args.destroy_seconds,
            }
        if not args.skip_faults:
            log(f"fault runs: 2 rounds of {args.fault_pods} pods, one agent kill")
            faults = fault_runs(cp, mig, args.fault_pods, leaks).figures(leaks)
    for where in leaks.found.values():
        log(f"  leaked: {where}")
    return figures, faults, leaks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--pods", type=int, default=200, help="pods one by one (default 200)")
    parser.add_argument("--burst", type=int, default=20, help="pods at once (default 20)")
    parser.add_argument("--bursts", type=int, default=1, help="how many bursts (default 1)")
    parser.add_argument("--driver", choices=sorted(DRIVERS), action="append", help="(default: all)")
    parser.add_argument("--skip-whole", action="store_true", help="no whole-device phases")
    parser.add_argument("--mig-pods", type=int, default=60, help="dynamic MIG pods one by one (60)")
    parser.add_argument("--mig-burst", type=int, default=8, help="dynamic MIG pods at once (8)")
    parser.add_argument("--mig-gpus", default=MIG_GPUS, help=f"simulated products ({MIG_GPUS})")
    parser.add_argument(
        "--create-seconds", type=float, default=1.0, help="simulated GPU instance create (1.0)"
    )
    parser.add_argument(
        "--destroy-seconds", type=float, default=0.5, help="simulated GPU instance destroy (0.5)"
    )
    parser.add_argument("--fault-pods", type=int, default=6, help="pods per fault round (6)")
    parser.add_argument("--skip-mig", action="store_true", help="no dynamic MIG phases")
    parser.add_argument("--skip-faults", action="store_true", help="no fault runs")
    parser.add_argument(
        "--xid-rounds", type=int, default=20, help="Xids to taints, one GPU each (20; 0: none)"
    )
    args = parser.parse_args()
    if args.fault_pods < 3 and not args.skip_faults:
        parser.error("--fault-pods must be at least 3 (a third of them are deleted)")
    bin_dir = bin_dir_from_env()
    if missing := missing_binaries(bin_dir):
        sys.exit(f"missing {', '.join(missing)} in {bin_dir}: run scripts/build-k8s-bins.sh")
    workdir = Path(tempfile.mkdtemp(prefix="gpupart-bench-dra-"))
    cp = ControlPlane(bin_dir=bin_dir, workdir=workdir, controller_manager=True)
    figures: dict[str, dict[str, Any]] = {}
    mig: dict[str, Any] | None = None
    faults: dict[str, Any] | None = None
    leaks: Leaks | None = None
    xid_s: list[float] = []
    started = time.monotonic()
    try:
        cp.start()
        for name in [] if args.skip_whole else args.driver or list(DRIVERS):
            log(f"{name}: {args.pods} pods one by one, {args.bursts} x {args.burst} at once")
            with DRIVERS[name](cp, max(args.burst, 1)) as target:
                figures[name] = measure(cp, target, args.pods, args.burst, args.bursts).figures()
                if target.xid_to_taint is not None and args.xid_rounds > 0:
                    log(f"{name}: {args.xid_rounds} Xids to taints")
                    xid_s = target.xid_to_taint(args.xid_rounds)
        if not (args.skip_mig and args.skip_faults):
            mig, faults, leaks = mig_phases(cp, args)
    finally:
        cp.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    log(f"done in {time.monotonic() - started:.0f} s")

    def per_driver(key: str) -> dict[str, Any]:
        return {n: (figures[n][key] if n in figures else None) for n in DRIVERS}

    def burst_over_single(driver: str) -> float | None:
        """The burst's p99 call over the one-by-one p50 call (what one call takes alone)."""
        found = figures.get(driver, {})
        burst = (found.get("burst_call_ms") or {}).get("p99")
        single = (found.get("call_ms") or {}).get("p50")
        return round(burst / single, 3) if burst is not None and single else None

    def ratio(q: str) -> float | None:
        ours, theirs = (figures.get(n, {}).get("prepare_ms", {}).get(q) for n in DRIVERS)
        return round(ours / theirs, 3) if ours is not None and theirs else None

    counted = [f["mismatches"] for f in figures.values()] + [
        f["mismatches"] for f in (mig, faults) if f is not None
    ]
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
                "dynamic_mig_running_p95_s": mig["running_s"]["p95"] if mig else None,
                "xid_to_taint_ms": p50_p95_p99(xid_s, 1000) if xid_s else None,
                "burst20_p99_over_single": burst_over_single("gpupart"),
                "burst20_p99_over_single_example_driver": burst_over_single("example_driver"),
                "call_ms": per_driver("call_ms"),
                "burst_call_ms": per_driver("burst_call_ms"),
                "mismatches": sum(counted) if counted else None,
                "leaked_instances": len(leaks.found) if leaks is not None else None,
                "retried_prepares": per_driver("retried_prepares"),
                "pods": args.pods,
                "burst_size": args.burst,
                "bursts": args.bursts,
                "dynamic_mig": mig,
                "faults": faults,
            }
        )
    )


if __name__ == "__main__":
    main()
