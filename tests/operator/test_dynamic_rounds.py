"""The dynamic MIG round's pure room without a server: pods and Nodes in, plans, memory and news out; the debounce.

Aspects: which pods are demand (unbound, Unschedulable, asking for nvidia.com/mig-*), which
hold slices on a node and by name (for reasons), what a malformed pod does (skipped, the others
still read), a dynamic partition's GPUs on nodes with only an inventory or neither (and the
words for the latter), a partition with `interface: dra` planned for nowhere (its node's old
plan removed), a partition that breaks the core's resolution costs only itself (the
other partitions' pods still get plans), a node's memory record (idle since first seen, each
plan answer counted once, the back-off after a failure, forgotten when the node leaves), a
pod's news told again only when its words change and not more than once a minute, and the
round's debounce (a burst is one round; a steady trickle still gets one within the maximum).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from gpupart.core.api.spec import Mode
from gpupart.core.api.wire import (
    INVENTORY_ANNOTATION,
    MIG_PLAN_ANNOTATION,
    STATE_ANNOTATION,
    GpuState,
    Inventory,
    InventoryGpu,
    MigDevice,
    MigPlan,
    NodeReport,
    PlanReport,
    encode_inventory,
    encode_mig_plan,
    encode_report,
)
from gpupart.core.mig.layout import MigInstance, Placement
from gpupart_operator.demand import (
    EVENT_REPEAT_S,
    Memory,
    NodeMemory,
    dynamic_gpus,
    observe,
    plan_demand,
    read_pods,
    requests_mig,
    settle,
    survey,
    unknown_gpus,
)
from gpupart_operator.loops import DemandLoop
from gpupart_operator.model import read_node, read_partition, resolve_each


def pod(
    name: str,
    limits: dict[str, Any],
    *,
    node: str | None = None,
    unschedulable: bool = True,
    phase: str = "Pending",
) -> dict[str, Any]:
    conditions = []
    if unschedulable:
        conditions.append({"type": "PodScheduled", "status": "False", "reason": "Unschedulable"})
    return {
        "metadata": {
            "name": name,
            "namespace": "ns",
            "uid": f"uid-{name}",
            "creationTimestamp": "2026-12-01T10:00:00Z",
        },
        "spec": {
            **({"nodeName": node} if node else {}),
            "containers": [{"name": "c", "resources": {"limits": limits}}],
        },
        "status": {"phase": phase, "conditions": conditions},
    }


def test_demand_unbound_and_holders() -> None:
    facts = read_pods(
        [
            pod("wants", {"nvidia.com/mig-3g.40gb": "2"}),
            pod("tried-not-yet", {"nvidia.com/mig-1g.10gb": "1"}, unschedulable=False),
            pod("runs", {"nvidia.com/mig-1g.10gb": "1"}, node="n1", unschedulable=False),
            pod("done", {"nvidia.com/mig-1g.10gb": "1"}, node="n1", phase="Succeeded"),
            pod("cpu", {"cpu": "1"}),
        ]
    )
    (wants,) = facts.pending
    assert (wants.key, wants.uid, wants.profiles) == ("ns/wants", "uid-wants", ("3g.40gb",) * 2)
    assert wants.pending_since > 0
    assert set(facts.unbound) == {"ns/wants", "ns/tried-not-yet"}
    assert dict(facts.holders["n1"]) == {"1g.10gb": 1}
    assert facts.holder_pods == {"n1": {"1g.10gb": ("ns/runs",)}}
    assert set(facts.namespaces) == {"ns/wants", "ns/tried-not-yet", "ns/runs"}


def node_raw(
    name: str, inventory: int | None, devices: tuple[MigDevice, ...] = ()
) -> dict[str, Any]:
    annotations = {}
    if inventory is not None:
        gpus = tuple(
            InventoryGpu(i, f"GPU-{i}", "NVIDIA H100 80GB HBM3", 81559, Mode.MIG, devices)
            for i in range(inventory)
        )
        annotations[INVENTORY_ANNOTATION] = encode_inventory(Inventory(gpus))
    labels = {"pool": "dyn", "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    return {"metadata": {"name": name, "labels": labels, "annotations": annotations}}


def dynamic_raw(name: str = "dyn") -> dict[str, Any]:
    return {
        "apiVersion": "gpupart.io/v1alpha1",
        "kind": "GpuPartition",
        "metadata": {"name": name, "generation": 1, "creationTimestamp": "2026-12-01T10:00:00Z"},
        "spec": {
            "nodeSelector": {"matchLabels": {"pool": "dyn"}},
            "mode": "MIG",
            "mig": {"dynamic": {"minIdleSeconds": 0}},
        },
    }


def test_dynamic_gpus_come_from_the_inventory_and_a_node_with_neither_is_named() -> None:
    partitions = [read_partition(dynamic_raw())]
    nodes = [read_node(node_raw("listed", 2)), read_node(node_raw("bare", None))]

    def resolution(nodes: list[Any]) -> Any:
        parsed = [p.partition for p in partitions if p.partition is not None]
        return resolve_each(parsed, [n.view for n in nodes]).resolution

    found = dynamic_gpus(resolution(nodes), partitions, nodes)
    assert {n: [g.index for g in gpus] for n, gpus in found.items()} == {"listed": [0, 1]}
    words = unknown_gpus(resolution(nodes))
    assert words.startswith("bare: GPUs unknown") and "listed" not in words, words
    assert unknown_gpus(resolution(nodes[:1])) == ""


def test_a_dra_partition_gets_no_mig_plan_and_its_old_plan_is_removed() -> None:
    """Dynamic MIG through DRA: the scheduler allocates the placements (the kubelet plugin
    makes them), so the rounds plan nothing there and a plan left from before goes."""
    raw = dynamic_raw()
    raw["spec"]["interface"] = "dra"
    partitions = [read_partition(raw)]
    node = node_raw("n1", 2)
    node["metadata"]["annotations"][MIG_PLAN_ANNOTATION] = encode_mig_plan(MigPlan("old"))
    surveyed = survey(partitions, [node], [read_node(node)])
    assert surveyed.dynamic == {} and surveyed.nodes == ()
    assert surveyed.stale == ("n1",) and not surveyed.live
    # Beside a device-plugin dynamic partition, only that one's node is planned.
    plugin = dynamic_raw("plugin")
    plugin["spec"]["nodeSelector"] = {"matchLabels": {"pool": "plugin"}}
    other = node_raw("n2", 1)
    other["metadata"]["labels"]["pool"] = "plugin"
    surveyed = survey(
        [*partitions, read_partition(plugin)], [node, other], [read_node(node), read_node(other)]
    )
    assert set(surveyed.dynamic) == {"n2"} and surveyed.stale == ("n1",) and surveyed.live


def test_a_malformed_pod_is_skipped_and_the_others_still_count() -> None:
    bad = pod("bad", {"nvidia.com/mig-3g.40gb": "lots"})
    worse: dict[str, Any] = {
        "metadata": "nope",
        "spec": {"containers": [{"resources": {"limits": {"nvidia.com/mig-x": 1}}}]},
    }
    facts = read_pods([bad, worse, pod("good", {"nvidia.com/mig-1g.10gb": "1"})])
    assert [p.key for p in facts.pending] == ["ns/good"]
    assert [key for key, _ in facts.skipped] == ["ns/bad", "?"], facts.skipped


@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=5),
        lambda c: (
            st.lists(c, max_size=3)
            | st.dictionaries(
                st.sampled_from(
                    [
                        "metadata",
                        "spec",
                        "status",
                        "containers",
                        "resources",
                        "limits",
                        "nodeName",
                        "nvidia.com/mig-1g.10gb",
                    ]
                ),
                c,
                max_size=4,
            )
        ),
        max_leaves=20,
    )
)
def test_no_listed_object_breaks_the_reading(raw: Any) -> None:
    items = [raw] if isinstance(raw, dict) else []
    read_pods(items + [pod("good", {"nvidia.com/mig-1g.10gb": "1"})])
    assert isinstance(requests_mig(raw), bool) if isinstance(raw, dict) else True


def test_requests_mig_reads_limits_and_requests_of_every_container() -> None:
    assert requests_mig(pod("a", {"nvidia.com/mig-1g.10gb": "1"}))
    init = {
        "spec": {"initContainers": [{"resources": {"requests": {"nvidia.com/mig-2g.20gb": "1"}}}]}
    }
    assert requests_mig(init)
    assert not requests_mig(pod("b", {"nvidia.com/gpu": "1"}))


def test_a_burst_is_one_round_and_a_trickle_gets_one_within_the_maximum() -> None:
    rounds: list[float] = []

    async def scenario() -> None:
        loop = DemandLoop(lambda: rounds.append(time.monotonic()), idle=0.2, most=0.6, every=60)
        task = asyncio.create_task(loop.run())
        for _ in range(5):  # a burst inside the idle window
            loop.wake()
            await asyncio.sleep(0.02)
        await asyncio.sleep(1.0)
        assert len(rounds) == 1
        # A wake every 0.05 s never leaves 0.2 s of quiet: only the maximum starts a round.
        rounds.clear()
        for _ in range(30):
            loop.wake()
            await asyncio.sleep(0.05)
        task.cancel()
        assert rounds, "no round during a steady trickle"

    asyncio.run(scenario())


def test_pending_pods_carry_the_nodes_their_selector_allows() -> None:
    wants = pod("wants", {"nvidia.com/mig-3g.40gb": "1"})
    wants["spec"]["nodeSelector"] = {"zone": "b"}
    facts = read_pods([wants, pod("anywhere", {"nvidia.com/mig-1g.10gb": "1"})])
    placed = {p.key: p.nodes for p in facts.placed({"n1": {"zone": "a"}, "n2": {"zone": "b"}})}
    assert placed == {"ns/wants": frozenset({"n2"}), "ns/anywhere": frozenset({"n1", "n2"})}


def _required(*terms: dict[str, Any]) -> dict[str, Any]:
    return {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": list(terms)}
        }
    }


def test_pending_pods_carry_the_nodes_kube_schedulers_node_affinity_allows() -> None:
    """An empty term places the pod nowhere (kube-scheduler never binds it, so no slice is
    made for it); matchFields name the node, as a DaemonSet's pods do."""
    nowhere = pod("nowhere", {"nvidia.com/mig-1g.10gb": "1"})
    nowhere["spec"]["affinity"] = _required({})
    pinned = pod("pinned", {"nvidia.com/mig-1g.10gb": "1"})
    field = {"key": "metadata.name", "operator": "In", "values": ["n2"]}
    pinned["spec"]["affinity"] = _required({"matchFields": [field]})
    facts = read_pods([nowhere, pinned])
    placed = {p.key: p.nodes for p in facts.placed({"n1": {"zone": "a"}, "n2": {"zone": "a"}})}
    assert placed == {"ns/nowhere": frozenset(), "ns/pinned": frozenset({"n2"})}


def test_a_partition_that_breaks_the_resolution_does_not_stop_the_round_for_the_others() -> None:
    good = read_partition(dynamic_raw("good"))
    assert good.partition is not None
    # A value no parser produces (a priority that is a string): stands for a bug in the core,
    # which makes resolving all partitions together raise.
    spec = dataclasses.replace(good.partition.spec, name="broken", priority="high")  # type: ignore[arg-type]
    broken = dataclasses.replace(
        good, name="broken", partition=dataclasses.replace(good.partition, spec=spec)
    )
    raws = [node_raw("n1", 1)]
    surveyed = survey([broken, good], raws, [read_node(r) for r in raws])
    assert [g.partition for g in surveyed.dynamic["n1"]] == ["good"]
    pods = read_pods([pod("wants", {"nvidia.com/mig-3g.40gb": "1"})])
    _, planned = plan_demand(Memory(), surveyed, pods, now=1000.0, ttl_s=120, retry_s=5)
    change = planned.round.changes["n1"]
    assert [r.pod for r in change.plan.reservations] == ["ns/wants"], change


def _answered(raw: dict[str, Any], plan: MigPlan, state: GpuState) -> dict[str, Any]:
    """`raw` holding `plan`, answered by its agent with `state`."""
    report = NodeReport((), (), PlanReport(plan.id, state, "e2e"))
    raw["metadata"]["annotations"].update(
        {MIG_PLAN_ANNOTATION: encode_mig_plan(plan), STATE_ANNOTATION: encode_report(report)}
    )
    return raw


def test_a_nodes_record_counts_each_answer_once_backs_off_and_keeps_when_idle_began() -> None:
    partitions = [read_partition(dynamic_raw())]
    small = MigInstance(Placement(0, 1), "1g.10gb")
    idle = MigDevice("MIG-0", small)
    raw = _answered(node_raw("n1", 1, (idle,)), MigPlan("p1"), GpuState.FAILED)
    (view,) = survey(partitions, [raw], [read_node(raw)]).nodes
    first, hold, answer = observe(NodeMemory(), view, now=100.0, retry_s=5)
    assert (answer, hold, first.failed) == ("failed", True, ("p1", 100.0))
    assert first.idle_since == {(0, small): 100.0}
    later, hold, answer = observe(first, view, now=104.0, retry_s=5)
    assert (answer, hold, later.idle_since) == ("", True, {(0, small): 100.0})
    _, hold, _ = observe(later, view, now=105.0, retry_s=5)
    assert not hold  # the back-off is over
    # The instance in use is no longer idle; a new plan answered Applied is counted once.
    used = _answered(
        node_raw("n1", 1, (dataclasses.replace(idle, used=True),)), MigPlan("p2"), GpuState.APPLIED
    )
    (view,) = survey(partitions, [used], [read_node(used)]).nodes
    after, _, answer = observe(later, view, now=106.0, retry_s=5)
    assert (answer, after.idle_since, after.answered) == ("applied", {}, "p2")
    # A node that holds no dynamic GPU any more is forgotten by the round.
    gone = survey(partitions, [], [])
    memory = Memory({"n1": after})
    memory, _ = plan_demand(memory, gone, read_pods([]), now=107.0, ttl_s=120, retry_s=5)
    assert memory.nodes == {}


def test_a_pod_hears_the_same_news_again_only_when_its_words_change_at_most_once_a_minute() -> None:
    partitions = [read_partition(dynamic_raw())]
    raws = [node_raw("n1", 1)]
    # 7g.80gb twice on one GPU: the second pod waits, with the planner's reason.
    pods = read_pods([pod(n, {"nvidia.com/mig-7g.80gb": "1"}) for n in ("a", "b")])
    surveyed = survey(partitions, raws, [read_node(r) for r in raws])

    def round_at(memory: Memory, now: float, reason: str | None = None) -> tuple[Memory, list[str]]:
        memory, planned = plan_demand(memory, surveyed, pods, now=now, ttl_s=120, retry_s=5)
        if reason is not None:
            waiting = tuple((p, reason) for p, _ in planned.round.unserved)
            planned = dataclasses.replace(
                planned, round=dataclasses.replace(planned.round, unserved=waiting)
            )
        memory, settled = settle(memory, planned, set(), pods, now=now, ttl_s=120)
        return memory, [f"{n.pod} {n.reason}" for n in settled.news]

    memory, news = round_at(Memory(), 0.0, "busy")
    assert news == ["ns/b MigSliceUnavailable"], news
    memory, news = round_at(memory, 1.0, "busy")
    assert news == []  # the same words
    memory, news = round_at(memory, 2.0, "busier")
    assert news == []  # new words, but within the minute
    memory, news = round_at(memory, EVENT_REPEAT_S + 1, "busier")
    assert news == ["ns/b MigSliceUnavailable"], news
