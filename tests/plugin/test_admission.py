"""Shared-GPU admission: every container gets its own pod's GPU and limits, or a refusal, never another pod's.

We test these aspects:
- the pod spec's shared containers, in the kubelet's Allocate order, with their own limits;
- `admit_shared` refusals (no pod, several pods awaiting, a slot count that is not the container's);
- the Allocator end to end against a model of the kubelet's device manager (batches sorted by
  creation time, one Allocate per container, init-container devices reused by app containers,
  re-Allocate of devices already given, deletions, plugin restarts), with binds that follow the
  extender's one-pod-per-node rule and binds that ignore it: the answer for every container is
  its own pod's assignment and its own limits, or a refusal.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpupart.core.api.resources import GPU_SHARED
from gpupart.core.api.spec import Mode
from gpupart.core.api.wire import GivenContainer, PodAssignment
from gpupart.core.errors import GpupartError, InvalidInput
from gpupart.core.node.admission import (
    AssignedPod,
    SharedContainer,
    admit_shared,
    shared_containers,
)
from gpupart.core.node.devices import OfferedGpu
from gpupart_plugin.allocator import Allocator
from gpupart_plugin.devices import DeviceHub

NODE = "node-a"
GPU_MIB = 81920
DEFAULT_MIB, DEFAULT_PERCENT = 4096, 25


def container(name: str, slots: int, memory: int = 0, compute: int = 0) -> dict[str, object]:
    limits: dict[str, object] = {GPU_SHARED: str(slots)} if slots else {}
    if memory:
        limits["gpupart.io/gpu-memory"] = str(memory)
    if compute:
        limits["gpupart.io/gpu-compute"] = str(compute)
    return {"name": name, "resources": {"limits": limits}}


def test_shared_containers_are_in_kubelet_order_with_their_own_limits() -> None:
    pod = {
        "spec": {
            "initContainers": [container("fetch", 1, 2000), container("plain", 0)],
            "containers": [container("serve", 1, 30000, 40), container("sidecar", 0)],
        }
    }
    assert shared_containers(pod) == (
        SharedContainer("fetch", 1, 2000, 0, init=True),
        SharedContainer("serve", 1, 30000, 40),
    )


def test_memory_without_a_slot_in_the_same_container_is_refused() -> None:
    pod = {"spec": {"containers": [container("a", 1), container("b", 0, memory=1000)]}}
    with pytest.raises(InvalidInput, match=r"containers\[1\].*need nvidia.com/gpu.shared"):
        shared_containers(pod)


def pod(n: int, *containers: SharedContainer, **kw: object) -> AssignedPod:
    return AssignedPod(
        f"uid-{n}",
        "ml",
        f"pod-{n}",
        PodAssignment(str(kw.pop("node", NODE)), 0, "GPU-0"),
        containers or (SharedContainer("main", 1),),
        **kw,  # type: ignore[arg-type]
    )


def test_admit_refuses_rather_than_guess() -> None:
    with pytest.raises(InvalidInput, match="no pod bound to node node-a awaits"):
        admit_shared([pod(1, node="node-b")], node=NODE, ids=["GPU-0::0"])
    with pytest.raises(InvalidInput, match="2 pods on node node-a await.*ml/pod-1, ml/pod-2"):
        admit_shared([pod(1), pod(2)], node=NODE, ids=["GPU-0::0"])
    with pytest.raises(InvalidInput, match="container main asks for 1 shared slot.*allocated 2"):
        admit_shared([pod(1)], node=NODE, ids=["GPU-0::0", "GPU-0::1"])
    # Finished, deleted and unreadably recorded pods never await.
    others = [
        pod(2, phase="Failed"),
        pod(3, deleting=True),
        pod(4, record_problem="gpupart.io/allocation: not JSON"),
    ]
    assert admit_shared([pod(1), *others], node=NODE, ids=["GPU-0::0"]).pod.uid == "uid-1"


def test_admit_serves_containers_in_order_and_repeats_what_it_gave() -> None:
    init, app = SharedContainer("fetch", 1, 1000, init=True), SharedContainer("serve", 1, 9000)
    first = pod(1, init, app)
    assert admit_shared([first], node=NODE, ids=["GPU-0::0"]).container == init
    given = GivenContainer("fetch", ("GPU-0::0",), "GPU-0", 1000, 25)
    # The app container reuses the init container's slot: it is the next container, not a repeat.
    second = admit_shared([replace(first, given=(given,))], node=NODE, ids=["GPU-0::0"])
    assert second.container == app and second.repeat is None
    done = replace(first, given=(given, GivenContainer("serve", ("GPU-0::1",), "GPU-0", 9000, 25)))
    again = admit_shared([done, pod(2)], node=NODE, ids=["GPU-0::1"])
    assert again.pod.uid == "uid-1" and again.repeat == done.given[1]


# --- the Allocator against a model of the kubelet ---------------------------------------------


def mps_gpus(count: int) -> list[OfferedGpu]:
    return [
        OfferedGpu(
            i, f"GPU-{i}", "A100-SXM4-80GB", GPU_MIB, i, 0, Mode.MPS, replicas=4,
            mps_pipe_directory=f"/run/gpupart/mps/GPU-{i}/pipe",
            mps_memory_mib=DEFAULT_MIB, mps_compute_percent=DEFAULT_PERCENT,
        )
        for i in range(count)
    ]  # fmt: skip


@dataclass
class ApiServer:
    """The pods as the API server holds them (what the plugin lists and patches)."""

    pods: dict[str, AssignedPod] = field(default_factory=dict)
    created: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Creation second, then an arbitrary tie-break: the kubelet's order within one second."""
    fail_writes: bool = False

    def listed(self) -> tuple[AssignedPod, ...]:
        return tuple(p for p in self.pods.values() if p.live)

    def record(self, assigned: AssignedPod, given: tuple[GivenContainer, ...]) -> None:
        if self.fail_writes:
            raise GpupartError("API server unavailable")
        if assigned.uid in self.pods:
            self.pods[assigned.uid] = replace(self.pods[assigned.uid], given=given)


@dataclass
class Kubelet:
    """The device manager's side: admits pods one at a time, Allocate per container, keeps what it got."""

    api: ApiServer
    allocator: Allocator
    slots: list[str]
    queue: list[str] = field(default_factory=list)
    held: dict[str, dict[str, tuple[str, ...]]] = field(default_factory=dict)
    refused: list[str] = field(default_factory=list)
    """Messages of the plugin's refusals (pods rejected for want of free slots are not here)."""
    answers: dict[str, dict[str, dict[str, str]]] = field(default_factory=dict)

    def free(self) -> list[str]:
        used = {d for containers in self.held.values() for ids in containers.values() for d in ids}
        return [s for s in self.slots if s not in used]

    def admit_batch(self, size: int) -> list[tuple[str, str, dict[str, str]]]:
        """Admit up to `size` queued pods, sorted by creation time as HandlePodAdditions does."""
        batch, self.queue = self.queue[:size], self.queue[size:]
        out = []
        for uid in sorted(batch, key=lambda u: self.api.created[u]):
            assigned = self.api.pods.get(uid)
            if assigned is None or not assigned.live:
                continue
            out.extend(self._admit(assigned))
        return out

    def _admit(self, assigned: AssignedPod) -> list[tuple[str, str, dict[str, str]]]:
        got: dict[str, tuple[str, ...]] = {}
        reusable: list[str] = []
        out = []
        for c in assigned.containers:
            take = reusable[: c.replicas] if not c.init else []
            reusable = reusable[len(take) :]
            free = [s for s in self.free() if s not in {d for ids in got.values() for d in ids}]
            if len(free) < c.replicas - len(take):
                self._reject(assigned)
                return out
            ids = (*take, *free[: c.replicas - len(take)])
            try:
                answer = self.allocator.allocate(GPU_SHARED, list(ids))
            except GpupartError as error:
                self.refused.append(str(error))
                self._reject(assigned)
                return out
            got[c.name] = ids
            if c.init:
                reusable.extend(ids)
            envs = dict(answer.envs)
            self.answers.setdefault(assigned.uid, {})[c.name] = envs
            out.append((assigned.uid, c.name, envs))
        self.held[assigned.uid] = got
        return out

    def reallocate(self, uid: str) -> tuple[str, str, dict[str, str]] | None:
        """The re-Allocate of a container's devices after the kubelet lost its own state."""
        got = self.held.get(uid)
        if not got:
            return None
        name, ids = sorted(got.items())[0]
        answer = self.allocator.allocate(GPU_SHARED, list(ids))
        return uid, name, dict(answer.envs)

    def _reject(self, assigned: AssignedPod) -> None:
        # UnexpectedAdmissionError: the pod fails, and whatever it got is released.
        self.api.pods[assigned.uid] = replace(assigned, phase="Failed")
        self.held.pop(assigned.uid, None)


def expected_envs(assigned: AssignedPod, name: str) -> tuple[str, str, str]:
    c = next(c for c in assigned.containers if c.name == name)
    gpu = assigned.assignment.gpu_uuid
    return (
        gpu,
        f"{gpu}={c.memory_mib or DEFAULT_MIB}M",
        str(c.compute_percent or DEFAULT_PERCENT),
    )


containers_st = st.lists(
    st.tuples(st.booleans(), st.integers(1, 2), st.sampled_from([0, 5000, 15000, 30000])),
    min_size=1,
    max_size=3,
).map(
    lambda cs: tuple(
        SharedContainer(f"{'init' if init else 'app'}-{i}", slots, memory, memory // 1000, init)
        for i, (init, slots, memory) in enumerate(sorted(cs, key=lambda c: not c[0]))
    )
)
step_st = st.one_of(
    st.tuples(
        st.just("create"), containers_st, st.integers(0, 1), st.integers(0, 2), st.integers(0, 9)
    ),
    st.tuples(st.just("admit"), st.integers(1, 4)),
    st.tuples(st.just("delete"), st.integers(0, 20)),
    st.tuples(st.just("restart")),
    st.tuples(st.just("reallocate"), st.integers(0, 20)),
    st.tuples(st.just("writes"), st.booleans()),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(step_st, min_size=4, max_size=40), st.booleans())
def test_every_container_gets_its_own_pods_gpu_and_limits_or_a_refusal(
    steps: list[tuple[object, ...]], gated: bool
) -> None:
    """Over random bursts (equal creation seconds), batches, deletions, restarts and re-Allocates.

    `gated`: binds follow the extender's rule (a pod is bound only when no other pod on the
    node awaits its slots); otherwise binds come in any order and the plugin must refuse.
    """
    hub = DeviceHub()
    hub.set_gpus(mps_gpus(2))
    api = ApiServer()

    def allocator() -> Allocator:
        return Allocator(hub, NODE, api.listed, api.record)

    kubelet = Kubelet(api, allocator(), list(hub.devices(GPU_SHARED)))
    pending: list[AssignedPod] = []  # created, not yet bound (the gate holds them)
    seen: list[tuple[str, str, dict[str, str]]] = []
    n = 0
    writes_failed = False

    def bind_what_may() -> None:
        while pending:
            if gated and any(not p.complete for p in api.listed()):
                return
            assigned = pending.pop(0)
            api.pods[assigned.uid] = assigned
            kubelet.queue.append(assigned.uid)

    for step in steps:
        kind = step[0]
        if kind == "create":
            _, containers, gpu, second, tie = step
            n += 1
            assigned = AssignedPod(
                f"uid-{n}", "ml", f"p{n}", PodAssignment(NODE, int(gpu), f"GPU-{gpu}"),
                containers,  # type: ignore[arg-type]
            )  # fmt: skip
            api.created[assigned.uid] = (int(second), int(tie))  # 1 s resolution: bursts tie
            pending.append(assigned)
        elif kind == "admit":
            seen.extend(kubelet.admit_batch(int(step[1])))  # type: ignore[call-overload]
        elif kind == "delete" and api.pods:
            uid = sorted(api.pods)[int(step[1]) % len(api.pods)]  # type: ignore[call-overload]
            api.pods[uid] = replace(api.pods[uid], deleting=True)
            kubelet.held.pop(uid, None)
        elif kind == "restart":
            kubelet.allocator = allocator()  # a new plugin process: memory gone
        elif kind == "reallocate" and kubelet.held:
            uid = sorted(kubelet.held)[int(step[1]) % len(kubelet.held)]  # type: ignore[call-overload]
            try:
                again = kubelet.reallocate(uid)
            except GpupartError:
                again = None
            if again is not None:
                seen.append(again)
                assert again[2] == kubelet.answers[uid][again[1]]  # the same answer as before
        elif kind == "writes":
            api.fail_writes = bool(step[1])
            writes_failed |= api.fail_writes
        bind_what_may()

    for uid, name, envs in seen:
        gpu, memory, compute = expected_envs(api.pods[uid], name)
        assert envs["NVIDIA_VISIBLE_DEVICES"] == gpu, (uid, name)
        assert envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == memory, (uid, name)
        assert envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == compute, (uid, name)
    if gated and not writes_failed:
        # With the extender's rule and a working API the plugin refuses nothing.
        assert kubelet.refused == []


def test_mps_limits_are_the_served_pods_own_not_those_of_the_first_listed_pod() -> None:
    # Served pods with their own limits are listed before the one awaiting its Allocate: the
    # answer carries the awaiting container's figures, or the GPU's defaults when it has none.
    hub = DeviceHub()
    hub.set_gpus(mps_gpus(1))
    early = GivenContainer("main", ("GPU-0::0",), "GPU-0", 2000, 10)
    served = pod(1, SharedContainer("main", 1, 2000, 10), given=(early,))
    plain = pod(2, SharedContainer("main", 1), given=(replace(early, devices=("GPU-0::1",)),))
    awaiting = pod(3, SharedContainer("main", 1, 30000, 40))
    defaults = pod(4, SharedContainer("main", 1))
    for listed, ids, memory, compute in (
        ((served, plain, awaiting), ["GPU-0::2"], 30000, 40),
        ((awaiting, served), ["GPU-0::2"], 30000, 40),
        ((served, defaults), ["GPU-0::3"], DEFAULT_MIB, DEFAULT_PERCENT),
    ):
        allocator = Allocator(hub, NODE, lambda listed=listed: listed, lambda _p, _g: None)
        envs = dict(allocator.allocate(GPU_SHARED, ids).envs)
        assert envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"GPU-0={memory}M", listed
        assert envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == str(compute), listed
