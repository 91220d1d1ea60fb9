"""Node scoring policies for shared-GPU pods: one pod against one node state, pure and memoised.

This is the module the scheduler extender serves: `score_node(policy, state, request, ...)`
answers "how good is this node for this pod, and which GPUs would it use", or None when the
node cannot host the pod. The replay engine (`gpupart.sim.replay`) calls the same function.

Policies:
- ``random``: any feasible node; a random GPU among those that fit (paper baseline 01).
- ``bestfit``: least CPU and GPU left after placement, tightest GPU (paper baseline 05).
- ``fgd``: Fragmentation Gradient Descent (Weng et al., ATC '23), as the authors implement it,
  including the integer 0-100 score that makes many nodes tie.
- ``gpupart``: ours; see `score_gpupart` and docs/simulator.md.

A `FragmentationModel` holds the typical-pod mix and the memo tables; it is created per workload
and passed in, so nothing here is global. Node states that differ only in GPU order share memo
entries, because fragmentation depends on the multiset of free shares, not on GPU indices.

Over 400 lines on purpose: the four policies share the node-state helpers and the model's memo
tables; apart, each would reach into the others' internals.
"""

from __future__ import annotations

import math
import random
from bisect import bisect_right
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import StrEnum

MILLI = 1000
"""One whole GPU, in per-GPU thousandths (the traces' and scoring's unit)."""


class GpuShape:
    """What a pod asks of a node and its GPUs, for trace pods and scoring requests alike.

    `gpu_milli` is per GPU and below 1000 only for a single shared GPU; `gpu_spec` lists the GPU
    models accepted (empty accepts any).
    """

    __slots__ = ()
    cpu_milli: int
    memory_mib: int
    num_gpu: int
    gpu_milli: int
    gpu_spec: tuple[str, ...]

    @property
    def total_gpu_milli(self) -> int:
        return self.num_gpu * self.gpu_milli

    @property
    def is_shared(self) -> bool:
        return self.num_gpu == 1 and 0 < self.gpu_milli < MILLI

    def accepts(self, model: str) -> bool:
        """Whether a node with GPUs of `model` may host this pod (CPU-only pods go anywhere)."""
        if self.num_gpu == 0 or not self.gpu_spec:
            return True
        return model in self.gpu_spec


TYPICAL_COVERAGE = 0.95
"""FGD's typical pods are the most frequent shapes that together cover this share of all pods."""
DEFAULT_CPU_REQUEST = 100
"""kube-scheduler counts a pod with no CPU request as 100m when scoring (GetNonzeroRequests)."""
BESTFIT_MAX_CPU = 128_000
BESTFIT_MAX_GPU = 8 * MILLI
"""The authors' BestFit normalises CPU and GPU leftovers by the largest node shape."""


class Policy(StrEnum):
    RANDOM = "random"
    BESTFIT = "bestfit"
    FGD = "fgd"
    GPUPART = "gpupart"


DEFAULT_POLICY = Policy.GPUPART
"""What the extender scores with unless configured otherwise."""


@dataclass(frozen=True, slots=True)
class Request(GpuShape):
    """The resource shape of a pod: everything scoring looks at, nothing else (hashable)."""

    cpu_milli: int
    memory_mib: int
    num_gpu: int
    gpu_milli: int
    gpu_spec: tuple[str, ...] = ()


def request_of(pod: GpuShape) -> Request:
    return Request(pod.cpu_milli, pod.memory_mib, pod.num_gpu, pod.gpu_milli, pod.gpu_spec)


@dataclass(frozen=True, slots=True)
class NodeLeftover:
    """What is left on one node; `gpu_left[i]` is GPU i's free share in thousandths."""

    cpu_left: int
    memory_left: int
    gpu_left: tuple[int, ...]
    model: str

    @property
    def gpu_left_total(self) -> int:
        return sum(self.gpu_left)


@dataclass(frozen=True, slots=True)
class ScoredPlacement:
    """A scored way to put a pod on a node: higher `score` is better; `gpus` are GPU indices."""

    score: float
    gpus: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class TypicalPod:
    request: Request
    weight: float


def typical_pods(
    pods: Iterable[GpuShape], *, coverage: float = TYPICAL_COVERAGE
) -> tuple[TypicalPod, ...]:
    """FGD's target workload: the most popular pod shapes covering `coverage` of the pods.

    Shapes are (CPU, per-GPU share, GPU count, GPU models), CPU-only pods included; ties in
    popularity go to the larger shape, as in the authors' sort. Weights sum to 1.
    """
    counts: Counter[tuple[int, int, int, tuple[str, ...]]] = Counter()
    for pod in pods:
        cpu = pod.cpu_milli if pod.cpu_milli > 0 else DEFAULT_CPU_REQUEST
        spec = pod.gpu_spec if pod.num_gpu > 0 else ()
        counts[(cpu, pod.gpu_milli, pod.num_gpu, spec)] += 1
    total = sum(counts.values())
    if total == 0:
        return ()
    ranked = sorted(counts.items(), key=lambda item: (item[1], item[0]), reverse=True)
    chosen: list[tuple[tuple[int, int, int, tuple[str, ...]], int]] = []
    covered = 0
    for shape, count in ranked:
        if covered >= coverage * total:
            break
        chosen.append((shape, count))
        covered += count
    return tuple(
        TypicalPod(Request(cpu, 0, num, milli, spec), count / covered)
        for (cpu, milli, num, spec), count in chosen
    )


@dataclass(frozen=True, slots=True)
class _GpuClass:
    """Typical pods that share a GPU shape; they differ only in CPU, kept as a step function."""

    num_gpu: int
    gpu_milli: int
    gpu_spec: tuple[str, ...]
    cpu_steps: tuple[int, ...]
    """Sorted CPU requests of the class's typical pods."""
    cumulative: tuple[float, ...]
    """cumulative[k] = total weight of the first k pods of `cpu_steps` (length len+1)."""


@dataclass(frozen=True, slots=True)
class FragmentationModel:
    """Typical-pod mix plus memo tables for node fragmentation (FGD's F(n)), one per workload.

    F(n) = sum over typical pods t of w_t * frag_t(n), where frag_t(n) is the free GPU share on
    GPUs too small for t when n can host t, and all of n's free GPU share otherwise. Rewritten
    by GPU class c: F = L - sum_c [c fits the GPUs] * W_c(cpu_left) * (L - small_c), where L is
    the node's free share and W_c(cpu) the weight of c's pods asking no more CPU than is left.
    """

    typical: tuple[TypicalPod, ...]
    classes: tuple[_GpuClass, ...] = ()
    cpu_per_gpu: float = 0.0
    """The mix's CPU per GPU share (CPU milli per GPU thousandth) over its GPU pods; 0: unknown."""
    _weights: dict[int, tuple[float, ...]] = field(default_factory=dict, compare=False)
    _gains: dict[tuple[tuple[int, ...], str], tuple[tuple[int, int], ...]] = field(
        default_factory=dict, compare=False
    )
    _frag: dict[tuple[int, tuple[int, ...], str], float] = field(
        default_factory=dict, compare=False
    )

    @staticmethod
    def of(typical: tuple[TypicalPod, ...]) -> FragmentationModel:
        grouped: dict[tuple[int, int, tuple[str, ...]], list[tuple[int, float]]] = {}
        for pod in typical:
            r = pod.request
            if r.num_gpu == 0:
                continue  # a CPU-only pod sees every free GPU share as fragment: no gain term
            grouped.setdefault((r.num_gpu, r.gpu_milli, r.gpu_spec), []).append(
                (r.cpu_milli, pod.weight)
            )
        classes = []
        for (num, milli, spec), members in sorted(grouped.items()):
            members.sort()
            cumulative = [0.0]
            for _, weight in members:
                cumulative.append(cumulative[-1] + weight)
            classes.append(
                _GpuClass(num, milli, spec, tuple(c for c, _ in members), tuple(cumulative))
            )
        cpu = sum(p.weight * p.request.cpu_milli for p in typical if p.request.num_gpu)
        gpu = sum(p.weight * p.request.total_gpu_milli for p in typical if p.request.num_gpu)
        return FragmentationModel(typical, tuple(classes), cpu / gpu if gpu > 0 else 0.0)

    def stranded(self, state: NodeLeftover) -> float:
        """Free GPU share the node's free CPU cannot feed at the mix's CPU per GPU (thousandths).

        A node with 2 free GPUs and 8 free cores, in a mix that asks about 11 cores per GPU, can
        host typical pods on at most 8/11 of a GPU: the rest will most likely stay idle.
        """
        if self.cpu_per_gpu <= 0.0:
            return 0.0
        return max(0.0, state.gpu_left_total - state.cpu_left / self.cpu_per_gpu)

    def fragmentation(self, state: NodeLeftover) -> float:
        """F(n) in GPU thousandths; states with the same free shares in any order share the memo."""
        key = (state.cpu_left, tuple(sorted(state.gpu_left, reverse=True)), state.model)
        value = self._frag.get(key)
        if value is None:
            value = self._fragmentation(*key)
            self._frag[key] = value
        return value

    def _fragmentation(self, cpu_left: int, gpus: tuple[int, ...], model: str) -> float:
        left = sum(gpus)
        if left == 0:
            return 0.0
        weights = self._weights.get(cpu_left)
        if weights is None:
            weights = tuple(c.cumulative[bisect_right(c.cpu_steps, cpu_left)] for c in self.classes)
            self._weights[cpu_left] = weights
        gains = self._gains.get((gpus, model))
        if gains is None:
            gains = self._class_gains(gpus, left, model)
            self._gains[(gpus, model)] = gains
        value = float(left)
        for index, usable in gains:
            value -= weights[index] * usable
        return value

    def _class_gains(
        self, gpus: tuple[int, ...], left: int, model: str
    ) -> tuple[tuple[int, int], ...]:
        """For each class that fits these GPUs (`left` free in all): (class index, usable share)."""
        gains = []
        for index, c in enumerate(self.classes):
            if c.gpu_spec and model not in c.gpu_spec:
                continue
            fitting = 0
            small = 0
            for share in gpus:
                if share >= c.gpu_milli:
                    fitting += 1
                else:
                    small += share
            if fitting >= c.num_gpu:
                gains.append((index, left - small))
        return tuple(gains)


def fits(state: NodeLeftover, request: Request) -> bool:
    """The filter: CPU, memory, GPU model, and enough GPUs with enough free share."""
    if state.cpu_left < request.cpu_milli or state.memory_left < request.memory_mib:
        return False
    if request.num_gpu == 0:
        return True
    if not state.gpu_left or not request.accepts(state.model):
        return False
    need = request.gpu_milli
    return sum(1 for share in state.gpu_left if share >= need) >= request.num_gpu


def take(state: NodeLeftover, request: Request, gpus: tuple[int, ...]) -> NodeLeftover:
    """The node state after placing `request` on GPU indices `gpus` (assumed feasible)."""
    left = list(state.gpu_left)
    for index in gpus:
        left[index] -= request.gpu_milli
    return NodeLeftover(
        state.cpu_left - request.cpu_milli,
        state.memory_left - request.memory_mib,
        tuple(left),
        state.model,
    )


def score_node(
    policy: Policy,
    state: NodeLeftover,
    request: Request,
    *,
    model: FragmentationModel,
    rng: random.Random | None = None,
) -> ScoredPlacement | None:
    """Score one node for one pod under `policy`; None if the node cannot host the pod.

    `rng` is needed only by ``random``. GPU indices follow the paper: whole-GPU pods take the
    lowest-index free GPUs; a shared pod's GPU is the policy's choice, lowest index on ties.
    """
    if not fits(state, request):
        return None
    if policy is Policy.RANDOM:
        if rng is None:
            raise ValueError("the random policy needs an rng")
        return ScoredPlacement(rng.random(), _random_gpu(state, request, rng))
    if policy is Policy.BESTFIT:
        return ScoredPlacement(float(bestfit_score(state, request)), _tightest_gpus(state, request))
    if policy is Policy.FGD:
        return _gradient(state, request, model.fragmentation, tightest_on_ties=False)
    return score_gpupart(state, request, model)


def bestfit_score(state: NodeLeftover, request: Request) -> int:
    """The authors' BestFit: 100 * (1 - mean of CPU and GPU left after placement, normalised)."""
    cpu = (state.cpu_left - request.cpu_milli) / BESTFIT_MAX_CPU
    gpu = (state.gpu_left_total - request.total_gpu_milli) / BESTFIT_MAX_GPU
    return int((1.0 - (0.5 * cpu + 0.5 * gpu)) * 100)


def _lowest_free(state: NodeLeftover, count: int) -> tuple[int, ...]:
    free = [i for i, share in enumerate(state.gpu_left) if share == MILLI]
    return tuple(free[:count])


def _candidates(state: NodeLeftover, request: Request) -> list[int]:
    """For a shared pod: one GPU index per distinct free share that fits (lowest index first)."""
    seen: set[int] = set()
    out = []
    for index, share in enumerate(state.gpu_left):
        if share >= request.gpu_milli and share not in seen:
            seen.add(share)
            out.append(index)
    return out


def _tightest_gpus(state: NodeLeftover, request: Request) -> tuple[int, ...]:
    if not request.is_shared:
        return _lowest_free(state, request.num_gpu)
    best = -1
    for index, share in enumerate(state.gpu_left):
        if share >= request.gpu_milli and (best < 0 or share < state.gpu_left[best]):
            best = index
    return (best,)


def _random_gpu(state: NodeLeftover, request: Request, rng: random.Random) -> tuple[int, ...]:
    if not request.is_shared:
        return _lowest_free(state, request.num_gpu)
    fitting = [i for i, share in enumerate(state.gpu_left) if share >= request.gpu_milli]
    return (fitting[rng.randrange(len(fitting))],)


def _sigmoid_score(delta: float) -> int:
    """The authors' FGD node score: int(sigmoid(dF / 1000) * 100), 0-100."""
    # Clamped where exp() would overflow: the score there is already 0 (or 100).
    return int(100.0 / (1.0 + math.exp(min(700.0, -delta / 1000.0))))


def _gradient(
    state: NodeLeftover,
    request: Request,
    cost: Callable[[NodeLeftover], float],
    *,
    tightest_on_ties: bool,
) -> ScoredPlacement:
    """FGD's score on the gradient of `cost`: whole-GPU pods take the lowest free GPUs; a shared
    pod the candidate GPU with the best score (the first, or with `tightest_on_ties` the one with
    the least free share, among equals)."""
    before = cost(state)
    if not request.is_shared:
        gpus = _lowest_free(state, request.num_gpu)
        return ScoredPlacement(
            float(_sigmoid_score(before - cost(take(state, request, gpus)))), gpus
        )
    best_score = -1
    best_gpu = -1
    for index in _candidates(state, request):
        score = _sigmoid_score(before - cost(take(state, request, (index,))))
        if score > best_score or (
            tightest_on_ties
            and score == best_score
            and state.gpu_left[index] < state.gpu_left[best_gpu]
        ):
            best_score, best_gpu = score, index
    return ScoredPlacement(float(best_score), (best_gpu,))


def gpupart_cost(
    state: NodeLeftover, model: FragmentationModel, *, takes_gpu: bool = True
) -> float:
    """Our node cost: expected fragmentation F plus CPU-stranded GPU share S.

    For a pod that takes GPU share, C(n) = F(n) + S(n). A CPU-only pod takes no GPU share: the
    only GPU capacity it can waste is share that its CPU would have fed and that is still usable,
    so for it the stranded share counts only beyond what F already counts as lost,
    C(n) = F(n) + max(0, free share - F(n) - free CPU / c) = max(F(n), S(n)). When CPU runs out
    this sends CPU-only pods to nodes whose free GPU share is fragmented anyway, and keeps the
    CPU beside whole free GPUs for the GPU pods.
    """
    fragmentation, stranded = model.fragmentation(state), model.stranded(state)
    return fragmentation + stranded if takes_gpu else max(fragmentation, stranded)


def score_gpupart(
    state: NodeLeftover, request: Request, model: FragmentationModel
) -> ScoredPlacement:
    """Ours: FGD's gradient over fragmentation plus GPU share stranded without CPU.

    Node cost C(n) = F(n) + S(n): FGD's expected fragmentation F against the typical-pod mix,
    plus S(n) = max(0, free GPU share - free CPU / c), the free GPU share the node's CPU cannot
    feed at the mix's CPU per GPU share c (`FragmentationModel.stranded`). F alone sees CPU only
    through each typical pod's exact request, so it lets CPU-hungry pods drain nodes whose GPUs
    then idle; S charges that drain as it happens. The score is FGD's, on C instead of F:
    ``int(sigmoid((C_before - C_after) / 1000) * 100)``, rounded to 1/100 on purpose (ties go
    to the fixed node order, which packs better than following small gradients exactly; see
    docs/simulator.md). Inside the node a shared pod takes the tightest GPU among those with the
    best score, so larger holes stay open for larger shares. A CPU-only pod's cost counts the
    stranded share only beyond the fragmented share (`gpupart_cost`).
    """
    return _gradient(state, request, _cost(Policy.GPUPART, model, request), tightest_on_ties=True)


def score_placement(
    policy: Policy,
    state: NodeLeftover,
    request: Request,
    gpus: tuple[int, ...],
    *,
    model: FragmentationModel,
) -> float:
    """The score `score_node` gives placing `request` on exactly the GPU indices `gpus`.

    For ``fgd`` (cost F) and ``gpupart`` (`gpupart_cost`), the policies that score a cost gradient:
    ``int(sigmoid((cost_before - cost_after) / 1000) * 100)``. `score_node` computes this for
    each candidate GPU and keeps the best; the scheduler extender, which weighs GPUs by other
    terms too, asks for one placement at a time. Feasibility is the caller's business.
    """
    cost = _cost(policy, model, request)
    return float(_sigmoid_score(cost(state) - cost(take(state, request, gpus))))


def _cost(
    policy: Policy, model: FragmentationModel, request: Request
) -> Callable[[NodeLeftover], float]:
    """The node cost whose gradient `policy` scores for `request`: F for ``fgd``, `gpupart_cost`
    for ``gpupart``."""
    if policy is Policy.FGD:
        return model.fragmentation
    if policy is Policy.GPUPART:
        takes_gpu = request.num_gpu > 0
        return lambda state: gpupart_cost(state, model, takes_gpu=takes_gpu)
    raise ValueError(f"the {policy} policy scores no cost gradient")
