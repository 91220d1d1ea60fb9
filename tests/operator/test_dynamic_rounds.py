"""The dynamic MIG round's edge without a server: listed pods in, demand and holders out; the debounce.

Aspects: which pods are demand (unbound, Unschedulable, asking for nvidia.com/mig-*), which
hold slices on a node and by name (for reasons), what a malformed pod does (skipped, the others
still read), a dynamic partition's GPUs on nodes with only an inventory or neither (and the
words for the latter), and the round's debounce (a burst is one round; a steady trickle still
gets one within the maximum).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from gpupart.core.api.spec import Mode
from gpupart.core.api.wire import INVENTORY_ANNOTATION, Inventory, InventoryGpu, encode_inventory
from gpupart_operator.demand import dynamic_gpus, read_pods, requests_mig, unknown_gpus
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


def node_raw(name: str, inventory: int | None) -> dict[str, Any]:
    annotations = {}
    if inventory is not None:
        gpus = tuple(
            InventoryGpu(i, f"GPU-{i}", "NVIDIA H100 80GB HBM3", 81559, Mode.MIG)
            for i in range(inventory)
        )
        annotations[INVENTORY_ANNOTATION] = encode_inventory(Inventory(gpus))
    labels = {"pool": "dyn", "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    return {"metadata": {"name": name, "labels": labels, "annotations": annotations}}


def test_dynamic_gpus_come_from_the_inventory_and_a_node_with_neither_is_named() -> None:
    raw = {
        "apiVersion": "gpupart.io/v1alpha1",
        "kind": "GpuPartition",
        "metadata": {"name": "dyn", "generation": 1, "creationTimestamp": "2026-12-01T10:00:00Z"},
        "spec": {
            "nodeSelector": {"matchLabels": {"pool": "dyn"}},
            "mode": "MIG",
            "mig": {"dynamic": {}},
        },
    }
    partitions = [read_partition(raw)]
    nodes = [read_node(node_raw("listed", 2)), read_node(node_raw("bare", None))]
    def resolution(nodes: list[Any]) -> Any:
        parsed = [p.partition for p in partitions if p.partition is not None]
        return resolve_each(parsed, [n.view for n in nodes]).resolution

    found = dynamic_gpus(resolution(nodes), partitions, nodes)
    assert {n: [g.index for g in gpus] for n, gpus in found.items()} == {"listed": [0, 1]}
    words = unknown_gpus(resolution(nodes))
    assert words.startswith("bare: GPUs unknown") and "listed" not in words, words
    assert unknown_gpus(resolution(nodes[:1])) == ""


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
