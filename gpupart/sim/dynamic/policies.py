"""The simulator's policies: ours (the planner) and the baselines, each from the reference's description.

- ``gpupart``: `gpupart.core.dynamic.planner.plan` after every batch of events.
- ``static_best``: one layout on every GPU from the start, never changed; the caller picks the
  best of `geometries` with hindsight.
- ``nos``: count-only geometries (every maximal profile-count vector of the model, no
  placements), a 60 s / 10 s batch window, one plan in flight cluster-wide, nodes by name, pods
  by priority then smallest profile first, the geometry giving the most lacking profiles per
  GPU, free devices destroyed and recreated on a GPU that gets a create, creation without a
  placement (NVML's lowest free start) over at most 20 orders with partial application, and a
  device-plugin restart after every change before new devices can be used.
- ``hami``: HAMi 2.10: per pod, the smallest profile (by memory, then memory slices) whose memory and
  compute cover the request, at a fixed placement order (1g and 3g from the highest start,
  the rest from the lowest), nodes in name order (its node score is 0), created for the pod,
  destroyed when it exits; idle instances are never re-carved because there are none.
- ``first_fit``: DRA DynamicMIG: the requested profile at the first free (node, GPU, start) in
  device order, created for the pod, destroyed when it exits.
- ``dra_nvidia_order`` and ``dra_gpupart_order``: kube-scheduler's DRA first fit over the devices
  `gpupart.core.dra` publishes, sorted by name (NVIDIA's order) or by `placement_ranks` (ours),
  re-ordered after each change (`gpupart.sim.dynamic.dra`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cache
from itertools import permutations

from gpupart.core.api.spec import DEFAULT_DYNAMIC, DynamicMig
from gpupart.core.dynamic.model import (
    Gpu,
    Instance,
    MigDemand,
    Use,
)
from gpupart.core.dynamic.planner import plan
from gpupart.core.errors import InfeasibleLayout, InvalidInput
from gpupart.core.mig.catalogue import GpuModel, MigProfile
from gpupart.core.mig.layout import Layout, MigInstance, Placement, check_layout, fit_layout
from gpupart.core.mig.planning import Step
from gpupart.sim.dynamic.dra import DRA_POLICIES, DraOrder
from gpupart.sim.dynamic.simulation import (
    DEFAULT_LATENCIES,
    Change,
    Cluster,
    Decision,
    GpuKey,
    Latencies,
    SimInstance,
    SimNode,
    SimPod,
    SimPolicy,
    SimResult,
    create_steps,
    destroy_each,
    destroy_steps,
    place_each,
    simulate,
)

NOS_BATCH_TIMEOUT_S = 60.0
NOS_BATCH_IDLE_S = 10.0
NOS_MAX_ATTEMPTS = 20


def plain_profiles(model: GpuModel) -> tuple[MigProfile, ...]:
    """Profiles without media-engine or graphics variants: what the workloads ask for."""
    return tuple(p for p in model.profiles if "+" not in p.name and "-" not in p.name)


def _fits(model: GpuModel, layout: Sequence[MigInstance], instance: MigInstance) -> bool:
    if any(instance.placement.overlaps(other.placement) for other in layout):
        return False
    try:
        check_layout(model, (*layout, instance))
    except InfeasibleLayout:
        return False
    return True


class Ours:
    """The planner, asked after every batch of events; instances stay idle when pods leave."""

    name = "gpupart"
    binds_free = False

    def __init__(self, policy: DynamicMig = DEFAULT_DYNAMIC) -> None:
        self.policy = policy

    def initial(self, node: SimNode) -> Layout:
        del node  # instances are created on demand
        return ()

    def departed(
        self, cluster: Cluster, now: float, freed: Sequence[tuple[GpuKey, MigInstance]]
    ) -> Decision:
        del cluster, now, freed  # instances stay idle for reuse
        return Decision()

    def decide(self, cluster: Cluster, now: float) -> Decision:
        gpus = []
        keys: dict[tuple[str, int], GpuKey] = {}
        for (n, index), instances in cluster.gpus.items():
            node = cluster.nodes[n]
            states = []
            for state in instances.values():
                if state.bound:
                    use = Use.IN_USE
                elif state.pod or state.ready_at > now:
                    use = Use.RESERVED
                else:
                    use = Use.IDLE
                states.append(Instance(state.instance, use, state.pod, state.idle_since))
            gpus.append(Gpu(node.name, index, node.model, tuple(states), self.policy))
            keys[(node.name, index)] = (n, index)
        demand = [
            MigDemand(p.pod.name, p.pod.profiles, p.pod.priority, p.pod.arrival)
            for p in cluster.pending.values()
            if not p.reserved
        ]
        result = plan(gpus, demand, now=now, mix=cluster.mix(now))
        reservations: dict[GpuKey, list[tuple[str, MigInstance]]] = {}
        for r in result.reservations:
            reservations.setdefault(keys[(r.node, r.gpu)], []).append((r.pod, r.instance))
        steps = {keys[(p.node, p.gpu)]: p.steps for p in result.gpus}
        changes = tuple(
            Change(key, steps.get(key, ()), tuple(reservations.get(key, ())))
            for key in sorted(set(steps) | set(reservations))
        )
        wake = None
        if (
            self.policy.warm_counts
        ):  # an idle instance coming of age may be merged into the warm mix
            ages = [
                s.idle_since + self.policy.min_idle_s
                for gpu in cluster.gpus.values()
                for s in gpu.values()
                if not s.pod and s.idle_since + self.policy.min_idle_s > now
            ]
            wake = min(ages, default=None)
        return Decision(changes, wake)


class Static:
    """One layout on every GPU from the start; kube-scheduler binds pods to free instances."""

    binds_free = True

    def __init__(self, counts: tuple[tuple[str, int], ...]) -> None:
        self.counts = counts
        self.name = "static_best"

    def initial(self, node: SimNode) -> Layout:
        layout = fit_layout(node.model, dict(self.counts))
        return layout if layout is not None else ()

    def decide(self, cluster: Cluster, now: float) -> Decision:
        del cluster, now  # the layout never changes
        return Decision()

    def departed(
        self, cluster: Cluster, now: float, freed: Sequence[tuple[GpuKey, MigInstance]]
    ) -> Decision:
        del cluster, now, freed
        return Decision()


@cache
def geometries(model: GpuModel) -> tuple[tuple[tuple[str, int], ...], ...]:
    """Every maximal count vector of plain profiles that fits the GPU (nos' allowed geometries)."""
    names = [p.name for p in plain_profiles(model)]
    found: set[tuple[int, ...]] = set()

    def grow(vector: list[int], first: int) -> None:
        extended = False
        for k in range(len(names)):
            vector[k] += 1
            if fit_layout(model, dict(zip(names, vector, strict=True))) is not None:
                extended = True
                if k >= first:
                    grow(vector, k)
            vector[k] -= 1
        if not extended:
            found.add(tuple(vector))

    grow([0] * len(names), 0)
    return tuple(
        tuple((n, c) for n, c in zip(names, vector, strict=True) if c)
        for vector in sorted(found, reverse=True)
    )


class Nos:
    """nos' MIG partitioner and agent, as the reference describes them (see module docstring)."""

    name = "nos"
    binds_free = True

    def __init__(self, plugin_restart_s: float) -> None:
        self.plugin_restart_s = plugin_restart_s
        self.batch_start: float | None = None
        self.last_added = 0.0
        self.seen: set[str] = set()

    def initial(self, node: SimNode) -> Layout:
        # a MIG GPU with no device gets the geometry with the fewest memory slices (nos#25)
        fewest = min(geometries(node.model), key=lambda g: sum(c for _, c in g))
        layout = fit_layout(node.model, dict(fewest))
        return layout if layout is not None else ()

    def departed(
        self, cluster: Cluster, now: float, freed: Sequence[tuple[GpuKey, MigInstance]]
    ) -> Decision:
        del cluster, now, freed  # freed devices stay; the next batch may re-geometry them
        return Decision()

    def decide(self, cluster: Cluster, now: float) -> Decision:
        lacking_pods = [
            p.pod for p in cluster.pending.values() if not self._served_by_free(cluster, p.pod)
        ]
        if not lacking_pods:
            self.batch_start = None
            return Decision()
        in_flight = max(
            (s.ready_at for gpu in cluster.gpus.values() for s in gpu.values()), default=0.0
        )
        in_flight = max(in_flight, *cluster.busy_until.values())
        if now < in_flight:  # one plan in flight cluster-wide, until its devices are advertised
            self.batch_start = None
            return Decision(wake=in_flight)
        new = [p for p in lacking_pods if p.name not in self.seen]
        if self.batch_start is None:
            self.batch_start, self.last_added = now, now
        if new:
            self.seen.update(p.name for p in new)
            self.last_added = now
        ready = (
            now - self.batch_start >= NOS_BATCH_TIMEOUT_S
            or now - self.last_added >= NOS_BATCH_IDLE_S
        )
        if not ready:
            wake = min(self.batch_start + NOS_BATCH_TIMEOUT_S, self.last_added + NOS_BATCH_IDLE_S)
            return Decision(wake=wake)
        self.batch_start = None
        changes = self._plan(cluster, lacking_pods)
        return Decision(changes, wake=None if changes else now + NOS_BATCH_TIMEOUT_S)

    def _served_by_free(self, cluster: Cluster, pod: SimPod) -> bool:
        free: dict[str, int] = {}
        for gpu in cluster.gpus.values():
            for state in gpu.values():
                if not state.pod:
                    free[state.instance.profile] = free.get(state.instance.profile, 0) + 1
        return all(free.get(p, 0) >= pod.profiles.count(p) for p in set(pod.profiles))

    def _plan(self, cluster: Cluster, pods: list[SimPod]) -> tuple[Change, ...]:
        pods = sorted(pods, key=lambda p: (-p.priority, min(_slices_of(p.profiles)), p.name))
        lacking: dict[str, int] = {}
        for pod in pods:
            for profile in pod.profiles:
                lacking[profile] = lacking.get(profile, 0) + 1
        for gpu in cluster.gpus.values():
            for state in gpu.values():
                if not state.pod and lacking.get(state.instance.profile, 0) > 0:
                    lacking[state.instance.profile] -= 1
        changes = []
        for (n, index), gpu in sorted(cluster.gpus.items()):
            if not any(v > 0 for v in lacking.values()):
                break
            model = cluster.nodes[n].model
            used: dict[str, int] = {}
            for state in gpu.values():
                if state.pod:
                    used[state.instance.profile] = used.get(state.instance.profile, 0) + 1
            current: dict[str, int] = {}
            for state in gpu.values():
                current[state.instance.profile] = current.get(state.instance.profile, 0) + 1
            best, best_gain = None, 0
            for geometry in geometries(model):
                g = dict(geometry)
                if any(g.get(p, 0) < c for p, c in used.items()):
                    continue
                gain = sum(
                    min(max(0, g.get(p, 0) - current.get(p, 0)), need)
                    for p, need in lacking.items()
                    if need > 0
                )
                if gain > best_gain:
                    best, best_gain = g, gain
            if best is None:
                continue
            change, provided = self._apply_geometry(model, (n, index), gpu, best)
            if change is not None:
                changes.append(change)
                for profile, count in provided.items():
                    if lacking.get(profile, 0) > 0:
                        lacking[profile] = max(0, lacking[profile] - count)
        return tuple(changes)

    def _apply_geometry(
        self,
        model: GpuModel,
        key: GpuKey,
        gpu: dict[MigInstance, SimInstance],
        geometry: dict[str, int],
    ) -> tuple[Change | None, dict[str, int]]:
        """The agent: keep used devices, destroy and recreate free ones, create without placements."""
        used = sorted(i for i, s in gpu.items() if s.pod)
        free = sorted(i for i, s in gpu.items() if not s.pod)
        wanted: list[str] = []
        for profile, count in sorted(geometry.items()):
            wanted += [profile] * (count - sum(1 for i in used if i.profile == profile))
        best: list[MigInstance] = []
        for attempt, order in enumerate(permutations(wanted)):
            if attempt >= NOS_MAX_ATTEMPTS:
                break
            layout = list(used)
            made = []
            for profile in order:
                placed = _lowest_free(model, layout, profile)
                if placed is not None:
                    layout.append(placed)
                    made.append(placed)
            if len(made) > len(best):
                best = made
            if len(made) == len(wanted):
                break
        if sorted(best) == free:
            return None, {}
        steps: list[Step] = []
        for instance in free:
            steps += destroy_steps(key[1], instance)
        for instance in sorted(best):
            steps += create_steps(key[1], instance)
        provided: dict[str, int] = {}
        for instance in best:
            provided[instance.profile] = provided.get(instance.profile, 0) + 1
        for instance in free:
            provided[instance.profile] = provided.get(instance.profile, 0) - 1
        return Change(key, tuple(steps), delay=self.plugin_restart_s), provided


def _lowest_free(
    model: GpuModel, layout: Sequence[MigInstance], profile: str
) -> MigInstance | None:
    found = model.find_profile(profile)
    if found is None:
        return None
    for start in found.starts:
        candidate = MigInstance(Placement(start, found.memory_slices), profile)
        if _fits(model, layout, candidate):
            return candidate
    return None


def _slices_of(profiles: Sequence[str]) -> list[int]:
    return [int(p.split("g.")[0].split(".")[-1]) for p in profiles]


class PerPod:
    """HAMi 2.10 and DRA first-fit: an instance created per pod, destroyed when it exits."""

    binds_free = False

    def __init__(self, name: str) -> None:
        self.name = name

    def initial(self, node: SimNode) -> Layout:
        del node  # MIG on, no instance: each pod's instance is created for it
        return ()

    def departed(
        self, cluster: Cluster, now: float, freed: Sequence[tuple[GpuKey, MigInstance]]
    ) -> Decision:
        del cluster, now
        return destroy_each(freed)

    def decide(self, cluster: Cluster, now: float) -> Decision:
        del now  # per pod, at once: no batching
        taken: dict[GpuKey, list[MigInstance]] = {k: list(g) for k, g in cluster.gpus.items()}
        waiting = sorted(
            (p.pod for p in cluster.pending.values() if not p.reserved),
            key=lambda p: (-p.priority, p.arrival, p.name),
        )
        return place_each(cluster.nodes, taken, waiting, self._place)

    def _place(
        self, node: SimNode, n: int, taken: dict[GpuKey, list[MigInstance]], pod: SimPod
    ) -> list[tuple[GpuKey, MigInstance]] | None:
        picks: list[tuple[GpuKey, MigInstance]] = []
        for profile in sorted(pod.profiles, key=lambda p: -max(_slices_of([p]))):
            pick = None
            for index in range(node.gpus):
                layout = [*taken[(n, index)], *(i for k, i in picks if k == (n, index))]
                instance = self._choose(node.model, layout, profile)
                if instance is not None:
                    pick = ((n, index), instance)
                    break
            if pick is None:
                return None
            picks.append(pick)
        return picks

    def _choose(
        self, model: GpuModel, layout: list[MigInstance], wanted: str
    ) -> MigInstance | None:
        asked = model.find_profile(wanted)
        if asked is None:
            return None
        if self.name == "first_fit":
            return _lowest_free(model, layout, wanted)
        options = sorted(
            (
                p
                for p in plain_profiles(model)
                if p.memory_mib >= asked.memory_mib and p.compute_slices >= asked.compute_slices
            ),
            key=lambda p: (p.memory_mib, p.memory_slices, p.compute_slices),
        )
        for profile in options:
            high_first = profile.name.startswith(("1g.", "3g."))
            starts = sorted(profile.starts, reverse=high_first)
            for start in starts:
                candidate = MigInstance(Placement(start, profile.memory_slices), profile.name)
                if _fits(model, layout, candidate):
                    return candidate
        return None


POLICY_NAMES = ("gpupart", "static_best", "nos", "hami", "first_fit", *DRA_POLICIES)
"""The names `--policy` takes, in the order figures are shown."""


def run_policy(
    name: str,
    nodes: Sequence[SimNode],
    pods: Sequence[SimPod],
    *,
    latencies: Latencies = DEFAULT_LATENCIES,
    timer: Callable[[], float] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[SimResult, str]:
    """One policy over the workload, and a note (the layout static_best chose with hindsight:
    most pods served, then allocation, then the lowest p95 and total time-to-bind).

    `progress(done, total)` counts arrivals; static_best's runs (one per layout) add up."""
    one: SimPolicy | None = None
    if name == "gpupart":
        one = Ours()
    elif name == "nos":
        one = Nos(latencies.plugin_restart)
    elif name in ("hami", "first_fit"):
        one = PerPod(name)
    elif name in DRA_POLICIES:
        one = DraOrder(DRA_POLICIES[name])
    if one is not None:
        return simulate(nodes, pods, one, latencies=latencies, timer=timer, progress=progress), ""
    if name != "static_best":
        raise InvalidInput(
            "--policy", f"unknown policy {name!r} (known: {', '.join(POLICY_NAMES)})"
        )
    models = {node.model for node in nodes}
    candidates = [
        counts
        for counts in geometries(min(models, key=lambda m: m.product))
        if all(fit_layout(m, dict(counts)) is not None for m in models)
    ]
    # with hindsight: a layout without some requested profile never serves those pods
    asked = {profile for pod in pods for profile in pod.profiles}
    complete = [c for c in candidates if asked <= {p for p, _ in c}]
    candidates = complete or candidates
    best: tuple[tuple[int, float, float, float], SimResult, str] | None = None
    for k, counts in enumerate(candidates):

        def step(done: int, total: int, k: int = k) -> None:
            if progress is not None:
                progress(k * total + done, len(candidates) * total)

        result = simulate(
            nodes, pods, Static(counts), latencies=latencies, timer=timer, progress=step
        )
        waits = sum(result.bind_s)
        score = (result.served, result.allocation, -result.percentile(95), -waits)
        if best is None or score > best[0]:
            text = ", ".join(f"{n} x {p}" for p, n in counts)
            best = (score, result, f"every GPU: {text} (best of {len(candidates)} layouts)")
    if best is None:
        raise InvalidInput("nodes", "no MIG layout fits every GPU model of the cluster")
    return best[1], best[2]
