"""Shared-GPU admission: which pod and container a shared-slot Allocate is for, exactly or not at all.

The kubelet's Allocate names no pod: only device ids and their count. gpupart makes the pairing
exact by construction (docs/adr-001-shared-gpu-admission.md): the extender binds at most one
shared-GPU pod per node that the device plugin has not fully served, so at any time at most one
pod on a node awaits shared slots, and the kubelet calls Allocate once per container of that pod
in its own order (init containers, then app containers). The plugin records what each container
got in the pod's `gpupart.io/allocation` annotation before answering; the record is what the
extender waits for before binding the next shared pod there, and what a repeated Allocate for
devices the kubelet already gave is answered from. Anything else is refused with a message.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpupart.core.api.resources import (
    GPU_COMPUTE,
    GPU_MEMORY,
    GPU_SHARED,
    container_amounts,
    whole,
)
from gpupart.core.api.wire import GivenContainer, PodAssignment
from gpupart.core.errors import InvalidInput

TERMINAL_PHASES = frozenset({"Succeeded", "Failed"})
"""Pod phases after which the kubelet never allocates again."""


@dataclass(frozen=True, slots=True)
class SharedContainer:
    """One container that asks for shared-GPU replicas (client slots), with its own limits (0 = the GPU's default)."""

    name: str
    replicas: int
    memory_mib: int = 0
    compute_percent: int = 0
    init: bool = False


@dataclass(frozen=True, slots=True)
class AssignedPod:
    """A pod on this node that the extender gave a shared GPU, and what the plugin gave it so far."""

    uid: str
    namespace: str
    name: str
    assignment: PodAssignment
    containers: tuple[SharedContainer, ...]
    """Its containers that ask for slots, in the kubelet's Allocate order."""
    given: tuple[GivenContainer, ...] = ()
    """The `gpupart.io/allocation` record: what each served container got."""
    record_problem: str = ""
    """Set when the record is there but unreadable: the pod is never served again."""
    phase: str = "Pending"
    deleting: bool = False
    """The pod has a deletion timestamp (the kubelet admits it no more)."""

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def complete(self) -> bool:
        """Every container that asks for slots was served (an unreadable record counts as served)."""
        return bool(self.record_problem) or admission_complete(self.containers, self.given)

    @property
    def live(self) -> bool:
        return self.phase not in TERMINAL_PHASES and not self.deleting


@dataclass(frozen=True, slots=True)
class SharedAdmission:
    """The answer to one shared Allocate: the container it is for, or the record to repeat."""

    pod: AssignedPod
    container: SharedContainer | None
    """The next container of the one awaiting pod; None when `repeat` answers."""
    repeat: GivenContainer | None = None
    """The kubelet asks again for devices it gave a container already: the same answer."""


def admission_complete(
    containers: Iterable[SharedContainer], given: Iterable[GivenContainer]
) -> bool:
    served = {g.name for g in given}
    return all(c.name in served for c in containers)


def shared_containers(pod: Mapping[str, Any], *, where: str = "pod") -> tuple[SharedContainer, ...]:
    """The containers of a pod that ask for `nvidia.com/gpu.shared`, init containers first.

    That is the kubelet's Allocate order. A container's `gpupart.io/gpu-memory` and
    `gpupart.io/gpu-compute` are its own limits; on a container that asks for no slot they
    would reach no GPU, so they are refused.
    """
    spec = pod.get("spec", pod)
    if not isinstance(spec, Mapping):
        raise InvalidInput(f"{where}.spec", "must be a mapping")
    found = []
    for key, init in (("initContainers", True), ("containers", False)):
        containers = spec.get(key) or []
        if not isinstance(containers, list):
            raise InvalidInput(f"{where}.spec.{key}", "must be a list")
        for position, container in enumerate(containers):
            place = f"{where}.spec.{key}[{position}].resources"
            amounts = {
                name: whole(amount, path, amount)
                for name, (amount, path) in container_amounts(container, place)
            }
            slots, memory, compute = (
                amounts.get(n, 0) for n in (GPU_SHARED, GPU_MEMORY, GPU_COMPUTE)
            )
            if not slots:
                if memory or compute:
                    raise InvalidInput(
                        f"{place}.limits",
                        f"{GPU_MEMORY} and {GPU_COMPUTE} need {GPU_SHARED} in the same container",
                    )
                continue
            found.append(
                SharedContainer(str(container.get("name") or ""), slots, memory, compute, init)
            )
    return tuple(found)


def admit_shared(pods: Iterable[AssignedPod], *, node: str, ids: Sequence[str]) -> SharedAdmission:
    """Which container a shared Allocate of `ids` is for; InvalidInput names what stands in the way.

    A repeat first: the devices are exactly those a live, fully served pod's container got
    (the kubelet asks again when it lost its own record), answered as before. Otherwise the
    one live pod on `node` that is not fully served: its next container, whose slot count must
    be the number of ids. No such pod, or more than one, is refused rather than guessed.
    """
    here = _live_on(pods, node)
    wanted = frozenset(ids)
    repeats = {
        (pod.uid, given)
        for pod in here
        if pod.complete
        for given in pod.given
        if frozenset(given.devices) == wanted
    }
    if repeats:
        answers = {(g.gpu_uuid, g.memory_mib, g.compute_percent) for _, g in repeats}
        if len(answers) > 1:
            raise InvalidInput(
                "Allocate", f"devices {sorted(wanted)} were given to several containers before"
            )
        uid, given = min(repeats, key=lambda r: (r[0], r[1].name))
        return SharedAdmission(next(p for p in here if p.uid == uid), None, given)
    awaiting = sorted((p for p in here if not p.complete), key=lambda p: p.key)
    if not awaiting:
        raise InvalidInput(
            "Allocate",
            f"no pod bound to node {node} awaits shared GPU slots (every pod with a "
            "gpupart.io/assignment was served); is the gpupart scheduler extender configured?",
        )
    if len(awaiting) > 1:
        raise InvalidInput(
            "Allocate",
            f"{len(awaiting)} pods on node {node} await shared GPU slots at once "
            f"({', '.join(p.key for p in awaiting[:5])}): the kubelet names no pod, so gpupart "
            "refuses to guess; only one shared-GPU pod per node may await admission (is more "
            "than one extender binding here?)",
        )
    pod = awaiting[0]
    served = {g.name for g in pod.given}
    container = next(c for c in pod.containers if c.name not in served)
    if container.replicas != len(ids):
        raise InvalidInput(
            "Allocate",
            f"pod {pod.key} container {container.name} asks for {container.replicas} shared slot(s), "
            f"the kubelet allocated {len(ids)}",
        )
    return SharedAdmission(pod, container)


def awaiting_pod(pods: Iterable[AssignedPod], *, node: str) -> AssignedPod | None:
    """The one live pod on `node` that is not fully served, None when there is none or several."""
    awaiting = [p for p in _live_on(pods, node) if not p.complete]
    return awaiting[0] if len(awaiting) == 1 else None


def _live_on(pods: Iterable[AssignedPod], node: str) -> list[AssignedPod]:
    return [p for p in pods if p.assignment.node == node and p.live]
