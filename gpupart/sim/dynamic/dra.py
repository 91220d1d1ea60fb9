"""The DRA policies: kube-scheduler's first fit over the devices `gpupart.core.dra` publishes, NVIDIA's order or ours.

Per pod (by priority, then arrival), nodes are tried in name order and the pod goes to the
first node on which the allocator model (`gpupart.core.dra.allocator.first_fit`) finds devices
for all its MIG requests (one claim, one request per instance). Name order because
kube-scheduler's DRA plugin filters nodes but scores no device, and its default scores see
CPU and memory, not the GPUs: for GPU pods the node choice is a tie it breaks arbitrarily.
The simulator's node order is the deterministic stand-in, the same the per-pod baselines use, so
the two DRA policies differ only in the device order, which is what they measure.

On a node, each GPU publishes every placement of every profile with its counters, as a
dynamic-MIG agent would (`gpu_devices` with `in_use` the instances that exist, then
`pool_slices`, `keep_choices` and `read_slice`: one slice per profile across the GPUs):
NVIDIA's order sorts the devices by name, ours ranks them across the GPUs against the observed
mix (`placement_ranks`). The devices are rebuilt after every allocation change and published
as the agent publishes them (`slice_writes` counts the slices it rewrote). The chosen instance
is created for the pod (create latency) and destroyed when the pod leaves: no warm pool.

Each pod the policy cannot place when it first tries is recorded with the cause
(`refusal_cause`): whether a device order could have helped at that moment, and which part of
the order (within a GPU, or across GPUs).
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum

from gpupart.core.api.spec import Mode
from gpupart.core.dra import names
from gpupart.core.dra.allocator import DeviceRequest, first_fit
from gpupart.core.dra.claims import holding_claim
from gpupart.core.dra.devices import DraGpu, GpuDevices, Order, gpu_devices
from gpupart.core.dra.pool import keep_choices, pool_slices
from gpupart.core.dra.read import ClaimView, SliceView, read_slice
from gpupart.core.dynamic.model import Mix
from gpupart.core.errors import InvalidInput
from gpupart.core.mig.catalogue import GpuModel
from gpupart.core.mig.layout import Layout, MigInstance, Placement
from gpupart.core.node.devices import OfferedGpu
from gpupart.sim.dynamic.simulation import (
    Cluster,
    Decision,
    GpuKey,
    SimNode,
    SimPod,
    destroy_each,
    place_each,
)

DRA_POLICIES = {"dra_nvidia_order": Order.NVIDIA, "dra_gpupart_order": Order.GPUPART}
"""The DRA policy names and the device order each publishes."""

_CLAIMS_NAMESPACE = "sim"
CACHE_LIMIT = 4096
"""GPU device lists kept between decisions (a GPU's list depends only on its instances and the mix)."""


class Refusal(StrEnum):
    """Why no device of a node fits one more instance of a profile, from the GPUs' contents."""

    PLACEMENT = "placement"
    """A GPU has the compute slices, memory slices and instance room free, but no legal
    placement of the profile among them: the order within that GPU put the others there (or
    a limit of the profile's own, such as its media engines, is used up)."""
    SPREAD = "spread"
    """The node has that much free in total, but no one GPU has it: the order across GPUs."""
    FULL = "full"
    """The node has not that much free: no order could have placed it."""


def refusal_cause(model: GpuModel, gpus: Sequence[Sequence[MigInstance]], profile: str) -> Refusal:
    """Why one more `profile` fits on none of these GPUs (each GPU's instances; the caller
    knows that none fits)."""
    wanted = model.require_profile(profile)
    free_compute = free_memory = 0
    for gpu in gpus:
        compute = model.compute_slices - sum(
            model.require_profile(i.profile).compute_slices for i in gpu
        )
        memory = model.memory_slices - sum(i.placement.size for i in gpu)
        if (
            compute >= wanted.compute_slices
            and memory >= wanted.memory_slices
            and len(gpu) < model.max_instances
        ):
            return Refusal.PLACEMENT
        free_compute += compute
        free_memory += memory
    if free_compute >= wanted.compute_slices and free_memory >= wanted.memory_slices:
        return Refusal.SPREAD
    return Refusal.FULL


def instance_of_device(device_name: str, devices: Sequence[GpuDevices]) -> tuple[int, MigInstance]:
    """The GPU index and MIG placement of a published device, from its attributes."""
    for gpu in devices:
        for device in gpu.devices:
            if device["name"] != device_name:
                continue
            attributes = device["attributes"]
            start = attributes[names.PLACEMENT_START]["int"]
            size = attributes[names.PLACEMENT_SIZE]["int"]
            profile = attributes[names.PROFILE]["string"]
            return gpu.index, MigInstance(Placement(start, size), profile)
    raise KeyError(device_name)


class DraOrder:
    """kube-scheduler with DRA over one device order (see the module docstring)."""

    binds_free = False

    def __init__(self, order: Order, *, patience_s: float | None = None) -> None:
        self.order = order
        self.patience_s = patience_s
        """None: a pod waits until it fits (kube-scheduler retries); else it is given up when
        it does not fit within this long of arrival (0: a loss system, as benchmarks count)."""
        self.name = f"dra_{order.value}_order"
        self._cache: dict[tuple[int, int, tuple[MigInstance, ...]], GpuDevices] = {}
        self._cache_mix: Mix | None = None
        self.refused: dict[str, tuple[str, Refusal]] = {}
        self.slice_writes = 0
        """Slices whose content changed between two states a node's pool was read in: the
        writes an agent re-publishing after each change would make."""
        self._published: dict[int, tuple[object, tuple[SliceView, ...]]] = {}
        """Node position -> the state its pool was last published for, and the pool."""
        """Pod -> its largest profile and why it did not fit, at its first refusal."""

    def initial(self, node: SimNode) -> Layout:
        del node  # MIG on, no instance: each claim's instance is made when it is prepared
        return ()

    def departed(
        self, cluster: Cluster, now: float, freed: Sequence[tuple[GpuKey, MigInstance]]
    ) -> Decision:
        del cluster, now  # the claim is deallocated and its instance destroyed
        return destroy_each(freed)

    def decide(self, cluster: Cluster, now: float) -> Decision:
        # NVIDIA's order ignores the mix; a constant one keeps its devices cached across calls
        mix = cluster.mix(now) if self.order is Order.GPUPART else Mix()
        if mix != self._cache_mix:
            self._cache.clear()
            self._cache_mix = mix
        taken: dict[GpuKey, list[MigInstance]] = {k: list(g) for k, g in cluster.gpus.items()}
        waiting = sorted(
            (
                p.pod
                for p in cluster.pending.values()
                if not p.reserved
                and (self.patience_s is None or now - p.pod.arrival <= self.patience_s)
            ),
            key=lambda p: (-p.priority, p.arrival, p.name),
        )
        decision = place_each(
            cluster.nodes,
            taken,
            waiting,
            lambda node, n, held, pod: self.allocate(node, n, held, pod, mix),
        )
        placed = {pod for change in decision.changes for pod, _ in change.reservations}
        for pod in waiting:
            if pod.name not in placed and pod.name not in self.refused:
                self.refused[pod.name] = self.refusal(cluster.nodes, taken, pod)
        return decision

    def refusal(
        self, nodes: Sequence[SimNode], taken: dict[GpuKey, list[MigInstance]], pod: SimPod
    ) -> tuple[str, Refusal]:
        """The pod's largest profile and the nearest miss over the nodes (PLACEMENT first)."""
        causes = []
        largest = pod.profiles[0]
        for n, node in enumerate(nodes):
            model = node.model
            largest = max(pod.profiles, key=lambda p: model.require_profile(p).memory_slices)
            gpus = [taken[(n, index)] for index in range(node.gpus)]
            causes.append(refusal_cause(model, gpus, largest))
        rank = list(Refusal)
        return largest, min(causes, key=rank.index, default=Refusal.FULL)

    def devices(
        self, node: SimNode, n: int, taken: dict[GpuKey, list[MigInstance]], mix: Mix
    ) -> list[GpuDevices]:
        """The node's GPUs as the agent publishes them now, in this policy's order."""
        found = []
        for index in range(node.gpus):
            in_use = tuple(sorted(taken[(n, index)]))
            key = (n, index, in_use)
            cached = self._cache.get(key)
            if cached is None:
                if len(self._cache) >= CACHE_LIMIT:
                    self._cache.clear()
                gpu = OfferedGpu(
                    index,
                    f"GPU-{node.name}-{index}",
                    node.model.product,
                    node.model.memory_mib,
                    index,
                    None,
                    Mode.MIG,
                )
                cached = gpu_devices(
                    DraGpu(gpu, node.model, dynamic=True, in_use=in_use),
                    mix=mix,
                    order=self.order,
                )
                self._cache[key] = cached
            found.append(cached)
        return found

    def publish(
        self,
        node: SimNode,
        n: int,
        taken: dict[GpuKey, list[MigInstance]],
        devices: Sequence[GpuDevices],
        claims: Sequence[ClaimView],
        mix: Mix,
    ) -> tuple[SliceView, ...]:
        """The node's pool as the agent leaves it after this state's publish: the wanted
        slices, each kept in its published order where that changes no next pick
        (`keep_choices`); the slices it rewrote are counted in `slice_writes`."""
        state = (tuple(tuple(sorted(taken[(n, i)])) for i in range(node.gpus)), mix)
        last = self._published.get(n)
        if last is not None and last[0] == state:
            return last[1]
        wanted = pool_slices(node.name, node.name, devices)
        if last is not None:
            wanted = keep_choices(last[1], wanted, claims, mix=mix)
        views = []
        for doc in wanted:
            view = read_slice(doc)
            if view is None:
                raise InvalidInput(
                    doc["metadata"]["name"], "a slice of ours is not read back as ours"
                )
            views.append(view)
        if last is not None:
            before = {v.name: v.content for v in last[1]}
            self.slice_writes += sum(
                1 for v in views if v.name in before and before[v.name] != v.content
            )
        self._published[n] = (state, tuple(views))
        return tuple(views)

    def allocate(
        self,
        node: SimNode,
        n: int,
        taken: dict[GpuKey, list[MigInstance]],
        pod: SimPod,
        mix: Mix,
    ) -> list[tuple[GpuKey, MigInstance]] | None:
        """The instances the scheduler's first fit gives `pod` on this node, or None."""
        devices = self.devices(node, n, taken, mix)
        held = {index: taken[(n, index)] for index in range(node.gpus)}
        claims = [holding_claim(node.name, held, _CLAIMS_NAMESPACE)]
        views = self.publish(node, n, taken, devices, claims, mix)
        requests = [
            DeviceRequest(
                f"mig-{k}", match=((names.TYPE, names.TYPE_MIG), (names.PROFILE, profile))
            )
            for k, profile in enumerate(pod.profiles)
        ]
        results = first_fit(views, claims, requests)
        if results is None:
            return None
        picks = []
        for result in results:
            index, instance = instance_of_device(result.device, devices)
            picks.append(((n, index), instance))
        return picks
