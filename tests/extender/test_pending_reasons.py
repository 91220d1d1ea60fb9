"""The pending pods' reasons (docs/adr-019-pending-reasons.md): which pods, what the text says, when an Event is posted.

We test these aspects:
- `unschedulable` keeps only our schedulers' unbound, live GPU pods whose PodScheduled
  condition is False/Unschedulable; `PendingPods` follows watch events and relists;
- `service.pending_reason` over every node: the nodes in the way named with their pods, the rest
  counted, MIG's dynamic outlook (a slice being made, a profile only a dynamic GPU can make, a
  profile nothing makes), nodes with room (kube-scheduler's own reasons then), a pod it cannot
  read; and it takes no hold and counts no filter decision;
- `Reporter.round` posts once per distinct text per pod, again when the text changes, afresh
  after the pod left, and goes on past a sink that fails.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import pytest

from gpupart.core.api.spec import GpuConfig, Mode
from gpupart.core.api.wire import DESIRED_ANNOTATION, DesiredGroup, encode_desired
from gpupart.core.scheduling.pending import pending_message
from gpupart_extender.cache import NODE, POD, ClusterCache
from gpupart_extender.pending import REASON, PendingPods, Reporter, unschedulable
from gpupart_extender.service import ExtenderService
from gpupart_testsupport.objects import mig_gpu, node, pod, reserve, whole_gpu

OURS = ("gpupart-scheduler",)


def _failed(p: dict[str, Any]) -> dict[str, Any]:
    """`p` as kube-scheduler leaves a pod it could not place."""
    p = copy.deepcopy(p)
    p["status"]["conditions"] = [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/4"}
    ]
    return p


MIG_POD = _failed(pod("wait", {"nvidia.com/mig-3g.40gb": 1}))


@pytest.mark.parametrize(
    ("change", "kept"),
    [
        (lambda _: None, True),
        (lambda p: p["spec"].update(schedulerName="default-scheduler"), False),
        (lambda p: p["spec"].update(nodeName="node-mig"), False),
        (lambda p: p["metadata"].update(deletionTimestamp="2026-01-01T00:00:00Z"), False),
        (lambda p: p["status"].update(phase="Failed"), False),
        (lambda p: p["status"].update(conditions=[]), False),
        (lambda p: p["status"]["conditions"][0].update(reason="SchedulerError"), False),
        (lambda p: p["spec"]["containers"][0].update(resources={}), False),
        # A request it cannot read is kept: the reason says so.
        (
            lambda p: p["spec"]["containers"][0]["resources"]["limits"].update(
                {"nvidia.com/mig-3g.40gb": "-1"}
            ),
            True,
        ),
    ],
    ids=[
        "ours",
        "other-scheduler",
        "bound",
        "deleting",
        "finished",
        "not-tried",
        "not-unschedulable",
        "no-gpu",
        "unreadable-request",
    ],
)
def test_unschedulable_keeps_only_our_gpu_pods_kube_scheduler_gave_up_on(
    change: Any, kept: bool
) -> None:
    p = copy.deepcopy(MIG_POD)
    change(p)
    assert unschedulable(p, OURS) is kept


def test_pending_pods_follow_watch_events_and_relists() -> None:
    pending = PendingPods(OURS)
    other = _failed(pod("other", {"nvidia.com/gpu": 1}))
    pending.apply("ADDED", MIG_POD)
    pending.apply("ADDED", other)
    assert set(pending.pods()) == {"uid-team-a-wait", "uid-team-a-other"}
    bound = copy.deepcopy(other)
    bound["spec"]["nodeName"] = "node-whole"
    pending.apply("MODIFIED", bound)
    assert set(pending.pods()) == {"uid-team-a-wait"}
    pending.apply("DELETED", MIG_POD)
    assert pending.pods() == {}
    pending.replace([MIG_POD, bound])
    assert set(pending.pods()) == {"uid-team-a-wait"}


def test_the_reason_names_the_node_in_the_way_and_counts_the_rest(
    service: ExtenderService,
) -> None:
    text = service.pending_reason(MIG_POD)
    assert text.startswith("0/4 nodes can take it (gpupart): "), text
    assert (
        "node-mig: 2 GPUs, no free 3g.40gb slice (all 2 in use by team-a/train-1, team-b/train-2)"
        in text
    ), text
    assert "node-bare: no GPU inventory" in text, text
    # Nothing a filter does: no hold for the bind to find, no decision counted.
    assert service.cache.reservations.held("uid-team-a-wait") is None
    decisions = service.metrics.decisions.labels("filter", "unschedulable")
    assert decisions._value.get() == 0


def test_nodes_with_room_point_at_kube_schedulers_own_reasons(service: ExtenderService) -> None:
    text = service.pending_reason(_failed(pod("w", {"nvidia.com/gpu": 1})))
    assert text.startswith("gpupart finds GPU room for it on 1/4 node(s) (node-whole): "), text
    assert "the others: " in text, text


def test_a_pod_it_cannot_read_says_so(service: ExtenderService) -> None:
    text = service.pending_reason(_failed(pod("bad", {"nvidia.com/mig-3g.40gb": "x"})))
    assert text.startswith("gpupart cannot read this pod: invalid pod: "), text


def _dynamic_cache(reservations: list[Any]) -> ClusterCache:
    dyn = node("node-dyn", [mig_gpu(0, [])], reservations=reservations)
    desired = (DesiredGroup("dyn-h100", 1, None, GpuConfig(Mode.MIG, dynamic=True)),)
    dyn["metadata"]["annotations"][DESIRED_ANNOTATION] = encode_desired(desired)
    cache = ClusterCache()
    cache.replace(NODE, [dyn, node("node-whole", [whole_gpu(0)])])
    cache.replace(POD, [])
    return cache


def _reason(service: ExtenderService, cache: ClusterCache, p: Mapping[str, Any]) -> str:
    fresh = ExtenderService(cache, service.scoring, binder=service.binder, metrics=service.metrics)
    return fresh.pending_reason(p)


@pytest.mark.parametrize(
    ("profile", "reservations", "lead"),
    [
        (
            "3g.40gb",
            [reserve("team-a/wait", 0, "3g.40gb", 4, 4)],
            "dynamic MIG is creating a 3g.40gb slice for this pod on node-dyn (GPU 0, slots 4-7). ",
        ),
        (
            "3g.40gb",
            [],
            "no node offers 3g.40gb yet; dynamic MIG (GpuPartition dyn-h100) can make one on "
            "node-dyn GPU 0: the operator's MigSliceUnavailable events on this pod say what is in "
            "the way. ",
        ),
        (
            "1g.5gb",
            [],
            "no node offers 1g.5gb and no GpuPartition with dynamic MIG selects a node that could "
            "make one. ",
        ),
        # Another pod's reservation is no slice made for this one.
        (
            "3g.40gb",
            [reserve("team-a/else", 0, "3g.40gb", 4, 4)],
            "no node offers 3g.40gb yet; dynamic MIG (GpuPartition dyn-h100)",
        ),
        # An expired reservation is nothing being made.
        (
            "3g.40gb",
            [reserve("team-a/wait", 0, "3g.40gb", 4, 4, expires=1.0)],
            "no node offers 3g.40gb yet; dynamic MIG (GpuPartition dyn-h100)",
        ),
    ],
    ids=["being-made", "dynamic-can", "nothing-can", "someone-elses", "expired"],
)
def test_a_mig_pod_is_told_what_dynamic_mig_does_for_it(
    service: ExtenderService, profile: str, reservations: list[Any], lead: str
) -> None:
    p = _failed(pod("wait", {f"nvidia.com/mig-{profile}": 1}))
    text = _reason(service, _dynamic_cache(reservations), p)
    assert text.startswith(lead), text
    assert "0/2 nodes can take it (gpupart): " in text, text


def test_the_message_fits_an_event() -> None:
    reasons = {f"n{i}: a long reason " + "x" * 80: 1 for i in range(40)}
    text = pending_message(lead="", nodes=40, fits=[], reasons=reasons)
    assert len(text) == 1024 and text.endswith("..."), len(text)


class Sink:
    def __init__(self) -> None:
        self.posted: list[tuple[str, str, str]] = []
        self.fail = False

    def warn(self, pod: Mapping[str, Any], reason: str, message: str) -> None:
        if self.fail:
            raise RuntimeError("API down")
        self.posted.append((pod["metadata"]["name"], reason, message))


def test_the_reporter_posts_each_distinct_text_once_per_pending_pod() -> None:
    pending = PendingPods(OURS)
    texts = {"wait": "first"}
    sink = Sink()
    reporter = Reporter(pending, lambda p: texts[p["metadata"]["name"]], sink)
    pending.apply("ADDED", MIG_POD)
    assert reporter.round() == 1
    assert reporter.round() == 0
    texts["wait"] = "second"
    assert reporter.round() == 1
    pending.apply("DELETED", MIG_POD)
    assert reporter.round() == 0
    pending.apply("ADDED", MIG_POD)  # back: a new attempt, said again
    assert reporter.round() == 1
    assert sink.posted == [
        ("wait", REASON, "first"),
        ("wait", REASON, "second"),
        ("wait", REASON, "second"),
    ]


def test_a_failing_sink_or_explanation_costs_only_that_pod() -> None:
    pending = PendingPods(OURS)
    other = _failed(pod("other", {"nvidia.com/gpu": 1}))
    pending.replace([MIG_POD, other])

    why = ["why"]

    def explain(p: Mapping[str, Any]) -> str:
        if p["metadata"]["name"] == "wait":
            raise ValueError("a bug")
        return why[0]

    sink = Sink()
    reporter = Reporter(pending, explain, sink)
    assert reporter.round() == 1
    assert sink.posted == [("other", REASON, "why")]
    sink.fail = True
    why[0] = "why now"
    assert reporter.round() == 0  # not posted, so tried again next round
    sink.fail = False
    assert reporter.round() == 1
    assert sink.posted[-1] == ("other", REASON, "why now")


@pytest.mark.parametrize(
    ("groups", "text", "found"),
    [
        ([("dyn", None, True)], None, ((0, "dyn"), (1, "dyn"))),
        ([("dyn", (1,), True), ("static", (0,), False)], None, ((1, "dyn"),)),
        ([("dyn", (1, 7), True)], None, ((1, "dyn"),)),  # GPU 7 is not in the inventory
        ([("a", (0,), True), ("b", (0,), True)], None, ((0, "a"),)),  # the first group wins
        ([], "not json", ()),  # unreadable: no words, no failure
        ([], None, ()),
    ],
    ids=["all-gpus", "some-gpus", "unknown-gpu", "first-wins", "unreadable", "none"],
)
def test_the_dynamic_gpus_are_read_from_the_desired_annotation(
    groups: list[tuple[str, tuple[int, ...] | None, bool]], text: str | None, found: Any
) -> None:
    from gpupart_extender.objects import read_node

    obj = node("n", [mig_gpu(0, []), mig_gpu(1, [])])
    desired = tuple(
        DesiredGroup(name, 1, gpus, GpuConfig(Mode.MIG, dynamic=dynamic))
        for name, gpus, dynamic in groups
    )
    if groups:
        obj["metadata"]["annotations"][DESIRED_ANNOTATION] = encode_desired(desired)
    if text is not None:
        obj["metadata"]["annotations"][DESIRED_ANNOTATION] = text
    entry = read_node(obj)
    assert entry.dynamic == found
    assert not entry.problem  # the node itself is read as ever


def test_nodes_the_pods_node_selector_rules_out_are_counted_in_kube_schedulers_words(
    service: ExtenderService,
) -> None:
    # A whole-GPU pod pinned to the MIG node's pool: node-whole has room, but the pod may not
    # go there, so it is no "room elsewhere"; the words are the MIG node's, the rest counted.
    labelled = [
        node("node-mig", [mig_gpu(0, [("3g.40gb", 0, 4)]), mig_gpu(1, [("3g.40gb", 0, 4)])]),
        node("node-whole", [whole_gpu(0), whole_gpu(1)]),
    ]
    labelled[0]["metadata"]["labels"] = {"pool": "a100"}
    labelled[1]["metadata"]["labels"] = {"pool": "h100"}
    cache = ClusterCache()
    cache.replace(NODE, labelled)
    cache.replace(POD, [])
    pinned = _failed(pod("pinned", {"nvidia.com/gpu": 1}))
    pinned["spec"]["nodeSelector"] = {"pool": "a100"}
    text = _reason(service, cache, pinned)
    assert text.startswith("0/2 nodes can take it (gpupart): "), text
    assert "1 node(s) didn't match Pod's node affinity/selector" in text, text
    assert "node-mig: 2 GPUs" in text and "node-whole" not in text, text
    # The same through required node affinity (matchFields on the name too).
    del pinned["spec"]["nodeSelector"]
    pinned["spec"]["affinity"] = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {
                        "matchFields": [
                            {"key": "metadata.name", "operator": "In", "values": ["node-mig"]}
                        ]
                    }
                ]
            }
        }
    }
    assert "1 node(s) didn't match Pod's node affinity/selector" in _reason(service, cache, pinned)
    # Relabelled, the pod may go to node-whole, where there is room.
    labelled[1]["metadata"]["labels"] = {"pool": "a100"}
    cache.apply(NODE, "MODIFIED", labelled[1])
    del pinned["spec"]["affinity"]
    pinned["spec"]["nodeSelector"] = {"pool": "a100"}
    assert _reason(service, cache, pinned).startswith(
        "gpupart finds GPU room for it on 1/2 node(s) (node-whole)"
    )
