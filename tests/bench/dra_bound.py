"""Offline bound for the DRA benchmark: the most pods any placements could have bound on a replay.

The DRA benchmark (`dra.py`, "Simulated order") replays pods that ask one MIG profile each on one
node of GPUs with dynamic MIG, as a loss system: a pod that no free placement fits when it
arrives is given up, a placed one holds its instance over ``[arrival, arrival + duration)``.
Half-open, as in the simulator: a departure at ``t`` frees its room for an arrival at ``t``
(the engine pops every event of an instant before the policy decides, and a destroyed
instance leaves the GPU's layout at once). The simulator's pods hold their instance longer,
from arrival to bind + duration (the instance's create and advertise latencies, 1.2 s by
default, come first), so any of its schedules is one of the schedules counted here. Device
orders are compared by the pods bound and by the pods of large (4g and larger) profiles bound;
this module says how far from the best possible those figures are: the most pods, and the
most large pods, that any choice of which pods to accept and of a GPU and placement for each
(kept for the pod's whole life, as MIG cannot move an instance) could have bound, knowing every
arrival and departure in advance.

`offline_bound` returns two maxima, each over its own schedules (the schedule that binds the
most pods need not bind the most large ones):

- ``bound_4g_plus``, exact when the model allows it (checked on its catalogue, not assumed):
  if every large profile fits on an empty GPU and no two large instances fit together on one
  GPU (`fit_layout` of any two of them is None), then with every small pod refused a large
  pod fits exactly when its GPU holds no other large instance, so a schedule of large pods is
  an assignment of intervals to ``gpus`` machines, one interval at a time on each; the most
  intervals so schedulable is what the greedy by earliest end computes (each interval in that
  order to the free machine that became free last, or refused: Carlisle and Lloyd, 1995).
  On the H100-SXM5-80GB, 4g.40gb and 7g.80gb both start only at memory slice 0, so this
  holds. For a model where it does not, the figure is the relaxation below over the large
  pods alone (an upper bound).
- ``bound``, an upper bound from a per-instant relaxation, an integer program solved exactly by
  HiGHS (`scipy.optimize.milp`): at every maximal set of pods alive together (the pods alive at
  an arrival instant, unless the next arrival instant's set contains them: every instant's set
  is contained in one of these, and a GPU's layout rules only get harder with more instances),
  the accepted pods alive must split into at most ``gpus`` vectors of profile counts each of
  which one GPU can hold (`fit_layout` is not None: every maximal such vector of the replay's
  profiles is a column with an integer multiplicity). Every real schedule passes this test at
  every instant, so the optimum is an upper bound. This is exact per instant: it already
  implies every per-instant cut on sums (compute and memory slices, instances, large ones
  per GPU), as each of those holds for every one-GPU vector. What it relaxes is time: pods may
  change GPU and placement from one instant to the next, so fragmentation (a small instance
  that, staying where it was put, blocks a later 4g) costs nothing, and that is just what a
  device order can get wrong. So the gap between it and a policy is the most the order could
  gain, not what it must.
- the exact model, optional (``exact_time_limit_s``): binary ``z[pod, gpu, start]`` (at most
  one per pod) and, at every such set and on every GPU, the rules of `check_layout` as linear
  rows (each memory slice covered at most once, compute slices, instances, each profile's
  maximum count, the media engines); GPUs being interchangeable, the pod at position ``j`` in
  arrival order may only use GPUs ``0..j`` (relabel GPUs by first use). Its optimum is the
  exact maximum, but on 300 arrivals and 8 GPUs (about 9,000 binaries) HiGHS does not even
  finish the root LP in minutes, so the benchmark's figures are the relaxation's; on small
  replays (the tests) it is solved to optimality, and when HiGHS stops at its time limit its
  dual bound (rounded down) is still an upper bound. ``bound`` is the smaller of the two, and
  ``bound_exact`` is 1 where it is the exact maximum (the exact model solved to optimality).

    python tests/bench/dra_bound.py [--seeds N] [--arrivals N] [--exact S]

prints the figures of W4 (seeds 0 to N-1, 8 H100-SXM5-80GB, as `dra.py` runs it) as one JSON
object on its last line, progress on stderr.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp  # type: ignore[import-untyped]
from scipy.sparse import coo_array  # type: ignore[import-untyped]

from gpupart.core.mig.catalogue import GpuModel, MigProfile, require_gpu_model
from gpupart.core.mig.layout import fit_layout
from gpupart.sim.dynamic.simulation import SimPod
from gpupart.sim.dynamic.workloads import w4_mixed_sizes

GPUS = 8
"""As `dra.py`: one node of 8 GPUs."""
W4_ARRIVALS = 300
SEEDS = 5
LARGE = ("4g.", "7g.")
"""As `dra.py`'s `large`: the profiles counted as 4g and larger."""


def large(profile: str) -> bool:
    return profile.startswith(LARGE)


@dataclass(frozen=True, slots=True)
class _Interval:
    profile: MigProfile
    start: float
    end: float


def _intervals(model: GpuModel, pods: Sequence[SimPod]) -> list[_Interval]:
    found = []
    for pod in pods:
        if len(pod.profiles) != 1:
            raise ValueError(f"{pod.name}: the bound is for pods of one instance each")
        found.append(
            _Interval(
                model.require_profile(pod.profiles[0]), pod.arrival, pod.arrival + pod.duration
            )
        )
    return sorted(found, key=lambda i: (i.start, i.end, i.profile.name))


def alive_sets(intervals: Sequence[_Interval]) -> list[list[int]]:
    """The maximal sets of intervals alive together (half-open), as indices into `intervals`:
    the set alive at each arrival instant unless the next arrival instant's contains it."""
    instants = sorted({i.start for i in intervals})
    sets = []
    for k, t in enumerate(instants):
        alive = [n for n, i in enumerate(intervals) if i.start <= t < i.end]
        later = instants[k + 1] if k + 1 < len(instants) else math.inf
        if min(intervals[n].end for n in alive) <= later:
            sets.append(alive)
    return sets


def most_intervals(intervals: Sequence[tuple[float, float]], machines: int) -> int:
    """The most half-open intervals schedulable on `machines`, one at a time on each (exact):
    by earliest end, each to the machine free the latest before it starts, or refused."""
    free_at: list[float] = [-math.inf] * machines  # sorted ascending
    taken = 0
    for start, end in sorted(intervals, key=lambda i: (i[1], i[0])):
        fits = [k for k, t in enumerate(free_at) if t <= start]
        if fits:
            free_at[fits[-1]] = end
            free_at.sort()
            taken += 1
    return taken


def large_ones_exclusive(model: GpuModel, profiles: Sequence[MigProfile]) -> bool:
    """Whether each of these profiles fits on an empty GPU and no two of them fit together."""
    names = sorted({p.name for p in profiles})
    if any(fit_layout(model, {name: 1}) is None for name in names):
        return False
    for a, b in itertools.combinations_with_replacement(names, 2):
        counts = {a: 2} if a == b else {a: 1, b: 1}
        if fit_layout(model, counts) is not None:
            return False
    return True


def gpu_vectors(model: GpuModel, profiles: Sequence[MigProfile]) -> list[tuple[int, ...]]:
    """Every maximal vector of counts of `profiles` that one GPU of `model` holds."""
    ranges = [range(p.max_count + 1) for p in profiles]
    fitting = []
    for vector in itertools.product(*ranges):
        if sum(v * p.memory_slices for v, p in zip(vector, profiles, strict=True)) > (
            model.memory_slices
        ):
            continue
        counts = {p.name: v for p, v in zip(profiles, vector, strict=True) if v}
        if fit_layout(model, counts) is not None:
            fitting.append(vector)
    chosen = set(fitting)
    return [
        v
        for v in fitting
        if not any(w != v and all(a <= b for a, b in zip(v, w, strict=True)) for w in chosen)
    ]


class _Program:
    """A 0-1 / integer maximisation, row by row, handed to HiGHS."""

    def __init__(self) -> None:
        self.objective: list[float] = []
        self.upper: list[float] = []
        self.rows: list[int] = []
        self.cols: list[int] = []
        self.values: list[float] = []
        self.rhs: list[float] = []

    def variable(self, gain: float, upper: float) -> int:
        self.objective.append(gain)
        self.upper.append(upper)
        return len(self.objective) - 1

    def at_most(self, terms: Sequence[tuple[int, float]], limit: float) -> None:
        row = len(self.rhs)
        for col, value in terms:
            self.rows.append(row)
            self.cols.append(col)
            self.values.append(value)
        self.rhs.append(limit)

    def solve(self, time_limit_s: float | None) -> tuple[float, bool]:
        """(an upper bound on the optimum, whether it is the proven optimum)."""
        n = len(self.objective)
        if n == 0:
            return 0.0, True
        matrix = coo_array((self.values, (self.rows, self.cols)), shape=(len(self.rhs), n)).tocsr()
        options: dict[str, Any] = {"disp": False}
        if time_limit_s is not None:
            options["time_limit"] = time_limit_s
        result: Any = milp(
            -np.asarray(self.objective),
            constraints=[LinearConstraint(matrix, -np.inf, np.asarray(self.rhs))]
            if self.rhs
            else [],
            integrality=np.ones(n),
            bounds=Bounds(np.zeros(n), np.asarray(self.upper)),
            options=options,
        )
        if result.status == 0:
            return float(-result.fun), True
        dual = getattr(result, "mip_dual_bound", None)
        if dual is None or not math.isfinite(dual):
            return math.inf, False
        return float(-dual), False


def _floor(value: float) -> int:
    return math.floor(value + 1e-6) if math.isfinite(value) else sys.maxsize


def per_instant_bound(
    model: GpuModel, gpus: int, intervals: Sequence[_Interval], sets: Sequence[Sequence[int]]
) -> int:
    """The relaxation: each instant's accepted pods split into `gpus` one-GPU count vectors."""
    profiles = sorted({i.profile for i in intervals}, key=lambda p: p.name)
    vectors = gpu_vectors(model, profiles)
    program = _Program()
    take = [program.variable(1.0, 1.0) for _ in intervals]
    for alive in sets:
        use = [program.variable(0.0, gpus) for _ in vectors]
        program.at_most([(u, 1.0) for u in use], gpus)
        for k, profile in enumerate(profiles):
            mine = [(take[n], 1.0) for n in alive if intervals[n].profile == profile]
            if mine:
                program.at_most(
                    mine + [(u, -float(v[k])) for u, v in zip(use, vectors, strict=True)], 0.0
                )
    value, _ = program.solve(None)
    return _floor(value)


def _weight(profile: MigProfile, rule: str) -> int:
    """What one instance of `profile` takes of a GPU-wide limit of `check_layout`."""
    if rule == "compute":
        return profile.compute_slices
    if rule == "instances":
        return 1
    if rule.startswith("count "):
        return int(profile.name == rule.removeprefix("count "))
    return int(getattr(profile.engines, rule))


def exact_bound(
    model: GpuModel,
    gpus: int,
    intervals: Sequence[_Interval],
    sets: Sequence[Sequence[int]],
    time_limit_s: float | None,
) -> tuple[int, bool]:
    """The exact model (see the module docstring): (its optimum or HiGHS's bound, proven)."""
    program = _Program()
    placed: list[list[tuple[int, int, int]]] = []  # per interval: (variable, gpu, start)
    for n, interval in enumerate(intervals):
        options = [
            (program.variable(1.0, 1.0), g, s)
            for g in range(min(gpus, n + 1))
            for s in interval.profile.starts
        ]
        placed.append(options)
        program.at_most([(v, 1.0) for v, _, _ in options], 1.0)
    caps = {
        "compute": model.compute_slices,
        "instances": model.max_instances,
        "decoders": model.engines.decoders,
        "encoders": model.engines.encoders,
        "jpeg": model.engines.jpeg,
        "ofa": model.engines.ofa,
        **{f"count {p.name}": p.max_count for p in model.profiles},
    }
    for alive in sets:
        for g in range(gpus):
            here = [(n, v, s) for n in alive for v, gg, s in placed[n] if gg == g]
            if len(here) < 2:
                continue
            for m in range(model.memory_slices):
                cover = [
                    (v, 1.0) for n, v, s in here if s <= m < s + intervals[n].profile.memory_slices
                ]
                if len(cover) > 1:
                    program.at_most(cover, 1.0)
            for rule, cap in caps.items():
                terms = [(v, float(_weight(intervals[n].profile, rule))) for n, v, _ in here]
                # a row that all the pods here together cannot break (one instance each) is left out
                most = {n: _weight(intervals[n].profile, rule) for n, _, _ in here}
                if sum(most.values()) > cap:
                    program.at_most([(v, w) for v, w in terms if w], float(cap))
    value, proven = program.solve(time_limit_s)
    return _floor(value), proven


def offline_bound(
    model: GpuModel,
    gpus: int,
    pods: Sequence[SimPod],
    large: Callable[[str], bool],
    *,
    exact_time_limit_s: float | None = None,
) -> dict[str, int]:
    """The most pods and the most `large` pods any schedule binds (module docstring):
    ``bound``, ``bound_4g_plus``, and ``bound_exact`` (1 if ``bound`` is the exact maximum)."""
    intervals = _intervals(model, pods)
    if not intervals:
        return {"bound": 0, "bound_4g_plus": 0, "bound_exact": 1}
    big = [i for i in intervals if large(i.profile.name)]
    if not big:
        bound_4g_plus = 0
    elif large_ones_exclusive(model, [i.profile for i in big]):
        bound_4g_plus = most_intervals([(i.start, i.end) for i in big], gpus)
    else:
        bound_4g_plus = per_instant_bound(model, gpus, big, alive_sets(big))
    sets = alive_sets(intervals)
    relaxed = per_instant_bound(model, gpus, intervals, sets)
    exact, proven = sys.maxsize, False
    if exact_time_limit_s is not None:
        exact, proven = exact_bound(model, gpus, intervals, sets, exact_time_limit_s)
    return {
        "bound": min(relaxed, exact),
        "bound_4g_plus": bound_4g_plus,
        "bound_exact": int(proven),
    }


def step(text: str) -> None:
    print(f"dra_bound: {text}", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--seeds", type=int, default=SEEDS)
    parser.add_argument("--arrivals", type=int, default=W4_ARRIVALS)
    parser.add_argument(
        "--exact", type=float, default=None, metavar="S", help="also try the exact model, S s each"
    )
    args = parser.parse_args(argv)
    h100 = require_gpu_model("H100-SXM5-80GB")
    per_seed: dict[str, dict[str, int | float]] = {}
    totals = {"bound": 0, "bound_4g_plus": 0, "requested": 0, "requested_4g_plus": 0}
    started = time.perf_counter()
    for seed in range(args.seeds):
        t = time.perf_counter()
        pods = w4_mixed_sizes(seed=seed, gpus=GPUS, arrivals=args.arrivals)
        figures: dict[str, int | float] = dict(
            offline_bound(h100, GPUS, pods, large, exact_time_limit_s=args.exact)
        )
        figures["requested"] = len(pods)
        figures["requested_4g_plus"] = sum(1 for p in pods if any(map(large, p.profiles)))
        for key in totals:
            totals[key] += int(figures[key])
        figures["seconds"] = round(time.perf_counter() - t, 2)
        per_seed[str(seed)] = figures
        step(f"W4 seed {seed}: {json.dumps(figures)}")
    step(f"seconds: {time.perf_counter() - started:.1f}")
    print(json.dumps({"W4": {**totals, "per_seed": per_seed, "arrivals": args.arrivals}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
