"""Operator logic on plain values: node selection, conflicts, desired groups, status and conditions.

Aspects: selection by labels, per-node validation (unknown product, profile not offered,
infeasible layout, GPU index beyond the node, a node without GPUs), a node's GPUs from the
agent's inventory over the count label, dynamic MIG on nodes whose GPUs are unknown, conflict
resolution by priority then age (and a loser left with nothing says Conflict), status from node
reports, conditions and their transition times, deletion release, restoreOnDelete's wait for
whole GPUs; one interface per node (a partition asking the other one gets none of its GPUs and
hears both names: a law), and status.interface's counts from the inventory.
"""

import copy

from hypothesis import given
from hypothesis import strategies as st

from gpupart.core.api.spec import GpuConfig, Interface, Mode, parse_partition
from gpupart.core.api.wire import DesiredGroup, GpuReport, GpuState, NodeReport
from gpupart.core.cluster.partitioning import (
    LabeledNode,
    Partition,
    _node_status,
    merge_conditions,
    released,
    resolve,
)
from gpupart.core.mig.layout import MigInstance, Placement

BASE = {
    "apiVersion": "gpupart.io/v1alpha1",
    "kind": "GpuPartition",
    "metadata": {"name": "a", "generation": 2},
    "spec": {
        "nodeSelector": {"matchLabels": {"pool": "mig"}},
        "mode": "MIG",
        "mig": {"devices": {"1g.10gb": 7}},
    },
}


def partition(name="a", created="2026-01-01T00:00:00Z", deleting=False, **spec):
    document = copy.deepcopy(BASE)
    document["metadata"]["name"] = name
    document["spec"].update(spec)
    return Partition(parse_partition(document), created, deleting)


def node(name, product="NVIDIA-A100-SXM4-80GB", count="2", report=None, inventory=None, **labels):
    all_labels = {"pool": "mig", "nvidia.com/gpu.product": product, "nvidia.com/gpu.count": count}
    all_labels.update(labels)
    return LabeledNode(
        name, {k: v for k, v in all_labels.items() if v is not None}, report, inventory
    )


def conditions(status):
    return {c.type: (c.status, c.reason) for c in status.conditions}


def test_selected_nodes_get_the_partition_and_status_waits_for_agents():
    result = resolve([partition()], [node("n1"), node("n2"), node("cpu", pool="cpu")])
    assert set(result.desired) == {"n1", "n2"}
    (group,) = result.desired["n1"]
    assert (group.partition, group.generation, group.gpus, group.config.mode) == (
        "a",
        2,
        None,
        Mode.MIG,
    )
    status = result.statuses["a"]
    assert [n for n, _ in status.nodes] == ["n1", "n2"]
    assert conditions(status)["Ready"] == ("False", "NotApplied")
    assert conditions(status)["Progressing"] == ("True", "Applying")


def test_applied_reports_make_the_partition_ready():
    report = NodeReport(
        observed=(("a", 2),),
        gpus=tuple(
            GpuReport(i, GpuState.APPLIED, Mode.MIG, (MigInstance(Placement(0, 1), "1g.10gb"),))
            for i in (0, 1)
        ),
    )
    status = resolve([partition()], [node("n1", report=report)]).statuses["a"]
    assert conditions(status)["Ready"] == ("True", "Applied")
    assert conditions(status)["Degraded"] == ("False", "Healthy")


def test_old_generation_in_report_is_still_pending():
    report = NodeReport(observed=(("a", 1),), gpus=(GpuReport(0, GpuState.APPLIED, Mode.MIG),))
    status = resolve([partition()], [node("n1", report=report)]).statuses["a"]
    assert dict(status.nodes)["n1"].state is GpuState.PENDING
    assert "generation 2" in dict(status.nodes)["n1"].message


def test_blocked_gpu_names_the_pods_in_the_way():
    report = NodeReport(
        observed=(("a", 2),),
        gpus=(
            GpuReport(
                1,
                GpuState.BLOCKED,
                Mode.MIG,
                message="3 instances in use",
                blocking_pods=("team/train-1",),
            ),
        ),
    )
    status = resolve([partition()], [node("n1", report=report)]).statuses["a"]
    assert conditions(status)["Degraded"] == ("True", "Blocked")
    assert "team/train-1" in dict(status.nodes)["n1"].message


def test_profile_not_offered_by_a_nodes_gpu_fails_only_that_node():
    result = resolve([partition()], [node("a100"), node("a30", product="NVIDIA-A30")])
    status = result.statuses["a"]
    failed = dict(status.nodes)["a30"]
    assert (
        failed.state is GpuState.FAILED
        and "1g.10gb" in failed.message
        and "A30-24GB" in failed.message
    )
    assert "a30" not in result.desired, "bad input changes nothing on the node"
    assert conditions(status)["Ready"] == ("False", "InvalidForNode")


def test_unknown_product_and_missing_label_are_named():
    result = resolve([partition()], [node("t4", product="Tesla-T4"), node("bare", product=None)])
    messages = {n: s.message for n, s in result.statuses["a"].nodes}
    assert "'Tesla-T4' is not in gpupart's catalogue" in messages["t4"]
    assert "no nvidia.com/gpu.product label" in messages["bare"]
    assert result.desired == {}


def test_gpu_index_beyond_the_node_is_refused():
    result = resolve([partition(gpus=[3])], [node("n1", count="2")])
    assert "has 2 GPUs" in dict(result.statuses["a"].nodes)["n1"].message


def test_selector_matching_nothing_is_a_condition_not_an_error():
    status = resolve([partition()], [node("cpu", pool="cpu")]).statuses["a"]
    assert conditions(status)["Ready"] == ("False", "NoMatchingNodes")


def test_higher_priority_wins_a_shared_gpu_and_the_loser_keeps_the_rest():
    low = partition("low", gpus=[0, 1])
    high = partition("high", created="2026-02-01T00:00:00Z", gpus=[1], priority=5)
    result = resolve([low, high], [node("n1")])
    groups = {g.partition: g.gpus for g in result.desired["n1"]}
    assert groups == {"high": (1,), "low": (0,)}
    assert conditions(result.statuses["low"])["Conflict"][0] == "True"
    assert (
        "taken by high"
        in [c for c in result.statuses["low"].conditions if c.type == "Conflict"][0].message
    )
    assert conditions(result.statuses["high"])["Conflict"][0] == "False"


def test_equal_priority_goes_to_the_older_partition():
    older = partition("older", created="2026-01-01T00:00:00Z")
    newer = partition("newer", created="2026-03-01T00:00:00Z")
    result = resolve([newer, older], [node("n1")])
    assert [g.partition for g in result.desired["n1"]] == ["older"]
    assert conditions(result.statuses["newer"])["Conflict"][0] == "True"


def test_label_change_moves_a_node_between_partitions():
    a = partition("a")
    b = partition("b", nodeSelector={"matchLabels": {"pool": "other"}})
    before = resolve([a, b], [node("n1")])
    after = resolve([a, b], [node("n1", pool="other")])
    assert [g.partition for g in before.desired["n1"]] == ["a"]
    assert [g.partition for g in after.desired["n1"]] == ["b"]


def test_deleting_partition_releases_its_nodes_and_waits_for_reports():
    result = resolve([partition(deleting=True)], [node("n1")])
    assert result.desired == {} and result.statuses == {}
    still = node("n1", report=NodeReport(observed=(("a", 2),), gpus=()))
    assert released("a", [still, node("n2")]) == ["n1"]
    assert released("a", [node("n2")]) == []


def test_resolve_is_deterministic_whatever_the_input_order():
    parts = [partition("x", created="2026-01-02T00:00:00Z"), partition("y")]
    nodes = [node("n2"), node("n1")]
    assert resolve(parts, nodes) == resolve(list(reversed(parts)), list(reversed(nodes)))


def test_condition_times_move_only_on_status_flips():
    first = resolve([partition()], [node("n1")]).statuses["a"].conditions
    old = merge_conditions([], first, now="T1")
    again = merge_conditions(old, first, now="T2")
    assert all(c["lastTransitionTime"] == "T1" for c in again)
    applied = NodeReport(observed=(("a", 2),), gpus=(GpuReport(0, GpuState.APPLIED, Mode.MIG),))
    later = resolve([partition()], [node("n1", count="1", report=applied)]).statuses["a"].conditions
    merged = {c["type"]: c["lastTransitionTime"] for c in merge_conditions(old, later, now="T3")}
    assert merged["Ready"] == "T3" and merged["Degraded"] == "T1"


def test_a_blocked_message_names_each_gpu_once_without_repeating_its_prefix():
    report = NodeReport(
        (("p", 1),),
        (
            GpuReport(
                0,
                GpuState.BLOCKED,
                Mode.MPS,
                message="in use by pods a/x; it leaves MPS mode once idle",
            ),
            GpuReport(
                1,
                GpuState.BLOCKED,
                Mode.MPS,
                message="in use by pods a/x; it leaves MPS mode once idle",
            ),
        ),
    )
    group = DesiredGroup("p", 1, None, GpuConfig(Mode.MIG, (("1g.10gb", 1),)))
    status = _node_status(group, report)
    assert status.message == "GPU 0, 1: in use by pods a/x; it leaves MPS mode once idle"


DYNAMIC = {"mig": {"dynamic": {}}}


def ready(status):
    return next(c for c in status.conditions if c.type == "Ready")


def test_the_agents_inventory_gives_a_node_its_gpus_and_wins_over_the_label():
    only_inventory = node("inv", count=None, inventory=(0, 1, 2))
    assert only_inventory.gpu_indices == (0, 1, 2) and only_inventory.count_disagreement == ""
    wrong_label = node("lab", count="8", inventory=(0, 1))
    assert wrong_label.gpu_indices == (0, 1)
    assert "nvidia.com/gpu.count=8" in wrong_label.count_disagreement
    assert "inventory lists 2 GPU(s)" in wrong_label.count_disagreement
    assert node("plain", count="2").gpu_indices == (0, 1)
    assert node("none", count=None).gpu_indices is None
    # spec.gpus is checked against what the agent lists, not the label.
    result = resolve([partition(gpus=[2])], [only_inventory, wrong_label])
    states = dict(result.statuses["a"].nodes)
    assert states["inv"].state is GpuState.PENDING
    assert states["lab"].state is GpuState.FAILED and "has 2 GPUs (0, 1)" in states["lab"].message


def test_a_dynamic_partition_on_a_node_with_only_the_inventory_gets_every_gpu():
    result = resolve([partition(**DYNAMIC)], [node("inv", count=None, inventory=(0, 1))])
    (group,) = result.desired["inv"]
    assert group.config.dynamic and group.gpus is None
    assert ready(result.statuses["a"]).reason == "NotApplied"
    # Two partitions split it by index, as with the label.
    low = partition("low", gpus=[0, 1])
    high = partition("high", gpus=[1], priority=3)
    split = resolve([low, high], [node("inv", count=None, inventory=(0, 1))])
    assert {g.partition: g.gpus for g in split.desired["inv"]} == {"high": (1,), "low": (0,)}


def test_a_dynamic_partition_on_a_node_with_neither_says_so_and_what_to_do():
    result = resolve([partition(**DYNAMIC)], [node("bare", count=None), node("ok")])
    status = result.statuses["a"]
    condition = ready(status)
    assert condition.reason == "GpusUnknown"
    assert condition.message.startswith("bare: GPUs unknown"), condition.message
    assert "gpupart.io/inventory" in condition.message
    assert "label the node nvidia.com/gpu.count=<GPUs>" in condition.message
    assert dict(status.nodes)["bare"].state is GpuState.PENDING
    # Still written: the agent, once it runs there, enables MIG and publishes its inventory.
    assert [g.partition for g in result.desired["bare"]] == ["a"]
    # A static partition needs no index there: the agent applies it to every GPU it has.
    static = resolve([partition()], [node("bare", count=None)])
    assert ready(static.statuses["a"]).reason == "NotApplied"


def test_a_node_without_gpus_is_refused_by_name():
    result = resolve(
        [partition()], [node("empty", count=None, inventory=()), node("zero", count="0")]
    )
    states = dict(result.statuses["a"].nodes)
    assert "empty has no GPU (the node agent's gpupart.io/inventory lists none)" in (
        states["empty"].message
    )
    assert "zero has no GPU (nvidia.com/gpu.count is 0)" in states["zero"].message
    assert ready(result.statuses["a"]).reason == "InvalidForNode"
    assert result.desired == {}


def test_a_partition_left_with_no_gpu_by_a_conflict_says_conflict_naming_the_winner():
    old = partition("old", created="2026-01-01T00:00:00Z")
    new = partition("new", created="2026-02-01T00:00:00Z")
    result = resolve([old, new], [node("n1"), node("n2")])
    condition = ready(result.statuses["new"])
    assert condition.reason == "Conflict", condition
    assert "n1 GPU 0, 1 taken by old" in condition.message
    assert "n2 GPU 0, 1 taken by old" in condition.message
    assert conditions(result.statuses["new"])["Conflict"] == ("True", "GpusClaimedElsewhere")
    # With GPUs unknown on both sides, the winner takes all and the loser still says why.
    unknown = resolve([old, new], [node("n1", count=None)])
    assert ready(unknown.statuses["new"]).reason == "Conflict"
    assert ready(resolve([new], [node("cpu", pool="cpu")]).statuses["new"]).reason == (
        "NoMatchingNodes"
    )


def whole(index, state=GpuState.APPLIED, mode=Mode.NONE, **kw):
    return GpuReport(index, state, mode, **kw)


def test_restore_on_delete_keeps_the_node_annotation_and_waits_for_whole_gpus():
    gone = partition(deleting=True, restoreOnDelete=True)
    # The agent has not acted on the deletion yet: it still reports applying the partition.
    applying = node("n1", report=NodeReport((("a", 2),), (whole(0, mode=Mode.MIG),)))
    result = resolve([gone], [applying])
    assert result.desired == {"n1": ()}, "an annotation without groups: every GPU whole"
    release = result.releases["a"]
    assert release.unanswered == ("n1",) and release.restoring == ()
    # It acted: one GPU is whole, the other still holds a pod's instance.
    blocked = whole(
        1,
        GpuState.BLOCKED,
        Mode.MIG,
        message="leaving MIG mode destroys 3g.40gb at slots 4-7, in use",
        blocking_pods=("team-a/train",),
    )
    waiting = node("n1", report=NodeReport((), (whole(0), blocked)))
    result = resolve([gone], [waiting])
    assert result.releases["a"].unanswered == () and result.releases["a"].restoring == ("n1",)
    status = result.statuses["a"]
    ((name, state),) = status.nodes
    assert state.state is GpuState.BLOCKED and "(in use by team-a/train)" in state.message
    condition = ready(status)
    assert condition.reason == "Restoring"
    assert condition.message.startswith("returning GPUs to whole GPUs before deletion: 0 of 1")
    assert "team-a/train" in condition.message
    assert conditions(status)["Degraded"] == ("True", "Blocked")
    # Whole again: nothing holds the deletion.
    done = resolve([gone], [node("n1", report=NodeReport((), (whole(0), whole(1))))])
    assert done.releases["a"].restoring == () and done.releases["a"].unanswered == ()
    assert dict(done.statuses["a"].nodes)["n1"].state is GpuState.APPLIED
    assert done.desired == {"n1": ()}


def test_restore_on_delete_leaves_gpus_that_a_live_partition_takes():
    gone = partition("a", deleting=True, restoreOnDelete=True, gpus=[0, 1])
    other = partition("b", created="2026-02-01T00:00:00Z", gpus=[1])
    report = NodeReport((("b", 2),), (whole(0), whole(1, mode=Mode.MIG)))
    result = resolve([gone, other], [node("n1", report=report)])
    assert [g.partition for g in result.desired["n1"]] == ["b"]
    ((_, state),) = result.statuses["a"].nodes
    assert state.gpus == (0,) and state.state is GpuState.APPLIED, state
    # Nowhere to restore (every GPU went to b, or no agent ever reported): no status entry.
    taken = resolve(
        [partition("a", deleting=True, restoreOnDelete=True, gpus=[1]), other],
        [node("n1", report=report), node("silent")],
    )
    assert taken.statuses["a"].nodes == () and taken.releases["a"].restoring == ()


def test_deletion_without_restore_removes_the_annotation_and_writes_no_status():
    still = node("n1", report=NodeReport((("a", 2),), (whole(0, mode=Mode.MIG),)))
    result = resolve([partition(deleting=True)], [still])
    assert result.desired == {} and result.statuses == {}
    assert result.releases["a"].unanswered == ("n1",) and result.releases["a"].restoring == ()


# --- one interface per node (ADR 023) ----------------------------------------------------------


def test_a_node_serves_one_interface_and_the_other_partition_hears_both_names():
    plugin = partition("plugin", gpus=[0])
    dra = partition("dra", created="2026-01-02T00:00:00Z", gpus=[1], interface="dra")
    result = resolve([plugin, dra], [node("n1"), node("n2", pool="other")])
    assert [g.partition for g in result.desired["n1"]] == ["plugin"]
    status = result.statuses["dra"]
    assert conditions(status)["Conflict"] == ("True", "GpusClaimedElsewhere")
    assert conditions(status)["Ready"] == ("False", "Conflict")
    message = next(c.message for c in status.conditions if c.type == "Conflict")
    assert "n1" in message and "plugin" in message and "dra" in message, message
    assert conditions(result.statuses["plugin"])["Conflict"] == ("False", "NoConflict")
    # Priority decides, as for GPUs: the DRA partition takes the node, the other hears why.
    first = partition("dra", created="2026-01-02T00:00:00Z", gpus=[1], interface="dra", priority=5)
    result = resolve([plugin, first], [node("n1")])
    assert [(g.partition, g.config.interface) for g in result.desired["n1"]] == [
        ("dra", Interface.DRA)
    ]
    assert conditions(result.statuses["plugin"])["Conflict"][0] == "True"


def test_partitions_of_one_interface_share_a_node_by_gpu():
    a = partition("a", gpus=[0], interface="dra")
    b = partition("b", created="2026-01-02T00:00:00Z", gpus=[1], interface="dra")
    result = resolve([a, b], [node("n1")])
    assert [(g.partition, g.gpus) for g in result.desired["n1"]] == [("a", (0,)), ("b", (1,))]
    assert all(conditions(s)["Conflict"][0] == "False" for s in result.statuses.values())


def test_status_counts_how_the_held_gpus_are_served_now():
    moving = LabeledNode(
        "n1",
        {"pool": "mig", "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"},
        inventory_gpus=(0, 1, 2),
        interfaces=((0, Interface.DRA), (1, None), (2, Interface.DEVICE_PLUGIN)),
    )
    served = resolve([partition(interface="dra")], [moving]).statuses["a"].served
    assert served.wanted is Interface.DRA  # GPU 2 has not begun to move yet
    assert (served.dra, served.device_plugin, served.moving, served.unreported) == (1, 1, 1, 0)
    assert (served.served, served.held) == (1, 3)
    # No inventory yet: the count label's GPUs are held, and nothing says how they are served.
    plain = resolve([partition()], [node("n2", count="2")]).statuses["a"].served
    assert (plain.unreported, plain.served, plain.held) == (2, 0, 2)


@st.composite
def tables(draw):
    partitions = [
        partition(
            f"p{k}",
            created=f"2026-01-0{k + 1}T00:00:00Z",
            priority=draw(st.integers(0, 2)),
            interface=draw(st.sampled_from(["devicePlugin", "dra"])),
            **({"gpus": draw(st.sets(st.integers(0, 3), min_size=1).map(sorted))}
               if draw(st.booleans()) else {}),
        )
        for k in range(draw(st.integers(1, 4)))
    ]  # fmt: skip
    nodes = [node(f"n{k}", count="4") for k in range(draw(st.integers(1, 3)))]
    return partitions, nodes


@given(tables())
def test_law_no_node_is_given_two_interfaces_and_every_refusal_names_both(table):
    partitions, nodes = table
    result = resolve(partitions, nodes)
    for name, groups in result.desired.items():
        assert len({g.config.interface for g in groups}) <= 1, (name, groups)
        held = [i for g in groups for i in (g.gpus or range(4))]
        assert len(held) == len(set(held)), groups  # and no GPU twice
    for p in partitions:
        spec = p.spec
        for name, groups in result.desired.items():
            mine = [g for g in groups if g.partition == spec.name]
            others = {g.config.interface for g in groups} - {spec.config.interface}
            if others:
                assert not mine
                conflict = next(
                    c for c in result.statuses[spec.name].conditions if c.type == "Conflict"
                )
                assert conflict.status == "True"
                said = f"{name} serves its GPUs through {others.pop()} for partition "
                assert said in conflict.message and spec.name in conflict.message
                owner = conflict.message.split(said, 1)[1].split(",", 1)[0]
                assert owner in {g.partition for g in groups}, conflict.message
