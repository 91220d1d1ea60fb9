"""Workloads for the dynamic MIG simulator: trace pods mapped to MIG requests, and seeded generators.

- `from_trace`: any trace `gpupart simulate` reads, with creation and deletion times: a one-GPU
  pod takes the smallest profile covering its share of SMs and memory, a multi-GPU pod that
  many whole-GPU profiles; qos gives the priority (LS and Guaranteed 2, Burstable 1, BE 0).
- `w2_shifting_inference`: an inference mix of 1g/2g/3g requests whose shares shift every
  30-60 simulated minutes (the hard case for a static layout).
- `w3_adversarial`: bursts of short 1g requests alternating with 3g/4g requests, which strand
  large placements when small instances land anywhere.
- `w4_mixed_sizes`: one-instance requests of 1g to 7g, arriving and leaving at random (where the
  small ones land decides whether 4g and 7g still fit).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from gpupart.core.scheduling.scoring import MILLI
from gpupart.sim.dynamic.simulation import SimPod
from gpupart.sim.trace import Pod

SHARE_TO_PROFILE = ((125, "1g.10gb"), (250, "2g.20gb"), (500, "3g.40gb"), (571, "4g.40gb"))
"""gpu_milli up to the bound -> profile on an 80 GB, 7-compute-slice GPU; above: 7g.80gb."""
WHOLE_GPU = "7g.80gb"
QOS_PRIORITY = {"LS": 2, "Guaranteed": 2, "Burstable": 1, "BE": 0}


def profile_for_share(gpu_milli: int) -> str:
    for bound, profile in SHARE_TO_PROFILE:
        if gpu_milli <= bound:
            return profile
    return WHOLE_GPU


def from_trace(pods: Sequence[Pod], *, limit: int | None = None) -> tuple[SimPod, ...]:
    """Trace pods with GPUs and times as MIG requests, in creation order, times from the first."""
    timed = sorted(
        (
            p
            for p in pods
            if p.num_gpu > 0 and p.creation_time is not None and p.deletion_time is not None
        ),
        key=lambda p: (p.creation_time or 0, p.name),
    )
    if limit is not None:
        timed = timed[:limit]
    if not timed:
        return ()
    start = timed[0].creation_time or 0
    result = []
    for pod in timed:
        if pod.num_gpu == 1 and pod.gpu_milli < MILLI:
            profiles: tuple[str, ...] = (profile_for_share(pod.gpu_milli),)
        else:
            profiles = (WHOLE_GPU,) * pod.num_gpu
        created, deleted = pod.creation_time or 0, pod.deletion_time or 0
        result.append(
            SimPod(
                pod.name,
                profiles,
                float(created - start),
                float(max(1, deleted - created)),
                QOS_PRIORITY.get(pod.qos, 0),
            )
        )
    return tuple(result)


W2_PROFILES = ("1g.10gb", "2g.20gb", "3g.40gb")


def w2_shifting_inference(
    *, seed: int, gpus: int, hours: float = 8.0, load: float = 0.9
) -> tuple[SimPod, ...]:
    """Poisson arrivals of inference pods; every 30-60 min the profile shares are redrawn.

    The arrival rate keeps the expected memory slices in use at `load` x the cluster's.
    """
    rng = random.Random(f"W2-{seed}")
    mean_duration = 600.0
    slices = {"1g.10gb": 1, "2g.20gb": 2, "3g.40gb": 4}
    pods = []
    t = 0.0
    end = hours * 3600
    phase_end = 0.0
    shares: list[float] = []
    k = 0
    while True:
        if t >= phase_end:
            phase_end = t + rng.uniform(1800, 3600)
            dominant = rng.randrange(len(W2_PROFILES))
            shares = [0.8 if i == dominant else 0.1 for i in range(len(W2_PROFILES))]
            mean_slices = sum(s * slices[p] for s, p in zip(shares, W2_PROFILES, strict=True))
            rate = load * gpus * 8 / (mean_slices * mean_duration)
        t += rng.expovariate(rate)
        if t >= end:
            break
        profile = rng.choices(W2_PROFILES, weights=shares)[0]
        duration = rng.expovariate(1 / mean_duration)
        pods.append(SimPod(f"w2-{k:05d}", (profile,), t, max(5.0, duration), rng.choice((0, 1))))
        k += 1
    return tuple(pods)


def w3_adversarial(*, seed: int, gpus: int, rounds: int = 24) -> tuple[SimPod, ...]:
    """Rounds of a 1g burst (enough to touch every GPU) then 3g/4g requests, random lifetimes."""
    rng = random.Random(f"W3-{seed}")
    pods = []
    t = 0.0
    k = 0
    for _ in range(rounds):
        for _ in range(gpus * 3):
            t += rng.uniform(0.5, 3.0)
            pods.append(SimPod(f"w3-{k:05d}", ("1g.10gb",), t, rng.uniform(60, 900)))
            k += 1
        for _ in range(gpus):
            t += rng.uniform(2.0, 10.0)
            profile = rng.choice(("3g.40gb", "4g.40gb"))
            pods.append(SimPod(f"w3-{k:05d}", (profile,), t, rng.uniform(300, 1800), 1))
            k += 1
        t += rng.uniform(60, 300)
    return tuple(pods)


MIXED_SIZES = (
    ("1g.10gb", 0.35),
    ("2g.20gb", 0.2),
    ("3g.40gb", 0.2),
    ("4g.40gb", 0.15),
    ("7g.80gb", 0.1),
)
"""W4's profiles and their shares of the arrivals."""


def w4_mixed_sizes(
    *, seed: int, gpus: int, arrivals: int = 300, load: float = 1.0
) -> tuple[SimPod, ...]:
    """Poisson arrivals of one instance each, mixed 1g to 7g (`MIXED_SIZES`), exponential run
    times: the case where small instances land decides whether 4g and 7g still fit.

    The arrival rate keeps the expected memory slices asked for at `load` x the cluster's."""
    rng = random.Random(f"W4-{seed}")
    mean_duration = 600.0
    slices = {"1g.10gb": 1, "2g.20gb": 2, "3g.40gb": 4, "4g.40gb": 4, "7g.80gb": 8}
    profiles = [p for p, _ in MIXED_SIZES]
    weights = [w for _, w in MIXED_SIZES]
    mean_slices = sum(w * slices[p] for p, w in MIXED_SIZES)
    rate = load * gpus * 8 / (mean_slices * mean_duration)
    pods = []
    t = 0.0
    for k in range(arrivals):
        t += rng.expovariate(rate)
        profile = rng.choices(profiles, weights=weights)[0]
        duration = max(5.0, rng.expovariate(1 / mean_duration))
        pods.append(SimPod(f"w4-{k:05d}", (profile,), t, duration))
    return tuple(pods)
