"""DRA benchmark: device order (simulated and through the real kube-scheduler) and scheduling throughput.

Three parts, each skippable; progress on stderr, the last line one JSON object.

**Simulated order** (`order_simulated`): one node of 8 H100-SXM5-80GB GPUs, dynamic MIG,
arrivals and departures replayed by the simulator's `dra_nvidia_order` and `dra_gpupart_order`
policies (kube-scheduler's first fit over the devices `gpupart.core.dra` publishes, one slice
per profile across the GPUs, re-ordered after each change as the agent does; `slice_writes`
counts the slices rewritten). Workloads (`gpupart.sim.dynamic.workloads`): W1, a window of the Alibaba
default trace's GPU pods (its start drawn by the seed; skipped when the trace is absent), W2
(1g/2g/3g shifting mix), W3 (1g bursts then 3g/4g), W4 (300 arrivals mixed 1g to 7g), each over
`--seeds`. A loss system, as the order's effect is seen at arrival: a pod that no device fits
when it arrives is given up (`patience_s=0`), so a stranded 4g does not wait and hold the next
free room.

Every pod given up is counted by its largest profile and the cause (`refused`,
`gpupart.sim.dynamic.dra.refusal_cause`): `placement` (a GPU had the room in count but not
in place: what the order within a GPU decides), `spread` (the node had it, no one GPU: the
order across GPUs) or `full` (no order could have placed it).

**Live order** (`order`): the same W4 sequences (`--live-seeds`) replayed through the real
kube-scheduler and kube-controller-manager (the test bed's control plane, kwok nodes), on two
nodes at once: one publishes our devices in NVIDIA's lexicographic order (`Order.NVIDIA`), the
other in ours. Each pod asks one MIG profile through a ResourceClaimTemplate of the chart's
profile class; the bench plays the node agent: after each allocation change (a claim allocated
or released) it re-publishes the node's pool as the agent does (`keep_choices`, then
`publish_plan`: at most one slice re-ordered, in place, no generation bump; NVIDIA's order never
changes), with the observed mix of the last hour's arrivals. A pod that is unschedulable when it
arrives is deleted (given up); a bound one is deleted at its departure and its claim waited out.
Time is compressed (no waiting between events) and instances take no creation time, so the live
figures can differ a little from the simulated W4 ones. `predicted_differs` counts allocations
where the scheduler chose another device than the core's model of its first fit
(`gpupart.core.dra.allocator.first_fit`) predicted.
`offline_bound` (and `W4_offline_bound` in the simulated part) is `dra_bound.offline_bound` of the
same replays: the most pods, and the most 4g+ pods, that any choice of devices and of which pods
to take could have bound, knowing the replay in advance.

**Throughput** (`throughput_pods_s`): `--nodes` kwok nodes of 8 GPUs, `--pods` pods per
configuration, pods/s from the first create to the last bind, each configuration with its own
kube-scheduler started for it (the others stopped):
- `device_plugin_extender`: today's path, MPS-shared GPUs advertised as extended resources,
  the chart's scheduler configuration with the real `gpupart extender`
  (`scheduler_throughput.py`'s machinery and pods);
- `dra_gpupart`: our pools, dynamic MIG with every profile of the catalogue (25 devices a GPU,
  one counters slice and one slice per profile across the GPUs, ADR 032), the chart's
  DeviceClasses; half the pods claim one 1g.10gb through a ResourceClaimTemplate, half ask
  `nvidia.com/mig-1g.10gb: 1` and get their claim from the profile class's
  `extendedResourceName` (KEP-5004); the chart's scheduler configuration without the extender;
  devices never re-ordered;
- `dra_gpupart_reorder`: the same, with the node agents' re-ordering on (every claim watched, a
  node's pool re-published after each of its allocation changes, as the agent does:
  `keep_choices`, at most one re-order a change); `agents_cpu_s_while_allocating` is the CPU
  the re-publishing took from the same two cores;
- `dra_gpupart_common`: our pools limited to 1g.10gb, 2g.20gb, 3g.40gb, 4g.40gb and 7g.80gb
  (`spec.mig.dynamic.profiles`, 14 placements a GPU), what a partition for mixed work names;
- `dra_gpupart_same_devices`: our pools limited to the profile asked (`spec.mig.dynamic.profiles:
  [1g.10gb]`: 7 placements, 7 devices a GPU; no whole-GPU device since ADR 030), one device
  fewer than the example's 8;
- `dra_gpupart_static`: our pools of a static MIG layout, 7 x 1g.10gb instances a GPU, one
  device each and no counters (so no counters-only slice);
- `dra_example_driver`: the pools `sigs.k8s.io/dra-example-driver` v0.4.0 publishes with
  `--num-devices 8 --gpu-partitions 7` (file `internal/profiles/gpu/gpu.go`, `EnumerateDevices`:
  one counters-only slice with a `gpu-<i>-counters` set of `memory` 80Gi and `compute` 100 per
  GPU, then one slice of every GPU's 7 `gpu-<i>-partition-<j>` devices and its `gpu-<i>-full`
  device, attributes `index`, `uuid`, `model`, `driverVersion`, `partition`, `partitionable`,
  `full`; slice names as its publisher `k8s.io/dynamic-resource-allocation/resourceslice`
  generates them), its DeviceClass (`deployments/helm/.../deviceclass.yaml`, with
  `deviceClass.extendedResourceName: example.com/gpu`); the same pod mix (template claims and
  `example.com/gpu: 1`). 7 partitions, as 8 GPUs of 8 devices are the 64 devices its one
  device slice may hold with counters, and a GPU then holds 7 pods, as 1g.10gb on an H100.
`slice_writes_per_allocation`: slice writes during `dra_gpupart_reorder` over the claims
allocated in it.

    python tests/bench/dra.py [--trace-dir DIR] [--seeds N] [--live-seeds N] [--live-arrivals N]
                              [--nodes N] [--pods N] [--configs A,B,...] [--skip-sim]
                              [--skip-live-order] [--skip-throughput]

Why the parts are shaped so, and what the figures mean for the goals: docs/adr-025-dra-live-benchmarks.md.

The live parts need the binaries of scripts/build-k8s-bins.sh (GPUPART_K8S_BIN or the cache).
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
import uuid as uuidlib
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from dra_bound import offline_bound
from kubernetes import client, watch
from scheduler_throughput import (
    _pod as shared_gpu_pod,
)
from scheduler_throughput import (
    extender_config,
    run_batch,
    shared_gpu_nodes,
    start_extender,
)

from gpupart.core.api.spec import Mode
from gpupart.core.dra import names
from gpupart.core.dra.allocator import DeviceRequest, first_fit
from gpupart.core.dra.claims import holding_claim
from gpupart.core.dra.devices import DraGpu, GpuDevices, GpuFacts, Order, gpu_devices
from gpupart.core.dra.pool import Slice, keep_choices, pool_slices, publish_plan
from gpupart.core.dra.read import AllocationResult, ClaimView, SliceView, read_claims, read_slice
from gpupart.core.dynamic.model import Mix
from gpupart.core.mig.catalogue import require_gpu_model
from gpupart.core.mig.layout import MigInstance, Placement
from gpupart.core.node.devices import OfferedGpu, OfferedMigDevice
from gpupart.sim.dynamic.dra import DraOrder
from gpupart.sim.dynamic.simulation import MIX_WINDOW_S, SimNode, SimPod, simulate
from gpupart.sim.dynamic.workloads import (
    from_trace,
    w2_shifting_inference,
    w3_adversarial,
    w4_mixed_sizes,
)
from gpupart.sim.trace import parse_pods
from gpupart_testsupport.chart import IMAGE_FLAGS
from gpupart_testsupport.cluster import (
    LOOPBACK,
    ControlPlane,
    bin_dir_from_env,
    create_nodes,
    gpu_node,
    http_get,
    http_ok,
    missing_binaries,
    parallel,
    start_scheduler,
)
from gpupart_testsupport.polling import wait_for

SEEDS = 5
LIVE_SEEDS = 1
GPUS = 8
W1_PODS = 80
W4_ARRIVALS = 300
LARGE = ("4g.", "7g.")
H100 = require_gpu_model("H100-SXM5-80GB")
FACTS = GpuFacts(pci_bus_id="0000:18:00.0", driver_version="570.86.05")
GROUP, VERSION = "resource.k8s.io", "v1"
REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "gpupart"
WAIT_S = 120.0
"""Deadline of one wait on the control plane (generous: a loaded 2-core machine)."""
POLL_S = 0.05
SMALL = "1g.10gb"
"""The profile every throughput pod asks."""
EXAMPLE_DRIVER = "gpu.example.com"
EXAMPLE_EXTENDED = "example.com/gpu"
EXAMPLE_PARTITIONS = 7
DRA_SCHEDULER = "dra-scheduler"
DP_SCHEDULER = "gpupart-scheduler"


def step(text: str) -> None:
    print(f"dra: {text}", file=sys.stderr, flush=True)


def _terminate(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)  # run the finally blocks that stop what we started


def large(profile: str) -> bool:
    return profile.startswith(LARGE)


# ---------------------------------------------------------------------------------------------
# Simulated order


def workloads(trace_dir: Path, seed: int) -> dict[str, tuple[SimPod, ...]]:
    found: dict[str, tuple[SimPod, ...]] = {}
    source = trace_dir / "openb_pod_list_default.csv"
    if source.exists():
        trace = from_trace(parse_pods(source.read_text(encoding="utf-8"), source=str(source)))
        # one instance per pod: multi-GPU pods are whole GPUs, which no order changes
        pods = [p for p in trace if len(p.profiles) == 1]
        start = random.Random(f"W1-{seed}").randrange(max(1, len(pods) - W1_PODS))
        window = pods[start : start + W1_PODS]
        first = window[0].arrival if window else 0.0
        found["W1"] = tuple(
            SimPod(p.name, p.profiles, p.arrival - first, p.duration, p.priority) for p in window
        )
    found["W2"] = w2_shifting_inference(seed=seed, gpus=GPUS, hours=1.0, load=0.9)
    found["W3"] = w3_adversarial(seed=seed, gpus=GPUS, rounds=2)
    found["W4"] = w4_mixed_sizes(seed=seed, gpus=GPUS, arrivals=W4_ARRIVALS)
    return found


def share(f: Mapping[str, int], part: str, whole: str) -> float:
    return f[part] / f[whole] if f[whole] else 0.0


def comparison(nvidia: Mapping[str, int], ours: Mapping[str, int]) -> dict[str, float]:
    """Ours against NVIDIA's order: the 4g+ acceptance ratio and the overall gain in points."""
    base = share(nvidia, "bound_4g_plus", "requested_4g_plus")
    ratio = share(ours, "bound_4g_plus", "requested_4g_plus") / base if base else 0.0
    points = 100 * (share(ours, "bound", "requested") - share(nvidia, "bound", "requested"))
    return {"ratio_4g_plus": round(ratio, 3), "overall_points": round(points, 2)}


def offline_bounds(replays: Iterable[Sequence[SimPod]]) -> dict[str, int]:
    """The offline bound (`dra_bound.offline_bound`) summed over W4 replays: the most pods and
    4g+ pods any choice of devices, and of which pods to take, binds on each."""
    total = {"bound": 0, "bound_4g_plus": 0}
    for pods in replays:
        found = offline_bound(H100, GPUS, pods, large)
        for key in total:
            total[key] += found[key]
    return total


def simulated(trace_dir: Path, seeds: int) -> dict[str, Any]:
    node = [SimNode("node-0", H100, GPUS)]
    totals = {
        order.value: {
            "slice_writes": 0,
            "bound": 0,
            "bound_4g_plus": 0,
            "requested_4g_plus": 0,
            "requested": 0,
        }
        for order in (Order.NVIDIA, Order.GPUPART)
    }
    per_workload: dict[str, dict[str, dict[str, int]]] = {}
    refused: dict[str, dict[str, int]] = {order: {} for order in totals}
    """Order -> "<profile>/<cause>" -> pods given up (`gpupart.sim.dynamic.dra.Refusal`)."""
    started = time.perf_counter()
    if not (trace_dir / "openb_pod_list_default.csv").exists():
        step(f"W1 skipped: no trace under {trace_dir}")
    for seed in range(seeds):
        for name, pods in workloads(trace_dir, seed).items():
            for order in (Order.NVIDIA, Order.GPUPART):
                t = time.perf_counter()
                policy = DraOrder(order, patience_s=0.0)
                result = simulate(node, pods, policy)
                bound = {name for name, _ in result.waits}
                for pod, (profile, cause) in policy.refused.items():
                    if pod not in bound:
                        key = f"{profile}/{cause}"
                        refused[order.value][key] = refused[order.value].get(key, 0) + 1
                figures = {
                    "slice_writes": policy.slice_writes,
                    "bound": len(bound),
                    "bound_4g_plus": sum(
                        1 for p in pods if p.name in bound and any(map(large, p.profiles))
                    ),
                    "requested_4g_plus": sum(1 for p in pods if any(large(x) for x in p.profiles)),
                    "requested": len(pods),
                }
                for key, value in figures.items():
                    totals[order.value][key] += value
                    per_workload.setdefault(name, {}).setdefault(order.value, {}).setdefault(key, 0)
                    per_workload[name][order.value][key] += value
                step(
                    f"simulated seed {seed} {name} {order.value:<8} {json.dumps(figures)} "
                    f"({time.perf_counter() - t:.1f} s)"
                )
    w4_bound = offline_bounds(
        w4_mixed_sizes(seed=seed, gpus=GPUS, arrivals=W4_ARRIVALS) for seed in range(seeds)
    )
    step(f"simulated per workload: {json.dumps(per_workload)}")
    step(f"simulated seconds: {time.perf_counter() - started:.1f}")
    return {
        **{
            order: {**f, "refused": dict(sorted(refused[order].items()))}
            for order, f in totals.items()
        },
        **comparison(totals["nvidia"], totals["gpupart"]),
        "per_workload": per_workload,
        "W4_offline_bound": w4_bound,
        "seeds": seeds,
    }


# ---------------------------------------------------------------------------------------------
# A node's pool, published as the node agent would


def offered(node: str, index: int) -> OfferedGpu:
    return OfferedGpu(
        index, f"GPU-{node}-{index}", "NVIDIA H100 80GB HBM3", H100.memory_mib, index, 0, Mode.MIG
    )


def placements(docs: Sequence[Slice]) -> dict[str, tuple[int, MigInstance]]:
    """Each MIG device of our pool documents: its GPU index and placement (from its attributes;
    device names do not depend on the node, so one table serves every pool of one shape)."""
    found = {}
    for doc in docs:
        for device in doc["spec"].get("devices", []):
            attributes = device["attributes"]
            if attributes[names.TYPE]["string"] != names.TYPE_MIG:
                continue
            instance = MigInstance(
                Placement(
                    attributes[names.PLACEMENT_START]["int"],
                    attributes[names.PLACEMENT_SIZE]["int"],
                ),
                attributes[names.PROFILE]["string"],
            )
            found[device["name"]] = (attributes[names.PARENT_INDEX]["int"], instance)
    return found


@dataclass
class LivePool:
    """One node's pool of MIG GPUs as its agent keeps it: the slices last written, the writes."""

    custom: Any
    node: str
    uid: str
    order: Order
    profiles: tuple[str, ...] | None = None
    """Dynamic MIG: the profiles offered (None: all); `static` instead: no counters."""
    static: bool = False
    """A static layout of 7 x 1g.10gb instances per GPU, each one device (no counters)."""
    views: dict[str, SliceView] = field(default_factory=dict)
    built: dict[tuple[int, tuple[MigInstance, ...], Mix], GpuDevices] = field(default_factory=dict)
    """GPU devices by (index, instances held, mix)."""
    writes: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def wanted(self, in_use: Mapping[int, Sequence[MigInstance]], mix: Mix) -> tuple[Slice, ...]:
        if self.static:
            layout = [
                OfferedMigDevice(f"MIG-{self.node}-{index}-{s}", at(SMALL, s), s + 1, 0)
                for index in range(GPUS)
                for s in H100.require_profile(SMALL).starts
            ]
            static = [
                gpu_devices(
                    DraGpu(
                        replace(
                            offered(self.node, index),
                            mig=tuple(
                                m for m in layout if m.uuid.startswith(f"MIG-{self.node}-{index}-")
                            ),
                        ),
                        H100,
                        facts=FACTS,
                    )
                )
                for index in range(GPUS)
            ]
            return pool_slices(self.node, self.uid, static)
        gpus = []
        for index in range(GPUS):
            held = tuple(sorted(in_use.get(index, ())))
            # one GPU's devices follow from its own instances and the mix: an allocation
            # rebuilds only its GPU's, as a node's agent would need to (the bench plays 100)
            found = self.built.get((index, held, mix))
            if found is None:
                if len(self.built) >= 4096:
                    self.built.clear()
                found = gpu_devices(
                    DraGpu(
                        offered(self.node, index),
                        H100,
                        dynamic=True,
                        profiles=self.profiles,
                        in_use=held,
                        facts=FACTS,
                    ),
                    mix=mix,
                    order=self.order,
                )
                self.built[(index, held, mix)] = found
            gpus.append(found)
        return pool_slices(self.node, self.uid, gpus)

    def publish(self, in_use: Mapping[int, Sequence[MigInstance]], mix: Mix) -> int:
        """Write what `publish_plan` says (nothing when the order is unchanged); the writes."""
        with self.lock:
            wanted = self.wanted(in_use, mix)
            if self.views and self.order is Order.GPUPART:
                # as the agent does: a re-order is written where it changes a next pick
                claims = [holding_claim(self.node, in_use)]
                wanted = keep_choices(list(self.views.values()), wanted, claims, mix=mix)
            plan = publish_plan(list(self.views.values()), wanted)
            for doc in (*plan.creates, *plan.updates):
                name = doc["metadata"]["name"]
                if name in self.views:
                    body = {
                        **doc,
                        "metadata": {
                            **doc["metadata"],
                            "resourceVersion": self.views[name].resource_version,
                        },
                    }
                    written = self.custom.replace_cluster_custom_object(
                        GROUP, VERSION, "resourceslices", name, body
                    )
                else:
                    written = self.custom.create_cluster_custom_object(
                        GROUP, VERSION, "resourceslices", doc
                    )
                view = read_slice(written)
                if view is None:
                    raise RuntimeError(f"slice {name} is not read back as ours")
                self.views[name] = view
            for name in plan.deletes:
                self.custom.delete_cluster_custom_object(GROUP, VERSION, "resourceslices", name)
                del self.views[name]
            count = len(plan.creates) + len(plan.updates) + len(plan.deletes)
            self.writes += count
            return count


def at(profile: str, start: int) -> MigInstance:
    return MigInstance(Placement(start, H100.require_profile(profile).memory_slices), profile)


def in_use_of(
    devices: Sequence[str], table: Mapping[str, tuple[int, MigInstance]]
) -> dict[int, list[MigInstance]]:
    found: dict[int, list[MigInstance]] = {}
    for device in devices:
        if device in table:  # the whole GPU is no placement: its counters exclude the rest
            index, instance = table[device]
            found.setdefault(index, []).append(instance)
    return found


def our_results(claim: ClaimView, pool: str) -> list[str]:
    return [r.device for r in claim.results if r.driver == names.DRIVER and r.pool == pool]


# ---------------------------------------------------------------------------------------------
# Live order


def claim_pod(
    name: str, namespace: str, node: str, template: str, scheduler: str = DRA_SCHEDULER
) -> dict[str, Any]:
    """A pod with one claim from `template`, pinned to `node` (when given)."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {"app": name.rsplit("-", 1)[0]},
        },
        "spec": {
            "schedulerName": scheduler,
            "nodeSelector": {"kubernetes.io/hostname": node} if node else {},
            "terminationGracePeriodSeconds": 0,
            "resourceClaims": [{"name": "dev", "resourceClaimTemplateName": template}],
            "containers": [
                {
                    "name": "main",
                    "image": "gpupart/sleep:0",
                    "resources": {"claims": [{"name": "dev"}], "requests": {"cpu": "10m"}},
                }
            ],
        },
    }


def claim_template(name: str, device_class: str) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name},
        "spec": {
            "spec": {
                "devices": {
                    "requests": [{"name": "dev", "exactly": {"deviceClassName": device_class}}]
                }
            }
        },
    }


def profile_template(profile: str) -> str:
    return f"mig-{names.profile_label(profile)}"


def claims_of(custom: Any, namespace: str) -> list[dict[str, Any]]:
    found = custom.list_namespaced_custom_object(GROUP, VERSION, namespace, "resourceclaims")
    return list(found["items"])


def owned_by(claim: Mapping[str, Any], pod: str) -> bool:
    return any(o.get("name") == pod for o in claim["metadata"].get("ownerReferences") or [])


def outcome(core: Any, namespace: str, pod: str) -> str | None:
    """ "bound", "unschedulable", or None while the scheduler has not decided."""
    found = core.read_namespaced_pod(pod, namespace)
    if found.spec.node_name:
        return "bound"
    for c in found.status.conditions or []:
        if c.type == "PodScheduled" and c.status == "False" and c.reason == "Unschedulable":
            return "unschedulable"
    return None


@dataclass
class Replay:
    """One order's replay of a sequence on its own node and namespace."""

    api: Any
    pool: LivePool
    namespace: str
    table: dict[str, tuple[int, MigInstance]]
    bound: dict[str, int] = field(default_factory=dict)
    requested: dict[str, int] = field(default_factory=dict)
    allocations: int = 0
    releases: int = 0
    predicted_differs: int = 0

    def run(self, pods: Sequence[SimPod]) -> None:
        core = client.CoreV1Api(self.api)
        custom = client.CustomObjectsApi(self.api)
        by_name = {p.name: p for p in pods}
        events = [(p.arrival, 0, p.name) for p in pods]
        heapq.heapify(events)
        held: dict[str, str] = {}  # pod -> its device
        recent: deque[tuple[float, str]] = deque()
        for pod in pods:
            self.requested[pod.profiles[0]] = self.requested.get(pod.profiles[0], 0) + 1
        while events:
            now, kind, name = heapq.heappop(events)
            pod = by_name[name]
            (profile,) = pod.profiles
            if kind == 0:
                recent.append((now, profile))
                while recent and recent[0][0] < now - MIX_WINDOW_S:
                    recent.popleft()
                device = self.arrive(core, custom, name, profile, held)
                if device is None:
                    continue
                held[name] = device
                heapq.heappush(events, (now + pod.duration, 1, name))
            else:
                self.delete(core, custom, name)
                del held[name]
                self.releases += 1
            counts: dict[str, float] = {}
            for _, p in recent:
                counts[p] = counts.get(p, 0) + 1
            self.pool.publish(in_use_of(list(held.values()), self.table), Mix.of(counts))

    def run_reporting(self, pods: Sequence[SimPod], errors: list[BaseException]) -> None:
        """`run`, its exception kept in `errors` (for a thread)."""
        try:
            self.run(pods)
        except BaseException as error:
            errors.append(error)

    def arrive(
        self, core: Any, custom: Any, name: str, profile: str, held: Mapping[str, str]
    ) -> str | None:
        """Create the pod; its device once bound, or None when it was given up."""
        predicted = self.predict(held, profile)
        core.create_namespaced_pod(
            self.namespace,
            claim_pod(name, self.namespace, self.pool.node, profile_template(profile)),
        )
        result = wait_for(
            lambda: outcome(core, self.namespace, name),
            WAIT_S,
            f"pod {self.namespace}/{name} bound or unschedulable",
            interval=POLL_S,
        )
        if result == "unschedulable":
            self.delete(core, custom, name)
            return None
        device: str = wait_for(
            lambda: self.device_of(custom, name), WAIT_S, f"the claim of {name}", POLL_S
        )
        if predicted != device:
            self.predicted_differs += 1
        self.bound[profile] = self.bound.get(profile, 0) + 1
        self.allocations += 1
        return device

    def predict(self, held: Mapping[str, str], profile: str) -> str | None:
        """The device the core's first-fit model says the scheduler takes now."""
        allocated = tuple(
            AllocationResult("dev", names.DRIVER, self.pool.node, device)
            for device in held.values()
        )
        claims = [ClaimView(self.namespace, "held", "", allocated)]
        request = DeviceRequest("dev", ((names.TYPE, names.TYPE_MIG), (names.PROFILE, profile)))
        found = first_fit(list(self.pool.views.values()), claims, [request])
        return found[0].device if found else None

    def device_of(self, custom: Any, pod: str) -> str | None:
        for claim in claims_of(custom, self.namespace):
            if owned_by(claim, pod):
                reading = read_claims([claim])
                for view in reading.items:
                    devices = our_results(view, self.pool.node)
                    if devices:
                        return devices[0]
        return None

    def delete(self, core: Any, custom: Any, pod: str) -> None:
        """Delete the pod and wait until its claim is gone (its device free again)."""
        core.delete_namespaced_pod(pod, self.namespace, grace_period_seconds=0)
        wait_for(
            lambda: not any(owned_by(c, pod) for c in claims_of(custom, self.namespace)),
            WAIT_S,
            f"the claim of {pod} released",
            POLL_S,
        )

    def figures(self) -> dict[str, Any]:
        bound = sum(self.bound.values())
        return {
            "bound": bound,
            "bound_4g_plus": sum(v for k, v in self.bound.items() if large(k)),
            "requested": sum(self.requested.values()),
            "requested_4g_plus": sum(v for k, v in self.requested.items() if large(k)),
            "bound_by_profile": dict(sorted(self.bound.items())),
            "requested_by_profile": dict(sorted(self.requested.items())),
            "slice_writes": self.pool.writes,
            "allocations": self.allocations,
            "releases": self.releases,
            "predicted_differs": self.predicted_differs,
        }


def make_pool(
    api: Any,
    node: str,
    order: Order,
    profiles: tuple[str, ...] | None = None,
    *,
    static: bool = False,
) -> LivePool:
    uid = client.CoreV1Api(api).read_node(node).metadata.uid
    pool = LivePool(client.CustomObjectsApi(api), node, uid, order, profiles, static)
    pool.publish({}, Mix())
    pool.writes = 0  # the pool's first publish is no re-order
    return pool


def live_order(cp: ControlPlane, api: Any, seeds: int, arrivals: int) -> dict[str, Any]:
    custom = client.CustomObjectsApi(api)
    totals: dict[str, dict[str, Any]] = {}
    started = time.monotonic()
    for seed in range(seeds):
        pods = w4_mixed_sizes(seed=seed, gpus=GPUS, arrivals=arrivals)
        replays = {}
        for order in (Order.NVIDIA, Order.GPUPART):
            node = f"order-{order.value}-{seed}"
            create_nodes(api, [gpu_node(node)])
            namespace = node
            client.CoreV1Api(api).create_namespace({"metadata": {"name": namespace}})
            cp.wait_namespace_ready(namespace)
            for profile in sorted({p.profiles[0] for p in pods}):
                label = names.profile_label(profile)
                custom.create_namespaced_custom_object(
                    GROUP,
                    VERSION,
                    namespace,
                    "resourceclaimtemplates",
                    claim_template(profile_template(profile), f"mig-{label}.gpupart.io"),
                )
            pool = make_pool(api, node, order)
            table = placements(pool.wanted({}, Mix()))
            replays[order.value] = Replay(cp.api_client(), pool, namespace, table)
        t = time.monotonic()
        errors: list[BaseException] = []  # raised below, after both threads ended

        threads = [
            threading.Thread(target=replay.run_reporting, args=(pods, errors))
            for replay in replays.values()
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        for order, replay in replays.items():
            figures = replay.figures()
            step(f"live seed {seed} W4 {order:<8} {json.dumps(figures)}")
            into = totals.setdefault(order, {})
            for key, value in figures.items():
                if isinstance(value, dict):
                    part = into.setdefault(key, {})
                    for k, v in value.items():
                        part[k] = part.get(k, 0) + v
                else:
                    into[key] = into.get(key, 0) + value
        step(f"live seed {seed}: {time.monotonic() - t:.0f} s")
    ours = totals["gpupart"]
    bound = offline_bounds(
        w4_mixed_sizes(seed=seed, gpus=GPUS, arrivals=arrivals) for seed in range(seeds)
    )
    ours["slice_writes_per_allocation"] = (
        round(ours["slice_writes"] / ours["allocations"], 3) if ours["allocations"] else 0.0
    )
    step(f"live order seconds: {time.monotonic() - started:.0f}")
    return {
        **totals,
        **comparison(totals["nvidia"], totals["gpupart"]),
        "offline_bound": bound,
        "gpupart_to_bound_4g_plus": round(
            ours["bound_4g_plus"] / max(1, bound["bound_4g_plus"]), 3
        ),
        "workload": f"W4, {arrivals} arrivals",
        "seeds": seeds,
    }


# ---------------------------------------------------------------------------------------------
# Throughput


def extended_pod(name: str, scheduler: str, resource: str) -> dict[str, Any]:
    limits = {resource: "1", "cpu": "10m"}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": name.rsplit("-", 1)[0]}},
        "spec": {
            "schedulerName": scheduler,
            "terminationGracePeriodSeconds": 0,
            "containers": [
                {"name": "m", "image": "x", "resources": {"limits": limits, "requests": limits}}
            ],
        },
    }


def mixed_pods(template: str, resource: str) -> Callable[[str, str], dict[str, Any]]:
    """Even-numbered pods claim through `template`, odd ones ask the extended `resource`."""

    def manifest(name: str, scheduler: str) -> dict[str, Any]:
        if int(name.rsplit("-", 1)[1]) % 2:
            return extended_pod(name, scheduler, resource)
        pod = claim_pod(name, "", "", template, scheduler)
        del pod["metadata"]["namespace"]
        return pod

    return manifest


def example_device(
    name: str, attributes: Mapping[str, Any], counter_set: str, memory: int, compute: int
) -> dict[str, Any]:
    """One device as dra-example-driver builds it: capacity and counters both memory/compute."""
    amounts = {"memory": {"value": str(memory)}, "compute": {"value": str(compute)}}
    return {
        "name": name,
        "attributes": dict(attributes),
        "allowMultipleAllocations": False,
        "capacity": amounts,
        "consumesCounters": [{"counterSet": counter_set, "counters": amounts}],
    }


def example_slices(node: str, uid: str, gpus: int, partitions: int) -> list[dict[str, Any]]:
    """What dra-example-driver v0.4.0 publishes for one node (see the module docstring)."""
    rng = random.Random(f"example-{node}")
    memory = 80 * 1024**3
    compute = 100
    part_memory, part_compute = memory // partitions, compute // partitions
    devices: list[dict[str, Any]] = []
    counter_sets = []
    for i in range(gpus):
        attrs: dict[str, dict[str, Any]] = {
            "index": {"int": i},
            "uuid": {"string": f"gpu-{uuidlib.UUID(int=rng.getrandbits(128))}"},
            "model": {"string": "LATEST-GPU-MODEL"},
            "driverVersion": {"version": "1.0.0"},
        }
        counter_set = f"gpu-{i}-counters"
        counter_sets.append(
            {
                "name": counter_set,
                "counters": {"memory": {"value": "80Gi"}, "compute": {"value": str(compute)}},
            }
        )

        for j in range(partitions):
            extra = {"partition": {"int": j}, "partitionable": {"bool": True}}
            devices.append(
                example_device(
                    f"gpu-{i}-partition-{j}",
                    {**attrs, **extra},
                    counter_set,
                    part_memory,
                    part_compute,
                )
            )
        extra = {"partitionable": {"bool": True}, "full": {"bool": True}}
        devices.append(
            example_device(f"gpu-{i}-full", {**attrs, **extra}, counter_set, memory, compute)
        )
    bodies = [{"sharedCounters": counter_sets}, {"devices": devices}]
    return [
        {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "ResourceSlice",
            "metadata": {
                # the Go publisher's scheme: <index, 5 hex digits>-<driver>-<owner>-<random>
                "generateName": f"{k:05x}-{EXAMPLE_DRIVER}-{node}-",
                "ownerReferences": [
                    {
                        "apiVersion": "v1",
                        "kind": "Node",
                        "name": node,
                        "uid": uid,
                        "controller": True,
                    }
                ],
            },
            "spec": {
                "driver": EXAMPLE_DRIVER,
                "pool": {"name": node, "generation": 1, "resourceSliceCount": len(bodies)},
                "nodeName": node,
                **body,
            },
        }
        for k, body in enumerate(bodies)
    ]


EXAMPLE_CLASS = {
    "apiVersion": f"{GROUP}/{VERSION}",
    "kind": "DeviceClass",
    "metadata": {"name": EXAMPLE_DRIVER},
    "spec": {
        "selectors": [{"cel": {"expression": f"device.driver == '{EXAMPLE_DRIVER}'"}}],
        "extendedResourceName": EXAMPLE_EXTENDED,
    },
}


class Republisher:
    """The node agents' re-ordering for many nodes: every claim watched, a node's pool
    re-published after each change of its allocations (the latest state; changes that come
    while a node is being written are folded into its next write)."""

    def __init__(
        self, api: Any, pools: Mapping[str, LivePool], table: Mapping[str, tuple[int, MigInstance]]
    ) -> None:
        self.api = api
        self.pools = pools
        self.table = table
        self.mix = Mix.of({SMALL: 1})
        self.devices: dict[str, dict[str, list[str]]] = {node: {} for node in pools}
        self.allocated: set[str] = set()
        self.where: dict[str, set[str]] = {}
        """Claim -> the pools it holds devices of."""
        self.dirty: set[str] = set()
        self.busy: set[str] = set()
        self.cond = threading.Condition()
        self.stopping = threading.Event()
        self.errors: list[BaseException] = []
        self.threads: list[threading.Thread] = []
        self.watcher: watch.Watch | None = None
        self.cpu_s = 0.0
        """CPU seconds the re-publishing took here: on a cluster each node's agent spends its
        share on its own node, here all of it is taken from the scheduler's two cores."""

    def start(self, workers: int = 4) -> None:
        custom = client.CustomObjectsApi(self.api)
        listed = custom.list_cluster_custom_object(GROUP, VERSION, "resourceclaims")
        for claim in listed["items"]:
            self.observe("ADDED", claim)
        version = listed["metadata"]["resourceVersion"]
        self.threads = [threading.Thread(target=self.watch, args=(version,), daemon=True)]
        self.threads += [
            threading.Thread(target=self.work, daemon=True) for _ in range(max(1, workers))
        ]
        for thread in self.threads:
            thread.start()

    def watch(self, version: str) -> None:
        custom = client.CustomObjectsApi(self.api)
        while not self.stopping.is_set():
            self.watcher = watch.Watch()
            try:
                for event in self.watcher.stream(
                    custom.list_cluster_custom_object,
                    GROUP,
                    VERSION,
                    "resourceclaims",
                    resource_version=version,
                    timeout_seconds=30,
                ):
                    claim = event["object"]
                    version = claim["metadata"]["resourceVersion"]
                    self.observe(event["type"], claim)
                    if self.stopping.is_set():
                        break
            except BaseException as error:  # the bench fails on it when it stops
                if not self.stopping.is_set():
                    self.errors.append(error)
                return

    def observe(self, kind: str, claim: Mapping[str, Any]) -> None:
        key = f"{claim['metadata'].get('namespace')}/{claim['metadata'].get('name')}"
        views = read_claims([claim]).items if kind != "DELETED" else ()
        by_pool: dict[str, list[str]] = {}
        for view in views:
            for result in view.results:
                if result.driver == names.DRIVER and result.pool in self.devices:
                    by_pool.setdefault(result.pool, []).append(result.device)
        with self.cond:
            if by_pool:
                self.allocated.add(key)
            for node in self.where.get(key, set()) | set(by_pool):
                devices = by_pool.get(node, [])
                if self.devices[node].get(key, []) != devices:
                    if devices:
                        self.devices[node][key] = devices
                    else:
                        self.devices[node].pop(key, None)
                    self.dirty.add(node)
            self.where[key] = set(by_pool)
            self.cond.notify_all()

    def work(self) -> None:
        while True:
            with self.cond:
                while not self.stopping.is_set() and not (self.dirty - self.busy):
                    self.cond.wait(0.5)
                if self.stopping.is_set():
                    return
                node = min(self.dirty - self.busy)
                self.dirty.discard(node)
                self.busy.add(node)
                held = [d for devices in self.devices[node].values() for d in devices]
            started = time.thread_time()
            try:
                self.pools[node].publish(in_use_of(held, self.table), self.mix)
            except BaseException as error:  # the bench fails on it when it stops
                self.errors.append(error)
                return
            finally:
                with self.cond:
                    self.cpu_s += time.thread_time() - started
                    self.busy.discard(node)
                    self.cond.notify_all()

    def settle(self) -> None:
        """Until every change seen so far is written."""
        wait_for(lambda: not (self.dirty or self.busy), WAIT_S, "the re-publishing to settle")

    def stop(self) -> None:
        self.stopping.set()
        if self.watcher is not None:
            self.watcher.stop()
        with self.cond:
            self.cond.notify_all()
        for thread in self.threads[1:]:
            thread.join(timeout=30)
        if self.errors:
            raise self.errors[0]


@contextmanager
def scheduler(
    bin_dir: Path, kubeconfig: Path, workdir: Path, config: Mapping[str, Any], token: str
) -> Iterator[None]:
    """A kube-scheduler of this configuration, healthy, stopped on leaving (its plugins'
    time per extension point logged first)."""
    name = config["profiles"][0]["schedulerName"]
    proc, port = start_scheduler(bin_dir, kubeconfig, config, name, workdir, verbosity=1)
    try:
        wait_for(lambda: http_ok(f"https://{LOOPBACK}:{port}/healthz"), 120, f"{name} healthy")
        yield
        status, text = http_get(f"https://{LOOPBACK}:{port}/metrics", token=token)
        if status == 200:
            step(f"{name} plugin seconds (sampled): {plugin_seconds(text)}")
    finally:
        proc.stop()


def plugin_seconds(metrics: str) -> str:
    """The costliest plugins at each extension point from kube-scheduler's sampled histogram
    `scheduler_plugin_execution_duration_seconds` (sum and count per plugin)."""
    sums: dict[tuple[str, str], float] = {}
    counts: dict[tuple[str, str], float] = {}
    for line in metrics.splitlines():
        for suffix, into in (("_sum{", sums), ("_count{", counts)):
            head = "scheduler_plugin_execution_duration_seconds" + suffix
            if not line.startswith(head):
                continue
            labels = dict(
                part.split("=", 1)
                for part in line[len(head) : line.index("}")].split(",")
                if "=" in part
            )
            key = (
                labels.get("extension_point", "").strip('"'),
                labels.get("plugin", "").strip('"'),
            )
            into[key] = into.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    ranked = sorted(sums.items(), key=lambda item: -item[1])[:6]
    return ", ".join(
        f"{point}/{plugin} {total:.2f} s over {int(counts.get((point, plugin), 0))}"
        for (point, plugin), total in ranked
    )


def dra_config() -> dict[str, Any]:
    """The chart's scheduler configuration without the extender, as DRA nodes need none."""
    plain = {k: v for k, v in extender_config(0).items() if k != "extenders"}
    plain["profiles"] = [{**plain["profiles"][0], "schedulerName": DRA_SCHEDULER}]
    return plain


@dataclass
class Bench:
    """The throughput part's control plane, nodes and namespace."""

    cp: ControlPlane
    api: Any
    bin_dir: Path
    workdir: Path
    pods: int
    namespace: str = "tp"
    nodes: list[str] = field(default_factory=list)

    @property
    def core(self) -> Any:
        return client.CoreV1Api(self.api)

    @property
    def custom(self) -> Any:
        return client.CustomObjectsApi(self.api)

    def scheduler(self, config: Mapping[str, Any]) -> AbstractContextManager[None]:
        return scheduler(self.bin_dir, self.cp.kubeconfig, self.workdir, config, self.cp.token)

    def batch(
        self, label: str, scheduler: str, manifest: Callable[[str, str], dict[str, Any]]
    ) -> float:
        """A warm-up pod bound first (the scheduler's caches synced), then the timed batch:
        pods/s until all are bound. The caller clears the batch (`clear`)."""
        warm = f"{label}-warm"
        self.core.create_namespaced_pod(self.namespace, manifest(f"{warm}-0", scheduler))
        wait_for(
            lambda: self.core.read_namespaced_pod(f"{warm}-0", self.namespace).spec.node_name,
            WAIT_S,
            f"the {label} warm-up pod bound",
        )
        self.clear(warm)
        load = os.getloadavg()[0]
        rate = run_batch(self.core, self.namespace, label, scheduler, self.pods, manifest)
        step(
            f"throughput {label}: {rate:.1f} pods/s "
            f"(load average {load:.1f} before, {os.getloadavg()[0]:.1f} after)"
        )
        return rate

    def clear(self, label: str) -> None:
        """Delete the batch's pods and wait until they and every claim are gone. The delete is
        asked again while pods remain: on a loaded server one collection delete of 2,000
        pods can time out (504) part-way."""

        def gone() -> bool:
            pods = self.core.list_namespaced_pod(
                self.namespace, label_selector=f"app={label}", _preload_content=False
            )
            if json.loads(pods.data)["items"]:
                self.core.delete_collection_namespaced_pod(
                    self.namespace, label_selector=f"app={label}", grace_period_seconds=0
                )
                return False
            claims = self.custom.list_namespaced_custom_object(
                GROUP, VERSION, self.namespace, "resourceclaims", _preload_content=False
            )
            return not json.loads(claims.data)["items"]

        wait_for(gone, 600, f"the {label} pods and their claims gone", interval=0.5)

    def delete_slices(self, driver: str) -> None:
        found = self.custom.list_cluster_custom_object(GROUP, VERSION, "resourceslices")
        mine = [s["metadata"]["name"] for s in found["items"] if s["spec"]["driver"] == driver]
        parallel(
            lambda name: self.custom.delete_cluster_custom_object(
                GROUP, VERSION, "resourceslices", name
            ),
            mine,
        )


CONFIGS = (
    "device_plugin_extender",
    "dra_gpupart",
    "dra_gpupart_reorder",
    "dra_gpupart_common",
    "dra_gpupart_same_devices",
    "dra_gpupart_static",
    "dra_example_driver",
)
COMMON_PROFILES = ("1g.10gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb")
"""`dra_gpupart_common`: the profiles most partitions name (14 placements a GPU on an H100)."""


def live_throughput(bench: Bench, node_count: int, configs: Sequence[str]) -> dict[str, Any]:
    api, custom = bench.api, bench.custom
    step(f"throughput: creating {node_count} nodes of 8 GPUs")
    create_nodes(api, shared_gpu_nodes(node_count, prefix="tp"))
    bench.nodes = [f"tp-{n:05d}" for n in range(node_count)]
    bench.core.create_namespace({"metadata": {"name": bench.namespace}})
    bench.cp.wait_namespace_ready(bench.namespace)
    rates: dict[str, float] = {}
    plain = dra_config()
    template = f"one-{names.profile_label(SMALL)}"
    custom.create_namespaced_custom_object(
        GROUP,
        VERSION,
        bench.namespace,
        "resourceclaimtemplates",
        claim_template(template, f"mig-{names.profile_label(SMALL)}.gpupart.io"),
    )
    ours = mixed_pods(template, f"nvidia.com/mig-{SMALL}")
    out: dict[str, Any] = {}

    def our_pools(profiles: tuple[str, ...] | None) -> dict[str, LivePool]:
        step(f"throughput: publishing our pools (profiles {profiles or 'all'})")
        found = parallel(lambda node: make_pool(api, node, Order.GPUPART, profiles), bench.nodes)
        step(f"throughput: {sum(len(p.views) for p in found)} slices")
        return {p.node: p for p in found}

    if "device_plugin_extender" in configs:
        step("throughput: the device-plugin path with the extender")
        extender, port = start_extender(bench.cp.kubeconfig, bench.workdir)
        try:
            with bench.scheduler(extender_config(port)):
                rates["device_plugin_extender"] = bench.batch("dp", DP_SCHEDULER, shared_gpu_pod)
                bench.clear("dp")
        finally:
            extender.stop()
    if "dra_gpupart" in configs or "dra_gpupart_reorder" in configs:
        pools = our_pools(None)
        if "dra_gpupart" in configs:
            with bench.scheduler(plain):
                step("throughput: DRA, our slices, no re-ordering")
                rates["dra_gpupart"] = bench.batch("dra", DRA_SCHEDULER, ours)
                bench.clear("dra")
        if "dra_gpupart_reorder" in configs:
            rates["dra_gpupart_reorder"], out["reorder"] = reordered(bench, pools, plain, ours)
            out["slice_writes_per_allocation"] = out["reorder"]["slice_writes_per_allocation"]
        bench.delete_slices(names.DRIVER)
    if "dra_gpupart_common" in configs:
        our_pools(COMMON_PROFILES)
        with bench.scheduler(plain):
            step(f"throughput: DRA, our slices limited to {', '.join(COMMON_PROFILES)}")
            rates["dra_gpupart_common"] = bench.batch("common", DRA_SCHEDULER, ours)
            bench.clear("common")
        bench.delete_slices(names.DRIVER)
    if "dra_gpupart_same_devices" in configs:
        our_pools((SMALL,))
        with bench.scheduler(plain):
            step("throughput: DRA, our slices limited to 1g.10gb (the example's device count)")
            rates["dra_gpupart_same_devices"] = bench.batch("same", DRA_SCHEDULER, ours)
            bench.clear("same")
        bench.delete_slices(names.DRIVER)
    if "dra_gpupart_static" in configs:
        step("throughput: publishing our pools (static MIG, 7 x 1g.10gb per GPU)")
        parallel(lambda node: make_pool(api, node, Order.GPUPART, static=True), bench.nodes)
        with bench.scheduler(plain):
            step("throughput: DRA, our static MIG slices (no counters)")
            rates["dra_gpupart_static"] = bench.batch("static", DRA_SCHEDULER, ours)
            bench.clear("static")
        bench.delete_slices(names.DRIVER)
    if "dra_example_driver" in configs:
        step("throughput: publishing dra-example-driver's pools")
        custom.create_cluster_custom_object(GROUP, VERSION, "deviceclasses", EXAMPLE_CLASS)
        uids = {n.metadata.name: n.metadata.uid for n in bench.core.list_node().items}
        docs = [
            doc
            for node in bench.nodes
            for doc in example_slices(node, uids[node], GPUS, EXAMPLE_PARTITIONS)
        ]
        parallel(
            lambda doc: custom.create_cluster_custom_object(GROUP, VERSION, "resourceslices", doc),
            docs,
        )
        custom.create_namespaced_custom_object(
            GROUP,
            VERSION,
            bench.namespace,
            "resourceclaimtemplates",
            claim_template("one-example", EXAMPLE_DRIVER),
        )
        with bench.scheduler(plain):
            step("throughput: DRA, dra-example-driver's slices")
            rates["dra_example_driver"] = bench.batch(
                "example", DRA_SCHEDULER, mixed_pods("one-example", EXAMPLE_EXTENDED)
            )
            bench.clear("example")
        bench.delete_slices(EXAMPLE_DRIVER)
    ratios = {
        name: round(rates[a] / rates[b], 3)
        for name, a, b in (
            ("dra_gpupart_to_device_plugin_extender", "dra_gpupart", "device_plugin_extender"),
            ("dra_gpupart_to_dra_example_driver", "dra_gpupart", "dra_example_driver"),
            ("dra_gpupart_reorder_to_dra_gpupart", "dra_gpupart_reorder", "dra_gpupart"),
        )
        if a in rates and b in rates
    }
    return {
        "throughput_pods_s": {k: round(v, 1) for k, v in rates.items()},
        "throughput_ratios": ratios,
        **out,
        "nodes": node_count,
        "pods": bench.pods,
    }


def reordered(
    bench: Bench,
    pools: Mapping[str, LivePool],
    config: Mapping[str, Any],
    manifest: Callable[[str, str], dict[str, Any]],
) -> tuple[float, dict[str, Any]]:
    """The batch with every node's pool re-ordered after each of its allocation changes; the
    rate and the slice writes (those while the batch is allocated, and while it is released)."""
    table = placements(next(iter(pools.values())).wanted({}, Mix()))
    before = sum(p.writes for p in pools.values())
    republisher = Republisher(bench.api, pools, table)
    republisher.start()
    try:
        with bench.scheduler(config):
            step("throughput: DRA, our slices, re-ordered after each allocation change")
            t = time.monotonic()
            rate = bench.batch("reorder", DRA_SCHEDULER, manifest)
            republisher.settle()
            wall, cpu = time.monotonic() - t, republisher.cpu_s
            allocated = len(republisher.allocated)
            written = sum(p.writes for p in pools.values()) - before
            bench.clear("reorder")
            republisher.settle()
    finally:
        republisher.stop()
    released = sum(p.writes for p in pools.values()) - before - written
    return rate, {
        "slice_writes_while_allocating": written,
        "claims_allocated": allocated,
        "slice_writes_per_allocation": round(written / max(1, allocated), 3),
        "slice_writes_while_releasing": released,
        "agents_cpu_s_while_allocating": round(cpu, 1),
        "batch_s": round(wall, 1),
    }


# ---------------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace-dir", default="../shared/traces/alibaba-gpu-v2023")
    parser.add_argument("--seeds", type=int, default=SEEDS, help="simulated seeds")
    parser.add_argument("--live-seeds", type=int, default=LIVE_SEEDS, help="live W4 seeds")
    parser.add_argument(
        "--live-arrivals", type=int, default=W4_ARRIVALS, help="live: W4 arrivals a seed"
    )
    parser.add_argument("--nodes", type=int, default=100, help="throughput: kwok nodes")
    parser.add_argument("--pods", type=int, default=2000, help="throughput: pods per config")
    parser.add_argument(
        "--configs", default=",".join(CONFIGS), help="throughput: the configurations to run"
    )
    parser.add_argument("--skip-sim", action="store_true")
    parser.add_argument("--skip-live-order", action="store_true")
    parser.add_argument("--skip-throughput", action="store_true")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, _terminate)
    out: dict[str, Any] = {}
    if not args.skip_sim:
        out["order_simulated"] = simulated(Path(args.trace_dir), args.seeds)
    if not (args.skip_live_order and args.skip_throughput):
        bin_dir = bin_dir_from_env()
        missing = missing_binaries(bin_dir)
        if missing:
            step(
                f"missing {', '.join(missing)} in {bin_dir}; build them with scripts/build-k8s-bins.sh"
            )
            return 2
        workdir = Path(tempfile.mkdtemp(prefix="gpupart-bench-dra-"))
        cp = ControlPlane(bin_dir=bin_dir, workdir=workdir, controller_manager=True)
        try:
            step("starting the control plane")
            cp.start(scheduler=False)
            rendered = cp.helm(
                "template",
                "gp",
                str(CHART),
                *IMAGE_FLAGS,
                "--set-json",
                "dra.enabled=true",
                "--show-only",
                "templates/dra-deviceclasses.yaml",
            ).stdout
            cp.kubectl("apply", "-f", "-", input=rendered)
            api = cp.api_client()
            # one kube-scheduler at a time, each started for its part
            if not args.skip_live_order:
                with scheduler(bin_dir, cp.kubeconfig, workdir, dra_config(), cp.token):
                    out["order"] = live_order(cp, api, args.live_seeds, args.live_arrivals)
            if not args.skip_throughput:
                bench = Bench(cp, api, bin_dir, workdir, args.pods)
                configs = [c for c in args.configs.split(",") if c]
                unknown = sorted(set(configs) - set(CONFIGS))
                if unknown:
                    step(f"unknown --configs {unknown}; known: {','.join(CONFIGS)}")
                    return 2
                out.update(live_throughput(bench, args.nodes, configs))
        except BaseException:
            print(cp.log_tails(), file=sys.stderr)
            raise
        finally:
            cp.stop()
    print(json.dumps(out, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
