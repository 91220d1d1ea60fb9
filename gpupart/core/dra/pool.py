"""A node's DRA pool: its ResourceSlice documents, and the publish plan from the slices that exist to the wanted ones.

Pool rules (dra.md §3): pool name = node name; counter sets in counters-only slices (at most
8 sets a slice), then one slice per GPU (split where a GPU has more devices than a slice
holds); every slice carries the pool's generation and the slice count; names are fixed by GPU
index, so the scheduler searches GPUs in index order and a re-order never renames.

The plan follows the Go publisher: when no slice is new or gone and at most one changes, that
one is updated and the generation kept (a re-order is one write); otherwise every slice is
written at the next generation, new ones created, and the obsolete ones deleted last. The
scheduler allocates only from a complete pool at its highest generation, so at no step is the
pool complete and wrong.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpupart.core.dra import names
from gpupart.core.dra.devices import GpuDevices
from gpupart.core.dra.read import SliceView, read_slice
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


def pool_slices(
    node: str, node_uid: str, gpus: Sequence[GpuDevices], *, generation: int = 0
) -> tuple[Slice, ...]:
    """Every slice of the node's pool, in name order; none when the node publishes nothing."""
    if not node:
        raise InvalidInput("node", "a pool needs the node's name")
    bodies: list[tuple[str, dict[str, Any]]] = []
    counter_sets = [g.counters for g in sorted(gpus, key=lambda g: g.index) if g.counters]
    for number in range(0, len(counter_sets), names.MAX_COUNTER_SETS):
        chunk = counter_sets[number : number + names.MAX_COUNTER_SETS]
        part = names.counters_slice_part(number // names.MAX_COUNTER_SETS)
        bodies.append((part, {"sharedCounters": list(chunk)}))
    indexes = [g.index for g in gpus]
    if len(set(indexes)) != len(indexes):
        raise InvalidInput("gpus", f"a GPU index appears twice: {sorted(indexes)}")
    for gpu in sorted(gpus, key=lambda g: g.index):
        # The API's smaller cap holds for a slice with counters or taints (a tainted GPU
        # has at most a few devices without counters, so its cut does not move).
        advanced = gpu.counters or any(d.get("taints") for d in gpu.devices)
        limit = names.MAX_DEVICES_WITH_COUNTERS if advanced else names.MAX_DEVICES
        part = names.gpu_slice_part(gpu.index)
        devices = list(gpu.devices)
        chunks = [devices[k : k + limit] for k in range(0, len(devices), limit)] or [[]]
        for k, chunk in enumerate(chunks):
            bodies.append((part if k == 0 else f"{part}-{k}", {"devices": chunk}))
    return tuple(
        _document(names.slice_name(node, part), node, node_uid, body, generation, len(bodies))
        for part, body in bodies
    )


@dataclass(frozen=True, slots=True)
class PublishPlan:
    """The writes that turn the pool's slices into the wanted ones, in this order: creates and
    updates (all at `generation`), then deletes."""

    generation: int
    creates: tuple[Slice, ...] = ()
    updates: tuple[Slice, ...] = ()
    deletes: tuple[str, ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.creates or self.updates or self.deletes)

    @property
    def bumps(self) -> bool:
        """Whether the plan moves the pool to a new generation."""
        return bool(self.creates or self.deletes) or len(self.updates) > 1


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
    if consistent and set(now) == set(views) and len(changed) <= 1:
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
    return PublishPlan(generation, creates, updates, deletes)
