"""What the extender trusts: only assignments it signed, and at bind only the live pod.

We test these aspects:
- the watch cache counts a pod's `gpupart.io/assignment` only when it verifies for that pod's
  UID and node; a forged, copied, re-targeted or unsigned one neither takes room on the GPU it
  names nor frees room: the pod counts on its node, on no GPU in particular, with its spec's
  amounts, and never holds a serial-admission node;
- a verified assignment a tenant edits (or removes) later stays counted as it was;
- an assignment counts on the GPU its UUID names in the node's inventory, whatever its index
  says; a UUID the node does not have is counted on no GPU, with a logged reason;
- without a readable key no assignment is trusted; once the key can be read they are;
- bind signs every shared-GPU assignment for the live pod's UID (it verifies with the key),
  and refuses, with a sentence, a pod that is not the one filter saw (UID), not ours
  (`schedulerName`), bound already, being deleted, not pending, gone, or whose live demand
  differs from the filter's (a lying filter body); shared-GPU binds without a readable key are
  refused naming the setting or the file, while MIG and whole-GPU binds need no key.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from extender_objects import FakeBinder

from gpupart.core.api.provenance import forgery
from gpupart.core.api.wire import ASSIGNMENT_ANNOTATION, PodAssignment, decode_assignment
from gpupart.keyfile import KeyFile
from gpupart_extender.cache import NODE, POD, ClusterCache
from gpupart_extender.metrics import Metrics
from gpupart_extender.objects import KeySource, SignerSource
from gpupart_extender.service import ExtenderService
from gpupart_extender.settings import ExtenderSettings
from gpupart_testsupport.objects import (
    KEY,
    KEYS,
    keys,
    node,
    pod,
    shared,
    shared_gpu,
    signed,
    whole_gpu,
    write_key_file,
    write_public_key_file,
)

GPUS = [shared_gpu(0, memory=40000), shared_gpu(1, memory=40000)]


def cluster(*pods: dict[str, Any], source: KeySource | None = keys) -> ClusterCache:
    c = ClusterCache(keys=source)
    c.replace(NODE, [node("n1", GPUS, serial=True), node("n2", GPUS), node("w", [whole_gpu(0)])])
    c.replace(POD, list(pods))
    return c


def used(c: ClusterCache, name: str = "n1") -> tuple[list[int], list[str]]:
    """Memory used on each GPU of the node, and the pods counted on no GPU in particular."""
    view = c.snapshot.view(name)
    assert view is not None
    return [g.used_memory_mib for g in view.gpus], [t.pod for t in view.unplaced_tenants]


def with_assignment(p: dict[str, Any], assignment: PodAssignment) -> dict[str, Any]:
    """`p` carrying `assignment` exactly as given (a tenant's own annotation)."""
    from gpupart.core.api.wire import encode_assignment

    p["metadata"]["annotations"][ASSIGNMENT_ANNOTATION] = encode_assignment(assignment)
    return p


# --- the watch cache -------------------------------------------------------------------------


def test_a_genuine_assignment_counts_on_its_gpu() -> None:
    c = cluster(pod("a", shared(30000), node="n1", assignment=PodAssignment("n1", 1, "GPU-0001")))
    assert used(c) == ([0, 30000], [])


@pytest.mark.parametrize(
    "claimed",
    [
        pytest.param(
            PodAssignment("n1", 0, "GPU-0000", 1, 1, "uid-team-a-t", "0" * 64), id="forged"
        ),
        pytest.param(
            signed(PodAssignment("n1", 0, "GPU-0000", 1, 1), "uid-team-b-victim"),
            id="copied from another pod",
        ),
        pytest.param(
            signed(PodAssignment("n2", 0, "GPU-0000", 1, 1), "uid-team-a-t"),
            id="signed for another node",
        ),
        pytest.param(PodAssignment("n1", 0, "GPU-0000", 1, 1, "uid-team-a-t"), id="unsigned"),
        pytest.param(
            replace(signed(PodAssignment("n1", 0, "GPU-0000", 1, 1), "uid-team-a-t"), gpu=1),
            id="edited",
        ),
    ],
)
def test_an_assignment_that_does_not_verify_takes_and_frees_nothing(
    claimed: PodAssignment, caplog: pytest.LogCaptureFixture
) -> None:
    """The tenant's pod asks 50000 MiB (kube-scheduler counts it against the node's 80000);
    its annotation claims 1 MiB on GPU 0."""
    tenant = with_assignment(pod("t", shared(50000), node="n1"), claimed)
    with caplog.at_level(logging.WARNING, logger="gpupart_extender.cache"):
        c = cluster(tenant)
    # Not on GPU 0 (with 1 MiB or otherwise): on the node, with its spec's 50000 MiB.
    assert used(c) == ([0, 0], ["team-a/t"])
    assert c.snapshot.awaiting("n1") == ()  # and it never holds the node's admission
    (record,) = [r for r in caplog.records if r.getMessage().startswith("Ignored a pod's GPU")]
    assert "team-a/t" in str(record.__dict__) and "on no GPU in particular" in str(record.__dict__)
    # 80000 - 50000 MiB are left on the node, on whichever GPU: 30000 fit, 31000 do not.
    service = ExtenderService(
        c, ExtenderSettings().scoring(), binder=FakeBinder(), metrics=Metrics()
    )
    assert service.filter(pod("fits", shared(30000)), ["n1"]).passed == ["n1"]
    why = service.filter(pod("big", shared(31000)), ["n1"]).failed["n1"]
    assert "50000 MiB used by pods without a GPU assignment (team-a/t)" in why, why


def test_a_forged_copy_of_another_pods_assignment_leaves_that_pod_counted_once() -> None:
    victim = pod("victim", shared(30000), node="n1", assignment=PodAssignment("n1", 0, "GPU-0000"))
    copy = pod("t", shared(30000), node="n1")
    copy["metadata"]["annotations"] = dict(victim["metadata"]["annotations"])
    c = cluster(victim, copy)
    assert used(c) == ([30000, 0], ["team-a/t"])


def test_a_verified_assignment_edited_by_its_tenant_stays_counted_as_it_was() -> None:
    genuine = pod("a", shared(30000), node="n1", assignment=PodAssignment("n1", 1, "GPU-0001"))
    c = cluster(genuine)
    assert used(c) == ([0, 30000], [])
    edited = with_assignment(
        pod("a", shared(30000), node="n1"),
        PodAssignment("n1", 0, "GPU-0000", 1, 1, "uid-team-a-a", "f" * 64),
    )
    c.apply(POD, "MODIFIED", edited)
    assert used(c) == ([0, 30000], [])
    removed = pod("a", shared(30000), node="n1")
    c.apply(POD, "MODIFIED", removed)
    assert used(c) == ([0, 30000], [])
    c.apply(POD, "DELETED", removed)
    assert used(c) == ([0, 0], [])


def test_an_assignment_counts_on_the_gpu_its_uuid_names(caplog: pytest.LogCaptureFixture) -> None:
    # Index 0 but GPU 1's UUID: the node agent serves by UUID, so does the count.
    by_uuid = pod("a", shared(30000), node="n1", assignment=PodAssignment("n1", 0, "GPU-0001"))
    gone = pod("b", shared(5000), node="n1", assignment=PodAssignment("n1", 1, "GPU-0009"))
    with caplog.at_level(logging.WARNING, logger="gpupart_extender.cache"):
        c = cluster(by_uuid, gone)
    assert used(c) == ([0, 30000], ["team-a/b"])
    texts = [str(r.__dict__) for r in caplog.records if "Ignored a pod's GPU" in r.getMessage()]
    assert len(texts) == 1 and "GPU-0009, not in the inventory" in texts[0], texts
    view = c.snapshot.view("n1")
    assert view is not None and [t.pod for t in view.gpus[1].tenants] == ["team-a/a"]


def test_without_a_readable_key_no_assignment_counts_until_one_can_be_read(
    tmp_path: Path,
) -> None:
    path = tmp_path / "keys"
    a = pod("a", shared(30000), node="n1", assignment=PodAssignment("n1", 1, "GPU-0001"))
    assert used(cluster(a, source=None)) == ([0, 0], ["team-a/a"])
    c = cluster(a, source=KeyFile.private(path).keys)  # the Secret is not mounted yet
    assert used(c) == ([0, 0], ["team-a/a"])
    assert c.recheck_assignments() == 0 and used(c) == ([0, 0], ["team-a/a"])
    write_key_file(path)
    assert c.recheck_assignments() == 1
    assert used(c) == ([0, 30000], [])
    assert c.recheck_assignments() == 0  # nothing left to check


def test_a_rotated_key_file_verifies_with_every_key_it_holds(tmp_path: Path) -> None:
    path = write_key_file(tmp_path / "keys", b"a-new-assignment-key-signs-now-1", KEY)
    a = pod("a", shared(30000), node="n1", assignment=PodAssignment("n1", 1, "GPU-0001"))
    assert used(cluster(a, source=KeyFile.private(path).keys)) == ([0, 30000], [])


# --- bind ------------------------------------------------------------------------------------


def service_of(
    c: ClusterCache, binder: FakeBinder, source: SignerSource | None = keys
) -> ExtenderService:
    return ExtenderService(
        c,
        ExtenderSettings().scoring(),
        binder=binder,
        metrics=Metrics(),
        keys=source,
        admission_wait_seconds=0.05,
    )


def filtered(svc: ExtenderService, p: dict[str, Any], nodes: list[str]) -> None:
    assert svc.filter(p, nodes).passed == nodes


def test_bind_signs_the_assignment_for_the_live_pods_uid() -> None:
    binder = FakeBinder()
    c = cluster()
    svc = service_of(c, binder)
    p = binder.live(pod("new", shared(8000, 20)))
    filtered(svc, p, ["n2"])
    assert svc.bind("team-a", "new", "uid-team-a-new", "n2") == ""
    assert binder.reads == 1
    ((_, _, _, annotations),) = binder.annotations
    assignment = decode_assignment(annotations[ASSIGNMENT_ANNOTATION])
    assert (assignment.pod_uid, assignment.memory_mib, assignment.compute_percent) == (
        "uid-team-a-new",
        8000,
        20,
    )
    assert forgery(assignment, KEYS, pod_uid="uid-team-a-new", node="n2") == ""
    # The watch shows the pod as bound: it counts where the extender put it.
    c.apply(POD, "MODIFIED", binder.pods["team-a", "new"])
    assert used(c, "n2")[1] == [] and sum(used(c, "n2")[0]) == 8000


def refusal(binder: FakeBinder, svc: ExtenderService, asked: dict[str, Any], uid: str) -> str:
    filtered(svc, asked, ["n2"])
    answer = svc.bind("team-a", asked["metadata"]["name"], uid, "n2")
    assert answer and binder.bindings == [], answer
    return answer


@pytest.mark.parametrize(
    ("change", "uid", "expected"),
    [
        (
            lambda p: p["metadata"].update(uid="uid-new-one"),
            "uid-team-a-p",
            "pod team-a/p now has UID 'uid-new-one', not 'uid-team-a-p' as in the bind request",
        ),
        (
            lambda p: p["spec"].update(schedulerName="default-scheduler"),
            "uid-team-a-p",
            "pod team-a/p is for scheduler 'default-scheduler'; this extender binds only pods "
            "of 'gpupart-scheduler' (setting scheduler_names)",
        ),
        (
            lambda p: p["spec"].pop("schedulerName"),
            "uid-team-a-p",
            "pod team-a/p is for scheduler 'default-scheduler'",
        ),
        (
            lambda p: p["spec"].update(nodeName="n1"),
            "uid-team-a-p",
            "pod team-a/p is already bound to node 'n1'; not bound again",
        ),
        (
            lambda p: p["metadata"].update(deletionTimestamp="2026-01-01T00:00:00Z"),
            "uid-team-a-p",
            "pod team-a/p is being deleted; not bound",
        ),
        (
            lambda p: p["status"].update(phase="Failed"),
            "uid-team-a-p",
            "pod team-a/p is Failed, not Pending; not bound",
        ),
        (
            lambda p: p["spec"].update(containers=pod("p", shared(30000))["spec"]["containers"]),
            "uid-team-a-p",
            "pod team-a/p asks for 1 shared-GPU slot(s), 30000 MiB, 0 %; 0m CPU, priority 0, "
            "but the filter call was for 1 shared-GPU slot(s), 1 MiB, 0 %",
        ),
        (lambda _: None, "", "the bind request for pod team-a/p names no pod UID"),
    ],
    ids=[
        "replaced",
        "other scheduler",
        "default scheduler",
        "bound",
        "deleting",
        "done",
        "demand differs",
        "no uid",
    ],  # fmt: skip
)
def test_bind_refuses_a_live_pod_that_is_not_the_one_filter_saw(
    change: Any, uid: str, expected: str
) -> None:
    binder = FakeBinder()
    svc = service_of(cluster(), binder)
    asked = pod("p", shared(1))  # what the filter body said
    live = pod("p", shared(1))
    change(live)
    binder.live(live)
    assert expected in refusal(binder, svc, asked, uid)


def test_bind_refuses_a_pod_it_cannot_read() -> None:
    binder = FakeBinder()
    svc = service_of(cluster(), binder)
    answer = refusal(binder, svc, pod("ghost", shared(1)), "uid-team-a-ghost")
    assert answer.startswith("cannot read pod team-a/ghost to check it before binding: ")
    assert 'pods "ghost" not found' in answer and answer.endswith("the scheduler will retry")


def test_bind_takes_the_amounts_from_the_live_pod_never_the_filter_body() -> None:
    """Filter asked with 1 MiB (the body lied); the live pod asks 30000: refused, and the
    scheduler's retry (filtering the real pod) binds with the real amount."""
    binder = FakeBinder()
    svc = service_of(cluster(), binder)
    binder.live(pod("p", shared(30000)))
    assert "asks for 1 shared-GPU slot(s), 30000 MiB" in refusal(
        binder, svc, pod("p", shared(1)), "uid-team-a-p"
    )
    filtered(svc, pod("p", shared(30000)), ["n2"])
    assert svc.bind("team-a", "p", "uid-team-a-p", "n2") == ""
    ((_, _, _, annotations),) = binder.annotations
    assert decode_assignment(annotations[ASSIGNMENT_ANNOTATION]).memory_mib == 30000


def test_shared_binds_without_a_readable_key_are_refused_naming_it(tmp_path: Path) -> None:
    binder = FakeBinder()
    binder.live(pod("p", shared(1)))
    answer = refusal(
        binder, service_of(cluster(), binder, None), pod("p", shared(1)), "uid-team-a-p"
    )
    assert answer == (
        "shared-GPU pod team-a/p not bound: no assignment key is configured (setting "
        "assignment_key_file, GPUPART_EXTENDER_ASSIGNMENT_KEY_FILE), and node agents serve "
        "only assignments signed with it"
    )
    absent = tmp_path / "absent"
    svc = service_of(cluster(), binder, KeyFile.private(absent).keys)
    answer = refusal(binder, svc, pod("p", shared(1)), "uid-team-a-p")
    assert answer.startswith(f"shared-GPU pod team-a/p not bound: {absent}: cannot read the ")
    assert "(setting assignment_key_file)" in answer
    public = write_public_key_file(tmp_path / "public")  # what a node agent holds
    svc = service_of(cluster(), binder, KeyFile.private(public).keys)
    answer = refusal(binder, svc, pod("p", shared(1)), "uid-team-a-p")
    assert f"{public}: holds 1 public key(s) and no private key: the extender signs" in answer
    assert answer.endswith(
        "(setting assignment_key_file); node agents serve only assignments signed with it"
    )


def test_whole_gpu_binds_need_no_key() -> None:
    binder = FakeBinder()
    svc = service_of(cluster(), binder, None)
    p = binder.live(pod("w1", {"nvidia.com/gpu": 1}))
    filtered(svc, p, ["w"])
    assert svc.bind("team-a", "w1", "uid-team-a-w1", "w") == ""
    assert binder.bindings == [("team-a", "w1", "uid-team-a-w1", "w")] and not binder.annotations
