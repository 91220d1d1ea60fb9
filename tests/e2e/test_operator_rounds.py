"""The operator's guards on the real API server: dynamic MIG rounds on the test's clock, passes that contain a refusal.

The operator's own classes (`Reconciler` and `DemandRounds` on one `Writer`) run in this
process against the session's kube-apiserver, without kopf: the test calls `run_round` and `reconcile_all` itself
and plays the node agent by writing the Node's inventory and state annotations. Nodes are kwok
Nodes no agent serves; pods name a scheduler no one runs, and their Unschedulable condition is
written as kube-scheduler would.

We test these aspects:
- a plan the node agent reports Failed is planned again only after `plan_retry_seconds` (by
  the round's clock), not in the rounds before (no plan for that node's GPUs, no reservation);
- the disruption counter counts every used instance a written plan leaves out of its layout:
  a plan in flight destroys an idle instance that a pod takes before the agent applies it; a
  reservation of that plan then ends, the plan is rewritten with the same layouts, and the
  counter shows the one used instance the written layout (read back from the Node) leaves out;
- dynamic MIG through DRA gets no MIG plan and no status.dynamicMig; back on the device plugin,
  a GPU still moving (neither interface serves it) is not planned either, and once the
  inventory shows the device plugin serving it, the waiting pod gets its plan;
- a write the API server refuses for one Node (an admission policy) costs that Node only:
  the pass completes, the other Node gets its desired configuration, the partition its status,
  and the refusal is counted.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Generator
from typing import Any

import pytest
from kubernetes import client

from gpupart.core.api.spec import Interface, Mode
from gpupart.core.api.wire import (
    DESIRED_ANNOTATION,
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
    decode_mig_plan,
    encode_inventory,
    encode_report,
)
from gpupart.core.mig.layout import MigInstance, Placement
from gpupart_operator.metrics import Metrics
from gpupart_operator.model import GROUP, PLURAL, VERSION, Resolutions
from gpupart_operator.reconciler import Reconciler
from gpupart_operator.rounds import DemandRounds
from gpupart_operator.settings import OperatorSettings
from gpupart_operator.writer import Writer
from gpupart_testsupport.cluster import ControlPlane, create_nodes, gpu_node, wait_for

from .test_operator import apply_crds

pytestmark = pytest.mark.e2e

PRODUCT_LABEL = "NVIDIA-H100-80GB-HBM3"
PRODUCT = "NVIDIA H100 80GB HBM3"
RETRY_S = 30.0


class Clock:
    """The rounds' clock (Unix seconds): moved by the test only."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


class Rounds:
    """One run's namespace, label, partition and nodes, with the operator's rounds on `clock`."""

    def __init__(self, cp: ControlPlane, run: str) -> None:
        self.cp, self.run = cp, run
        self.api = cp.api_client()
        self.core = client.CoreV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)
        self.settings = OperatorSettings(
            kubeconfig=str(cp.kubeconfig), plan_retry_seconds=RETRY_S, write_workers=2
        )
        self.metrics = Metrics()
        self.writer = Writer(self.api, self.settings, self.metrics)
        resolutions = Resolutions()
        self.reconciler = Reconciler(self.writer, self.metrics, resolutions)
        self.clock = Clock()
        self.rounds = DemandRounds(
            self.writer, self.settings, self.metrics, resolutions, clock=self.clock
        )
        self.ns = f"e2e-{run}"
        self.core.create_namespace({"metadata": {"name": self.ns}})
        self.nodes: list[str] = []

    def close(self) -> None:
        self.core.delete_collection_namespaced_pod(self.ns, grace_period_seconds=0)
        self.custom.delete_cluster_custom_object(GROUP, VERSION, PLURAL, self.run)
        for name in self.nodes:
            self.core.delete_node(name)
        self.writer.close()
        self.api.close()

    def partition(self, spec: dict[str, Any]) -> None:
        body = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "GpuPartition",
            "metadata": {"name": self.run},
            "spec": {"nodeSelector": {"matchLabels": {"gpupart.io/e2e-run": self.run}}, **spec},
        }
        self.custom.create_cluster_custom_object(GROUP, VERSION, PLURAL, body)

    def node(self, name: str, devices: tuple[MigDevice, ...] | None = None) -> None:
        """A one-H100 node; `devices`: its inventory in MIG mode (None: no inventory)."""
        labels = {
            "gpupart.io/e2e-run": self.run,
            "nvidia.com/gpu.product": PRODUCT_LABEL,
            "nvidia.com/gpu.count": "1",
        }
        manifest = gpu_node(name, {}, labels)
        create_nodes(self.api, [manifest])
        self.nodes.append(name)
        if devices is not None:
            self.inventory(name, devices)

    def inventory(
        self,
        name: str,
        devices: tuple[MigDevice, ...],
        interface: Interface | None = Interface.DEVICE_PLUGIN,
    ) -> None:
        gpu = InventoryGpu(0, f"GPU-{name}", PRODUCT, 81559, Mode.MIG, devices, interface=interface)
        self.annotate(name, {INVENTORY_ANNOTATION: encode_inventory(Inventory((gpu,)))})

    def annotate(self, name: str, annotations: dict[str, str | None]) -> None:
        self.core.patch_node(name, {"metadata": {"annotations": annotations}})

    def pending(self, name: str, profile: str) -> None:
        """A pod asking for one `profile` slice that kube-scheduler found no node for."""
        self.core.create_namespaced_pod(
            self.ns,
            {
                "metadata": {"name": name},
                "spec": {
                    "schedulerName": "e2e-nobody",
                    "containers": [
                        {
                            "name": "main",
                            "image": "x",
                            "resources": {"limits": {f"nvidia.com/mig-{profile}": "1"}},
                        }
                    ],
                },
            },
        )
        condition = {
            "type": "PodScheduled",
            "status": "False",
            "reason": "Unschedulable",
            "lastTransitionTime": "2026-12-01T10:00:00Z",
        }
        self.core.patch_namespaced_pod_status(
            name, self.ns, {"status": {"conditions": [condition]}}
        )

    def plan(self, name: str) -> MigPlan | None:
        text = (self.core.read_node(name).metadata.annotations or {}).get(MIG_PLAN_ANNOTATION)
        return None if text is None else decode_mig_plan(text)

    def disruptions(self) -> float:
        value = self.metrics.registry.get_sample_value("gpupart_dynamic_mig_disruptions_total")
        return value or 0.0


@pytest.fixture
def rounds(k8s_control_plane: ControlPlane) -> Generator[Rounds, None, None]:
    apply_crds(k8s_control_plane)
    r = Rounds(k8s_control_plane, f"rounds-{uuid.uuid4().hex[:6]}")
    try:
        yield r
    finally:
        r.close()


DYNAMIC = {"mode": "MIG", "mig": {"dynamic": {"minIdleSeconds": 0}}}


def _device(profile: str, start: int, size: int, *, used: bool = False) -> MigDevice:
    return MigDevice(f"MIG-{profile}-{start}", MigInstance(Placement(start, size), profile), used)


def test_a_failed_plan_is_planned_again_only_after_the_retry_time(rounds: Rounds) -> None:
    """The agent here answers every plan at once, as gpupart's does: a plan that changes a GPU
    fails (its creates fail), one that changes none (the back-off's, which only ends
    reservations) is Applied. The attempts (plans with a layout) must be `RETRY_S` apart."""
    r = rounds
    r.partition(DYNAMIC)
    n = f"{r.run}-a"
    r.node(n, ())
    r.pending("p", "3g.40gb")
    attempts: list[float] = []
    answered: set[str] = set()

    def round_at(now: float) -> None:
        r.clock.now = now
        r.rounds.run_round()
        plan = r.plan(n)
        if plan is None or plan.id in answered:
            return
        answered.add(plan.id)
        if plan.gpus:
            attempts.append(now)
            assert any(i.profile == "3g.40gb" for g in plan.gpus for i in g.layout), plan
            assert [x.pod for x in plan.reservations] == [f"{r.ns}/p"], plan
        state = GpuState.FAILED if plan.gpus else GpuState.APPLIED
        report = NodeReport((), (), PlanReport(plan.id, state, "create failed: e2e"))
        r.annotate(n, {STATE_ANNOTATION: encode_report(report)})

    start = r.clock.now
    for second in range(int(RETRY_S) * 2 + 2):
        round_at(start + second)
    # Seen failed one round after each attempt; planned again RETRY_S after that.
    assert attempts == [start, start + 1 + RETRY_S], [a - start for a in attempts]


def test_no_mig_plan_for_a_gpu_served_through_dra_or_moving(rounds: Rounds) -> None:
    r = rounds
    r.partition({**DYNAMIC, "interface": "dra"})
    n = f"{r.run}-dra"
    r.node(n, ())
    r.inventory(n, (), Interface.DRA)
    r.pending("p", "3g.40gb")

    def round_at(now: float) -> MigPlan | None:
        r.clock.now = now
        r.rounds.run_round()
        return r.plan(n)

    start = r.clock.now
    assert round_at(start) is None
    status = r.custom.get_cluster_custom_object(GROUP, VERSION, PLURAL, r.run).get("status")
    assert "dynamicMig" not in (status or {}), status
    # Back to the device plugin; the agent drains DRA's claims first (the GPU is moving).
    r.custom.patch_cluster_custom_object(
        GROUP, VERSION, PLURAL, r.run, {"spec": {"interface": "devicePlugin"}}
    )
    r.inventory(n, (), None)
    assert round_at(start + 1) is None
    r.inventory(n, ())
    plan = round_at(start + 2)
    assert plan is not None and [x.pod for x in plan.reservations] == [f"{r.ns}/p"], plan


def test_the_disruption_counter_counts_each_used_instance_a_written_plan_leaves_out(
    rounds: Rounds,
) -> None:
    r = rounds
    r.partition(DYNAMIC)
    n = f"{r.run}-a"
    small = _device("1g.10gb", 0, 1)
    r.node(n, (small,))
    r.pending("big", "7g.80gb")  # needs the whole GPU: the idle 1g.10gb goes
    r.pending("other", "7g.80gb")  # served later; keeps a reservation to end
    r.rounds.run_round()
    first = r.plan(n)
    assert first is not None and first.reservations, first
    assert all(small.instance not in g.layout for g in first.gpus), first
    assert r.disruptions() == 0
    # Before the agent applies the plan (no report yet: it is in flight), a pod takes the idle
    # 1g.10gb instance; then the pod the plan reserved for goes, so the plan is rewritten.
    r.inventory(n, (_device("1g.10gb", 0, 1, used=True),))
    reserved = first.reservations[0].pod.split("/")[1]
    r.core.delete_namespaced_pod(reserved, r.ns, grace_period_seconds=0)
    wait_for(
        lambda: reserved not in {p.metadata.name for p in r.core.list_namespaced_pod(r.ns).items},
        30,
        f"pod {reserved} deleted",
    )
    r.clock.now += 1
    r.rounds.run_round()
    written = r.plan(n)
    assert written is not None and written.id != first.id, written
    # The reference: the used instance the agent reports, against the layout read back.
    (gpu,) = [g for g in written.gpus if g.index == 0]
    assert small.instance not in gpu.layout, written
    assert r.disruptions() == 1


def test_a_write_refused_for_one_node_costs_that_node_only(
    rounds: Rounds, k8s_control_plane: ControlPlane
) -> None:
    r, cp = rounds, k8s_control_plane
    refused, fine = f"{r.run}-refused", f"{r.run}-fine"
    r.node(refused)
    r.node(fine)
    r.core.patch_node(refused, {"metadata": {"labels": {"gpupart.io/e2e-refuse": r.run}}})
    policy = f"{r.run}-refuse-desired"
    cp.kubectl("apply", "-f", "-", input=_refusing_policy(policy, r.run))
    try:
        # The policy is in force once it refuses a write of the desired annotation.
        def refusing() -> bool:
            try:
                r.annotate(refused, {DESIRED_ANNOTATION: "probe"})
            except client.ApiException as error:
                return error.status == 422
            r.annotate(refused, {DESIRED_ANNOTATION: None})
            return False

        wait_for(refusing, 30, "the admission policy to refuse the desired annotation")
        r.partition({"mode": "MIG", "mig": {"devices": {"1g.10gb": 7}}})
        result = r.reconciler.reconcile_all()
        assert result.writes >= 2  # the fine node's desired configuration and the status
        annotations = r.core.read_node(fine).metadata.annotations or {}
        assert DESIRED_ANNOTATION in annotations
        assert DESIRED_ANNOTATION not in (r.core.read_node(refused).metadata.annotations or {})
        assert r.metrics.registry.get_sample_value("gpupart_operator_refused_writes_total") == 1
        status = r.custom.get_cluster_custom_object(GROUP, VERSION, PLURAL, r.run)["status"]
        assert {c["type"] for c in status["conditions"]} >= {"Ready"}, status
    finally:
        cp.kubectl("delete", "validatingadmissionpolicybinding", policy, "--ignore-not-found")
        cp.kubectl("delete", "validatingadmissionpolicy", policy, "--ignore-not-found")


def _refusing_policy(name: str, run: str) -> str:
    """A ValidatingAdmissionPolicy (and binding) refusing, as 422 Invalid, any write of
    gpupart.io/desired on Nodes labelled gpupart.io/e2e-refuse=<run>."""
    return f"""
apiVersion: admissionregistration.k8s.io/v1
kind: ValidatingAdmissionPolicy
metadata:
  name: {name}
spec:
  failurePolicy: Fail
  matchConstraints:
    resourceRules:
      - apiGroups: [""]
        apiVersions: [v1]
        operations: [UPDATE]
        resources: [nodes]
  validations:
    - expression: >-
        !has(object.metadata.annotations) ||
        !('{DESIRED_ANNOTATION}' in object.metadata.annotations)
      message: e2e refuses the desired annotation on this node
      reason: Invalid
---
apiVersion: admissionregistration.k8s.io/v1
kind: ValidatingAdmissionPolicyBinding
metadata:
  name: {name}
spec:
  policyName: {name}
  validationActions: [Deny]
  matchResources:
    objectSelector:
      matchLabels:
        gpupart.io/e2e-refuse: {run}
"""
