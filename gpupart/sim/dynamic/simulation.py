"""Discrete-event simulator of dynamic MIG: pods arrive and leave, instance operations take time.

The engine owns the GPUs and the clock; a policy (ours or a baseline, `gpupart.sim.dynamic.policies`)
looks at the cluster after every batch of events and answers with changes: per GPU, NVML steps
to execute and the pods the new (or reused) instances are reserved for. Steps on one GPU run one
after the other (create and destroy latencies), new instances are usable after the advertise
latency (plus any device-plugin restart the policy adds), and a pod binds once every instance
reserved for it is usable. Pure: the caller passes a timer for the planner's CPU time.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Protocol

from gpupart.core.dynamic.model import Mix
from gpupart.core.mig.catalogue import GpuModel
from gpupart.core.mig.layout import Layout, MigInstance
from gpupart.core.mig.planning import (
    CreateComputeInstance,
    CreateGpuInstance,
    DestroyComputeInstance,
    DestroyGpuInstance,
    Step,
)

MIX_WINDOW_S = 3600.0
"""The observed mix is the profiles of the pods that arrived in the last hour."""
TAIL_S = 7200.0
"""The simulation goes on this long after the last arrival; pods still pending then are unserved."""


@dataclass(frozen=True, slots=True)
class Latencies:
    """Seconds per operation (defaults: docs/simulator.md, from the reference on partitioning)."""

    create: float = 1.0
    """Create a GPU instance and its compute instance at a placement."""
    destroy: float = 0.5
    """Destroy a compute instance and its GPU instance."""
    advertise: float = 0.2
    """Our device plugin advertising a new instance to the kubelet (ListAndWatch)."""
    plugin_restart: float = 60.0
    """NVIDIA's device plugin restarted after a change (the nos baseline only)."""


DEFAULT_LATENCIES = Latencies()


@dataclass(frozen=True, slots=True)
class SimNode:
    name: str
    model: GpuModel
    gpus: int


@dataclass(frozen=True, slots=True)
class SimPod:
    """A pod of the workload: its MIG instances (all on one node), arrival, run time, priority."""

    name: str
    profiles: tuple[str, ...]
    arrival: float
    duration: float
    priority: int = 0


GpuKey = tuple[int, int]
"""(node position in name order, GPU index)."""


@dataclass(slots=True)
class SimInstance:
    """An instance on a simulated GPU: who holds it (reserved or bound), when it is usable."""

    instance: MigInstance
    pod: str = ""
    bound: bool = False
    ready_at: float = 0.0
    idle_since: float = 0.0


@dataclass(frozen=True, slots=True)
class Change:
    """What a policy asks of one GPU: steps in order, then reservations of instances for pods."""

    gpu: GpuKey
    steps: tuple[Step, ...] = ()
    reservations: tuple[tuple[str, MigInstance], ...] = ()
    delay: float = 0.0
    """Extra seconds before new instances are usable (a device-plugin restart)."""


@dataclass(frozen=True, slots=True)
class Decision:
    changes: tuple[Change, ...] = ()
    wake: float | None = None
    """When the policy wants to be asked again even if nothing happens (batch windows, hysteresis)."""


@dataclass(slots=True)
class PendingSimPod:
    pod: SimPod
    reserved: list[tuple[GpuKey, MigInstance]] = field(default_factory=list)


class Cluster(Protocol):
    """What a policy sees of the simulated cluster (the engine implements it)."""

    @property
    def nodes(self) -> Sequence[SimNode]: ...
    @property
    def gpus(self) -> dict[GpuKey, dict[MigInstance, SimInstance]]: ...
    @property
    def pending(self) -> dict[str, PendingSimPod]: ...
    @property
    def busy_until(self) -> dict[GpuKey, float]: ...

    def mix(self, now: float) -> Mix: ...


class SimPolicy(Protocol):
    name: str
    binds_free: bool
    """Whether pending pods bind to any free usable instance of their profile (kube-scheduler
    on static devices); otherwise only to the instances the policy reserves."""

    def initial(self, node: SimNode) -> Layout: ...
    def decide(self, cluster: Cluster, now: float) -> Decision: ...
    def departed(
        self, cluster: Cluster, now: float, freed: Sequence[tuple[GpuKey, MigInstance]]
    ) -> Decision: ...


@dataclass(frozen=True, slots=True)
class SimResult:
    policy: str
    pods: int
    served: int
    allocation: float
    """Time-averaged share of memory slices held by bound pods, first to last arrival, in %."""
    bind_s: tuple[float, ...]
    """Time-to-bind of every served pod, sorted."""
    operations: int
    """GPU instances created plus destroyed."""
    hours: float
    disruptions: int
    decisions: int
    decide_s: float
    """CPU seconds spent in the policy's decide calls (by the caller's timer)."""
    waits: tuple[tuple[str, float], ...] = ()
    """(pod, time-to-bind) of every served pod, by name (per-profile figures)."""

    def percentile(self, q: float) -> float:
        if not self.bind_s:
            return 0.0
        rank = min(len(self.bind_s) - 1, max(0, round(q / 100 * len(self.bind_s) + 0.5) - 1))
        return self.bind_s[rank]

    @property
    def ops_per_hour(self) -> float:
        return self.operations / self.hours if self.hours else 0.0

    @property
    def ms_per_decision(self) -> float:
        return 1000 * self.decide_s / self.decisions if self.decisions else 0.0

    def figures(self) -> dict[str, float | int]:
        """The benchmark's figures for this run (JSON-ready)."""
        return {
            "allocation": round(self.allocation, 2),
            "served": self.served,
            "pods": self.pods,
            "bind_p50_s": round(self.percentile(50), 2),
            "bind_p95_s": round(self.percentile(95), 2),
            "bind_p99_s": round(self.percentile(99), 2),
            "ops_per_hour": round(self.ops_per_hour, 1),
            "disruptions": self.disruptions,
            "ms_per_decision": round(self.ms_per_decision, 3),
        }


def create_steps(gpu: int, instance: MigInstance) -> tuple[Step, Step]:
    """The NVML steps that make `instance` on GPU `gpu`: its GPU instance, then its compute instance."""
    return CreateGpuInstance(gpu, instance), CreateComputeInstance(gpu, instance)


def destroy_steps(gpu: int, instance: MigInstance) -> tuple[Step, Step]:
    """The NVML steps that remove `instance`: its compute instance, then its GPU instance."""
    return DestroyComputeInstance(gpu, instance), DestroyGpuInstance(gpu, instance)


Placer = Callable[
    [SimNode, int, dict[GpuKey, list[MigInstance]], SimPod],
    list[tuple[GpuKey, MigInstance]] | None,
]
"""A per-pod policy's choice on one node (its index in the cluster): the instances to create
for the pod, given what each GPU holds, or None when the node cannot take it."""


def place_each(
    nodes: Sequence[SimNode],
    taken: dict[GpuKey, list[MigInstance]],
    waiting: Iterable[SimPod],
    place: Placer,
) -> Decision:
    """Per-pod policies: each waiting pod, in order, on the first node `place` fits it on (what it
    picks counts as taken for the pods after it), its instances created at once."""
    changes: list[Change] = []
    for pod in waiting:
        for n, node in enumerate(nodes):
            picks = place(node, n, taken, pod)
            if picks is None:
                continue
            for key, instance in picks:
                taken[key].append(instance)
                changes.append(Change(key, create_steps(key[1], instance), ((pod.name, instance),)))
            break
    return Decision(tuple(changes))


def destroy_each(freed: Sequence[tuple[GpuKey, MigInstance]]) -> Decision:
    """Per-pod policies: every instance a departed pod held destroyed, per GPU."""
    by_gpu: dict[GpuKey, list[Step]] = {}
    for key, instance in freed:
        by_gpu.setdefault(key, []).extend(destroy_steps(key[1], instance))
    return Decision(tuple(Change(key, tuple(steps)) for key, steps in sorted(by_gpu.items())))


_ARRIVE, _READY, _DEPART, _WAKE = 0, 1, 2, 3


PROGRESS_EVERY = 64
"""Arrivals between two calls of a run's progress callback."""


class Engine:
    """One run of one policy over one workload."""

    def __init__(
        self,
        nodes: Sequence[SimNode],
        policy: SimPolicy,
        latencies: Latencies,
        timer: Callable[[], float] | None = None,
    ) -> None:
        self.nodes = sorted(nodes, key=lambda n: n.name)
        self.policy = policy
        self.latencies = latencies
        self.timer = timer
        self.gpus: dict[GpuKey, dict[MigInstance, SimInstance]] = {}
        self.busy_until: dict[GpuKey, float] = {}
        for n, node in enumerate(self.nodes):
            layout = policy.initial(node)
            for index in range(node.gpus):
                self.gpus[(n, index)] = {i: SimInstance(i) for i in layout}
                self.busy_until[(n, index)] = 0.0
        self.pending: dict[str, PendingSimPod] = {}
        self.running: dict[str, list[tuple[GpuKey, MigInstance]]] = {}
        self.recent: deque[tuple[float, SimPod]] = deque()
        self.events: list[tuple[float, int, int, str]] = []
        self.sequence = 0
        self.pods: dict[str, SimPod] = {}
        self.bind_s: list[float] = []
        self.waits: dict[str, float] = {}
        self.operations = 0
        self.disruptions = 0
        self.decisions = 0
        self.decide_s = 0.0
        self.allocated = 0
        self.total_slices = sum(node.model.memory_slices * node.gpus for node in self.nodes)
        self.area = 0.0
        self.clock = 0.0
        self.window = (0.0, 0.0)

    def mix(self, now: float) -> Mix:
        while self.recent and self.recent[0][0] < now - MIX_WINDOW_S:
            self.recent.popleft()
        counts: dict[str, float] = {}
        for _, pod in self.recent:
            for profile in pod.profiles:
                counts[profile] = counts.get(profile, 0) + 1
        return Mix.of(counts)

    def _push(self, when: float, kind: int, name: str) -> None:
        self.sequence += 1
        heapq.heappush(self.events, (when, kind, self.sequence, name))

    def run(
        self, pods: Sequence[SimPod], progress: Callable[[int, int], None] | None = None
    ) -> SimResult:
        arrived = 0
        for pod in pods:
            self.pods[pod.name] = pod
            self._push(pod.arrival, _ARRIVE, pod.name)
        first = min((p.arrival for p in pods), default=0.0)
        last = max((p.arrival for p in pods), default=0.0)
        self.window = (first, last)
        end = last + TAIL_S
        woken: set[float] = set()
        while self.events and self.events[0][0] <= end:
            now = self.events[0][0]
            self._advance(now)
            freed: list[tuple[GpuKey, MigInstance]] = []
            while self.events and self.events[0][0] == now:
                _, kind, _, name = heapq.heappop(self.events)
                if kind == _ARRIVE:
                    pod = self.pods[name]
                    self.pending[name] = PendingSimPod(pod)
                    self.recent.append((now, pod))
                    arrived += 1
                    if progress is not None and arrived % PROGRESS_EVERY == 0:
                        progress(arrived, len(pods))
                elif kind == _DEPART:
                    freed.extend(self._depart(name, now))
                elif kind == _WAKE:
                    woken.discard(now)
            if freed:
                self._apply(self._timed(partial(self.policy.departed, self, now, freed)), now)
            self._bind_ready(now)
            if self.pending or freed:
                decision = self._timed(partial(self.policy.decide, self, now))
                self._apply(decision, now)
                if decision.wake is not None and decision.wake > now and decision.wake not in woken:
                    woken.add(decision.wake)
                    self._push(decision.wake, _WAKE, "")
            self._bind_ready(now)
        self._advance(max(self.clock, last))
        if progress is not None:
            progress(len(pods), len(pods))
        served = len(self.bind_s)
        return SimResult(
            policy=self.policy.name,
            pods=len(pods),
            served=served,
            allocation=100.0 * self.area / (self.total_slices * (last - first))
            if last > first and self.total_slices
            else 0.0,
            bind_s=tuple(sorted(self.bind_s)),
            operations=self.operations,
            hours=max(end - first, 1.0) / 3600,
            disruptions=self.disruptions,
            decisions=self.decisions,
            decide_s=self.decide_s,
            waits=tuple(sorted(self.waits.items())),
        )

    def _timed(self, call: Callable[[], Decision]) -> Decision:
        if self.timer is None:
            return call()
        started = self.timer()
        decision = call()
        self.decide_s += self.timer() - started
        self.decisions += 1
        return decision

    def _advance(self, now: float) -> None:
        """Integrate allocated memory slices over the arrival window up to `now`."""
        first, last = self.window
        start, stop = max(self.clock, first), min(now, last)
        if stop > start:
            self.area += self.allocated * (stop - start)
        self.clock = max(self.clock, now)

    def _slices(self, key: GpuKey, instance: MigInstance) -> int:
        return self.nodes[key[0]].model.require_profile(instance.profile).memory_slices

    def _depart(self, name: str, now: float) -> list[tuple[GpuKey, MigInstance]]:
        held = self.running.pop(name, [])
        for key, instance in held:
            state = self.gpus[key][instance]
            state.pod, state.bound, state.idle_since = "", False, now
            self.allocated -= self._slices(key, instance)
        return held

    def _apply(self, decision: Decision, now: float) -> None:
        for change in decision.changes:
            self._change(change, now)

    def _change(self, change: Change, now: float) -> None:
        key = change.gpu
        gpu = self.gpus[key]
        t = max(now, self.busy_until[key])
        created: list[MigInstance] = []
        for step in change.steps:
            if isinstance(step, DestroyGpuInstance):
                state = gpu.pop(step.instance)
                self.operations += 1
                t += self.latencies.destroy
                if state.bound:  # a pod whose instance is destroyed under it
                    self.disruptions += 1
                    self._evict(state.pod, key, step.instance)
                elif state.pod and state.pod in self.pending:
                    self.pending[state.pod].reserved.remove((key, step.instance))
            elif isinstance(step, CreateGpuInstance):
                self.operations += 1
                t += self.latencies.create
                created.append(step.instance)
        self.busy_until[key] = t
        usable = t + (self.latencies.advertise + change.delay if created else 0.0)
        for instance in created:
            gpu[instance] = SimInstance(instance, ready_at=usable, idle_since=usable)
        if created:
            self._push(usable, _READY, "")
        for pod, instance in change.reservations:
            gpu[instance].pod = pod
            self.pending[pod].reserved.append((key, instance))

    def _evict(self, pod: str, key: GpuKey, instance: MigInstance) -> None:
        held = self.running.pop(pod, [])
        for other_key, other in held:
            self.allocated -= self._slices(other_key, other)
            if (other_key, other) != (key, instance):
                state = self.gpus[other_key][other]
                state.pod, state.bound, state.idle_since = "", False, self.clock

    def _bind_ready(self, now: float) -> None:
        free: dict[tuple[int, str], list[tuple[GpuKey, MigInstance]]] | None = None
        for name in sorted(self.pending, key=self._order):
            waiting = self.pending[name]
            if waiting.reserved:
                if len(waiting.reserved) == len(waiting.pod.profiles) and all(
                    self.gpus[k][i].ready_at <= now for k, i in waiting.reserved
                ):
                    self._bind(waiting, waiting.reserved, now)
            elif self.policy.binds_free:
                if free is None:
                    free = self._free(now)
                if not free:
                    break  # nothing free: no other pending pod can bind either
                found = self._free_for(waiting.pod, free)
                if found is not None:
                    self._bind(waiting, found, now)

    def _order(self, name: str) -> tuple[int, float, str]:
        pod = self.pods[name]
        return (-pod.priority, pod.arrival, name)

    def _free(self, now: float) -> dict[tuple[int, str], list[tuple[GpuKey, MigInstance]]]:
        """Free usable instances per (node, profile), last first so that pop() takes the lowest."""
        free: dict[tuple[int, str], list[tuple[GpuKey, MigInstance]]] = {}
        for key in sorted(self.gpus, reverse=True):
            for instance, state in sorted(self.gpus[key].items(), reverse=True):
                if not state.pod and state.ready_at <= now:
                    free.setdefault((key[0], instance.profile), []).append((key, instance))
        return free

    def _free_for(
        self, pod: SimPod, free: dict[tuple[int, str], list[tuple[GpuKey, MigInstance]]]
    ) -> list[tuple[GpuKey, MigInstance]] | None:
        """Free usable instances of the pod's profiles on one node, first node by name (taken)."""
        nodes = {n for n, p in free if p in pod.profiles and free[(n, p)]}
        for n in sorted(nodes):
            if all(len(free.get((n, p), ())) >= pod.profiles.count(p) for p in set(pod.profiles)):
                return [free[(n, p)].pop() for p in pod.profiles]
        return None

    def _bind(
        self, waiting: PendingSimPod, instances: list[tuple[GpuKey, MigInstance]], now: float
    ) -> None:
        pod = waiting.pod
        del self.pending[pod.name]
        for key, instance in instances:
            state = self.gpus[key][instance]
            state.pod, state.bound = pod.name, True
            self.allocated += self._slices(key, instance)
        self.running[pod.name] = list(instances)
        self.bind_s.append(now - pod.arrival)
        self.waits[pod.name] = now - pod.arrival
        self._push(now + pod.duration, _DEPART, pod.name)


def simulate(
    nodes: Sequence[SimNode],
    pods: Sequence[SimPod],
    policy: SimPolicy,
    *,
    latencies: Latencies = DEFAULT_LATENCIES,
    timer: Callable[[], float] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> SimResult:
    """One run; `progress(arrived, total)` every `PROGRESS_EVERY` arrivals and at the end."""
    return Engine(nodes, policy, latencies, timer).run(pods, progress)
