"""Why a pod's DRA claims cannot be allocated on each node, in words, from our slices and the allocated claims.

The verdict is the allocator model's (`allocator.first_fit`, with `firstAvailable`
alternatives and `matchAttribute` constraints tried in turn): a node it can allocate on never
gets a "cannot" sentence, and every node it cannot does (a Hypothesis law, tests/core). The
words come from a per-device account of what is in the way, for the first request that no
longer fits: the device taken by a claim (named by its pod, from `reservedFor`), the shared
counters exhausted (a MIG placement overlapping another, a whole GPU split into MIG devices),
consumable capacity left against the amount asked, a taint the claim does not tolerate (a
faulty GPU's, ADR 028), no such device at all, or a pool the
scheduler does not allocate from because it is incomplete (a generation being rolled over).
Pure: the extender passes what it watched, read by `read`, `requests`.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction

from gpupart.core.dra import names
from gpupart.core.dra.allocator import (
    DeviceRequest,
    blocking_taints,
    first_fit,
    pool_contents,
    round_up,
    usable_pools,
)
from gpupart.core.dra.read import AllocationResult, ClaimView, DeviceView, SliceView
from gpupart.core.dra.requests import (
    Alternative,
    ClaimSpec,
    ClassView,
    PodClaims,
    extended_class,
)
from gpupart.core.scheduling.pending import pending_message

MAX_COMBINATIONS = 256
"""Alternatives x constraint values tried per node; a pod asking more is not modelled."""
_SHOWN = 3
"""Holders (and nodes) named before "and N more"."""
NO_DEVICES = "node(s) had no gpupart DRA devices"
INCOMPLETE = "node(s) had an incomplete gpupart pool (being republished)"
MiB = Fraction(1024 * 1024)


@dataclass(frozen=True, slots=True)
class Wanted:
    """One request of the pod as the model allocates it: its alternatives, in order."""

    name: str
    """`<claim>/<request>` (the pod's name for the claim), unique in the pod."""
    alternatives: tuple[DeviceRequest, ...]
    words: tuple[str, ...]
    """What each alternative asks of one device, in words ("4g.40gb", "whole GPU")."""


@dataclass(frozen=True, slots=True)
class DraAsk:
    """Everything one pending pod asks through DRA (`ask_of`)."""

    pod: str
    wanted: tuple[Wanted, ...] = ()
    constraints: tuple[tuple[frozenset[int], str], ...] = ()
    """matchAttribute constraints: (indexes into `wanted`, attribute), all devices of those
    requests share the attribute's value."""
    problem: str = ""
    """Why gpupart cannot explain the pod ("" when it can)."""
    notes: tuple[str, ...] = ()
    """What else holds it (a claim not made yet), said before the node reasons."""
    pinned: str = ""
    """The node where one of its claims is allocated already ("" none): only that node can take it."""


@dataclass(frozen=True, slots=True)
class NodeReason:
    node: str
    fits: bool
    text: str = ""
    """The sentence in full, naming the node ("" when it fits)."""
    summary: str = ""
    """The same without node or pod names, for counting ("" when it fits)."""


def ask_of(
    pod: str,
    asked: PodClaims,
    claims: Mapping[str, ClaimSpec],
    allocated: Mapping[str, ClaimView],
    classes: Mapping[str, ClassView],
    *,
    namespace: str,
) -> DraAsk:
    """The pod's requests (`pod_claims`) resolved against its claims' specs and the classes.

    `claims`, `allocated`: by `namespace/name`; `classes`: by name."""
    wanted: list[Wanted] = []
    constraints: list[tuple[frozenset[int], str]] = []
    notes: list[str] = []
    pinned = ""
    for own, claim_name, template in asked.claims:
        if claim_name is None:
            notes.append(
                f"its claim {own} is not made yet (the resourceclaim controller of "
                f"kube-controller-manager makes it from template {template})"
            )
            continue
        key = f"{namespace}/{claim_name}"
        done = allocated.get(key)
        if done is not None:
            pools = sorted({r.pool for r in done.results})
            pinned = pools[0] if pools else pinned
            continue
        spec = claims.get(key)
        if spec is None:
            notes.append(f"its claim {key} is not in gpupart's watch yet")
            continue
        first = len(wanted)
        for request in spec.requests:
            found, problem = _resolve(request.alternatives, classes, f"claim {key}")
            if problem:
                return DraAsk(pod, problem=problem)
            words = tuple(_words(a, r) for a, r in zip(request.alternatives, found, strict=True))
            wanted.append(Wanted(f"{own}/{request.name}", found, words))
        index = {w.name.split("/", 1)[1]: first + k for k, w in enumerate(wanted[first:])}
        for c in spec.constraints:
            if c.problem:
                return DraAsk(pod, problem=f"claim {key} has {c.problem}, not one gpupart models")
            applies = frozenset(
                index[r.split("/")[0]] for r in c.requests if r.split("/")[0] in index
            )
            constraints.append((applies or frozenset(index.values()), c.match_attribute))
    for resource, count in asked.extended:
        found_class = extended_class(resource, classes)
        if found_class is None:
            continue  # the device plugin's, or no class serves it: not DRA's to explain
        alternative = Alternative(resource, found_class.name, found_class.selector, count)
        found, problem = _resolve((alternative,), classes, f"extended resource {resource}")
        if problem:
            return DraAsk(pod, problem=problem)
        wanted.append(Wanted(resource, found, (_words(alternative, found[0]),)))
    return DraAsk(pod, tuple(wanted), tuple(constraints), notes=tuple(notes), pinned=pinned)


def _resolve(
    alternatives: Sequence[Alternative], classes: Mapping[str, ClassView], where: str
) -> tuple[tuple[DeviceRequest, ...], str]:
    found = []
    for a in alternatives:
        device_class = classes.get(a.device_class)
        if device_class is None:
            return (), f"{where} asks for device class {a.device_class}, which does not exist"
        if device_class.selector.problem:
            return (), (
                f"class {a.device_class}'s selector is not one gpupart reads "
                f"({device_class.selector.problem})"
            )
        if not device_class.ours:
            return (
                (),
                f"{where} asks for class {a.device_class} of driver {device_class.selector.driver}",
            )
        if a.selector.problem:
            return (
                (),
                f"{where}'s selector for {a.name} is not one gpupart reads ({a.selector.problem})",
            )
        if a.problem:
            return (), f"{where}: {a.problem}"
        if a.selector.driver not in ("", names.DRIVER):
            return (), f"{where}'s selector for {a.name} asks for driver {a.selector.driver}"
        match: dict[str, str | int | bool] = dict(device_class.selector.match)
        for key, value in a.selector.match:
            # Class and claim asking two values: no device has both, and the words say which.
            match[key] = value if match.get(key, value) == value else f"{match[key]} and {value}"
        found.append(
            DeviceRequest(a.name, tuple(sorted(match.items())), a.count, a.capacity, a.tolerations)
        )
    return tuple(found), ""


def _words(alternative: Alternative, request: DeviceRequest) -> str:
    match = dict(request.match)
    kind = match.pop(names.TYPE, None)
    profile = match.pop(names.PROFILE, None)
    if profile is not None:
        what = str(profile)
    elif kind == names.TYPE_GPU:
        what = "whole GPU"
    elif kind == names.TYPE_SHARED:
        what = "shared GPU"
    elif kind == names.TYPE_MIG:
        what = "MIG device"
    else:
        what = f"device of class {alternative.device_class}"
    extras = [f"{k} {v}" for k, v in match.items()]
    extras += [_amount(name, value) for name, value in request.capacity]
    if extras:
        what += f" ({', '.join(extras)})"
    return what


def _amount(name: str, value: Fraction) -> str:
    if name == names.MEMORY:
        return f"{_number(value / MiB)} MiB of memory"
    if name == names.COMPUTE:
        return f"{_number(value)} % compute"
    return f"{_number(value)} {name}"


def _number(value: Fraction) -> str:
    return str(value.numerator) if value.denominator == 1 else f"{float(value):.1f}"


# -- the verdict: the allocator model, over alternatives and constraint values --


def allocate(
    slices: Sequence[SliceView],
    claims: Sequence[ClaimView],
    wanted: Sequence[Wanted],
    constraints: Sequence[tuple[frozenset[int], str]] = (),
) -> tuple[AllocationResult, ...] | None:
    """The model's allocation of `wanted` on one node (its slices), or None: each choice of
    alternatives in order, each value of each constrained attribute (in device order).
    Raises ValueError past MAX_COMBINATIONS (the caller says it does not model the pod)."""
    values = []
    for _, attribute in constraints:
        seen: list[str | int | bool] = []
        for views in usable_pools(slices).values():
            for view in views:
                for device in view.devices:
                    value = device.attribute(attribute)
                    if value is not None and value not in seen:
                        seen.append(value)
        values.append(seen)
    choices = [range(len(w.alternatives)) for w in wanted]
    total = 1
    for c in (*choices, *values):
        total *= max(1, len(c))
    if total > MAX_COMBINATIONS:
        raise ValueError(f"{total} combinations of alternatives and constrained values")
    for picks in itertools.product(*choices):
        for chosen in itertools.product(*values):
            requests = []
            for k, w in enumerate(wanted):
                request = w.alternatives[picks[k]]
                extra = [
                    (attribute, value)
                    for (members, attribute), value in zip(constraints, chosen, strict=True)
                    if k in members
                ]
                if extra:
                    match = {**dict(request.match), **dict(extra)}
                    request = DeviceRequest(
                        w.name,
                        tuple(sorted(match.items())),
                        request.count,
                        request.capacity,
                        request.tolerations,
                    )
                else:
                    request = DeviceRequest(
                        w.name, request.match, request.count, request.capacity, request.tolerations
                    )
                requests.append(request)
            found = first_fit(slices, claims, requests)
            if found is not None:
                return found
    return None


# -- the words: what is in the way of each device --


@dataclass(frozen=True, slots=True)
class Block:
    """Why one device cannot take a request now."""

    kind: str
    """`taken`, `overlap` (memory slots held), `counters` (other shared counters used up),
    `capacity` (a device taken whole is too small), `left` (shared capacity used up),
    `policy` (more than one claim may get), `missing` (no such capacity), `tainted` (a taint
    the request does not tolerate: the node agent's after a GPU fault, ADR 028)."""
    holders: tuple[tuple[str, str], ...] = ()
    """(holder, what it holds) in the way."""
    detail: str = ""


class _Usage:
    """What the allocated claims take of a node's usable pools, and who holds it."""

    def __init__(self, pools: Mapping[tuple[str, str], Sequence[SliceView]]) -> None:
        self.devices, self.counters = pool_contents(pools)
        self.taken: dict[tuple[str, str, str], str] = {}
        self.used: dict[tuple[str, str, str, str], Fraction] = {}
        self.users: dict[tuple[str, str, str, str], list[tuple[str, str]]] = {}
        self.consumed: dict[tuple[str, str, str, str], Fraction] = {}
        self.sharers: dict[tuple[str, str, str], list[str]] = {}

    def record(self, result: AllocationResult, holder: str) -> None:
        key = (result.driver, result.pool, result.device)
        device = self.devices.get(key)
        if device is None:
            return
        if device.multiple:
            for name, value in result.consumed:
                at = (*key, name)
                self.consumed[at] = self.consumed.get(at, Fraction(0)) + value
            self.sharers.setdefault(key, []).append(holder)
        else:
            self.taken[key] = holder
        for set_name, amounts in device.consumes:
            for counter, value in amounts:
                at = (result.driver, result.pool, set_name, counter)
                self.used[at] = self.used.get(at, Fraction(0)) + value
                self.users.setdefault(at, []).append((holder, describe(device)))

    def blocks(self, key: tuple[str, str, str], request: DeviceRequest) -> list[Block]:
        """Everything that keeps device `key` from `request` now (empty: it is free), checked
        as `first_fit` checks it."""
        device = self.devices[key]
        if not device.multiple and key in self.taken:
            return [Block("taken", ((self.taken[key], ""),))]  # the rest follows from that
        taints = blocking_taints(device, request)
        if taints:
            # The scheduler does not look further at a device whose taint the claim does not tolerate.
            said = ", ".join(
                f"{t.key}={t.value}:{t.effect}" if t.value else f"{t.key}:{t.effect}"
                for t in taints
            )
            return [Block("tainted", detail=f"is tainted {said}")]
        found = []
        short: dict[bool, list[str]] = {True: [], False: []}
        holders: dict[bool, list[tuple[str, str]]] = {True: [], False: []}
        for set_name, amounts in device.consumes:
            for counter, value in amounts:
                at = (key[0], key[1], set_name, counter)
                if at not in self.counters or self.used.get(at, 0) + value > self.counters[at]:
                    slot = counter.startswith(names.MEMORY_SLICE_PREFIX)
                    short[slot].append(counter)
                    holders[slot] += self.users.get(at, [])
        # A held memory slot is the reason (the placement overlaps an allocated one); other
        # counters used up (compute slices, engines) only where no slot is in the way.
        for slot, kind in ((True, "overlap"), (False, "counters")):
            if short[slot]:
                found.append(Block(kind, _unique(holders[slot]), _counters(short[slot])))
                break
        asked = dict(request.capacity)
        if device.multiple:
            for name in asked:
                if device.capacity_of(name) is None:
                    found.append(Block("missing", detail=name))
            for name, shared in device.capacity:
                share = round_up(asked.get(name), shared)
                if share is None:
                    top = shared.policy.maximum if shared.policy else None
                    found.append(
                        Block(
                            "policy",
                            detail=f"gives at most {_amount(name, top or shared.value)} to "
                            f"one claim, {_amount(name, asked[name])} asked",
                        )
                    )
                    continue
                used = self.consumed.get((*key, name), Fraction(0))
                if used + share > shared.value:
                    sharers = tuple((h, "") for h in self.sharers.get(key, []))
                    found.append(
                        Block(
                            "left",
                            _unique(sharers),
                            f"has {_amount(name, shared.value - used)} left, "
                            f"{_amount(name, share)} asked",
                        )
                    )
        else:
            for name, value in request.capacity:
                capacity = device.capacity_of(name)
                if capacity is None:
                    found.append(Block("missing", detail=name))
                elif capacity.value < value:
                    found.append(
                        Block(
                            "capacity",
                            detail=f"has {_amount(name, capacity.value)}, "
                            f"{_amount(name, value)} asked",
                        )
                    )
        return found


def _counters(counters: Iterable[str]) -> str:
    """Counter names for words: the memory slices as slots."""
    slots = sorted(
        int(c.removeprefix(names.MEMORY_SLICE_PREFIX))
        for c in counters
        if c.startswith(names.MEMORY_SLICE_PREFIX)
    )
    others = sorted(c for c in counters if not c.startswith(names.MEMORY_SLICE_PREFIX))
    return ", ".join(([f"memory slots {_span(slots)}"] if slots else []) + others)


def _span(values: Sequence[int]) -> str:
    if len(values) > 1 and values == list(range(values[0], values[-1] + 1)):
        return f"{values[0]}-{values[-1]}"
    return ", ".join(str(v) for v in values)


def _unique(items: Iterable[tuple[str, str]]) -> tuple[tuple[str, str], ...]:
    seen: dict[tuple[str, str], None] = {}
    for item in items:
        seen.setdefault(item, None)
    return tuple(seen)


def describe(device: DeviceView) -> str:
    """A device in words: `1g.10gb at slot 2`, `3g.40gb at slots 0-3`, `the whole GPU`."""
    profile = device.attribute(names.PROFILE)
    start = device.attribute(names.PLACEMENT_START)
    size = device.attribute(names.PLACEMENT_SIZE)
    if profile is not None and isinstance(start, int) and isinstance(size, int):
        return f"{profile} at {_slots(start, size)}"
    kind = device.attribute(names.TYPE)
    if kind == names.TYPE_GPU:
        return "the whole GPU"
    if kind == names.TYPE_SHARED:
        return "a share"
    return f"device {device.name}"


def _slots(start: int, size: int) -> str:
    return f"slot {start}" if size == 1 else f"slots {start}-{start + size - 1}"


def _gpu_of(device: DeviceView) -> int | None:
    for attribute in (names.INDEX, names.PARENT_INDEX):
        value = device.attribute(attribute)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def holder_of(claim: ClaimView) -> str:
    """Who holds a claim: its pods (`reservedFor`), else the claim itself."""
    pods = [f"{claim.namespace}/{c.name}" for c in claim.reserved_for if c.resource == "pods"]
    if not pods:
        return f"claim {claim.key}"
    return ", ".join(pods[:_SHOWN]) + (
        f" and {len(pods) - _SHOWN} more" if len(pods) > _SHOWN else ""
    )


def _listed(items: Sequence[str]) -> str:
    shown = ", ".join(items[:_SHOWN])
    more = len(items) - _SHOWN
    return f"{shown} and {more} more" if more > 0 else shown


def free_devices(
    slices: Sequence[SliceView], claims: Sequence[ClaimView], request: DeviceRequest
) -> tuple[str, ...]:
    """The devices of the node's usable pools that could take `request` alone, now."""
    usage = _usage(slices, claims, ())
    return tuple(
        key[2]
        for key, device in usage.devices.items()
        if _matches(request, device) and not usage.blocks(key, request)
    )


def _usage(
    slices: Sequence[SliceView],
    claims: Sequence[ClaimView],
    own: Sequence[AllocationResult],
) -> _Usage:
    usage = _Usage(usable_pools(slices))
    for claim in claims:
        holder = holder_of(claim)
        for result in claim.allocated:
            usage.record(result, holder)
    for result in own:
        usage.record(result, f"this pod's request {result.request}")
    return usage


def _matches(request: DeviceRequest, device: DeviceView) -> bool:
    return all(device.attribute(k) == v for k, v in request.match)


def node_reason(
    node: str, slices: Sequence[SliceView], claims: Sequence[ClaimView], ask: DraAsk
) -> NodeReason:
    """Whether the node can take the pod's requests, and if not, why, in words.

    `slices`: the node's (every pool whose `nodeName` is the node); `claims`: every allocated
    claim (those of other pools take nothing here)."""
    if not slices:
        return NodeReason(
            node, False, f"{node}: no gpupart DRA devices (no ResourceSlice)", NO_DEVICES
        )
    if not usable_pools(slices):
        top = max(s.generation for s in slices)
        current = [s for s in slices if s.generation == top]
        return NodeReason(
            node,
            False,
            f"{node}: its gpupart pool is incomplete (generation {top}: {len(current)} of "
            f"{current[0].slice_count} slices); the scheduler allocates nothing from it until "
            "the node agent has published the rest",
            INCOMPLETE,
        )
    if ask.pinned and ask.pinned != node:
        return NodeReason(
            node,
            False,
            f"{node}: a claim of this pod is allocated on {ask.pinned}",
            "node(s) did not hold this pod's allocated claim",
        )
    try:
        if allocate(slices, claims, ask.wanted, ask.constraints) is not None:
            return NodeReason(node, True)
        own: tuple[AllocationResult, ...] = ()
        for k in range(len(ask.wanted)):
            inside = [(m & frozenset(range(k + 1)), a) for m, a in ask.constraints]
            found = allocate(slices, claims, ask.wanted[: k + 1], [c for c in inside if c[0]])
            if found is None:
                return _explain(node, slices, claims, ask.wanted[k], own, k > 0)
            own = found
    except ValueError as error:
        return NodeReason(
            node,
            False,
            f"{node}: gpupart does not model this pod ({error})",
            "node(s) not modelled",
        )
    # Every request fits alone, not all of them together with the constraints.
    return NodeReason(
        node,
        False,
        f"{node}: its requests fit one by one but not together under the claims' constraints",
        "node(s) could not meet the claims' constraints",
    )


def _explain(
    node: str,
    slices: Sequence[SliceView],
    claims: Sequence[ClaimView],
    wanted: Wanted,
    own: Sequence[AllocationResult],
    beside: bool,
) -> NodeReason:
    usage = _usage(slices, claims, own)
    parts = []
    summaries = []
    for request, words in zip(wanted.alternatives, wanted.words, strict=True):
        text, summary = _alternative_words(usage, request, words)
        parts.append(text)
        summaries.append(summary)
    lead = f"{node}: " + ("beside its other requests, " if beside else "")
    if len(parts) == 1:
        return NodeReason(node, False, lead + parts[0], summaries[0])
    return NodeReason(
        node,
        False,
        lead + "none of the alternatives fits: " + "; else ".join(parts),
        "node(s) had none of "
        + " or ".join(
            _counted(r.count, w) for r, w in zip(wanted.alternatives, wanted.words, strict=True)
        ),
    )


def _counted(count: int, what: str) -> str:
    return f"{count} x {what}" if count > 1 else what


def _alternative_words(usage: _Usage, request: DeviceRequest, what: str) -> tuple[str, str]:
    candidates = [
        (key, device) for key, device in usage.devices.items() if _matches(request, device)
    ]
    if not candidates:
        return f"no {what} device", f"node(s) had no {what} device"
    by_gpu: dict[int | None, list[tuple[tuple[str, str, str], DeviceView]]] = {}
    for key, device in candidates:
        by_gpu.setdefault(_gpu_of(device), []).append((key, device))
    parts = []
    free = 0
    for gpu in sorted(by_gpu, key=lambda g: (g is None, g or 0)):
        devices = by_gpu[gpu]
        blocked = [(device, usage.blocks(key, request)) for key, device in devices]
        open_ = [device for device, blocks in blocked if not blocks]
        free += len(open_)
        name = f"GPU {gpu}" if gpu is not None else f"device {devices[0][1].name}"
        if open_:
            parts.append(f"{name} has {len(open_)} free ({_places(open_)})")
        else:
            parts.append(_blocked_words(name, what, blocked))
    text = "; ".join(parts)
    if request.count > 1:
        text = f"{free} of the {request.count} x {what} asked are free: {text}"
        return text, f"node(s) had fewer than {request.count} free {what} devices"
    return text, f"node(s) had no free {what} device"


def _places(devices: Sequence[DeviceView]) -> str:
    return ", ".join(describe(d) for d in devices)


def _blocked_words(name: str, what: str, blocked: Sequence[tuple[DeviceView, list[Block]]]) -> str:
    """One GPU whose every candidate device is blocked."""
    kinds = {b.kind for _, blocks in blocked for b in blocks}
    named = list(
        dict.fromkeys(_holder(h, what) for _, blocks in blocked for b in blocks for h in b.holders)
    )
    if named and kinds <= {"taken", "overlap", "counters"}:
        if all(d.attribute(names.TYPE) == names.TYPE_GPU for d, _ in blocked):
            return f"{name} is taken by {_listed(named)}"
        places = [_place(d) for d, _ in blocked]
        if kinds <= {"taken", "overlap"} and all(places):
            return f"{name} has {what} only at {' and '.join(places)}, taken by {_listed(named)}"
    said = []
    for kind, detail in dict.fromkeys(
        (b.kind, b.detail) for _, blocks in blocked for b in blocks if b.kind != "taken"
    ):
        if kind in ("counters", "overlap"):
            said.append(f"has no {detail} left for {what}")
        elif kind == "missing":
            said.append(f"has no {detail} capacity")
        else:
            said.append(detail)
    text = f"{name} " + ("has every " + what + " taken" if not said else "; ".join(said))
    if named:
        text += f" (held by {_listed(named)})"
    return text


def _place(device: DeviceView) -> str:
    start = device.attribute(names.PLACEMENT_START)
    size = device.attribute(names.PLACEMENT_SIZE)
    if isinstance(start, int) and isinstance(size, int):
        return _slots(start, size)
    return ""


def _holder(holder: tuple[str, str], what: str) -> str:
    who, held = holder
    return f"{who} ({held})" if held and held.split(" at ")[0] != what else who


# -- the message --


def dra_message(ask: DraAsk, reasons: Sequence[NodeReason], *, others: Mapping[str, int]) -> str:
    """The Event text for a pod waiting on DRA claims: its notes, then the nodes, three with
    devices of ours in full and the rest counted (nodes without any only counted); `others`:
    nodes left out for reasons of their own (node selector), counted by text."""
    if ask.problem:
        return f"gpupart cannot explain this pod: {ask.problem}."
    if not ask.wanted and not ask.pinned and ask.notes:
        return "; ".join(ask.notes) + "."  # nothing to allocate yet: the nodes do not matter
    fits = [r.node for r in reasons if r.fits]
    failing = [r for r in reasons if not r.fits]
    detailed = sorted(failing, key=lambda r: (r.summary in (NO_DEVICES, INCOMPLETE), r.node))
    counted: dict[str, int] = {}
    for k, reason in enumerate(detailed):
        text = reason.text if k < _SHOWN and reason.summary != NO_DEVICES else reason.summary
        counted[text] = counted.get(text, 0) + 1
    for text, count in others.items():
        counted[text] = counted.get(text, 0) + count
    nodes = len(reasons) + sum(others.values())
    return pending_message(lead="; ".join(ask.notes), nodes=nodes, fits=fits, reasons=counted)
