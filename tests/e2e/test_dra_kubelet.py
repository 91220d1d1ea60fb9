"""DRA on the real kubelet with the reference Go driver: claims prepared, CDI resolved by the runtime.

The control plane runs kube-controller-manager (the resourceclaim controller makes a claim from
each pod's ResourceClaimTemplate and releases it); the real kube-scheduler allocates from the
driver's ResourceSlice; the real kubelet calls the driver's NodePrepareResources and hands the
CDI IDs it returns to the fake runtime, which resolves them against the spec files the driver
wrote (as containerd does). One node and one driver serve the whole module.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Generator
from typing import Any

import pytest
from kubernetes import client

from gpupart_testsupport.cluster import ControlPlane
from gpupart_testsupport.dra import (
    EXAMPLE_CDI_KIND,
    EXAMPLE_DRIVER,
    GROUP,
    PREPARE,
    VERSION,
    ExampleDriver,
    claim_pod,
    claim_template,
    device_class,
    grpc_seconds,
    pod_claim_name,
)
from gpupart_testsupport.kubelet import KubeletNode
from gpupart_testsupport.polling import wait_for

pytestmark = pytest.mark.e2e

WAIT_S = 90
DEVICES = 4


@pytest.fixture(scope="module")
def driver(dra_control_plane: ControlPlane, dra_node: KubeletNode) -> Generator[ExampleDriver]:
    """The example driver on the module's node, its slice published, its DeviceClass made."""
    api = dra_control_plane.api_client()
    custom = client.CustomObjectsApi(api)
    try:
        custom.create_cluster_custom_object(
            GROUP, VERSION, "deviceclasses", device_class(EXAMPLE_DRIVER, EXAMPLE_DRIVER)
        )
    except client.ApiException as e:
        if e.status != 409:  # another module of the session made it
            raise
    drv = ExampleDriver(dra_node, dra_control_plane.kubeconfig, devices=DEVICES)
    drv.start()
    try:

        def published() -> bool:
            found = custom.list_cluster_custom_object(
                GROUP, VERSION, "resourceslices", field_selector=f"spec.nodeName={dra_node.name}"
            )["items"]
            return sum(len(s["spec"].get("devices") or []) for s in found) == DEVICES

        wait_for(published, WAIT_S, "the example driver's ResourceSlice", detail=drv.tail)
        yield drv
    finally:
        drv.stop()
        api.close()


class Cluster:
    """The reads these tests make, with the driver's and the node's logs on a timeout."""

    def __init__(self, cp: ControlPlane, node: KubeletNode, drv: ExampleDriver, ns: str) -> None:
        self.api = cp.api_client()
        self.core = client.CoreV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)
        self.node, self.driver, self.ns = node, drv, ns

    def until(self, check: Any, what: str) -> Any:
        return wait_for(
            check, WAIT_S, what, detail=lambda: f"{self.node.tails()}\n{self.driver.tail()}"
        )

    def template(self, name: str) -> None:
        self.custom.create_namespaced_custom_object(
            GROUP, VERSION, self.ns, "resourceclaimtemplates", claim_template(name, EXAMPLE_DRIVER)
        )

    def pod(self, name: str, template: str, containers: int = 1) -> None:
        self.core.create_namespaced_pod(
            self.ns, claim_pod(name, template, self.node.name, containers)
        )

    def pod_dict(self, name: str) -> dict[str, Any]:
        pod = self.core.read_namespaced_pod(name, self.ns)
        return self.api.sanitize_for_serialization(pod)  # type: ignore[no-any-return]

    def running(self, name: str) -> dict[str, Any]:
        return self.until(  # type: ignore[no-any-return]
            lambda: (p := self.pod_dict(name))["status"].get("phase") == "Running" and p,
            f"pod {name} Running",
        )

    def claim(self, name: str) -> dict[str, Any]:
        return self.custom.get_namespaced_custom_object(  # type: ignore[no-any-return]
            GROUP, VERSION, self.ns, "resourceclaims", name
        )


@pytest.fixture
def cluster(
    dra_control_plane: ControlPlane,
    dra_node: KubeletNode,
    driver: ExampleDriver,
    dra_namespace: str,
) -> Generator[Cluster]:
    c = Cluster(dra_control_plane, dra_node, driver, dra_namespace)
    yield c
    c.api.close()


def test_a_claim_from_a_template_is_prepared_and_its_container_gets_the_cdi_device(
    cluster: Cluster,
) -> None:
    before, _ = grpc_seconds(cluster.node, EXAMPLE_DRIVER, PREPARE)
    cluster.template("one-gpu")
    cluster.pod("app", "one-gpu", containers=2)
    pod = cluster.running("app")

    claim_name = pod_claim_name(pod)
    assert claim_name, pod["status"]
    claim = cluster.claim(claim_name)
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    assert (result["driver"], result["pool"], result["request"]) == (
        EXAMPLE_DRIVER,
        cluster.node.name,
        "gpu",
    )
    device, uid = result["device"], claim["metadata"]["uid"]
    assert [r["uid"] for r in claim["status"]["reservedFor"]] == [pod["metadata"]["uid"]]

    # Each container got exactly the IDs the driver returned, each resolved in a spec file of
    # the node's CDI directory, and the env those specs hold.
    index = device.removeprefix("gpu-")
    for container in ("app-0", "app-1"):
        got = cluster.node.container(cluster.ns, "app", container)
        assert got is not None, container
        common, own = f"{EXAMPLE_CDI_KIND}=common", f"{EXAMPLE_CDI_KIND}={uid}-{device}"
        assert got["cdiDevices"] == [common, own], got
        specs = got["cdi"]["specs"]
        assert set(specs) == {common, own} and not got["cdi"]["unresolved"], got["cdi"]
        assert all(p.startswith(f"{cluster.node.cdi_dir}/") for p in specs.values()), specs
        assert uid in specs[own], specs  # the claim's own transient spec
        env = got["env"]
        assert env[f"GPU_DEVICE_{index}"] == device, env
        # The claim's own spec: `<CLASS>_DEVICE_<DEVICE>_RESOURCE_CLAIM`, the device's name in
        # upper case with `-` as `_`.
        assert env[f"GPU_DEVICE_{device.upper().replace('-', '_')}_RESOURCE_CLAIM"] == uid, env
        assert env["KUBERNETES_NODE_NAME"] == cluster.node.name, env
        assert env["DRA_RESOURCE_DRIVER_NAME"] == EXAMPLE_DRIVER, env
        assert got["cdi"]["env"][f"GPU_DEVICE_{index}"] == device, got["cdi"]

    # The kubelet timed its NodePrepareResources call to the driver (its own histogram), and
    # its DRA manager connected to the driver. (v1.37 opens the health stream only for a
    # driver whose registration lists a DRAResourceHealth service, which the example driver's
    # does not; ours does: tests/e2e/test_dra_gpupart_kubelet.py sees the stream's health.)
    assert grpc_seconds(cluster.node, EXAMPLE_DRIVER, PREPARE)[0] >= before + 1
    log = cluster.node.kubelet_log()
    assert "Creating Dynamic Resource Allocation (DRA) manager" in log
    assert f'driverName="{EXAMPLE_DRIVER}" endpoint="/var/lib/kubelet/plugins/' in log, log[-2000:]

    # Deleting the pod unprepares the claim (the driver removes its spec) and the
    # resourceclaim controller deletes the claim it made.
    claim_spec = specs[own]
    cluster.core.delete_namespaced_pod("app", cluster.ns, grace_period_seconds=0)

    def released() -> bool:
        try:
            cluster.claim(claim_name)
        except client.ApiException as e:
            return e.status == 404
        return False

    cluster.until(released, f"claim {claim_name} deleted with its pod")
    cluster.until(
        lambda: (
            not any(p.name == claim_spec.rsplit("/", 1)[-1] for p in cluster.node.cdi_dir.iterdir())
        ),
        "the claim's CDI spec removed at unprepare",
    )


def test_an_unresolvable_cdi_device_fails_only_its_container_until_it_resolves(
    cluster: Cluster,
) -> None:
    # A malformed spec file names no device: containers naming other IDs are not affected.
    broken = cluster.node.cdi_dir / "broken.yaml"
    broken.write_text("cdiVersion: [not, a, version\n")
    # A second definition of the driver's common device makes it a conflict (CDI removes a
    # device two specs of the same directory define), so it resolves nowhere.
    conflict = cluster.node.cdi_dir / "zz-conflict.json"
    conflict.write_text(
        json.dumps(
            {
                "cdiVersion": "0.6.0",
                "kind": EXAMPLE_CDI_KIND,
                "devices": [{"name": "common", "containerEdits": {"env": ["STOLEN=1"]}}],
            }
        )
    )
    try:
        cluster.template("one-gpu")
        cluster.pod("blocked", "one-gpu")

        def refused() -> str | None:
            statuses = cluster.pod_dict("blocked")["status"].get("containerStatuses") or []
            waiting = ((statuses[0].get("state") or {}).get("waiting") or {}) if statuses else {}
            return (
                waiting.get("message") if waiting.get("reason") == "CreateContainerError" else None
            )

        message = cluster.until(refused, "pod blocked's container refused by the runtime")
        assert f"unresolvable CDI devices {EXAMPLE_CDI_KIND}=common" in message, message
        assert "conflicting device" in message and "zz-conflict.json" in message, message
        assert "broken.yaml" in message, message  # named as a spec error, nothing more
        assert cluster.node.container(cluster.ns, "blocked", "app-0") is None

        conflict.unlink()
        pod = cluster.running("blocked")
        got = cluster.node.container(cluster.ns, "blocked", "app-0")
        assert got is not None
        assert "STOLEN" not in got["env"], got["env"]
        assert not got["cdi"]["unresolved"] and len(got["cdi"]["specs"]) == 2, got["cdi"]
        assert pod_claim_name(pod)
    finally:
        broken.unlink(missing_ok=True)
        conflict.unlink(missing_ok=True)


def test_a_second_pod_gets_another_device_and_never_the_first_ones(cluster: Cluster) -> None:
    cluster.template("one-gpu")
    names = [f"p{i}-{uuid.uuid4().hex[:4]}" for i in range(2)]
    for name in names:
        cluster.pod(name, "one-gpu")
    pods = [cluster.running(name) for name in names]
    devices = []
    for name, pod in zip(names, pods, strict=True):
        claim = cluster.claim(pod_claim_name(pod) or "")
        (result,) = claim["status"]["allocation"]["devices"]["results"]
        got = cluster.node.container(cluster.ns, name, "app-0")
        assert got is not None
        own = [i for i in got["cdiDevices"] if i.endswith(f"-{result['device']}")]
        assert own == [f"{EXAMPLE_CDI_KIND}={claim['metadata']['uid']}-{result['device']}"], got
        devices.append(result["device"])
    assert len(set(devices)) == 2, devices
