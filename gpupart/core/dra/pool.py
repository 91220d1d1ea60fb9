"""A node's DRA pool: its ResourceSlice documents, and the publish plan from the slices that exist to the wanted ones.

Pool rules (dra.md §3, §9): pool name = node name; counter sets in counters-only slices (at most
8 sets a slice); then one slice per MIG profile across the node's GPUs (`mig-<m><c>-<profile>`,
in size order), one of the MPS and time-sliced GPUs (`shared`) and one of the whole GPUs
(`whole`), each split where it holds more devices than a slice may. Within a slice the devices
are in rank order across GPUs (`gpupart.core.dra.order`), so the scheduler's first fit picks
the GPU as well as the placement (docs/adr-032-dra-slices-by-profile.md). Every slice carries
the pool's generation and the slice count.

The plan writes only what changed. When no slice is new or gone and no device moved from one
slice to another (a re-order, a taint, an attribute), each changed slice is updated in place
and the generation kept: every mix of old and new slices is then a complete pool of the same
devices, each once. Otherwise every slice is written at the next generation, new ones created,
and the obsolete ones deleted last. The scheduler allocates only from a complete pool at its
highest generation, so at no step is the pool complete and wrong.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpupart.core.dra import names
from gpupart.core.dra.allocator import DeviceRequest, first_fit, usable_pools
from gpupart.core.dra.devices import Device, GpuDevices
from gpupart.core.dra.order import Rank
from gpupart.core.dra.read import ClaimView, SliceView, read_slice
from gpupart.core.dynamic.model import Mix
from gpupart.core.errors import InvalidInput

Slice = dict[str, Any]
"""A ResourceSlice document, as the API's JSON."""


def _metadata(name: str, node: str, node_uid: str) -> dict[str, Any]:
    return {
        "name": name,
        "ownerReferences": [
            {"apiVersion": "v1", "kind": "Node", "name": node, "uid": node_uid, "controller": True}
        ],
    }


def _document(
    name: str, node: str, node_uid: str, body: Mapping[str, Any], generation: int, count: int
) -> Slice:
    return {
        "apiVersion": names.API_VERSION,
        "kind": "ResourceSlice",
        "metadata": _metadata(name, node, node_uid),
        "spec": {
            "driver": names.DRIVER,
            "pool": {"name": node, "generation": generation, "resourceSliceCount": count},
            "nodeName": node,
            **body,
        },
    }


def slice_part(device: Mapping[str, Any]) -> str:
    """The slice a device of ours goes in: its MIG profile's, the shared GPUs' or the whole GPUs'."""
    attributes = device.get("attributes", {})
    kind = attributes.get(names.TYPE, {}).get("string")
    if kind == names.TYPE_MIG:
        return names.mig_slice_part(
            attributes[names.PROFILE]["string"],
            attributes[names.PLACEMENT_SIZE]["int"],
            attributes[names.COMPUTE_SLICES]["int"],
        )
    return names.SHARED_SLICE_PART if kind == names.TYPE_SHARED else names.WHOLE_SLICE_PART


def pool_slices(
    node: str, node_uid: str, gpus: Sequence[GpuDevices], *, generation: int = 0
) -> tuple[Slice, ...]:
    """Every slice of the node's pool, in name order; none when the node publishes nothing."""
    if not node:
        raise InvalidInput("node", "a pool needs the node's name")
    indexes = [g.index for g in gpus]
    if len(set(indexes)) != len(indexes):
        raise InvalidInput("gpus", f"a GPU index appears twice: {sorted(indexes)}")
    bodies: list[tuple[str, dict[str, Any]]] = []
    ordered = sorted(gpus, key=lambda g: g.index)
    counter_sets = [g.counters for g in ordered if g.counters]
    for number in range(0, len(counter_sets), names.MAX_COUNTER_SETS):
        chunk = counter_sets[number : number + names.MAX_COUNTER_SETS]
        part = names.counters_slice_part(number // names.MAX_COUNTER_SETS)
        bodies.append((part, {"sharedCounters": list(chunk)}))
    parts: dict[str, list[tuple[Rank, str, Device]]] = {}
    for gpu in ordered:
        names.check_gpu_index(gpu.index)
        for k, device in enumerate(gpu.devices):
            rank = gpu.ranks[k] if gpu.ranks else ()
            parts.setdefault(slice_part(device), []).append((rank, str(device["name"]), device))
    for part in sorted(parts):
        entries = sorted(parts[part], key=lambda e: e[:2])
        # The API's smaller cap holds for a slice with counters or taints.
        advanced = any(d.get("consumesCounters") or d.get("taints") for _, _, d in entries)
        limit = names.MAX_DEVICES_WITH_COUNTERS if advanced else names.MAX_DEVICES
        devices = [d for _, _, d in entries]
        for k in range(0, len(devices), limit):
            name = part if k == 0 else f"{part}-{k // limit}"
            bodies.append((name, {"devices": devices[k : k + limit]}))
    return tuple(
        _document(names.slice_name(node, part), node, node_uid, body, generation, len(bodies))
        for part, body in bodies
    )


def keep_choices(
    existing: Sequence[SliceView],
    wanted: Sequence[Slice],
    claims: Sequence[ClaimView],
    *,
    mix: Mix | None = None,
    reorders: int | None = 1,
) -> tuple[Slice, ...]:
    """`wanted`, except that a MIG slice holding the same devices as its published self keeps
    their published order unless re-ordering changes the device the scheduler's first fit
    gives one request of its profile (given `claims`, the pool's allocations); and of the
    slices whose next pick does change, only `reorders` are re-ordered (None: all), those of
    the profiles the demand `mix` asks most first, then by name.

    A change on one GPU re-ranks that GPU's placements in every profile's slice, but it
    seldom changes which device a profile gets next, and the next pick is what first fit over
    our order must agree with the core on (docs/adr-032-dra-slices-by-profile.md). A slice
    left behind keeps a valid order and is taken up again at the next change. A slice whose
    content changes otherwise (a taint, an attribute, its devices) is written as wanted.
    """
    if not usable_pools(existing):
        return tuple(wanted)  # the pool is written whole anyway
    now = {s.name: s for s in existing}
    shares = dict((mix or Mix()).shares)
    kept: list[Slice] = list(wanted)
    due: list[tuple[float, str, int, Slice]] = []
    for k, doc in enumerate(wanted):
        name = doc["metadata"]["name"]
        new, old = read_slice(doc), now.get(name)
        devices = doc["spec"].get("devices") or []
        attributes = devices[0].get("attributes", {}) if devices else {}
        profile = attributes.get(names.PROFILE, {}).get("string")
        if new is None or old is None or profile is None or old.content == new.content:
            continue
        if old.holds != new.holds:
            continue
        position = {d.name: n for n, d in enumerate(old.devices)}
        same = {
            **doc,
            "spec": {**doc["spec"], "devices": sorted(devices, key=lambda d: position[d["name"]])},
        }
        same_view = read_slice(same)
        if same_view is None or same_view.content != old.content:
            continue  # more than the order changed: written as wanted
        request = [DeviceRequest("next", ((names.TYPE, names.TYPE_MIG), (names.PROFILE, profile)))]
        picks = [
            first_fit([view if s.name == name else s for s in existing], claims, request)
            for view in (same_view, new)
        ]
        kept[k] = same
        if picks[0] != picks[1]:
            due.append((-shares.get(profile, 0.0), name, k, doc))
    for _, _, k, doc in sorted(due)[:reorders]:
        kept[k] = doc
    return tuple(kept)


@dataclass(frozen=True, slots=True)
class PublishPlan:
    """The writes that turn the pool's slices into the wanted ones, in this order: creates and
    updates (all at `generation`), then deletes."""

    generation: int
    creates: tuple[Slice, ...] = ()
    updates: tuple[Slice, ...] = ()
    deletes: tuple[str, ...] = ()
    bumps: bool = False
    """Whether the plan moves the pool to a new generation."""

    @property
    def empty(self) -> bool:
        return not (self.creates or self.updates or self.deletes)


def _with_pool(doc: Slice, generation: int, count: int) -> Slice:
    spec = {
        **doc["spec"],
        "pool": {**doc["spec"]["pool"], "generation": generation, "resourceSliceCount": count},
    }
    return {**doc, "spec": spec}


def publish_plan(existing: Sequence[SliceView], wanted: Sequence[Slice]) -> PublishPlan:
    """What to write so that the pool holds `wanted` (our own documents, any generation).

    `existing` are the pool's slices as read back (`read_slice`). Contents are compared as
    read, so the API server's re-spelling of a quantity (10240Mi as 10Gi) is no change.
    """
    views = {}
    for doc in wanted:
        view = read_slice(doc)
        if view is None:
            raise InvalidInput(
                "wanted", f"{doc['metadata']['name']} is not of driver {names.DRIVER}"
            )
        views[view.name] = view
    now = {s.name: s for s in existing}
    generations = {s.generation for s in existing}
    consistent = (
        len(generations) == 1
        and len(now) == len(existing)
        and all(s.slice_count == len(existing) for s in existing)
    )
    changed = [
        doc
        for doc in wanted
        if now.get(doc["metadata"]["name"]) is None
        or now[doc["metadata"]["name"]].content != views[doc["metadata"]["name"]].content
    ]
    count = len(wanted)
    in_place = len(changed) <= 1 or all(
        (old := now.get(d["metadata"]["name"])) is not None
        and old.holds == views[d["metadata"]["name"]].holds
        for d in changed
    )
    if consistent and set(now) == set(views) and in_place:
        generation = generations.pop()
        return PublishPlan(
            generation, updates=tuple(_with_pool(d, generation, count) for d in changed)
        )
    generation = max(generations, default=-1) + 1
    creates = tuple(
        _with_pool(d, generation, count) for d in wanted if d["metadata"]["name"] not in now
    )
    updates = tuple(
        _with_pool(d, generation, count) for d in wanted if d["metadata"]["name"] in now
    )
    deletes = tuple(sorted(name for name in now if name not in views))
    return PublishPlan(generation, creates, updates, deletes, bumps=True)
