"""The operator's edge without a server: raw objects in, the exact writes a pass needs out.

Aspects: parsing GpuPartitions and Nodes from API dicts (bad spec, bad state annotation, the
agent's inventory and a bad one, reachability), desired-annotation patches (set, change,
remove, leave alone, no group for a node being restored to whole GPUs), status documents
and merge patches (only what differs; nodes that left become null; transition times stay),
status.interface from the inventory's interface per GPU,
Events for condition changes, and a whole simulated pass applied twice: the second writes nothing.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from poison import PARTITION_CASES

from gpupart.core.api.spec import Interface, Mode
from gpupart.core.api.wire import (
    DESIRED_ANNOTATION,
    INVENTORY_ANNOTATION,
    STATE_ANNOTATION,
    GpuReport,
    GpuState,
    Inventory,
    InventoryGpu,
    NodeReport,
    decode_desired,
    encode_inventory,
    encode_report,
)
from gpupart.core.cluster.partitioning import Condition, resolve
from gpupart_operator.model import (
    InventoryCache,
    Resolutions,
    condition_events,
    desired_patches,
    event_manifest,
    event_type,
    invalid_status,
    listed_gpus,
    merge_patch,
    old_conditions,
    read_node,
    read_partition,
    resolve_each,
    status_document,
    status_patch,
)

NOW = "2026-01-01T00:00:00Z"
LATER = "2026-01-01T00:05:00Z"


def partition_raw(name: str = "a", generation: int = 1, **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "apiVersion": "gpupart.io/v1alpha1",
        "kind": "GpuPartition",
        "metadata": {
            "name": name,
            "uid": f"uid-{name}",
            "generation": generation,
            "creationTimestamp": "2026-01-01T00:00:00Z",
        },
        "spec": {
            "nodeSelector": {"matchLabels": {"pool": "mig"}},
            "mode": "MIG",
            "mig": {"devices": {"1g.10gb": 7}},
            "disruption": "WhenIdle",
            "priority": 0,
        },
    }
    body["spec"].update(spec)
    return body


def node_raw(
    name: str,
    product: str = "NVIDIA-A100-SXM4-80GB",
    count: int = 2,
    ready: str = "True",
    annotations: dict[str, str] | None = None,
    **labels: str,
) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "labels": {
                "pool": "mig",
                "nvidia.com/gpu.product": product,
                "nvidia.com/gpu.count": str(count),
                **labels,
            },
            "annotations": dict(annotations or {}),
        },
        "status": {"conditions": [{"type": "Ready", "status": ready}]},
    }


# --- parsing at the edge ---------------------------------------------------------------------


def test_a_listed_partition_parses_and_keeps_its_status():
    raw = partition_raw()
    raw["status"] = {"observedGeneration": 1}
    got = read_partition(raw)
    assert got.partition is not None and got.error == ""
    assert (got.name, got.uid, got.generation, got.deleting) == ("a", "uid-a", 1, False)
    assert got.partition.spec.config.mode is Mode.MIG
    assert got.status == {"observedGeneration": 1}


def test_a_watch_body_without_apiversion_still_parses():
    raw = partition_raw()
    del raw["apiVersion"], raw["kind"]
    assert read_partition(raw).partition is not None


def test_a_spec_the_core_refuses_becomes_an_error_naming_the_field():
    raw = partition_raw(mig={"devices": {"1g.10gb": 7}, "extra": 1})
    got = read_partition(raw)
    assert got.partition is None
    assert "spec.mig" in got.error and "extra" in got.error


def test_deletion_timestamp_marks_the_partition_deleting():
    raw = partition_raw()
    raw["metadata"]["deletionTimestamp"] = NOW
    got = read_partition(raw)
    assert got.deleting and got.partition is not None and got.partition.deleting


def test_a_node_is_read_with_its_report_and_readiness():
    report = NodeReport((("a", 1),), (GpuReport(0, GpuState.APPLIED, Mode.MIG),))
    got = read_node(node_raw("n1", annotations={STATE_ANNOTATION: encode_report(report)}))
    assert got.name == "n1" and got.reachable and got.desired is None
    assert got.view.report == report and got.view.gpu_count == 2


def test_a_malformed_state_annotation_is_ignored_and_said_why():
    got = read_node(node_raw("n1", annotations={STATE_ANNOTATION: '{"version": "v9"}'}))
    assert got.view.report is None
    assert "unknown format version" in got.report_error


def test_a_nodes_gpus_come_from_the_agents_inventory_and_a_bad_one_is_said():
    inventory = Inventory(
        tuple(
            InventoryGpu(i, f"GPU-{i}", "NVIDIA A100-SXM4-80GB", 81920, Mode.NONE)
            for i in (0, 1, 2)
        )
    )
    raw = node_raw("n1", annotations={INVENTORY_ANNOTATION: encode_inventory(inventory)})
    got = read_node(raw)
    assert got.view.inventory_gpus == (0, 1, 2) and got.view.gpu_indices == (0, 1, 2)
    assert "inventory lists 3 GPU(s)" in got.view.count_disagreement  # its label says 2
    bad = read_node(node_raw("n1", annotations={INVENTORY_ANNOTATION: "{"}))
    assert bad.view.inventory_gpus is None and bad.view.gpu_indices == (0, 1)
    assert bad.inventory_error.startswith("gpupart.io/inventory"), bad.inventory_error


def test_the_inventory_cache_answers_as_a_fresh_read_whatever_changes():
    cache = InventoryCache()

    def annotations(*indices: int) -> dict[str, str]:
        gpus = tuple(
            InventoryGpu(i, f"GPU-{i}", "NVIDIA H100 80GB HBM3", 81559, Mode.MIG) for i in indices
        )
        return {INVENTORY_ANNOTATION: encode_inventory(Inventory(gpus))}

    for seen in (
        annotations(0),
        annotations(0),
        annotations(0, 1),
        {INVENTORY_ANNOTATION: "{"},
        {},
    ):
        assert cache.listed("n1", seen) == listed_gpus(seen)
    plugin = Interface.DEVICE_PLUGIN
    assert cache.listed("n1", annotations(0, 1)) == (((0, plugin), (1, plugin)), "")
    cache.keep(set())
    assert cache.listed("n1", annotations(3)) == (((3, plugin),), "")
    raw = node_raw("n1", annotations=annotations(0, 1, 2))
    assert (
        read_node(raw, cache).view.inventory_gpus == read_node(raw).view.inventory_gpus == (0, 1, 2)
    )


def test_a_node_without_ready_true_is_unreachable():
    assert not read_node(node_raw("n1", ready="Unknown")).reachable
    bare = node_raw("n1")
    bare["status"] = {}
    assert not read_node(bare).reachable


# --- desired annotations ---------------------------------------------------------------------


def test_desired_patches_set_change_remove_and_leave_alone():
    a = read_partition(partition_raw()).partition
    assert a is not None
    nodes = [read_node(node_raw(n)) for n in ("new", "same", "stale")]
    nodes.append(read_node(node_raw("cpu", pool="cpu")))
    desired = resolve([a], [n.view for n in nodes]).desired
    current = {
        "same": desired_patches(desired, nodes[1:2])["same"]["metadata"]["annotations"][
            DESIRED_ANNOTATION
        ]
    }
    nodes = [
        read_node(node_raw("new")),
        read_node(node_raw("same", annotations={DESIRED_ANNOTATION: current["same"]})),
        read_node(node_raw("stale", annotations={DESIRED_ANNOTATION: "old"}, pool="other")),
        read_node(node_raw("cpu", pool="cpu")),
    ]
    desired = resolve([a], [n.view for n in nodes]).desired
    patches = desired_patches(desired, nodes)
    assert set(patches) == {"new", "stale"}
    assert patches["stale"] == {"metadata": {"annotations": {DESIRED_ANNOTATION: None}}}
    (group,) = decode_desired(patches["new"]["metadata"]["annotations"][DESIRED_ANNOTATION])
    assert (group.partition, group.generation) == ("a", 1)


def test_a_node_being_restored_keeps_an_annotation_without_groups():
    nodes = [read_node(node_raw("n1", annotations={DESIRED_ANNOTATION: "old"}))]
    (patch,) = desired_patches({"n1": ()}, nodes).values()
    text = patch["metadata"]["annotations"][DESIRED_ANNOTATION]
    assert text is not None and decode_desired(text) == ()
    again = [read_node(node_raw("n1", annotations={DESIRED_ANNOTATION: text}))]
    assert desired_patches({"n1": ()}, again) == {}


# --- status ----------------------------------------------------------------------------------


def resolved_status(*partitions: dict[str, Any], nodes: list[dict[str, Any]]):
    parsed = [read_partition(p).partition for p in partitions]
    return resolve([p for p in parsed if p], [read_node(n).view for n in nodes]).statuses


def test_status_document_counts_nodes_and_writes_conditions():
    statuses = resolved_status(partition_raw(), nodes=[node_raw("n1"), node_raw("n2")])
    doc = status_document(statuses["a"], [], now=NOW)
    assert doc["observedGeneration"] == 1
    assert (doc["selectedNodes"], doc["readyNodes"], doc["nodesReady"]) == (2, 0, "0/2")
    assert doc["nodes"]["n1"] == {"state": "Pending", "message": doc["nodes"]["n1"]["message"]}
    types = [c["type"] for c in doc["conditions"]]
    assert types == ["Ready", "Progressing", "Degraded", "Conflict"]
    assert all(c["lastTransitionTime"] == NOW for c in doc["conditions"])
    assert "kopf" not in doc


def test_status_interface_follows_the_inventory_the_agent_writes():
    """status.interface counts the held GPUs by the interface serving each now; `served` is
    what `kubectl get gpup -o wide` shows; a new inventory moves the counts, nothing else."""

    def inventory(*served: Interface | None) -> dict[str, str]:
        gpus = tuple(
            InventoryGpu(i, f"GPU-{i}", "NVIDIA A100-SXM4-80GB", 81920, Mode.MIG, interface=s)
            for i, s in enumerate(served)
        )
        return {INVENTORY_ANNOTATION: encode_inventory(Inventory(gpus))}

    dra = partition_raw(interface="dra")
    plugin = Interface.DEVICE_PLUGIN
    first = status_document(
        resolved_status(dra, nodes=[node_raw("n1", annotations=inventory(plugin, plugin))])["a"],
        [],
        now=NOW,
    )
    assert first["interface"] == {
        "dra": 0, "devicePlugin": 2, "moving": 0, "unreported": 0, "served": "0/2",
    }  # fmt: skip
    moving = status_document(
        resolved_status(dra, nodes=[node_raw("n1", annotations=inventory(Interface.DRA, None))])[
            "a"
        ],
        old_conditions(first),
        now=LATER,
    )
    assert status_patch(first, moving) == {
        "status": {"interface": {"dra": 1, "devicePlugin": 0, "moving": 1, "served": "1/2"}}
    }
    # No inventory yet: the count label's GPUs are held and not reported.
    bare = status_document(resolved_status(dra, nodes=[node_raw("n1")])["a"], [], now=NOW)
    assert bare["interface"]["unreported"] == 2 and bare["interface"]["served"] == "0/2"


def test_a_node_reads_the_interface_serving_each_gpu():
    gpus = (
        InventoryGpu(0, "GPU-0", "NVIDIA A100-SXM4-80GB", 81920, Mode.NONE),
        InventoryGpu(1, "GPU-1", "NVIDIA A100-SXM4-80GB", 81920, Mode.NONE, interface=None),
    )
    raw = node_raw("n1", annotations={INVENTORY_ANNOTATION: encode_inventory(Inventory(gpus))})
    view = read_node(raw).view
    assert view.interfaces == ((0, Interface.DEVICE_PLUGIN), (1, None))
    assert view.inventory_gpus == (0, 1)
    assert read_node(node_raw("n2")).view.interfaces == ()


def test_status_patch_is_empty_when_nothing_changed_and_time_does_not_move():
    statuses = resolved_status(partition_raw(), nodes=[node_raw("n1")])
    first = status_document(statuses["a"], [], now=NOW)
    stored = {**copy.deepcopy(first), "somethingElse": 1}
    again = status_document(statuses["a"], old_conditions(stored), now=LATER)
    assert status_patch(stored, again) == {}


def test_status_patch_nulls_nodes_that_left_and_keeps_transition_times():
    before = status_document(
        resolved_status(partition_raw(), nodes=[node_raw("n1"), node_raw("n2")])["a"], [], now=NOW
    )
    after = status_document(
        resolved_status(partition_raw(), nodes=[node_raw("n1")])["a"],
        old_conditions(before),
        now=LATER,
    )
    patch = status_patch(before, after)["status"]
    assert patch["nodes"] == {"n2": None}
    assert patch["selectedNodes"] == 1 and patch["nodesReady"] == "0/1"
    # The Ready message changed ("0 of 1"), its status did not: the time stays.
    assert [c["lastTransitionTime"] for c in patch["conditions"]] == [NOW] * 4
    assert patch["conditions"][0]["message"] == "0 of 1 node(s) applied"


def test_invalid_spec_status_says_why_and_claims_nothing():
    status = invalid_status(4, "spec.mig.extra: unknown field")
    doc = status_document(status, [], now=NOW)
    ready = doc["conditions"][0]
    assert (ready["status"], ready["reason"]) == ("False", "InvalidSpec")
    assert ready["message"] == "spec.mig.extra: unknown field"
    assert doc["observedGeneration"] == 4 and doc["nodes"] == {}


# --- merge patches ---------------------------------------------------------------------------


def apply_merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386, as the API server applies application/merge-patch+json."""
    if not isinstance(patch, dict):
        return patch
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = apply_merge_patch(result.get(key), value)
    return result


json_leaf = st.one_of(st.integers(), st.text(max_size=3), st.booleans())
json_values = st.recursive(
    json_leaf,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=2), inner, max_size=3)
    ),
    max_leaves=10,
)
json_objects = st.dictionaries(st.text(max_size=2), json_values, max_size=4)


@given(json_objects, json_objects)
def test_merge_patch_turns_old_into_new(old, new):
    patch = merge_patch(old, new)
    assert apply_merge_patch(old, patch) == new
    assert (patch == {}) == (old == new)


# --- Events ----------------------------------------------------------------------------------


def test_first_conditions_post_only_news():
    new = [
        Condition("Ready", "False", "NotApplied"),
        Condition("Progressing", "True", "Applying"),
        Condition("Degraded", "False", "Healthy"),
        Condition("Conflict", "False", "NoConflict"),
    ]
    assert [c.type for c in condition_events([], new)] == ["Ready", "Progressing"]


def test_status_or_reason_changes_post_events():
    old = [
        {"type": "Ready", "status": "False", "reason": "NotApplied"},
        {"type": "Conflict", "status": "False", "reason": "NoConflict"},
    ]
    new = [
        Condition("Ready", "False", "InvalidForNode", "n1: profile"),
        Condition("Conflict", "False", "NoConflict"),
    ]
    assert condition_events(old, new) == [new[0]]


def test_event_manifest_points_at_the_partition():
    partition = read_partition(partition_raw())
    condition = Condition("Conflict", "True", "GpusClaimedElsewhere", "n1 GPU 0 taken by b")
    event = event_manifest(partition, condition, namespace="default", now=NOW, instance="op-0")
    assert event["involvedObject"] == {
        "apiVersion": "gpupart.io/v1alpha1",
        "kind": "GpuPartition",
        "name": "a",
        "uid": "uid-a",
    }
    assert event["type"] == "Warning" and event["reason"] == "GpusClaimedElsewhere"
    assert event["message"] == "Conflict=True: n1 GPU 0 taken by b"
    assert event["metadata"] == {"generateName": "a.", "namespace": "default"}
    assert event_type(Condition("Ready", "True", "Applied")) == "Normal"
    assert event_type(Condition("Ready", "False", "NoMatchingNodes")) == "Warning"


# --- a whole pass, simulated -----------------------------------------------------------------


def simulated_pass(partitions: list[dict[str, Any]], nodes: list[dict[str, Any]]) -> int:
    """What Reconciler.reconcile_all computes, applied to the dicts; returns the write count."""
    parsed = [read_partition(p) for p in partitions]
    views = [read_node(n) for n in nodes]
    resolution = resolve([p.partition for p in parsed if p.partition], [n.view for n in views])
    writes = 0
    by_name = {n["metadata"]["name"]: n for n in nodes}
    for name, patch in desired_patches(resolution.desired, views).items():
        by_name[name].update(apply_merge_patch(by_name[name], patch))
        if by_name[name]["metadata"]["annotations"].get(DESIRED_ANNOTATION) is None:
            by_name[name]["metadata"]["annotations"].pop(DESIRED_ANNOTATION, None)
        writes += 1
    for raw, item in zip(partitions, parsed, strict=True):
        status = resolution.statuses.get(item.name) or invalid_status(item.generation, item.error)
        doc = status_document(status, old_conditions(item.status), now=NOW)
        patch = status_patch(item.status, doc)
        if patch:
            raw["status"] = apply_merge_patch(raw.get("status") or {}, patch["status"])
            writes += 1
    return writes


def test_a_second_pass_over_what_the_first_wrote_writes_nothing():
    partitions = [
        partition_raw("a"),
        partition_raw("b", priority=5, gpus=[0]),
        partition_raw("bad", mig={"devices": {"9g.99gb": 1}}),
    ]
    nodes = [node_raw(f"n{i}") for i in range(5)] + [node_raw("cpu", pool="cpu")]
    first = simulated_pass(partitions, nodes)
    assert first == 5 + 3
    assert simulated_pass(partitions, nodes) == 0
    # An agent reports: only the status of the partitions on that node changes.
    report = NodeReport(
        (("a", 1), ("b", 1)),
        (GpuReport(0, GpuState.APPLIED, Mode.MIG), GpuReport(1, GpuState.APPLIED, Mode.MIG)),
    )
    nodes[0]["metadata"]["annotations"][STATE_ANNOTATION] = encode_report(report)
    assert simulated_pass(partitions, nodes) == 2
    assert simulated_pass(partitions, nodes) == 0
    conflict = {c["type"]: c for c in partitions[0]["status"]["conditions"]}["Conflict"]
    assert conflict["status"] == "True" and "taken by b" in conflict["message"]
    assert json.dumps(partitions[0]["status"]).count("kopf") == 0


# --- containment: one unreadable partition affects only itself --------------------------------


@given(st.sampled_from(PARTITION_CASES))
def test_every_poison_partition_becomes_an_error_naming_its_field(case):
    _, spec, field = case
    raw = partition_raw()
    raw["spec"] = spec
    read = read_partition(raw)
    assert read.partition is None
    assert field in read.error and len(read.error) < 2000


@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
        max_leaves=20,
    )
)
def test_law_any_object_reads_as_a_value_never_an_exception(junk):
    raw = {"metadata": {"name": "junk", "generation": junk}, "spec": junk, "status": junk}
    read = read_partition(raw)
    assert read.name == "junk" and read.generation >= 0
    assert read.partition is None or read.error == ""
    assert isinstance(read.status, Mapping)
    assert old_conditions(read.status) == [] or isinstance(read.status.get("conditions"), list)


def test_a_partition_that_breaks_the_core_is_set_apart_and_the_others_resolve():
    good = read_partition(partition_raw("good")).partition
    assert good is not None
    # A value no parser produces (a priority that is a string): stands for a bug in the core.
    spec = dataclasses.replace(good.spec, name="broken", priority="high")  # type: ignore[arg-type]
    broken = dataclasses.replace(good, spec=spec)
    nodes = [read_node(node_raw("n1")).view]
    contained = resolve_each([broken, good], nodes)
    resolution, set_apart = contained.resolution, contained.broken
    assert isinstance(contained.error, TypeError)
    assert set(set_apart) == {"broken"} and "TypeError" in set_apart["broken"]
    assert "good" in resolution.statuses and "broken" not in resolution.statuses
    assert [g.partition for g in resolution.desired["n1"]] == ["good"]


def test_one_change_is_resolved_once_for_the_pass_and_the_round():
    """Both loops list the same change: the second to resolve it gets the first's answer."""
    resolutions = Resolutions()
    parsed = [p for p in [read_partition(partition_raw("a")).partition] if p is not None]
    first = resolutions.resolve(parsed, [read_node(node_raw("n1")).view])
    again = resolutions.resolve(list(parsed), [read_node(node_raw("n1")).view])
    assert again is first
    other = resolutions.resolve(parsed, [read_node(node_raw("n2")).view])
    assert other is not first and set(other.resolution.desired) == {"n2"}
