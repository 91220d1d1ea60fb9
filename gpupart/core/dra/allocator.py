"""A pure model of kube-scheduler's DRA allocation for our devices: the first full fit, in its search order.

What it models (k8s.io/dynamic-resource-allocation structured allocator, v0.36): only complete
pools at their highest generation; pools by (driver, name), slices by name, devices in slice
order; requests in claim order, each `count` devices, backtracking to the first full solution;
a device is taken once unless it allows multiple allocations; shared counters never
over-consumed (across the pool's slices); consumable capacity rounded up by its request policy
(an unrequested capacity takes the policy's default, else all of it) and never over-consumed;
a device with a NoSchedule or NoExecute taint the request does not tolerate is not allocated
(other effects, None included, are ignored, as the scheduler ignores them).
Selection is by equality on our own attributes (what our DeviceClasses' CEL says), not CEL.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction

from gpupart.core.dra.read import (
    AllocationResult,
    Capacity,
    ClaimView,
    DeviceTaint,
    DeviceView,
    SliceView,
)

BLOCKING_EFFECTS = frozenset({"NoSchedule", "NoExecute"})
"""The taint effects that keep a device from an allocation (others, None included, do not)."""


@dataclass(frozen=True, slots=True)
class DeviceToleration:
    """One `tolerations[]` entry of a request (empty key: every key; empty effect: every effect)."""

    key: str = ""
    operator: str = "Equal"
    value: str = ""
    effect: str = ""

    def tolerates(self, taint: DeviceTaint) -> bool:
        """The scheduler's rule (k8s.io/dynamic-resource-allocation `ToleratesTaint`)."""
        if self.effect and self.effect != taint.effect:
            return False
        if self.key and self.key != taint.key:
            return False
        if self.operator in ("", "Equal"):
            return self.value == taint.value
        return self.operator == "Exists"


@dataclass(frozen=True, slots=True)
class DeviceRequest:
    """One `exactly` request of a claim: devices whose attributes equal `match`, `count` of them."""

    name: str
    match: tuple[tuple[str, str | int | bool], ...] = ()
    count: int = 1
    capacity: tuple[tuple[str, Fraction], ...] = ()
    """`capacity.requests`: amount per consumable capacity name."""
    tolerations: tuple[DeviceToleration, ...] = ()


def blocking_taints(device: DeviceView, request: DeviceRequest) -> tuple[DeviceTaint, ...]:
    """The device's taints that keep it from `request` (known effects, not tolerated)."""
    return tuple(
        t
        for t in device.taints
        if t.effect in BLOCKING_EFFECTS and not any(x.tolerates(t) for x in request.tolerations)
    )


@dataclass(frozen=True, slots=True)
class _Candidate:
    driver: str
    pool: str
    device: DeviceView


def usable_pools(slices: Iterable[SliceView]) -> dict[tuple[str, str], tuple[SliceView, ...]]:
    """The pools the scheduler allocates from: complete at their highest generation, slices by name."""
    pools: dict[tuple[str, str], list[SliceView]] = {}
    for view in slices:
        pools.setdefault((view.driver, view.pool), []).append(view)
    usable = {}
    for key in sorted(pools):
        top = max(s.generation for s in pools[key])
        current = [s for s in pools[key] if s.generation == top]
        if all(s.slice_count == len(current) for s in current):
            usable[key] = tuple(sorted(current, key=lambda s: s.name))
    return usable


def round_up(request: Fraction | None, capacity: Capacity) -> Fraction | None:
    """What a request consumes of a consumable capacity, None when the policy refuses it."""
    policy = capacity.policy
    if request is None:
        return policy.default if policy and policy.default is not None else capacity.value
    if policy is None:
        return request
    if policy.minimum is not None:
        value = max(request, policy.minimum)
        if policy.step:
            steps = math.ceil((value - policy.minimum) / policy.step)
            value = policy.minimum + steps * policy.step
        if policy.maximum is not None and value > policy.maximum:
            return None
        return value
    if policy.valid_values:
        return next((v for v in policy.valid_values if request <= v), None)
    return request


DeviceKey = tuple[str, str, str]
"""(driver, pool, device name)."""
CounterKey = tuple[str, str, str, str]
"""(driver, pool, counter set, counter)."""


def pool_contents(
    pools: Mapping[tuple[str, str], Sequence[SliceView]],
) -> tuple[dict[DeviceKey, DeviceView], dict[CounterKey, Fraction]]:
    """Every device and every counter's total of the usable pools, by key."""
    devices: dict[DeviceKey, DeviceView] = {}
    counters: dict[CounterKey, Fraction] = {}
    for (driver, pool), views in pools.items():
        for view in views:
            for device in view.devices:
                devices[(driver, pool, device.name)] = device
            for set_name, amounts in view.counter_sets:
                for counter, value in amounts:
                    counters[(driver, pool, set_name, counter)] = value
    return devices, counters


class _State:
    """What is taken: devices, counters, consumed capacity; changed and restored by the search."""

    def __init__(self, pools: Mapping[tuple[str, str], Sequence[SliceView]]) -> None:
        self.devices, self.counters = pool_contents(pools)
        self.taken: set[tuple[str, str, str]] = set()
        self.used: dict[tuple[str, str, str, str], Fraction] = {}
        self.consumed: dict[tuple[str, str, str, str], Fraction] = {}

    def counters_fit(self, driver: str, pool: str, device: DeviceView) -> bool:
        for set_name, amounts in device.consumes:
            for counter, value in amounts:
                key = (driver, pool, set_name, counter)
                if key not in self.counters or self.used.get(key, 0) + value > self.counters[key]:
                    return False
        return True

    def use(self, driver: str, pool: str, device: DeviceView, sign: int) -> None:
        for set_name, amounts in device.consumes:
            for counter, value in amounts:
                key = (driver, pool, set_name, counter)
                self.used[key] = self.used.get(key, Fraction(0)) + sign * value

    def consume(
        self,
        driver: str,
        pool: str,
        device: str,
        amounts: Iterable[tuple[str, Fraction]],
        sign: int,
    ) -> None:
        for name, value in amounts:
            key = (driver, pool, device, name)
            self.consumed[key] = self.consumed.get(key, Fraction(0)) + sign * value

    def record(self, result: AllocationResult) -> None:
        """An allocation the scheduler already made (a claim's result)."""
        key = (result.driver, result.pool, result.device)
        device = self.devices.get(key)
        if device is None:
            return  # a device no longer published: it takes nothing from what is
        if device.multiple:
            self.consume(*key, result.consumed, 1)
        else:
            self.taken.add(key)
        self.use(result.driver, result.pool, device, 1)


def _shares(request: DeviceRequest, device: DeviceView) -> tuple[tuple[str, Fraction], ...] | None:
    """What `request` would consume of each of the device's capacities; None if it cannot."""
    asked = dict(request.capacity)
    if any(device.capacity_of(name) is None for name in asked):
        return None
    found = []
    for name, capacity in device.capacity:
        value = round_up(asked.get(name), capacity)
        if value is None:
            return None
        found.append((name, value))
    return tuple(found)


def _short(request: DeviceRequest, device: DeviceView) -> bool:
    """Whether a device taken whole has less of a requested capacity than asked (or none)."""
    for name, value in request.capacity:
        capacity = device.capacity_of(name)
        if capacity is None or capacity.value < value:
            return True
    return False


def first_fit(
    slices: Iterable[SliceView],
    claims: Iterable[ClaimView],
    requests: Sequence[DeviceRequest],
) -> tuple[AllocationResult, ...] | None:
    """The allocation the scheduler makes for one claim on one node, or None when none fits.

    `slices` are the node's pools (all drivers it models); `claims` the claims allocated already.
    """
    pools = usable_pools(slices)
    state = _State(pools)
    for claim in claims:
        for result in claim.allocated:
            state.record(result)
    order = [
        _Candidate(driver, pool, device)
        for (driver, pool), views in pools.items()
        for view in views
        for device in view.devices
    ]
    chosen: list[AllocationResult] = []

    def matches(request: DeviceRequest, device: DeviceView) -> bool:
        return all(device.attribute(k) == v for k, v in request.match)

    def place(r: int, k: int, picked: frozenset[str]) -> bool:
        if r == len(requests):
            return True
        request = requests[r]
        if k == request.count:
            return place(r + 1, 0, frozenset())
        for candidate in order:
            device, driver, pool = candidate.device, candidate.driver, candidate.pool
            key = (driver, pool, device.name)
            if device.name in picked or not matches(request, device):
                continue
            if blocking_taints(device, request):
                continue
            if not device.multiple and key in state.taken:
                continue
            if not state.counters_fit(driver, pool, device):
                continue
            shares: tuple[tuple[str, Fraction], ...] = ()
            if device.multiple:
                found = _shares(request, device)
                if found is None or any(
                    state.consumed.get((*key, name), 0) + value > capacity.value
                    for (name, value), (_, capacity) in zip(found, device.capacity, strict=True)
                ):
                    continue
                shares = found
                state.consume(*key, shares, 1)
            else:
                if _short(request, device):
                    continue
                state.taken.add(key)
            state.use(driver, pool, device, 1)
            chosen.append(
                AllocationResult(request.name, driver, pool, device.name, consumed=shares)
            )
            if place(r, k + 1, picked | {device.name}):
                return True
            chosen.pop()
            state.use(driver, pool, device, -1)
            if device.multiple:
                state.consume(*key, shares, -1)
            else:
                state.taken.discard(key)
        return False

    return tuple(chosen) if place(0, 0, frozenset()) else None
