"""Shared-GPU admission: every container gets its own pod's GPU and limits, or a refusal, never another pod's.

We test these aspects:
- the pod spec's shared containers, in the kubelet's Allocate order, with their own limits;
- which pods the agent believes (`read_shared_pod`): only assignments signed by the extender's
  key for that pod's UID and node; missing, forged, copied, edited or keyless ones are named;
- `admit_shared` refusals (no pod, several pods awaiting, an unverified pod awaiting, a slot
  count that is not the container's, slots of another GPU, a GPU without room);
- the Allocator end to end against a model of the kubelet's device manager (batches sorted by
  creation time, GetPreferredAllocation then one Allocate per container, init-container
  devices reused by app containers, re-Allocate of devices already given, deletions, plugin
  restarts that keep the checkpoint), with binds that follow the extender's one-pod-per-node
  rule and binds that ignore it, and with tenants' pods that preset spec.nodeName and carry no,
  forged, copied or edited assignments and pre-set allocation records: the answer for every
  container is its own pod's verified GPU and its own limits, or a refusal; no tenant's pod is
  ever served; no GPU holds more than its memory and 100 % compute;
- the checkpoint: written atomically, read back by a new process, an unreadable one refuses
  shared Allocates and nothing else.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpupart.core.api.pods import SharedContainer, parse_pod_request, shared_containers
from gpupart.core.api.provenance import sign
from gpupart.core.api.resources import GPU_SHARED
from gpupart.core.api.spec import Mode
from gpupart.core.api.wire import (
    ALLOCATION_CONDITION,
    ASSIGNMENT_ANNOTATION,
    GivenContainer,
    PodAssignment,
    allocation_condition,
    allocation_record,
    decode_allocation,
    encode_allocation,
    encode_assignment,
)
from gpupart.core.errors import GpupartError, InvalidInput
from gpupart.core.node.admission import (
    AdmissionRecord,
    AdmissionRefused,
    SharedPod,
    admission_complete,
    admit_shared,
    read_shared_pod,
)
from gpupart.core.node.devices import OfferedGpu
from gpupart.signing import PrivateKeys
from gpupart_plugin.checkpoint import CHECKPOINT_NAME, Checkpoint
from gpupart_plugin.deviceplugin.allocator import Allocator
from gpupart_plugin.deviceplugin.hub import DeviceHub

NODE = "node-a"
GPU_MIB = 81920
PLANTED_RECORD = "gpupart.io/allocation"
"""A tenant's record of what its pod got: the annotation the record was before ADR 034."""
DEFAULT_MIB, DEFAULT_PERCENT = 15000, 25
"""The MPS daemon's per-client ceilings: 30000 MiB (30 %) containers are above them."""
KEYS = PrivateKeys((b"k" * 32,))
OTHER_KEYS = PrivateKeys((b"x" * 32,))


def container(name: str, slots: int, memory: int = 0, compute: int = 0) -> dict[str, Any]:
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


# --- what the agent believes ------------------------------------------------------------------


def raw_pod(
    uid: str,
    containers: list[dict[str, Any]],
    *,
    node: str = NODE,
    annotations: dict[str, str] | None = None,
    phase: str = "Pending",
    init: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    return {
        "metadata": {
            "uid": uid,
            "namespace": "ml",
            "name": f"p-{uid}",
            "annotations": annotations or {},
        },
        "spec": {"nodeName": node, "containers": containers, "initContainers": init or []},
        "status": {"phase": phase},
    }


def signed(uid: str, gpu: int = 0, memory: int = 0, compute: int = 0, node: str = NODE) -> str:
    assignment = PodAssignment(node, gpu, f"GPU-{gpu}", memory, compute, pod_uid=uid)
    return encode_assignment(sign(assignment, KEYS))


def test_only_the_extenders_assignment_for_this_pod_and_node_is_believed() -> None:
    genuine = signed("u1", memory=5000)
    edited = json.loads(genuine)
    edited["memoryMiB"] = 80000
    unsigned = encode_assignment(PodAssignment(NODE, 0, "GPU-0", 5000, pod_uid="u1"))
    other_key = encode_assignment(sign(PodAssignment(NODE, 0, "GPU-0", pod_uid="u1"), OTHER_KEYS))
    cases = {
        "genuine": (genuine, "u1", NODE, ""),
        "copied from another pod": (genuine, "u2", NODE, "made for pod UID 'u1'"),
        "edited": (json.dumps(edited), "u1", NODE, "does not verify"),
        "unsigned": (unsigned, "u1", NODE, "carries no signature"),
        "another key": (other_key, "u1", NODE, "not one of the extender's published public keys"),
        "another node": (genuine, "u1", "node-b", "made for node 'node-a'"),
        "not JSON": ("{", "u1", NODE, "unreadable"),
    }
    for case, (text, uid, node, problem) in cases.items():
        pod = read_shared_pod(
            raw_pod(uid, [container("c", 1, 5000)], node=node, annotations={ASSIGNMENT_ANNOTATION: text}),
            KEYS,
        )  # fmt: skip
        assert pod is not None, case
        assert (problem in pod.problem) if problem else pod.problem == "", (case, pod.problem)
    bare = read_shared_pod(raw_pod("u3", [container("c", 1)]), KEYS)
    assert bare is not None and "has no gpupart.io/assignment" in bare.problem
    keyless = read_shared_pod(
        raw_pod("u1", [container("c", 1)], annotations={ASSIGNMENT_ANNOTATION: genuine}),
        "/etc/keys: no such file",
    )
    assert (
        keyless is not None
        and "cannot verify" in keyless.problem
        and "/etc/keys" in keyless.problem
    )
    # A pod that asks for no slot is none of the allocator's business, whatever it carries.
    forged_record = encode_allocation((GivenContainer("c", ("GPU-0::0",), "GPU-0", GPU_MIB, 100),))
    cpu_only = raw_pod(
        "u4", [{"name": "c"}], annotations={ASSIGNMENT_ANNOTATION: genuine, PLANTED_RECORD: forged_record}
    )  # fmt: skip
    assert read_shared_pod(cpu_only, KEYS) is None


def test_a_pod_whose_spec_is_unreadable_but_asks_for_slots_blocks_rather_than_hides() -> None:
    # A tenant's pod with a malformed shared container may be the pod being admitted: if the
    # agent skipped it, its Allocate would be paired with the one honest pod awaiting.
    broken = raw_pod("u5", [container("a", 1), container("b", 0, memory=1000)])
    pod = read_shared_pod(broken, KEYS)
    assert pod is not None and "spec is unreadable" in pod.problem
    honest = SharedPod(
        "u1",
        "ml",
        "honest",
        NODE,
        PodAssignment(NODE, 0, "GPU-0", pod_uid="u1"),
        (SharedContainer("main", 1),),
    )
    with pytest.raises(AdmissionRefused, match="2 pods on node node-a await.*spec is unreadable"):
        admit_shared([honest, pod], {}, node=NODE, ids=["GPU-0::0"], gpu=GPU0)
    # One that names no shared slot anywhere is none of the allocator's business.
    with pytest.raises(InvalidInput):
        read_shared_pod(
            raw_pod("u6", [{"name": "c", "resources": {"limits": {"gpupart.io/gpu-memory": "x"}}}]),
            KEYS,
        )


def shared_pod(n: int, *containers: SharedContainer, **kw: Any) -> SharedPod:
    gpu = int(kw.pop("gpu", 0))
    memory = int(kw.pop("memory", 0))
    return SharedPod(
        f"uid-{n}",
        "ml",
        f"pod-{n}",
        str(kw.pop("node", NODE)),
        PodAssignment(NODE, gpu, f"GPU-{gpu}", memory, pod_uid=f"uid-{n}"),
        containers or (SharedContainer("main", 1),),
        **kw,
    )


def mps_gpus(count: int) -> list[OfferedGpu]:
    return [
        OfferedGpu(
            i, f"GPU-{i}", "A100-SXM4-80GB", GPU_MIB, i, 0, Mode.MPS, replicas=4,
            mps_pipe_directory=f"/run/gpupart/mps/GPU-{i}/pipe",
            mps_memory_mib=DEFAULT_MIB, mps_compute_percent=DEFAULT_PERCENT,
        )
        for i in range(count)
    ]  # fmt: skip


GPU0, GPU1 = mps_gpus(2)


def test_admit_refuses_rather_than_guess() -> None:
    ids = ["GPU-0::0"]
    with pytest.raises(AdmissionRefused, match="no pod bound to node node-a awaits"):
        admit_shared([shared_pod(1, node="node-b")], {}, node=NODE, ids=ids, gpu=GPU0)
    with pytest.raises(AdmissionRefused, match="2 pods on node node-a await.*ml/pod-1; ml/pod-2"):
        admit_shared([shared_pod(1), shared_pod(2)], {}, node=NODE, ids=ids, gpu=GPU0)
    # A tenant's pod without a verified assignment may be the one being admitted: no guess.
    tenant = shared_pod(2, problem="it has no gpupart.io/assignment")
    with pytest.raises(AdmissionRefused, match="2 pods.*ml/pod-2 \\(it has no") as refused:
        admit_shared([shared_pod(1), tenant], {}, node=NODE, ids=ids, gpu=GPU0)
    assert set(refused.value.pods) == {"ml/pod-1", "ml/pod-2"}
    with pytest.raises(AdmissionRefused, match="pod ml/pod-2 is not served: it has no"):
        admit_shared([tenant], {}, node=NODE, ids=ids, gpu=GPU0)
    with pytest.raises(
        AdmissionRefused, match="container main asks for 1 shared slot.*allocated 2"
    ):
        admit_shared([shared_pod(1)], {}, node=NODE, ids=["GPU-0::0", "GPU-0::1"], gpu=GPU0)
    with pytest.raises(
        AdmissionRefused, match="assigned GPU GPU-1, the kubelet allocated slots of GPU GPU-0"
    ):
        admit_shared([shared_pod(1, gpu=1)], {}, node=NODE, ids=ids, gpu=GPU0)
    # Finished and deleted pods never await.
    others = [shared_pod(2, phase="Failed"), shared_pod(3, deleting=True)]
    assert (
        admit_shared([shared_pod(1), *others], {}, node=NODE, ids=ids, gpu=GPU0).pod.uid == "uid-1"
    )


def test_admit_checks_the_gpus_room_against_what_it_served_there() -> None:
    big = shared_pod(1, SharedContainer("main", 1, 60000), memory=60000)
    served = AdmissionRecord(
        "uid-1",
        "ml/pod-1",
        "GPU-0",
        60000,
        0,
        (GivenContainer("main", ("GPU-0::0",), "GPU-0", 60000, 25),),
    )
    other = shared_pod(2, SharedContainer("main", 1, 30000), memory=30000)
    with pytest.raises(
        AdmissionRefused,
        match="does not fit on GPU GPU-0: 21920 of 81920 MiB free, 30000 MiB assigned",
    ):
        admit_shared([big, other], {"uid-1": served}, node=NODE, ids=["GPU-0::1"], gpu=GPU0)
    # The same pod on the other GPU fits; and once the big pod is gone, on this one too.
    elsewhere = replace(other, assignment=replace(other.assignment, gpu=1, gpu_uuid="GPU-1"))
    assert admit_shared(
        [big, elsewhere], {"uid-1": served}, node=NODE, ids=["GPU-1::0"], gpu=GPU1
    ).container
    assert admit_shared([other], {"uid-1": served}, node=NODE, ids=["GPU-0::1"], gpu=GPU0).container
    # A container never gets more memory than its pod's assignment counted.
    greedy = shared_pod(3, SharedContainer("main", 1, 40000), memory=1)
    with pytest.raises(AdmissionRefused, match="asks for 40000 MiB, its assignment counts 1 MiB"):
        admit_shared([greedy], {}, node=NODE, ids=["GPU-0::1"], gpu=GPU0)


def test_admit_serves_containers_in_order_and_repeats_only_its_own_records() -> None:
    init, app = SharedContainer("fetch", 1, 1000, init=True), SharedContainer("serve", 1, 9000)
    first = shared_pod(1, init, app, memory=9000)
    assert admit_shared([first], {}, node=NODE, ids=["GPU-0::0"], gpu=GPU0).container == init
    given = GivenContainer("fetch", ("GPU-0::0",), "GPU-0", 1000, 25)
    record = AdmissionRecord("uid-1", "ml/pod-1", "GPU-0", 9000, 0, (given,))
    # The app container reuses the init container's slot: it is the next container, not a repeat.
    second = admit_shared([first], {"uid-1": record}, node=NODE, ids=["GPU-0::0"], gpu=GPU0)
    assert second.container == app and second.repeat is None
    done = replace(record, given=(given, GivenContainer("serve", ("GPU-0::1",), "GPU-0", 9000, 25)))
    again = admit_shared(
        [first, shared_pod(2)], {"uid-1": done}, node=NODE, ids=["GPU-0::1"], gpu=GPU0
    )
    assert again.pod.uid == "uid-1" and again.repeat == done.given[1]


# --- the Allocator against a model of the kubelet ---------------------------------------------


@dataclass
class ApiServer:
    """The pods as the API server holds them (plain dicts, what the plugin lists and patches)."""

    pods: dict[str, dict[str, Any]] = field(default_factory=dict)
    created: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Creation second, then an arbitrary tie-break: the kubelet's order within one second."""
    fail_writes: bool = False

    def listed(self) -> tuple[SharedPod, ...]:
        found = []
        for raw in self.pods.values():
            if raw["status"]["phase"] in ("Succeeded", "Failed"):
                continue
            pod = read_shared_pod(raw, KEYS)
            if pod is not None:
                found.append(pod)
        return tuple(found)

    def record(self, pod: SharedPod, given: tuple[GivenContainer, ...]) -> None:
        if self.fail_writes:
            raise GpupartError("API server unavailable")
        conditions = self.pods[pod.uid]["status"].setdefault("conditions", [])
        conditions[:] = [c for c in conditions if c["type"] != ALLOCATION_CONDITION]
        conditions.append(allocation_condition(given, "2026-01-01T00:00:00Z"))

    def live(self, uid: str) -> bool:
        raw = self.pods.get(uid)
        return (
            raw is not None
            and raw["status"]["phase"] not in ("Succeeded", "Failed")
            and not raw["metadata"].get("deletionTimestamp")
        )


@dataclass
class Kubelet:
    """The device manager's side: admits pods one at a time, asks the plugin's preference, Allocate per container."""

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
            if self.api.live(uid):
                out.extend(self._admit(uid))
        return out

    def _admit(self, uid: str) -> list[tuple[str, str, dict[str, str]]]:
        containers = shared_containers(self.api.pods[uid])
        got: dict[str, tuple[str, ...]] = {}
        reusable: list[str] = []
        out = []
        for c in containers:
            # The device manager's devicesToReuse: an init container's devices serve the
            # next init container and then the app containers, each taking from them first.
            take = reusable[: c.replicas]
            free = [s for s in self.free() if s not in {d for ids in got.values() for d in ids}]
            if len(free) < c.replicas - len(take):
                self._reject(uid)
                return out
            # GetPreferredAllocation, as the real kubelet asks a plugin that offers it.
            preferred = self.allocator.preferred(GPU_SHARED, free, take, c.replicas)
            ids = (*take, *[p for p in preferred if p not in take][: c.replicas - len(take)])
            try:
                answer = self.allocator.allocate(GPU_SHARED, list(ids))
            except GpupartError as error:
                self.refused.append(str(error))
                self._reject(uid)
                return out
            got[c.name] = ids
            if c.init:
                reusable.extend(d for d in ids if d not in reusable)
            else:
                reusable = [d for d in reusable if d not in ids]
            envs = dict(answer.envs)
            self.answers.setdefault(uid, {})[c.name] = envs
            out.append((uid, c.name, envs))
        self.held[uid] = got
        return out

    def reallocate(self, uid: str) -> tuple[str, str, dict[str, str]] | None:
        """The re-Allocate of a container's devices after the kubelet lost its own state."""
        got = self.held.get(uid)
        if not got:
            return None
        name, ids = sorted(got.items())[0]
        answer = self.allocator.allocate(GPU_SHARED, list(ids))
        return uid, name, dict(answer.envs)

    def _reject(self, uid: str) -> None:
        # UnexpectedAdmissionError: the pod fails, and whatever it got is released.
        self.api.pods[uid]["status"]["phase"] = "Failed"
        self.held.pop(uid, None)


containers_st = st.lists(
    st.tuples(st.booleans(), st.integers(1, 2), st.sampled_from([0, 5000, 15000, 30000])),
    min_size=1,
    max_size=3,
).map(
    lambda cs: tuple(
        (
            f"{'init' if init else 'app'}-{i}",
            init,
            container(f"{'init' if init else 'app'}-{i}", slots, memory, memory // 1000),
        )
        for i, (init, slots, memory) in enumerate(sorted(cs, key=lambda c: not c[0]))
    )
)
FORGERIES = ("none", "unsigned", "copied", "edited", "record")
step_st = st.one_of(
    st.tuples(
        st.just("create"), containers_st, st.integers(0, 1), st.integers(0, 2), st.integers(0, 9)
    ),
    st.tuples(
        st.just("tenant"),
        containers_st,
        st.sampled_from(FORGERIES),
        st.integers(0, 2),
        st.integers(0, 9),
    ),
    st.tuples(st.just("admit"), st.integers(1, 4)),
    st.tuples(st.just("delete"), st.integers(0, 20)),
    st.tuples(st.just("restart")),
    st.tuples(st.just("reallocate"), st.integers(0, 20)),
    st.tuples(st.just("writes"), st.booleans()),
)


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(step_st, min_size=4, max_size=40), st.booleans())
def test_every_container_gets_its_own_pods_gpu_and_limits_or_a_refusal(
    tmp_path: Path, steps: list[tuple[Any, ...]], gated: bool
) -> None:
    """Over random bursts (equal creation seconds), batches, deletions, restarts, re-Allocates and tenants.

    `gated`: binds follow the extender's rule (a pod is bound only when no other pod on the
    node awaits its slots, on a GPU with room); otherwise binds come in any order and the
    plugin must refuse. Tenants' pods preset spec.nodeName (no extender, no gate) and carry no
    assignment, an unsigned one, one copied from a served pod, a signed one edited to more
    memory, or a pre-set allocation record claiming the whole GPU.
    """
    state = tmp_path / f"state-{len(list(tmp_path.iterdir()))}"
    hub = DeviceHub()
    hub.set_gpus(mps_gpus(2))
    api = ApiServer()

    def allocator() -> Allocator:
        return Allocator(hub, NODE, api.listed, api.record, Checkpoint(state, NODE))

    kubelet = Kubelet(api, allocator(), list(hub.devices(GPU_SHARED)))
    pending: list[
        tuple[str, dict[str, Any], int]
    ] = []  # created, not yet bound (the gate holds them)
    tenants: set[str] = set()
    seen: list[tuple[str, str, dict[str, str]]] = []
    n = 0
    writes_failed = False

    def used(gpu: int) -> tuple[int, int, int]:
        """Memory, compute and slots the extender counts on `gpu`: live bound pods' requests."""
        amounts = [
            parse_pod_request(raw)
            for uid, raw in api.pods.items()
            if uid not in tenants and api.live(uid) and assigned_gpu(uid) == gpu
        ]
        return (
            sum(a.memory_mib for a in amounts),
            sum(a.compute_percent for a in amounts),
            sum(a.shared for a in amounts),
        )

    def assigned_gpu(uid: str) -> int | None:
        text = api.pods[uid]["metadata"]["annotations"].get(ASSIGNMENT_ANNOTATION)
        return int(json.loads(text)["gpu"]) if text else None

    def awaits(uid: str) -> bool:
        """The extender's gate: a live pod it bound whose allocation record is not complete."""
        if uid in tenants or not api.live(uid):
            return False
        record = allocation_record(api.pods[uid])
        given = decode_allocation(record) if isinstance(record, str) else ()
        return not admission_complete(shared_containers(api.pods[uid]), given)

    def bind_what_may() -> None:
        while pending:
            if gated and any(awaits(u) for u in api.pods):
                return
            uid, raw, gpu = pending.pop(0)
            request = parse_pod_request(raw)
            memory, compute, slots = used(gpu)
            clients = shared_containers(raw)
            if (
                any(
                    c.memory_mib > DEFAULT_MIB or c.compute_percent > DEFAULT_PERCENT
                    for c in clients
                )
                or memory + request.memory_mib > GPU_MIB
                or compute + request.compute_percent > 100
                or slots + request.shared > 4
            ):
                continue  # the extender would place it elsewhere or keep it Pending
            raw["spec"]["nodeName"] = NODE
            raw["metadata"]["annotations"][ASSIGNMENT_ANNOTATION] = signed(
                uid, gpu, request.memory_mib, request.compute_percent
            )
            api.pods[uid] = raw
            kubelet.queue.append(uid)

    for step in steps:
        kind = step[0]
        if kind in ("create", "tenant"):
            _, made, how, second, tie = step
            n += 1
            uid = f"uid-{n}"
            init = [c for _, is_init, c in made if is_init]
            app = [c for _, is_init, c in made if not is_init]
            raw = raw_pod(uid, app, node="", init=init)
            api.created[uid] = (int(second), int(tie))  # 1 s resolution: bursts tie
            if kind == "create":
                pending.append((uid, raw, int(how)))
            else:
                tenants.add(uid)
                raw["spec"]["nodeName"] = NODE  # preset: no scheduler, no extender, no gate
                notes = raw["metadata"]["annotations"]
                victim = next((u for u in api.pods if u not in tenants), None)
                if how == "unsigned":
                    notes[ASSIGNMENT_ANNOTATION] = encode_assignment(
                        PodAssignment(NODE, 1, "GPU-1", 1, pod_uid=uid)
                    )
                elif how == "copied" and victim is not None:
                    notes[ASSIGNMENT_ANNOTATION] = api.pods[victim]["metadata"]["annotations"][
                        ASSIGNMENT_ANNOTATION
                    ]
                elif how == "edited":
                    edited = json.loads(signed(uid, 0, 1, 1))
                    edited["memoryMiB"] = 40000
                    notes[ASSIGNMENT_ANNOTATION] = json.dumps(edited)
                elif how == "record":
                    slots = list(kubelet.slots)
                    # The annotation of the record before ADR 034, which nothing reads now.
                    notes[PLANTED_RECORD] = encode_allocation(
                        tuple(
                            GivenContainer(name, tuple(slots), "GPU-0", GPU_MIB, 100)
                            for name, _, _ in made
                        )
                    )
                api.pods[uid] = raw
                kubelet.queue.append(uid)
        elif kind == "admit":
            seen.extend(kubelet.admit_batch(int(step[1])))
        elif kind == "delete" and api.pods:
            uid = sorted(api.pods)[int(step[1]) % len(api.pods)]
            api.pods[uid]["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
            kubelet.held.pop(uid, None)
        elif kind == "restart":
            kubelet.allocator = allocator()  # a new plugin process: memory gone, checkpoint kept
        elif kind == "reallocate" and kubelet.held:
            uid = sorted(kubelet.held)[int(step[1]) % len(kubelet.held)]
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
        assert uid not in tenants, f"a tenant's pod was served: {uid} {name} {envs}"
        raw = api.pods[uid]
        assignment = json.loads(raw["metadata"]["annotations"][ASSIGNMENT_ANNOTATION])
        c = next(c for c in shared_containers(raw) if c.name == name)
        gpu = assignment["gpuUUID"]
        assert envs["NVIDIA_VISIBLE_DEVICES"] == gpu, (uid, name)
        assert (
            envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"{gpu}={c.memory_mib or DEFAULT_MIB}M"
        ), (uid, name)
        assert envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == str(
            c.compute_percent or DEFAULT_PERCENT
        ), (uid, name)
    # No GPU ever holds more than its memory and compute among the pods the agent served.
    for gpu in (0, 1):
        served = [
            u
            for u in kubelet.held
            if json.loads(api.pods[u]["metadata"]["annotations"][ASSIGNMENT_ANNOTATION])["gpu"]
            == gpu
        ]
        requests = [parse_pod_request(api.pods[u]) for u in served]
        assert sum(r.memory_mib for r in requests) <= GPU_MIB
        assert sum(r.compute_percent for r in requests) <= 100
    if gated and not writes_failed and not tenants:
        # With the extender's rule, a working API and no tenant's forgery the plugin refuses nothing.
        assert kubelet.refused == []


def test_mps_limits_are_the_served_pods_own_not_those_of_the_first_listed_pod(
    tmp_path: Path,
) -> None:
    # Served pods with their own limits are listed before the one awaiting its Allocate: the
    # answer carries the awaiting container's figures, or the GPU's defaults when it has none.
    hub = DeviceHub()
    hub.set_gpus(mps_gpus(1))
    early = GivenContainer("main", ("GPU-0::0",), "GPU-0", 2000, 10)
    served = shared_pod(1, SharedContainer("main", 1, 2000, 10), memory=2000)
    plain = shared_pod(2, SharedContainer("main", 1))
    records = [
        AdmissionRecord("uid-1", "ml/pod-1", "GPU-0", 2000, 10, (early,)),
        AdmissionRecord(
            "uid-2", "ml/pod-2", "GPU-0", 0, 0, (replace(early, devices=("GPU-0::1",)),)
        ),
    ]
    awaiting = shared_pod(3, SharedContainer("main", 1, 12000, 20), memory=12000)
    defaults = shared_pod(4, SharedContainer("main", 1))
    for case, (listed, ids, memory, compute) in enumerate((
        ((served, plain, awaiting), ["GPU-0::2"], 12000, 20),
        ((awaiting, served), ["GPU-0::2"], 12000, 20),
        ((served, defaults), ["GPU-0::3"], DEFAULT_MIB, DEFAULT_PERCENT),
    )):  # fmt: skip
        checkpoint = Checkpoint(tmp_path / str(case), NODE)
        checkpoint.save(records)
        allocator = Allocator(
            hub, NODE, lambda listed=listed: listed, lambda _p, _g: None, checkpoint
        )
        envs = dict(allocator.allocate(GPU_SHARED, ids).envs)
        assert envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"GPU-0={memory}M", listed
        assert envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == str(compute), listed


def test_a_container_above_the_mps_ceilings_is_refused_not_served_less(tmp_path: Path) -> None:
    # The daemon's defaults cap every client whatever its environment says (a client can only
    # lower them): serving 30000 MiB under a 15000 MiB ceiling would be a silent lie.
    hub = DeviceHub()
    hub.set_gpus(mps_gpus(1))
    for case, (memory, compute, resource) in enumerate(
        ((30000, 0, "gpu-memory"), (0, DEFAULT_PERCENT + 1, "gpu-compute"))
    ):
        big = shared_pod(1, SharedContainer("main", 1, memory, compute), memory=memory)
        checkpoint = Checkpoint(tmp_path / str(case), NODE)
        allocator = Allocator(hub, NODE, lambda big=big: [big], lambda _p, _g: None, checkpoint)
        with pytest.raises(InvalidInput, match=f"gpupart.io/{resource}.*MPS lets one client"):
            allocator.allocate(GPU_SHARED, ["GPU-0::0"])
        assert Checkpoint(tmp_path / str(case), NODE).records == {}  # nothing recorded as served


def test_the_checkpoint_is_atomic_read_back_and_an_unreadable_one_refuses_only_shared_slots(
    tmp_path: Path,
) -> None:
    record = AdmissionRecord(
        "uid-1",
        "ml/pod-1",
        "GPU-0",
        2000,
        10,
        (GivenContainer("main", ("GPU-0::0",), "GPU-0", 2000, 10),),
    )
    Checkpoint(tmp_path, NODE).save([record])
    assert Checkpoint(tmp_path, NODE).records == {"uid-1": record}
    assert [p.name for p in tmp_path.iterdir()] == [CHECKPOINT_NAME]  # no temporary file left
    # Another node's file, and a damaged one, are named and refuse shared Allocates only.
    assert "is not this node" in Checkpoint(tmp_path, "node-b").problem
    (tmp_path / CHECKPOINT_NAME).write_text(
        '{"version": "v1", "node": "node-a", "pods": [{"uid": 1}]}'
    )
    damaged = Checkpoint(tmp_path, NODE)
    assert damaged.problem and damaged.records == {}
    hub = DeviceHub()
    hub.set_gpus(mps_gpus(1))
    waiting = shared_pod(1)
    allocator = Allocator(hub, NODE, lambda: (waiting,), lambda _p, _g: None, damaged)
    with pytest.raises(AdmissionRefused, match="admission checkpoint is unreadable"):
        allocator.allocate(GPU_SHARED, ["GPU-0::0"])
    assert (tmp_path / CHECKPOINT_NAME).read_text().startswith('{"version"')  # kept as it was
