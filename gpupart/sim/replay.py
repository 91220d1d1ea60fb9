"""Trace replay engine: schedules a workload one pod at a time and measures GPU allocation.

Follows the protocol of the FGD paper's simulator (Weng et al., ATC '23; see docs/simulator.md):
pods sorted by name then shuffled with the seed; random copies of trace pods appended until the
requested GPU share reaches `load` x cluster capacity; no departures; each pod placed once on the
best-scoring feasible node, ties to the smallest node name; the policy picks the GPUs.

Pure and deterministic for a seed: randomness comes only from `random.Random(seed)`; progress
is reported through a callback the caller passes in.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from gpupart.core.errors import GpupartError
from gpupart.core.scheduling.scoring import (
    MILLI,
    FragmentationModel,
    NodeLeftover,
    Policy,
    Request,
    ScoredPlacement,
    TypicalPod,
    fits,
    request_of,
    score_node,
    take,
    typical_pods,
)
from gpupart.sim.trace import Node, Pod, larger_than_any_node

Progress = Callable[[int, int], None]
"""Called with (pods done, pods total) every `PROGRESS_EVERY` pods and at the end."""
PROGRESS_EVERY = 256
UNPLACEABLE_EXAMPLES = 3
"""How many unplaceable pods a result describes (it counts them all)."""


@dataclass(frozen=True, slots=True)
class ReplayResult:
    """What a replay measured. Percentages are of cluster GPU capacity (thousandths summed)."""

    policy: Policy
    seed: int
    load: float
    nodes: int
    gpus: int
    pods: int
    """Pods that arrived (trace pods plus copies)."""
    placed: int
    failed: int
    failed_gpu_milli: int
    allocated_milli: int
    capacity_milli: int
    curve: tuple[float, ...]
    """curve[p] = allocation % once p % of capacity has arrived, p = 0 .. floor(100 * load)."""
    fragmentation_curve: tuple[float, ...]
    """FGD's fragmentation amount as % of capacity, sampled like `curve`."""
    failed_by_kind: dict[str, int] = field(default_factory=dict)
    unplaceable: int = 0
    """Failed pods (among `failed`) that no node could host even when empty, or that the replay
    could not place for any other reason; the replay counts them and goes on."""
    unplaceable_examples: tuple[str, ...] = ()
    """Why, for the first few distinct such pods."""
    final_states: tuple[tuple[Node, NodeLeftover], ...] = field(default=(), repr=False)
    """Each node (name order) with what was left on it at the end."""

    @property
    def allocation_ratio(self) -> float:
        return 100.0 * self.allocated_milli / self.capacity_milli if self.capacity_milli else 0.0

    @property
    def unallocated_gpus(self) -> float:
        return (self.capacity_milli - self.allocated_milli) / MILLI

    @property
    def fragmentation(self) -> float:
        return self.fragmentation_curve[-1] if self.fragmentation_curve else 0.0


def arrivals(
    pods: Sequence[Pod], capacity_milli: int, *, load: float, rng: random.Random
) -> list[Pod]:
    """The arrival sequence: name order, shuffled, then tuned to `load` x capacity of GPU share.

    Tuning appends copies of uniformly drawn trace pods until the next copy would exceed the
    target (or drops random pods while above it), as the authors' `TunePodsByNodeTotalResource`.
    `load` <= 0 replays the trace as it is.
    """
    ordered = sorted(pods, key=lambda pod: pod.name)
    sequence = list(ordered)
    rng.shuffle(sequence)
    if load <= 0 or not ordered:
        return sequence
    target = load * capacity_milli
    total = sum(pod.total_gpu_milli for pod in sequence)
    if total > target:
        while total > target and sequence:
            removed = sequence.pop(rng.randrange(len(sequence)))
            total -= removed.total_gpu_milli
        return sequence
    if not any(pod.total_gpu_milli for pod in ordered):
        return sequence  # no GPU demand to tune on
    copy = 0
    while True:
        pod = ordered[rng.randrange(len(ordered))]
        if total + pod.total_gpu_milli > target:
            return sequence
        total += pod.total_gpu_milli
        sequence.append(replace(pod, name=f"{pod.name}-tuned-{copy}"))
        copy += 1


def initial_state(node: Node) -> NodeLeftover:
    return NodeLeftover(node.cpu_milli, node.memory_mib, (MILLI,) * node.gpus, node.model)


def kind_of(request: Request) -> str:
    if request.num_gpu == 0:
        return "cpu-only"
    if request.is_shared:
        return "shared"
    return "1-gpu" if request.num_gpu == 1 else f"{request.num_gpu}-gpu"


_Key = tuple[int, int, tuple[int, ...], str]
"""A node state up to GPU order: CPU left, memory left, free shares (largest first), model."""


class _Group:
    """Nodes in the same state (up to GPU order): they score the same for every pod."""

    __slots__ = ("members", "lowest", "scores", "canonical")

    def __init__(self, canonical: NodeLeftover) -> None:
        self.members: set[int] = set()
        self.lowest = -1
        self.scores: dict[Request, ScoredPlacement | None] = {}
        self.canonical = canonical


def replay(
    nodes: Sequence[Node],
    pods: Sequence[Pod],
    *,
    policy: Policy,
    seed: int,
    load: float = 1.3,
    typical: tuple[TypicalPod, ...] | None = None,
    progress: Progress | None = None,
    shuffle_nodes: bool = True,
) -> ReplayResult:
    """Replay `pods` on `nodes` under `policy`; see the module docstring for the protocol.

    `typical` overrides FGD's typical-pod mix (default: computed from `pods`, before tuning).
    """
    rng = random.Random(seed)
    by_name = sorted(nodes, key=lambda node: node.name)
    capacity = sum(node.gpu_milli for node in by_name)
    sequence = arrivals(pods, capacity, load=load, rng=rng)
    if shuffle_nodes:
        # The authors' simulator renames node i (in name order) to f"{perm[i]:04d}-{name}" with
        # a random permutation drawn after tuning; ties then go to the smallest new name.
        ranks = list(range(len(by_name)))
        rng.shuffle(ranks)
        ordered_nodes = [node for _, node in sorted(zip(ranks, by_name, strict=True))]
    else:
        ordered_nodes = by_name
    # from here on a node's index is its tie-break rank
    model = FragmentationModel.of(typical if typical is not None else typical_pods(pods))

    states = [initial_state(node) for node in ordered_nodes]
    groups: dict[_Key, _Group] = {}
    node_key: list[_Key] = []
    frag = [model.fragmentation(state) for state in states]
    frag_total = sum(frag)
    for index, state in enumerate(states):
        key = _key(state)
        node_key.append(key)
        _join(groups, key, index)

    max_percent = int(load * 100 + 1e-9) if load > 0 else 100
    curve: list[float] = []
    frag_curve: list[float] = []
    allocated = 0
    arrived = 0
    placed = 0
    failed = 0
    failed_milli = 0
    failed_by_kind: dict[str, int] = {}
    total = len(sequence)
    requests: dict[tuple[int, int, int, int, tuple[str, ...]], Request] = {}

    def sample() -> None:
        """One point of each curve: allocation and fragmentation as % of capacity now."""
        curve.append(100.0 * allocated / capacity if capacity else 0.0)
        frag_curve.append(100.0 * frag_total / capacity if capacity else 0.0)

    unplaceable = 0
    examples: list[str] = []
    too_large: dict[tuple[int, int, int, int, tuple[str, ...]], str] = {}

    def fail(request: Request, why: str = "") -> None:
        nonlocal failed, failed_milli, unplaceable
        failed += 1
        failed_milli += request.total_gpu_milli
        kind = kind_of(request)
        failed_by_kind[kind] = failed_by_kind.get(kind, 0) + 1
        if why:
            unplaceable += 1
            if len(examples) < UNPLACEABLE_EXAMPLES and why not in examples:
                examples.append(why)

    for done, pod in enumerate(sequence):
        shape = (pod.cpu_milli, pod.memory_mib, pod.num_gpu, pod.gpu_milli, pod.gpu_spec)
        request = requests.get(shape)
        if request is None:
            request = requests[shape] = request_of(pod)
            too_large[shape] = larger_than_any_node(by_name, pod)
        arrived += request.total_gpu_milli
        why = too_large[shape]
        chosen, new_state = -1, None
        if not why:
            try:
                chosen, new_state = _place(policy, groups, states, request, model, rng)
            except (GpupartError, ValueError, ArithmeticError) as error:
                # One pod the replay cannot place must not end the replay of the others.
                line = f" (line {pod.line})" if pod.line else ""
                why = f"pod {pod.name!r}{line}: cannot be placed: {error}"
        if new_state is None:
            fail(request, why)
        else:
            states[chosen] = new_state
            placed += 1
            allocated += request.total_gpu_milli
            _leave(groups, node_key[chosen], chosen)
            key = _key(new_state)
            node_key[chosen] = key
            _join(groups, key, chosen)
            new_frag = model.fragmentation(new_state)
            frag_total += new_frag - frag[chosen]
            frag[chosen] = new_frag
        while len(curve) <= max_percent and arrived * 100 >= len(curve) * capacity:
            sample()
        if progress is not None and (done + 1) % PROGRESS_EVERY == 0:
            progress(done + 1, total)
    while len(curve) <= max_percent:  # the tuned workload stops just short of the target
        sample()
    if progress is not None:
        progress(total, total)
    return ReplayResult(
        policy=policy,
        seed=seed,
        load=load,
        nodes=len(ordered_nodes),
        gpus=capacity // MILLI,
        pods=total,
        placed=placed,
        failed=failed,
        failed_gpu_milli=failed_milli,
        allocated_milli=allocated,
        capacity_milli=capacity,
        curve=tuple(curve),
        fragmentation_curve=tuple(frag_curve),
        failed_by_kind=failed_by_kind,
        unplaceable=unplaceable,
        unplaceable_examples=tuple(examples),
        final_states=tuple(zip(ordered_nodes, states, strict=True)),
    )


def _key(state: NodeLeftover) -> _Key:
    return (
        state.cpu_left,
        state.memory_left,
        tuple(sorted(state.gpu_left, reverse=True)),
        state.model,
    )


def _join(
    groups: dict[_Key, _Group],
    key: _Key,
    index: int,
) -> None:
    group = groups.get(key)
    if group is None:
        group = groups[key] = _Group(NodeLeftover(key[0], key[1], key[2], key[3]))
    group.members.add(index)
    if group.lowest < 0 or index < group.lowest:
        group.lowest = index


def _leave(
    groups: dict[_Key, _Group],
    key: _Key,
    index: int,
) -> None:
    group = groups[key]
    group.members.discard(index)
    if not group.members:
        del groups[key]
    elif group.lowest == index:
        group.lowest = min(group.members)


def _place(
    policy: Policy,
    groups: dict[_Key, _Group],
    states: list[NodeLeftover],
    request: Request,
    model: FragmentationModel,
    rng: random.Random,
) -> tuple[int, NodeLeftover | None]:
    """The node the pod goes to and that node's new state; (-1, None) when no node can host it."""
    chosen = _choose(policy, groups, request, model, rng)
    if chosen < 0:
        return chosen, None
    placement = score_node(policy, states[chosen], request, model=model, rng=rng)
    if placement is None:
        raise GpupartError("its node's group fits it, the node does not")
    return chosen, take(states[chosen], request, placement.gpus)


def _choose(
    policy: Policy,
    groups: dict[_Key, _Group],
    request: Request,
    model: FragmentationModel,
    rng: random.Random,
) -> int:
    """The node index the pod goes to, or -1 when no node can host it."""
    if policy is Policy.RANDOM:
        feasible: list[_Group] = []
        count = 0
        for group in groups.values():
            if request in group.scores:
                fit = group.scores[request] is not None
            else:
                fit = fits(group.canonical, request)
                # cache feasibility only: the random score itself must be drawn per pod
                group.scores[request] = ScoredPlacement(0.0, ()) if fit else None
            if fit:
                feasible.append(group)
                count += len(group.members)
        if count == 0:
            return -1
        pick = rng.randrange(count)
        for group in feasible:
            if pick < len(group.members):
                return sorted(group.members)[pick]
            pick -= len(group.members)
        raise AssertionError("unreachable")
    best_score = -float("inf")
    best_node = -1
    missing = _MISSING
    for group in groups.values():
        placement = group.scores.get(request, missing)
        if placement is missing:
            placement = score_node(policy, group.canonical, request, model=model)
            group.scores[request] = placement
        if placement is None:
            continue
        score = placement.score
        if score > best_score or (score == best_score and group.lowest < best_node):
            best_score = score
            best_node = group.lowest
    return best_node


_MISSING = ScoredPlacement(float("nan"), ())
