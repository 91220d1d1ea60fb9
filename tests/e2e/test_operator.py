"""The operator against the real API server: CRD applied with kubectl, nodes from kwok, kopf in-process.

Aspects: create -> desired annotations on matching nodes and a Pending status; a simulated node
agent -> Ready=True; update -> new generation on the nodes; a profile the node's GPU does not
offer -> Ready=False naming node and profile, nothing written to that node; a selector matching
no node; two partitions on one GPU -> Conflict=True naming the winner (priority, then age), and
the loser left with nothing reads Ready=False Conflict; a node's GPUs from the agent's inventory
when it has no count label, and a dynamic partition on a node with neither says so (GpusUnknown,
a Warning Event); a label change moves a node between partitions; a hand-edited annotation is
put back; delete -> annotations removed, finalizer held until the agent lets go, not held by an
unreachable node; restoreOnDelete -> held while pods keep a GPU from going whole, named, past
the release timeout, and released at once when the admin turns restoreOnDelete off;
Events for transitions; nothing of kopf in status; a pass in a steady state writes nothing,
counted at the API server's own /metrics; `spec.interface: dra` reaches the node's desired
annotation, `kubectl get gpup -o wide` shows it with the served count, status.interface
follows the agent's inventory, and a device-plugin partition on that node hears Conflict
naming both (one node, one interface).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import re
import ssl
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import kopf
import pytest
import yaml
from kubernetes.client.exceptions import ApiException
from poison import GOOD_SPECS, HUGE, LONG, PARTITION_CASES, partition

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
from gpupart.core.mig.layout import MigInstance, Placement
from gpupart.kubeconfig import describe_api_error
from gpupart_operator.main import build
from gpupart_operator.model import GROUP, OWNED_STATUS_KEYS, PLURAL, VERSION
from gpupart_operator.settings import OperatorSettings
from gpupart_operator.writer import Writer
from gpupart_testsupport.cluster import REPO, ControlPlane, create_nodes, gpu_node, mig_labels
from gpupart_testsupport.polling import wait_for

pytestmark = pytest.mark.e2e

CRD_DIR = REPO / "charts" / "gpupart" / "crds"
A100 = "NVIDIA-A100-SXM4-80GB"
RUN = f"op{int(time.time()) % 100000}"
TIMEOUT = 30


# --- fixtures: CRDs, an operator running in a thread --------------------------------------


def apply_crds(cp: ControlPlane) -> None:
    """Both CRDs from the chart, with kubectl, as an admin would."""
    cp.kubectl("apply", "-f", str(CRD_DIR))
    for crd in ("gpupartitions.gpupart.io", "clusterkopfpeerings.kopf.dev"):
        cp.kubectl("wait", "--for=condition=Established", "--timeout=60s", f"crd/{crd}")
    wait_for(lambda: cp.kubectl("get", "gpup", check=False).returncode == 0, 30, "gpup served")


class RunningOperator:
    """kopf.operator in its own thread and event loop, stopped through kopf's stop flag."""

    def __init__(self, cp: ControlPlane) -> None:
        self.settings = OperatorSettings(
            kubeconfig=str(cp.kubeconfig),
            drift_timer_seconds=3,
            debounce_seconds=0.1,
            release_retry_seconds=1,
            release_timeout_seconds=12,
            write_workers=8,
        )
        self.parts = build(self.settings)
        self.writer, self.reconciler = self.parts.writer, self.parts.reconciler
        self.stop = threading.Event()
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._main, name="gpupart-operator", daemon=True)

    def _main(self) -> None:
        try:
            asyncio.run(
                kopf.operator(
                    registry=self.parts.registry,
                    standalone=True,
                    clusterwide=True,
                    stop_flag=self.stop,
                    ready_flag=self.ready,
                )
            )
        except BaseException as error:  # noqa: BLE001 - reported by the fixture
            self.error = error

    def start(self) -> None:
        self.thread.start()
        if not self.ready.wait(TIMEOUT):
            raise RuntimeError(f"operator did not start: {self.error!r}")

    def close(self) -> None:
        self.stop.set()
        self.thread.join(TIMEOUT)
        self.parts.close()
        assert not self.thread.is_alive(), "operator thread did not stop"


@pytest.fixture(scope="module")
def operator(k8s_control_plane: ControlPlane) -> Iterator[RunningOperator]:
    apply_crds(k8s_control_plane)
    running = RunningOperator(k8s_control_plane)
    running.start()
    try:
        yield running
    finally:
        try:
            # Leave nothing with our finalizer behind for later modules: nodes that are gone
            # hold no deletion.
            k8s_control_plane.kubectl(
                "delete", "gpup", "-l", f"e2e-run={RUN}", "--ignore-not-found", "--wait=false"
            )
            k8s_control_plane.kubectl("delete", "node", "-l", f"e2e-run={RUN}", "--wait=false")
            wait_for(
                lambda: not _list_mine(running.writer),
                TIMEOUT,
                "this module's GpuPartitions to be gone",
            )
        finally:
            running.close()
    assert running.error is None, running.error


def _list_mine(writer: Writer) -> list[Any]:
    listed = writer.custom.list_cluster_custom_object(
        GROUP, VERSION, PLURAL, label_selector=f"e2e-run={RUN}"
    )
    return list(listed["items"])


# --- helpers -------------------------------------------------------------------------------


def apply(cp: ControlPlane, name: str, spec: dict[str, Any]) -> None:
    body = {
        "apiVersion": "gpupart.io/v1alpha1",
        "kind": "GpuPartition",
        "metadata": {"name": name, "labels": {"e2e-run": RUN}},
        "spec": spec,
    }
    cp.kubectl("apply", "-f", "-", input=yaml.safe_dump(body))


def get(op: RunningOperator, name: str) -> dict[str, Any]:
    return dict(op.writer.custom.get_cluster_custom_object(GROUP, VERSION, PLURAL, name))


def node(op: RunningOperator, name: str) -> dict[str, Any]:
    return json.loads(op.writer.core.read_node(name, _preload_content=False).data)


def annotation(op: RunningOperator, name: str, key: str = DESIRED_ANNOTATION) -> str | None:
    annotations = node(op, name)["metadata"].get("annotations") or {}
    return annotations.get(key)


def desired_partitions(op: RunningOperator, name: str) -> list[tuple[str, int]]:
    text = annotation(op, name)
    return [] if text is None else [(g.partition, g.generation) for g in decode_desired(text)]


def condition(obj: dict[str, Any], ctype: str) -> dict[str, Any]:
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c["type"] == ctype:
            return dict(c)
    return {}


def wait_condition(
    op: RunningOperator, name: str, ctype: str, status: str, reason: str | None = None
) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        obj = get(op, name)
        c = condition(obj, ctype)
        ok = c.get("status") == status and (reason is None or c.get("reason") == reason)
        return obj if ok else None

    return wait_for(check, TIMEOUT, f"{name} {ctype}={status} {reason or ''}")


def wait_desired(op: RunningOperator, node_name: str, expected: list[tuple[str, int]]) -> None:
    wait_for(
        lambda: desired_partitions(op, node_name) == expected,
        TIMEOUT,
        f"{node_name} desired == {expected}",
    )


def report(
    op: RunningOperator,
    node_name: str,
    observed: list[tuple[str, int]],
    gpus: tuple[GpuReport, ...] | None = None,
) -> None:
    """Play the node agent: say which partition generations this node applied (and how its GPUs are)."""
    if gpus is None:
        gpus = (
            GpuReport(
                0,
                GpuState.APPLIED,
                Mode.MIG,
                (MigInstance(Placement(0, 1), "1g.10gb"),) if observed else (),
            ),
        )
    text = encode_report(NodeReport(tuple(observed), gpus))
    op.writer.core.patch_node(
        node_name,
        {"metadata": {"annotations": {STATE_ANNOTATION: text}}},
        _content_type="application/merge-patch+json",
    )


def publish_inventory(op: RunningOperator, node_name: str, gpus: int) -> None:
    """Play the node agent: publish its inventory, `gpus` whole H100s."""
    inventory = Inventory(
        tuple(
            InventoryGpu(i, f"GPU-{node_name}-{i}", "NVIDIA H100 80GB HBM3", 81559, Mode.MIG)
            for i in range(gpus)
        )
    )
    op.writer.core.patch_node(
        node_name,
        {"metadata": {"annotations": {INVENTORY_ANNOTATION: encode_inventory(inventory)}}},
        _content_type="application/merge-patch+json",
    )


def publish_served(op: RunningOperator, node_name: str, *served: Interface | None) -> None:
    """Play the node agent: an inventory of A100s in MIG mode, each served as `served` says."""
    inventory = Inventory(
        tuple(
            InventoryGpu(i, f"GPU-{node_name}-{i}", "NVIDIA A100-SXM4-80GB", 81920, Mode.MIG,
                         interface=interface)
            for i, interface in enumerate(served)
        )
    )  # fmt: skip
    op.writer.core.patch_node(
        node_name,
        {"metadata": {"annotations": {INVENTORY_ANNOTATION: encode_inventory(inventory)}}},
        _content_type="application/merge-patch+json",
    )


def make_nodes(cp: ControlPlane, names: list[str], product: str = A100, **labels: str) -> None:
    create_nodes(
        cp.api_client(),
        [
            gpu_node(n, labels={**mig_labels(product, gpus=1), "e2e-run": RUN, **labels})
            for n in names
        ],
    )


def events_for(op: RunningOperator, name: str) -> list[dict[str, Any]]:
    listed = json.loads(
        op.writer.core.list_namespaced_event(
            "default", field_selector=f"involvedObject.name={name}", _preload_content=False
        ).data
    )
    return list(listed["items"])


def retries(op: RunningOperator, name: str) -> int:
    """How often kopf has retried the delete handler of `name` (0 once it is gone)."""
    try:
        annotations = get(op, name)["metadata"].get("annotations") or {}
    except ApiException as error:
        if error.status == 404:
            return 0
        raise
    return int(json.loads(annotations.get("gpupart.io/release", "{}")).get("retries", 0))


def gone(op: RunningOperator, name: str) -> bool:
    return not [p for p in _list_mine(op.writer) if p["metadata"]["name"] == name]


def assert_no_kopf_in_status(obj: dict[str, Any]) -> None:
    status = obj.get("status") or {}
    assert set(status) <= set(OWNED_STATUS_KEYS), status.keys()
    assert "kopf" not in json.dumps(status)


# --- tests ---------------------------------------------------------------------------------


def test_create_agent_report_update_and_events(
    k8s_control_plane: ControlPlane, operator: RunningOperator
) -> None:
    cp, op = k8s_control_plane, operator
    nodes = [f"{RUN}-life-{i}" for i in range(2)]
    make_nodes(cp, nodes, **{"e2e-op": f"{RUN}-life"})
    make_nodes(cp, [f"{RUN}-life-other"], **{"e2e-op": f"{RUN}-other"})
    name = f"{RUN}-life"
    spec = {
        "nodeSelector": {"matchLabels": {"e2e-op": f"{RUN}-life"}},
        "mode": "MIG",
        "mig": {"devices": {"1g.10gb": 7}},
    }
    apply(cp, name, spec)
    for n in nodes:
        wait_desired(op, n, [(name, 1)])
    assert annotation(op, f"{RUN}-life-other") is None
    obj = wait_condition(op, name, "Progressing", "True", "Applying")
    assert condition(obj, "Ready")["reason"] == "NotApplied"
    assert obj["status"]["observedGeneration"] == 1
    assert {n: s["state"] for n, s in obj["status"]["nodes"].items()} == dict.fromkeys(
        nodes, "Pending"
    )
    assert_no_kopf_in_status(obj)

    for n in nodes:
        report(op, n, [(name, 1)])
    obj = wait_condition(op, name, "Ready", "True", "Applied")
    assert obj["status"]["nodesReady"] == "2/2"
    assert condition(obj, "Progressing")["status"] == "False"
    table = cp.kubectl("get", "gpup", name).stdout.splitlines()
    assert table[0].split()[:4] == ["NAME", "MODE", "NODES", "READY"], table
    assert table[1].split()[1:4] == ["MIG", "2/2", "True"], table

    # Update: a new generation reaches every node; Ready drops until agents catch up.
    apply(cp, name, {**spec, "mig": {"devices": {"3g.40gb": 2}}})
    for n in nodes:
        wait_desired(op, n, [(name, 2)])
    obj = wait_condition(op, name, "Ready", "False", "NotApplied")
    assert obj["status"]["observedGeneration"] == 2
    (group,) = decode_desired(annotation(op, nodes[0]) or "")
    assert dict(group.config.mig) == {"3g.40gb": 2}

    # Events: one per transition, about this GpuPartition.
    reasons = wait_for(
        lambda: (
            {e["reason"] for e in events_for(op, name)} >= {"Applied", "NotApplied"}
            and {e["reason"] for e in events_for(op, name)}
        ),
        TIMEOUT,
        "Events for Ready transitions",
    )
    assert "Applying" in reasons, reasons
    event = next(e for e in events_for(op, name) if e["reason"] == "Applied")
    assert event["involvedObject"]["kind"] == "GpuPartition"
    assert event["type"] == "Normal" and event["message"].startswith("Ready=True")
    # kopf's own bookkeeping is in annotations, never in status.
    obj = get(op, name)
    assert_no_kopf_in_status(obj)
    assert "gpupart.io/last-handled-configuration" in obj["metadata"]["annotations"]
    assert "gpupart.io/finalizer" in obj["metadata"]["finalizers"]


def test_profile_not_offered_is_refused_for_that_node_only(
    k8s_control_plane: ControlPlane, operator: RunningOperator
) -> None:
    cp, op = k8s_control_plane, operator
    label = {"e2e-op": f"{RUN}-mixed"}
    make_nodes(cp, [f"{RUN}-a30"], product="NVIDIA-A30", **label)
    make_nodes(cp, [f"{RUN}-a100"], **label)
    name = f"{RUN}-mixed"
    apply(
        cp,
        name,
        {"nodeSelector": {"matchLabels": label}, "mode": "MIG", "mig": {"devices": {"1g.10gb": 7}}},
    )
    obj = wait_condition(op, name, "Ready", "False", "InvalidForNode")
    message = condition(obj, "Ready")["message"]
    assert f"{RUN}-a30" in message and "1g.10gb" in message and "A30" in message, message
    assert obj["status"]["nodes"][f"{RUN}-a30"]["state"] == "Failed"
    assert condition(obj, "Degraded")["status"] == "True"
    wait_desired(op, f"{RUN}-a100", [(name, 1)])
    assert annotation(op, f"{RUN}-a30") is None
    warning = wait_for(
        lambda: [e for e in events_for(op, name) if e["reason"] == "InvalidForNode"],
        TIMEOUT,
        "a Warning Event",
    )
    assert warning[0]["type"] == "Warning"


def test_selector_matching_no_node_says_so_and_settles(
    k8s_control_plane: ControlPlane, operator: RunningOperator
) -> None:
    cp, op = k8s_control_plane, operator
    name = f"{RUN}-nomatch"
    apply(
        cp,
        name,
        {
            "nodeSelector": {"matchLabels": {"e2e-op": "nobody"}},
            "mode": "TimeSlicing",
            "timeSlicing": {"replicas": 4},
        },
    )
    obj = wait_condition(op, name, "Ready", "False", "NoMatchingNodes")
    assert obj["status"]["nodes"] == {} and obj["status"]["nodesReady"] == "0/0"
    version = obj["metadata"]["resourceVersion"]
    # Not an error loop: a pass writes nothing (once what earlier tests left has settled: this
    # API server is shared), and this partition is never written again.
    wait_for(lambda: op.reconciler.reconcile_all().writes == 0, TIMEOUT, "a pass without writes")
    assert get(op, name)["metadata"]["resourceVersion"] == version


def test_two_partitions_on_one_gpu_the_higher_priority_wins(
    k8s_control_plane: ControlPlane, operator: RunningOperator
) -> None:
    cp, op = k8s_control_plane, operator
    label = {"e2e-op": f"{RUN}-conflict"}
    shared = f"{RUN}-shared"
    make_nodes(cp, [shared], **label)
    selector = {"matchLabels": label}
    old, new = f"{RUN}-old", f"{RUN}-new"
    apply(
        cp, old, {"nodeSelector": selector, "mode": "TimeSlicing", "timeSlicing": {"replicas": 2}}
    )
    wait_desired(op, shared, [(old, 1)])
    # creationTimestamp has one-second resolution: make "older" unambiguous.
    time.sleep(1.1)
    apply(
        cp,
        new,
        {
            "nodeSelector": selector,
            "mode": "TimeSlicing",
            "timeSlicing": {"replicas": 8},
            "priority": 10,
        },
    )
    wait_desired(op, shared, [(new, 1)])
    loser = wait_condition(op, old, "Conflict", "True")
    assert new in condition(loser, "Conflict")["message"]
    assert shared not in loser["status"]["nodes"]
    # Left with no GPU at all, it says Conflict, not that no node matches.
    loser = wait_condition(op, old, "Ready", "False", "Conflict")
    message = condition(loser, "Ready")["message"]
    assert f"{shared} GPU 0 taken by {new}" in message, message
    warning = wait_for(
        lambda: [e for e in events_for(op, old) if e["reason"] == "Conflict"],
        TIMEOUT,
        "a Warning Event for Ready=False Conflict",
    )
    assert warning[0]["type"] == "Warning" and new in warning[0]["message"]
    # One pass writes each partition's status in turn: wait for the winner's too.
    wait_condition(op, new, "Conflict", "False")
    # Equal priority: the older object wins.
    apply(
        cp, new, {"nodeSelector": selector, "mode": "TimeSlicing", "timeSlicing": {"replicas": 8}}
    )
    wait_desired(op, shared, [(old, 1)])
    assert old in condition(wait_condition(op, new, "Conflict", "True"), "Conflict")["message"]
    wait_condition(op, old, "Conflict", "False")


def test_gpus_come_from_the_agents_inventory_and_a_node_with_neither_is_named(
    k8s_control_plane: ControlPlane, operator: RunningOperator
) -> None:
    cp, op = k8s_control_plane, operator
    label = {"e2e-op": f"{RUN}-inv"}
    listed, bare = f"{RUN}-inv", f"{RUN}-bare"
    labels = {**mig_labels(gpus=1), "e2e-run": RUN, **label}
    del labels["nvidia.com/gpu.count"]  # GFD's product label, no count: as a playground has
    create_nodes(cp.api_client(), [gpu_node(n, labels=labels) for n in (listed, bare)])
    publish_inventory(op, listed, 2)
    name = f"{RUN}-inv"
    apply(
        cp,
        name,
        {"nodeSelector": {"matchLabels": label}, "mode": "MIG", "mig": {"dynamic": {}}},
    )
    obj = wait_condition(op, name, "Ready", "False", "GpusUnknown")
    message = condition(obj, "Ready")["message"]
    assert message.startswith(f"{bare}: GPUs unknown"), message
    assert listed not in message and "nvidia.com/gpu.count" in message, message
    nodes = obj["status"]["nodes"]
    assert nodes[bare]["state"] == "Pending" and nodes[bare]["message"] == message
    assert nodes[listed]["state"] == "Pending" and "GPUs unknown" not in nodes[listed]["message"]
    warning = wait_for(
        lambda: [e for e in events_for(op, name) if e["reason"] == "GpusUnknown"],
        TIMEOUT,
        "a Warning Event naming the node",
    )
    assert warning[0]["type"] == "Warning" and bare in warning[0]["message"]
    # Both still get the partition: the agent enables MIG where it runs, then says its GPUs.
    wait_desired(op, listed, [(name, 1)])
    wait_desired(op, bare, [(name, 1)])
    publish_inventory(op, bare, 1)
    wait_condition(op, name, "Ready", "False", "NotApplied")
    # spec.gpus is checked against what the agent lists: GPU 1 exists on one node only.
    apply(
        cp,
        name,
        {
            "nodeSelector": {"matchLabels": label},
            "mode": "MIG",
            "mig": {"dynamic": {}},
            "gpus": [1],
        },
    )
    obj = wait_condition(op, name, "Ready", "False", "InvalidForNode")
    assert f"{bare} has 1 GPU (0); spec.gpus asks for 1" in condition(obj, "Ready")["message"]
    wait_desired(op, listed, [(name, 2)])


def test_a_label_change_moves_a_node_between_partitions(
    k8s_control_plane: ControlPlane, operator: RunningOperator
) -> None:
    cp, op = k8s_control_plane, operator
    mover = f"{RUN}-mover"
    make_nodes(cp, [mover], **{"e2e-pool": f"{RUN}-x"})
    px, py = f"{RUN}-px", f"{RUN}-py"
    for name, pool in ((px, "x"), (py, "y")):
        apply(
            cp,
            name,
            {
                "nodeSelector": {"matchLabels": {"e2e-pool": f"{RUN}-{pool}"}},
                "mode": "MPS",
                "mps": {"maxClients": 4},
            },
        )
    wait_desired(op, mover, [(px, 1)])
    cp.kubectl("label", "node", mover, f"e2e-pool={RUN}-y", "--overwrite")
    wait_desired(op, mover, [(py, 1)])
    wait_condition(op, px, "Ready", "False", "NoMatchingNodes")
    # One pass writes px's status, then py's: wait for the second too.
    wait_for(lambda: mover in get(op, py)["status"]["nodes"], TIMEOUT, f"{mover} in {py}'s status")
    # A hand edit of the annotation is put back.
    op.writer.core.patch_node(
        mover,
        {"metadata": {"annotations": {DESIRED_ANNOTATION: None}}},
        _content_type="application/merge-patch+json",
    )
    wait_desired(op, mover, [(py, 1)])


def test_delete_holds_the_finalizer_until_the_agent_lets_go(
    k8s_control_plane: ControlPlane, operator: RunningOperator
) -> None:
    cp, op = k8s_control_plane, operator
    label = {"e2e-op": f"{RUN}-del"}
    held = f"{RUN}-held"
    make_nodes(cp, [held], **label)
    name = f"{RUN}-del"
    apply(
        cp,
        name,
        {"nodeSelector": {"matchLabels": label}, "mode": "MIG", "mig": {"devices": {"7g.80gb": 1}}},
    )
    wait_desired(op, held, [(name, 1)])
    report(op, held, [(name, 1)])
    wait_condition(op, name, "Ready", "True")

    cp.kubectl("delete", "gpup", name, "--wait=false")
    wait_desired(op, held, [])  # back to the partition-free configuration
    obj = wait_for(
        lambda: (
            (o := get(op, name))["metadata"].get("annotations", {}).get("gpupart.io/release") and o
        ),
        TIMEOUT,
        "kopf to record the waiting delete handler",
    )
    assert (
        obj["metadata"].get("deletionTimestamp")
        and "gpupart.io/finalizer" in obj["metadata"]["finalizers"]
    )
    progress = json.loads(obj["metadata"]["annotations"]["gpupart.io/release"])
    assert "waiting for" in progress.get("message", "") and held in progress["message"]
    assert_no_kopf_in_status(obj)
    # Two more retries: still held while the agent applies it.
    wait_for(lambda: retries(op, name) >= progress.get("retries", 0) + 2, TIMEOUT, "two retries")
    assert not gone(op, name)

    report(op, held, [])  # the agent has returned the GPUs to the default
    wait_for(lambda: gone(op, name), TIMEOUT, f"{name} to be deleted")


def test_delete_completes_past_the_timeout_when_an_agent_never_lets_go(
    k8s_control_plane: ControlPlane, operator: RunningOperator
) -> None:
    cp, op = k8s_control_plane, operator
    label = {"e2e-op": f"{RUN}-orphan"}
    orphan = f"{RUN}-orphan"
    make_nodes(cp, [orphan], **label)
    name = f"{RUN}-orphan"
    apply(cp, name, {"nodeSelector": {"matchLabels": label}, "mode": "None"})
    wait_desired(op, orphan, [(name, 1)])
    report(op, orphan, [(name, 1)])  # then its agent goes: the node stays Ready, nobody reports
    wait_condition(op, name, "Ready", "True")
    cp.kubectl("delete", "gpup", name, "--wait=false")
    wait_for(lambda: retries(op, name) >= 2, TIMEOUT, "two retries of the delete handler")
    assert not gone(op, name)  # still within the timeout: held for the agent
    wait_for(lambda: gone(op, name), TIMEOUT, f"{name} deleted once the timeout passed")

    def warnings() -> list[str]:
        events = op.writer.core.list_event_for_all_namespaces(
            field_selector=f"involvedObject.name={name}"
        ).items
        return [e.message for e in events if e.type == "Warning"]

    wait_for(warnings, TIMEOUT, "a Warning Event about the deletion")
    found = warnings()
    assert any("Deleted without confirmation from node(s)" in m and orphan in m for m in found), (
        found
    )


def test_restore_on_delete_waits_for_whole_gpus_naming_the_pods_in_the_way(
    k8s_control_plane: ControlPlane, operator: RunningOperator
) -> None:
    cp, op = k8s_control_plane, operator
    label = {"e2e-op": f"{RUN}-restore"}
    held = f"{RUN}-restore"
    make_nodes(cp, [held], **label)
    name = f"{RUN}-restore"
    apply(
        cp,
        name,
        {
            "nodeSelector": {"matchLabels": label},
            "mode": "MIG",
            "mig": {"devices": {"7g.80gb": 1}},
            "restoreOnDelete": True,
        },
    )
    wait_desired(op, held, [(name, 1)])
    report(op, held, [(name, 1)])
    wait_condition(op, name, "Ready", "True")

    cp.kubectl("delete", "gpup", name, "--wait=false")
    # The node keeps an annotation without groups: the agent's cue to make every GPU whole.
    wait_for(lambda: annotation(op, held) is not None and desired_partitions(op, held) == [],
             TIMEOUT, "a desired annotation without groups")  # fmt: skip
    obj = wait_condition(op, name, "Ready", "False", "Restoring")
    assert obj["status"]["nodes"][held]["message"] == (
        "the node agent has not acted on the deletion yet"
    )
    # The agent acts: the GPU cannot leave MIG mode while a pod uses its instance.
    in_use = GpuReport(
        0,
        GpuState.BLOCKED,
        Mode.MIG,
        (MigInstance(Placement(0, 8), "7g.80gb"),),
        "leaving MIG mode destroys 7g.80gb at slots 0-7, in use; it changes once they are idle",
        ("team-a/train",),
    )
    report(op, held, [], (in_use,))
    obj = wait_condition(op, name, "Degraded", "True", "Blocked")
    assert "(in use by team-a/train)" in obj["status"]["nodes"][held]["message"]
    assert "team-a/train" in condition(obj, "Ready")["message"]
    # No timeout while the agent answers and pods decide: kopf is told to retry (and retries)
    # past the release timeout (12 s), each time naming the pod.
    deleted = dt.datetime.fromisoformat(get(op, name)["metadata"]["deletionTimestamp"])

    def past_the_timeout() -> dict[str, Any] | None:
        annotations = get(op, name)["metadata"].get("annotations", {})
        progress = json.loads(annotations.get("gpupart.io/release", "{}"))
        delayed = progress.get("delayed")
        if not delayed or "team-a/train" not in progress.get("message", ""):
            return None
        after = (dt.datetime.fromisoformat(delayed) - deleted).total_seconds()
        return progress if after > op.settings.release_timeout_seconds + 1 else None

    progress = wait_for(past_the_timeout, 60, "a retry past the release timeout naming the pod")
    assert "team-a/train" in progress["message"] and "restoreOnDelete" in progress["message"]
    assert not gone(op, name)
    degraded = wait_for(
        lambda: [e for e in events_for(op, name) if e["reason"] == "Blocked"],
        TIMEOUT,
        "a Warning Event naming the pod",
    )
    assert degraded[0]["type"] == "Warning" and "team-a/train" in degraded[0]["message"]

    # The admin stops waiting: restoreOnDelete turned off on the deleting object ends it now,
    # leaving the GPU as it is (the whole path, with a real agent: test_restore_on_delete.py).
    cp.kubectl(
        "patch", "gpup", name, "--type=merge", "-p", '{"spec":{"restoreOnDelete":false}}'
    )  # fmt: skip
    wait_for(lambda: gone(op, name), TIMEOUT, f"{name} to be deleted")
    wait_for(lambda: annotation(op, held) is None, TIMEOUT, "the annotation removed")


def test_delete_does_not_wait_for_an_unreachable_or_vanished_node(
    k8s_control_plane: ControlPlane, operator: RunningOperator
) -> None:
    cp, op = k8s_control_plane, operator
    label = {"e2e-op": f"{RUN}-lost"}
    lost, vanished = f"{RUN}-lost", f"{RUN}-vanished"
    make_nodes(cp, [lost, vanished], **label)
    name = f"{RUN}-lost"
    apply(cp, name, {"nodeSelector": {"matchLabels": label}, "mode": "None"})
    for n in (lost, vanished):
        wait_desired(op, n, [(name, 1)])
        report(op, n, [(name, 1)])
    wait_condition(op, name, "Ready", "True")
    # kwok set the node Running once; it does not put Ready back after this.
    wait_for(lambda: node(op, lost)["status"].get("phase") == "Running", TIMEOUT, "kwok")
    conditions = node(op, lost)["status"]["conditions"]
    for c in conditions:
        if c["type"] == "Ready":
            c.update(status="Unknown", reason="NodeStatusUnknown")
    op.writer.core.patch_node_status(
        lost,
        {"status": {"conditions": conditions}},
        _content_type="application/strategic-merge-patch+json",
    )
    op.writer.core.delete_node(vanished)
    cp.kubectl("delete", "gpup", name, "--wait=false")
    wait_for(lambda: gone(op, name), TIMEOUT, f"{name} to be deleted without waiting")
    assert annotation(op, lost) is None
    events = op.writer.core.list_event_for_all_namespaces(
        field_selector=f"involvedObject.name={name}"
    ).items
    said = [(e.type, e.reason, e.message) for e in events]
    assert any(
        (kind, reason) == ("Warning", "NodesUnreachable")
        and lost in message
        and vanished not in message
        for kind, reason, message in said
    ), said


def _write_counts(cp: ControlPlane) -> dict[str, float]:
    """apiserver_request_total for the writes the operator could make, by (verb, resource)."""
    ctx = ssl.create_default_context(cafile=str(cp.ca_file))
    request = urllib.request.Request(f"{cp.api_url}/metrics")
    request.add_header("Authorization", f"Bearer {cp.token}")
    with urllib.request.urlopen(request, timeout=10, context=ctx) as response:
        text = response.read().decode()
    counts: dict[str, float] = {}
    pattern = re.compile(r"^apiserver_request_total\{([^}]*)\} (\S+)$")
    for line in text.splitlines():
        match = pattern.match(line)
        if not match:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1)))
        if labels.get("verb") not in ("PATCH", "PUT", "POST", "DELETE"):
            continue
        resource = labels.get("resource", "")
        sub = labels.get("subresource", "")
        # kwok writes node status (heartbeats) and leases; those are not ours.
        if resource in ("gpupartitions", "events") or (resource == "nodes" and sub == ""):
            key = f"{labels['verb']} {resource}/{sub}"
            counts[key] = counts.get(key, 0) + float(match.group(2))
    return counts


def _quiet_write_counts(cp: ControlPlane, period: float) -> dict[str, float]:
    """Write counts once they stay the same for `period` seconds (the API server is quiet)."""
    deadline = time.monotonic() + TIMEOUT
    previous = _write_counts(cp)
    while True:
        time.sleep(period)
        current = _write_counts(cp)
        if current == previous:
            return current
        assert time.monotonic() < deadline, f"writes never stopped: {previous} -> {current}"
        previous = current


def test_a_steady_state_drift_pass_writes_nothing(
    k8s_control_plane: ControlPlane, operator: RunningOperator
) -> None:
    cp, op = k8s_control_plane, operator
    label = {"e2e-op": f"{RUN}-quiet"}
    quiet = [f"{RUN}-quiet-{i}" for i in range(3)]
    make_nodes(cp, quiet, **label)
    name = f"{RUN}-quiet"
    apply(
        cp,
        name,
        {"nodeSelector": {"matchLabels": label}, "mode": "MIG", "mig": {"devices": {"1g.10gb": 7}}},
    )
    for n in quiet:
        wait_desired(op, n, [(name, 1)])
    wait_condition(op, name, "Progressing", "True")

    # Settled once a whole pass writes nothing.
    wait_for(lambda: op.reconciler.reconcile_all().writes == 0, TIMEOUT, "a quiet pass")
    # Earlier tests share this API server and may still be cleaning up (deleting partitions);
    # start counting once a whole drift period passes without writes from anyone.
    before = _quiet_write_counts(cp, op.settings.drift_timer_seconds + 1)
    writes = op.reconciler.writes
    versions = {n: node(op, n)["metadata"]["resourceVersion"] for n in quiet}
    version = get(op, name)["metadata"]["resourceVersion"]
    result = op.reconciler.reconcile_all()  # a forced pass
    time.sleep(op.settings.drift_timer_seconds + 1)  # and the drift timers firing on their own
    assert result.writes == 0
    assert op.reconciler.writes == writes
    assert _write_counts(cp) == before
    assert {n: node(op, n)["metadata"]["resourceVersion"] for n in quiet} == versions
    assert get(op, name)["metadata"]["resourceVersion"] == version


@pytest.mark.usefixtures("operator")  # the CRDs are applied
def test_the_cli_serves_healthz_and_metrics(k8s_control_plane: ControlPlane) -> None:
    """`gpupart operator` as a process: kopf's /healthz and the Prometheus /metrics answer."""
    import subprocess
    import sys

    from gpupart_testsupport.ports import LOOPBACK, free_port

    cp = k8s_control_plane
    # A partition of its own: the first pass is started by an object, whatever ran before.
    apply(
        cp,
        f"{RUN}-cli",
        {
            "nodeSelector": {"matchLabels": {"e2e-op": "nobody"}},
            "mode": "TimeSlicing",
            "timeSlicing": {"replicas": 2},
        },
    )
    live, prom = free_port(), free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gpupart.cli",
            "operator",
            "--standalone",
            f"--kubeconfig={cp.kubeconfig}",
            f"--liveness={live}",
            f"--metrics-port={prom}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:

        def fetch(port: int, path: str) -> str:
            with urllib.request.urlopen(f"http://{LOOPBACK}:{port}{path}", timeout=5) as r:
                return str(r.read().decode())

        def passes(text: str) -> float:
            found = re.search(r"^gpupart_operator_reconciles_total (\S+)$", text, re.MULTILINE)
            return float(found.group(1)) if found else 0.0

        # At least one: the operator in this process writes too, which may wake another pass.
        text = wait_for(
            lambda: passes(t := fetch(prom, "/metrics")) >= 1 and t,
            TIMEOUT,
            "a first pass in /metrics",
        )
        assert 'gpupart_operator_partitions{state="' in text
        health = json.loads(wait_for(lambda: fetch(live, "/healthz"), TIMEOUT, "/healthz"))
        assert "secondsSinceReconcile" in health, health
    finally:
        proc.terminate()
        output = proc.communicate(timeout=TIMEOUT)[0].decode(errors="replace")
    assert proc.returncode == 0, output[-3000:]


# --- poison: admission bounds, and containment of what an older CRD let in -------------------


def _create(op: RunningOperator, body: dict[str, Any]) -> Any:
    return op.writer.custom.create_cluster_custom_object(
        GROUP, VERSION, PLURAL, body, field_validation="Strict"
    )


def test_the_crd_refuses_every_poison_partition_at_admission(
    k8s_control_plane: ControlPlane, operator: RunningOperator
) -> None:
    """The chart's CRD (applied as is: its CEL rules are within the API server's cost budget)
    refuses each case of the corpus, naming the field; the valid ones at the bounds pass."""
    op = operator
    admitted = []
    for number, (case, spec, field) in enumerate(PARTITION_CASES):
        if case == "gpus 100000 long":
            # kube-apiserver itself spends its whole 60 s request timeout on a list this long
            # (504), before any of our rules; core parsing refuses it (tests/core).
            continue
        body = {**partition(spec, name=f"{RUN}-poison-{number}")}
        body["metadata"]["labels"] = {"e2e-run": RUN}
        try:
            _create(op, body)
        except ApiException as error:
            assert error.status in (400, 422), (case, error.status)
            message = describe_api_error(error, limit=2000)
            # Where the API server can say which field, it does (a number past int64 fails
            # JSON decoding first, where it names only the object).
            assert field.split(".")[-1].split("[")[0] in message or error.status == 400, (
                case,
                message[:400],
            )
        else:
            admitted.append(case)
    assert admitted == [], f"admitted past the CRD: {admitted}"
    for number, spec in enumerate(GOOD_SPECS):
        body = partition(spec, name=f"{RUN}-bound-{number}")
        body["metadata"]["labels"] = {"e2e-run": RUN}
        _create(op, body)
        k8s_control_plane.kubectl("delete", "gpup", f"{RUN}-bound-{number}", "--wait=false")


def permissive_crd() -> str:
    """The chart's CRD with the spec schema of an older, trusting chart: anything goes."""
    crd = yaml.safe_load((CRD_DIR / "gpupartition.yaml").read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    schema["properties"]["spec"] = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    return yaml.safe_dump(crd)


def test_one_bad_partition_among_good_ones_affects_only_itself(
    k8s_control_plane: ControlPlane, operator: RunningOperator
) -> None:
    """Specs an older CRD let in: the operator marks each InvalidSpec with the reason, the
    good partitions around them still reach Ready, and deleting a bad one completes."""
    cp, op = k8s_control_plane, operator
    label = {"e2e-op": f"{RUN}-poison"}
    good_nodes = [f"{RUN}-good-{i}" for i in range(2)]
    make_nodes(cp, good_nodes, **label)

    def mps(memory: str) -> dict[str, Any]:
        return {"mode": "MPS", "mps": {"maxClients": 4, "defaultMemory": memory}}

    bad = {
        f"{RUN}-bad-memory": (mps("1Ei"), "spec.mps.defaultMemory"),
        f"{RUN}-bad-exponent": (mps("1e99999999"), "more than a quantity can hold"),
        f"{RUN}-bad-profile": ({"mode": "MIG", "mig": {"devices": {f"1g.{HUGE}gb": 1}}}, "spec.mig.devices"),
        f"{RUN}-bad-label": ({"mode": "None", "nodeSelector": {"matchLabels": {"bad key": "x"}}}, "is not a label key"),
        f"{RUN}-bad-mode": ({"mode": LONG}, "spec.mode"),
    }  # fmt: skip
    cp.kubectl("apply", "-f", "-", input=permissive_crd())
    try:
        for name, (spec, _) in bad.items():
            apply(cp, name, spec)
        good = {
            f"{RUN}-good-mig": {
                "nodeSelector": {"matchLabels": label},
                "gpus": [0],
                "mode": "MIG",
                "mig": {"devices": {"1g.10gb": 7}},
            },
        }
        for name, spec in good.items():
            apply(cp, name, spec)
        for n in good_nodes:
            wait_desired(op, n, [(f"{RUN}-good-mig", 1)])
            report(op, n, [(f"{RUN}-good-mig", 1)])
        wait_condition(op, f"{RUN}-good-mig", "Ready", "True", "Applied")
        for name, (_, words) in bad.items():
            obj = wait_condition(op, name, "Ready", "False", "InvalidSpec")
            message = condition(obj, "Ready")["message"]
            assert words in message and len(message) < 2100, (name, message[:300])
        # Deleting a bad partition completes: its finalizer is removed.
        for name in bad:
            cp.kubectl("delete", "gpup", name, "--wait=false")
        for name in bad:
            wait_for(lambda name=name: gone(op, name), TIMEOUT, f"{name} to be deleted")
        assert condition(get(op, f"{RUN}-good-mig"), "Ready")["status"] == "True"
    finally:
        cp.kubectl("delete", "gpup", *bad, "--ignore-not-found", "--wait=false")
        cp.kubectl("apply", "-f", str(CRD_DIR / "gpupartition.yaml"))


def wide_row(cp: ControlPlane, name: str) -> dict[str, str]:
    """`kubectl get gpup NAME -o wide` as column -> value (no value holds a space)."""
    header, row = cp.kubectl("get", "gpup", name, "-o", "wide").stdout.splitlines()[:2]
    return dict(zip(header.split(), row.split(), strict=True))


def test_interface_dra_reaches_the_node_and_status_follows_the_agents_inventory(
    k8s_control_plane: ControlPlane, operator: RunningOperator
) -> None:
    cp, op = k8s_control_plane, operator
    label = {"e2e-op": f"{RUN}-dra"}
    n = f"{RUN}-dra-0"
    make_nodes(cp, [n], **label)
    name = f"{RUN}-dra"
    selector = {"matchLabels": label}
    apply(
        cp,
        name,
        {"nodeSelector": selector, "interface": "dra", "mode": "MIG", "mig": {"devices": {"1g.10gb": 7}}},
    )  # fmt: skip
    wait_desired(op, n, [(name, 1)])
    (group,) = decode_desired(annotation(op, n) or "")
    assert group.config.interface is Interface.DRA

    def interface_status(**expected: Any) -> dict[str, Any] | None:
        shown = (get(op, name).get("status") or {}).get("interface") or {}
        return shown if all(shown.get(k) == v for k, v in expected.items()) else None

    # The count label's GPU is held; no inventory says how it is served yet.
    wait_for(lambda: interface_status(unreported=1, served="0/1"), TIMEOUT, "GPU 0 unreported")
    row = wide_row(cp, name)
    assert (row["INTERFACE"], row["SERVED"]) == ("dra", "0/1"), row
    # The agent drains GPU 0 off the device plugin (neither serves it), then serves it by DRA.
    publish_served(op, n, None)
    wait_for(lambda: interface_status(moving=1, unreported=0), TIMEOUT, "GPU 0 moving")
    publish_served(op, n, Interface.DRA)
    shown = wait_for(
        lambda: interface_status(dra=1, moving=0, served="1/1"), TIMEOUT, "GPU 0 on DRA"
    )
    assert shown == {"dra": 1, "devicePlugin": 0, "moving": 0, "unreported": 0, "served": "1/1"}
    assert wide_row(cp, name)["SERVED"] == "1/1"

    # The chart's DRA partition examples pass this CRD's admission as written.
    for example in sorted((REPO / "charts" / "gpupart" / "examples" / "dra").glob("partition-*")):
        cp.kubectl("apply", "--dry-run=server", "-f", str(example))

    # One node, one interface: a newer device-plugin partition gets none of its GPUs.
    other = f"{RUN}-dra-plugin"
    apply(cp, other, {"nodeSelector": selector, "mode": "None"})
    obj = wait_condition(op, other, "Conflict", "True", "GpusClaimedElsewhere")
    message = condition(obj, "Conflict")["message"]
    assert n in message and name in message and other in message and "dra" in message, message
    assert condition(obj, "Ready")["reason"] == "Conflict"
    assert wide_row(cp, other)["INTERFACE"] == "devicePlugin"  # the CRD's default
    assert desired_partitions(op, n) == [(name, 1)]
    assert condition(get(op, name), "Conflict")["status"] == "False"
