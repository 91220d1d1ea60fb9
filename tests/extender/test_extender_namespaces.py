"""Namespaces in the extender: their labels decide anti-affinity namespaceSelectors, and a relabel changes answers.

We test these aspects:
- the cache keeps every readable Namespace as name -> labels in the snapshot; a relabel
  publishes a new mapping and leaves the one already published as it was; a change that is no
  relabel (a new resourceVersion) publishes nothing new; DELETED and a relist drop namespaces;
- a Namespace whose labels are not labels is listed as unreadable and selected by no selector's
  labels, while the others still are;
- filter and prioritize, memo on, through one long-lived service: a pending pod whose required
  (or preferred) podAntiAffinity term selects `app=infer` pods in namespaces labelled
  `tier=gold` shares the GPU of team-a's infer pod while team-a is not gold, is refused it
  (or scores lower) once team-a is relabelled gold, and shares it again once the label goes;
  the expected answer comes from the labels alone (a pod in a namespace the cache does not
  know is never selected by labels).
"""

from __future__ import annotations

from typing import Any

import pytest
from extender_objects import FakeBinder

from gpupart.core.api.wire import PodAssignment
from gpupart_extender.cache import NAMESPACE, NODE, POD, ClusterCache
from gpupart_extender.metrics import Metrics
from gpupart_extender.service import ExtenderService
from gpupart_extender.settings import ExtenderSettings
from gpupart_testsupport.objects import keys, namespace, node, pod, shared, shared_gpu

GOLD = {"matchLabels": {"tier": "gold"}}


def _cache(*namespaces: dict[str, Any]) -> ClusterCache:
    """n1: one MPS GPU (40000 MiB) holding team-a/infer (app=infer, 10000 MiB); n2: the same
    GPU, empty."""
    c = ClusterCache(keys=keys)
    c.replace(NODE, [node(n, [shared_gpu(0, memory=40000)]) for n in ("n1", "n2")])
    c.replace(
        POD,
        [
            pod(
                "infer",
                shared(10000),
                node="n1",
                labels={"app": "infer"},
                assignment=PodAssignment("n1", 0, "GPU-0000", 10000),
            )
        ],
    )
    c.replace(NAMESPACE, list(namespaces))
    return c


def _service(cache: ClusterCache) -> ExtenderService:
    return ExtenderService(
        cache, ExtenderSettings().scoring(), keys=keys, binder=FakeBinder(), metrics=Metrics()
    )


def _guest(selector: dict[str, Any], *, required: bool = True) -> dict[str, Any]:
    """A pending pod in team-c avoiding app=infer pods of the namespaces `selector` picks."""
    term = {
        "labelSelector": {"matchLabels": {"app": "infer"}},
        "namespaceSelector": selector,
        "topologyKey": "kubernetes.io/hostname",
    }
    anti = (
        {"requiredDuringSchedulingIgnoredDuringExecution": [term]}
        if required
        else {"preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 100, "podAffinityTerm": term}
        ]}
    )  # fmt: skip
    return pod("guest", shared(1000), namespace="team-c", affinity={"podAntiAffinity": anti})


def test_the_snapshot_holds_each_namespaces_labels_and_a_relabel_publishes_a_new_mapping() -> None:
    c = _cache(namespace("team-a"), namespace("team-c"))
    before = c.snapshot.namespaces
    assert dict(before) == {
        "team-a": {"kubernetes.io/metadata.name": "team-a"},
        "team-c": {"kubernetes.io/metadata.name": "team-c"},
    }
    relabelled = namespace("team-a", {"tier": "gold"})
    c.apply(NAMESPACE, "MODIFIED", relabelled)
    assert c.snapshot.namespaces["team-a"]["tier"] == "gold"
    assert "tier" not in before["team-a"], "a published mapping never changes"
    published = c.snapshot.namespaces
    relabelled["metadata"]["resourceVersion"] = "2"  # no relabel: nothing new to publish
    c.apply(NAMESPACE, "MODIFIED", relabelled)
    assert c.snapshot.namespaces is published
    c.apply(NAMESPACE, "DELETED", relabelled)
    assert list(c.snapshot.namespaces) == ["team-c"]
    c.replace(NAMESPACE, [namespace("team-b")])
    assert list(c.snapshot.namespaces) == ["team-b"] and c.snapshot.counts()["namespaces"] == 1


@pytest.mark.parametrize(
    "labels",
    [["tier"], {"tier": 1}, {"tier": "gold\n"}, {"-bad-key": "x"}, {"tier": "x" * 64}],
)
def test_an_unreadable_namespace_is_listed_and_selected_by_no_labels(labels: Any) -> None:
    bad = namespace("team-a")
    bad["metadata"]["labels"] = labels
    c = _cache(bad, namespace("team-b", {"tier": "gold"}))
    assert list(c.snapshot.namespaces) == ["team-b"]
    (unreadable,) = c.snapshot.unreadable
    assert (unreadable.kind, unreadable.name) == ("Namespace", "team-a")
    assert "Namespace.metadata.labels" in unreadable.problem, unreadable.problem
    assert c.snapshot.unreadable_counts()["Namespace"] == 1
    # team-a's labels are not known: its infer pod is not avoided, n1 still takes the guest.
    assert _service(c).filter(_guest(GOLD), ["n1", "n2"]).passed == ["n1", "n2"]
    c.apply(NAMESPACE, "MODIFIED", namespace("team-a", {"tier": "gold"}))
    assert c.snapshot.unreadable == ()
    assert _service(c).filter(_guest(GOLD), ["n1", "n2"]).passed == ["n2"]


def test_a_required_term_is_decided_by_the_other_namespaces_labels_and_follows_a_relabel() -> None:
    c = _cache(namespace("team-a"), namespace("team-c"))
    service = _service(c)  # one service, one memo, for every answer below
    names = ["n1", "n2"]
    guest = _guest(GOLD)
    for gold in (False, True, False, True):
        labels = {"tier": "gold"} if gold else {"tier": "silver"}
        c.apply(NAMESPACE, "MODIFIED", namespace("team-a", labels))
        for _ in range(2):  # the second answer comes from the memo
            outcome = service.filter(guest, names)
            if gold:
                assert outcome.passed == ["n2"], outcome
                assert "GPU 0: required podAntiAffinity with team-a/infer" in outcome.failed["n1"]
            else:
                assert outcome.passed == names, outcome
            assert [n for n, _ in service.prioritize(guest, names)] == names


def test_a_preferred_term_scores_by_the_other_namespaces_labels_and_follows_a_relabel() -> None:
    c = _cache(namespace("team-a"), namespace("team-c"))
    service = _service(c)
    guest = _guest(GOLD, required=False)
    scores = []
    for gold in (False, True, False):
        labels = {"tier": "gold"} if gold else {}
        c.apply(NAMESPACE, "MODIFIED", namespace("team-a", labels))
        scores.append(dict(service.prioritize(guest, ["n1"]))["n1"])
        assert service.filter(guest, ["n1"]).passed == ["n1"]  # preferred: never refused
    assert scores[1] < scores[0] == scores[2], scores


def test_a_pod_of_a_namespace_the_cache_does_not_know_is_not_selected_by_labels() -> None:
    # team-a has no Namespace object in the cache: no selector on labels picks it...
    c = _cache(namespace("team-c", {"tier": "gold"}))
    service = _service(c)
    assert service.filter(_guest(GOLD), ["n1"]).passed == ["n1"]
    # ...and only the empty selector takes every namespace (kube-scheduler v1.37).
    assert service.filter(_guest({}), ["n1"]).passed == []
    unlabelled = {"matchExpressions": [{"key": "tier", "operator": "NotIn", "values": ["x"]}]}
    assert service.filter(_guest(unlabelled), ["n1"]).passed == ["n1"]
