"""DRA on real-kubelet nodes for the e2e tests and benchmarks: the reference Go driver, claims, kubelet metrics.

A DRA plugin registers with a `KubeletNode`'s kubelet through `plugins_registry/` and serves
`plugins/<driver>/dra.sock`, both in the node's `/var/lib`; its CDI specs go to the node's
`cdi_dir`, where the fake runtime resolves them. The reference driver
(`sigs.k8s.io/dra-example-driver`'s kubelet plugin, built by scripts/build-k8s-bins.sh) runs
as a host binary inside the node's mount namespace, where the kubelet's default directories
are the node's own: it is what a DaemonSet pod with the kubelet's directories mounted sees.
Ours runs in the node agent (`gpupart node --dra`, `start_gpupart_dra`), outside the namespace,
given the node's directories by their paths.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpupart.core.api.spec import GpuConfig, Interface, Mode
from gpupart.core.api.wire import (
    DESIRED_ANNOTATION,
    INVENTORY_ANNOTATION,
    STATE_ANNOTATION,
    DesiredGroup,
    GpuState,
    decode_inventory,
    decode_report,
    encode_desired,
)
from gpupart.core.dra import names
from gpupart.core.mig.catalogue import require_gpu_model
from gpupart.core.mig.layout import MigInstance, Placement
from gpupart_testsupport.chart import IMAGE_FLAGS
from gpupart_testsupport.cluster import REPO, ControlPlane, http_get
from gpupart_testsupport.kubelet import KubeletNode
from gpupart_testsupport.polling import wait_for
from gpupart_testsupport.ports import LOOPBACK
from gpupart_testsupport.processes import Proc, spawn
from gpupart_testsupport.stack import Stack

GROUP, VERSION = "resource.k8s.io", "v1"
EXAMPLE_DRIVER = "gpu.example.com"
"""The example driver's name with its gpu profile, and the name of its DeviceClass."""
EXAMPLE_CDI_KIND = f"k8s.{EXAMPLE_DRIVER}/gpu"
"""Its CDI kind: vendor `k8s.<driver>`, class `gpu` (one transient spec per claim, one common)."""
PREPARE = "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources"
UNPREPARE = "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodeUnprepareResources"
"""The kubelet's `method_name` label of its DRA gRPC calls (v1 service)."""


GPUPART_GPU_CLASS = "gpu.gpupart.io"
"""The chart's DeviceClass of our whole GPUs (docs/dra.md)."""


def device_class(name: str, driver: str) -> dict[str, Any]:
    """A DeviceClass selecting every device of `driver` (the example driver's chart has this one)."""
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "DeviceClass",
        "metadata": {"name": name},
        "spec": {"selectors": [{"cel": {"expression": f"device.driver == '{driver}'"}}]},
    }


def claim_template(
    name: str,
    device_class_name: str,
    count: int = 1,
    *,
    selectors: tuple[str, ...] = (),
    capacity: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """A ResourceClaimTemplate with one request `gpu` for `count` devices of the class, each
    device also matching the CEL `selectors` and giving the `capacity` asked (shared devices)."""
    exactly: dict[str, Any] = {
        "deviceClassName": device_class_name,
        "allocationMode": "ExactCount",
        "count": count,
    }
    if selectors:
        exactly["selectors"] = [{"cel": {"expression": e}} for e in selectors]
    if capacity:
        exactly["capacity"] = {"requests": dict(capacity)}
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name},
        "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}}},
    }


def claim_pod(name: str, template: str, node: str, containers: int = 1) -> dict[str, Any]:
    """A Pod whose containers all use the claim made from `template`, kept to `node`."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": node},
            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": template}],
            "containers": [
                {
                    "name": f"app-{i}",
                    "image": "gpupart/cuda:0",
                    "resources": {"claims": [{"name": "gpu"}]},
                }
                for i in range(containers)
            ],
            "terminationGracePeriodSeconds": 0,
        },
    }


def pod_claim_name(pod: Mapping[str, Any], claim: str = "gpu") -> str | None:
    """The ResourceClaim the resourceclaim controller made for the pod's claim (status)."""
    for status in (pod.get("status") or {}).get("resourceClaimStatuses") or []:
        if status.get("name") == claim:
            return status.get("resourceClaimName")  # type: ignore[no-any-return]
    return None


# --- the reference driver --------------------------------------------------------------------


@dataclass
class ExampleDriver:
    """`dra-example-kubeletplugin` (gpu profile) serving one real-kubelet node."""

    node: KubeletNode
    kubeconfig: Path
    devices: int = 8
    proc: Proc | None = None

    @property
    def registration_socket(self) -> Path:
        return self.node.plugins_registry / f"{EXAMPLE_DRIVER}-reg.sock"

    @property
    def plugin_socket(self) -> Path:
        return self.node.plugins / EXAMPLE_DRIVER / "dra.sock"

    def start(self) -> None:
        """Start it and return once both sockets are there (the kubelet registers it then)."""
        command = [
            str(self.node.bin_dir / "dra-example-kubeletplugin"),
            f"--node-name={self.node.name}",
            f"--kubeconfig={self.kubeconfig}",
            f"--cdi-root={self.node.cdi_dir}",
            f"--num-devices={self.devices}",
            # Its metrics server would listen on every address; the kubelet's figures suffice.
            "--metrics-port=-1",
            # The default client rate (5 qps) would pace a burst of claims, not the driver.
            "--kube-api-qps=200",
            "--kube-api-burst=400",
            "-v=2",
        ]
        # NODE_NAME goes into the common CDI device's env (KUBERNETES_NODE_NAME).
        self.proc = spawn(
            "dra-example-kubeletplugin",
            self.node.in_namespace(command),
            self.node.logs,
            env={"NODE_NAME": self.node.name},
        )

        def up() -> bool:
            if not self.proc or not self.proc.alive():
                raise RuntimeError(f"dra-example-kubeletplugin exited\n{self.tail()}")
            return self.registration_socket.exists() and self.plugin_socket.exists()

        wait_for(up, 60, "the example driver's sockets", detail=self.tail)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()

    def tail(self) -> str:
        return self.proc.tail(40) if self.proc is not None else "(not started)"


# --- ours -----------------------------------------------------------------------------------


def install_gpupart_device_classes(cp: ControlPlane) -> None:
    """The chart's DeviceClasses of our driver (`dra.enabled`), applied (idempotent)."""
    rendered = cp.helm(
        "template", "gp", str(REPO / "charts" / "gpupart"), *IMAGE_FLAGS,
        "--set-json", "dra.enabled=true", "--show-only", "templates/dra-deviceclasses.yaml",
    ).stdout  # fmt: skip
    cp.kubectl("apply", "-f", "-", input=rendered)


WHOLE_DRA = GpuConfig(Mode.NONE, interface=Interface.DRA)
"""A whole GPU through DRA, as a GpuPartition without a partition mode asks for it."""


def start_gpupart_dra(
    stack: Stack,
    node: KubeletNode,
    gpus: int,
    wait_s: float = 90,
    *,
    configs: Sequence[GpuConfig] = (),
    recovery_s: float = 60,
    products: Sequence[str] = (),
    create_s: float = 0.0,
    destroy_s: float = 0.0,
    taint_effect: str = "",
) -> list[str]:
    """`gpupart node --dra` on the node with `gpus` simulated A100s, all on DRA, and the
    node's pool published; returns each GPU's UUID by index.

    `configs`: what each GPU becomes, by index (every one a DRA config); empty: all whole.
    `recovery_s`: the agent's clean window after an Xid.
    `products`: each GPU's simulated product by index (`A100-SXM4-80GB`, `H100-SXM5-80GB`);
    empty: all A100-SXM4-80GB. `create_s` / `destroy_s`: the simulated NVML time of each MIG
    instance create / destroy (`--simulate-create-seconds`, `--simulate-destroy-seconds`).
    `taint_effect`: of a faulty GPU's device taints (`--dra-taint-effect`; empty: the default).
    The desired annotation is written here as the operator writes it (the operator is not
    under test: one group per GPU, as one GpuPartition per GPU would give); the pool is the
    agent's own publisher's.
    """
    from kubernetes import client

    configs = tuple(configs) or (WHOLE_DRA,) * gpus
    if len(configs) != gpus or any(c.interface is not Interface.DRA for c in configs):
        raise ValueError(f"{len(configs)} configs for {gpus} GPUs, each must be on DRA")
    if products and len(products) != gpus:
        raise ValueError(f"{len(products)} products for {gpus} GPUs")
    core = client.CoreV1Api(stack.api_client)
    stack.start_dra_agent(
        node,
        ",".join(products) if products else f"{gpus}xA100-SXM4-80GB",
        recovery_s=recovery_s,
        create_s=create_s,
        destroy_s=destroy_s,
        taint_effect=taint_effect,
    )
    desired = encode_desired(
        tuple(DesiredGroup(f"e2e-{i}", 1, (i,), c) for i, c in enumerate(configs))
    )
    core.patch_node(node.name, {"metadata": {"annotations": {DESIRED_ANNOTATION: desired}}})

    def answered() -> Any:
        """The GPUs in the inventory once the agent applied the desired annotation on each (the
        DRA plugin reads each GPU's interface from it; a simulated GPU starts in MIG mode, and
        a claim prepared before its reset is refused)."""
        notes = core.read_node(node.name).metadata.annotations or {}
        report = decode_report(notes[STATE_ANNOTATION])
        found = decode_inventory(notes[INVENTORY_ANNOTATION]).gpus
        applied = {
            g.index
            for g in report.gpus
            if g.state is GpuState.APPLIED and g.mode is configs[g.index].mode
        }
        observed = all((f"e2e-{i}", 1) in report.observed for i in range(gpus))
        done = observed and applied == set(range(gpus))
        return found if done and len(found) == gpus else None

    def until(check: Any, what: str) -> Any:
        return wait_for(check, wait_s, what, detail=lambda: f"{stack.tails()}\n{node.tails()}")

    inventory = until(answered, "the agent's answer to the desired annotation")
    until(
        lambda: f'driverName="{names.DRIVER}"' in node.kubelet_log(),
        "the kubelet connected to our DRA plugin",
    )
    custom = client.CustomObjectsApi(stack.api_client)

    def published() -> bool:
        """The agent's publisher has the node's pool out: each GPU's devices of its mode (the
        whole-GPU one, the shared one, or the placements of a dynamic MIG GPU)."""
        listed = custom.list_cluster_custom_object(
            GROUP, VERSION, "resourceslices", field_selector=f"spec.nodeName={node.name}"
        )["items"]
        ours = [s for s in listed if s["spec"].get("driver") == names.DRIVER]
        # A device's name starts with its GPU's (`gpu-<i>`, docs/dra.md).
        kinds = {
            (int(d["name"].split("-")[1]), d["attributes"][names.TYPE]["string"])
            for s in ours
            for d in s["spec"].get("devices") or ()
        }
        return all((i, _published_kind(c)) in kinds for i, c in enumerate(configs))

    until(published, "the agent's ResourceSlices for the node's GPUs")
    return [g.uuid for g in sorted(inventory, key=lambda g: g.index)]


def _published_kind(config: GpuConfig) -> str:
    if config.mode is Mode.MIG:
        return names.TYPE_MIG
    return names.TYPE_SHARED if config.mode.is_shared else names.TYPE_GPU


# --- dynamic MIG: the devices' placements, the simulated GPUs' instances ---------------------

GpuMigInstance = tuple[int, MigInstance]
"""A MIG instance on the GPU of that index."""


def mig_device_placements(products: Sequence[str]) -> dict[str, GpuMigInstance]:
    """Every dynamic MIG device name a node of these GPUs (by index) can publish, with the
    instance it names: the names the publisher builds (docs/dra.md), never a split name."""
    found: dict[str, GpuMigInstance] = {}
    for index, product in enumerate(products):
        for p in require_gpu_model(product).profiles:
            for start in p.starts:
                instance = MigInstance(Placement(start, p.memory_slices), p.name)
                found[names.mig_device_name(index, p.name, start)] = (index, instance)
    return found


def simulated_mig_instances(state_file: Path) -> dict[GpuMigInstance, str]:
    """The MIG instances the simulated GPUs hold now, with their UUIDs: their state file
    (`--simulate-state`, written whole and renamed), what NVML would answer."""
    gpus = json.loads(state_file.read_text())["gpus"]
    return {
        (index, MigInstance(Placement(i["start"], i["size"]), i["profile"])): i["uuid"]
        for index, gpu in enumerate(gpus)
        for i in gpu["instances"]
    }


# --- the kubelet's own figures ---------------------------------------------------------------

_SAMPLE = re.compile(
    r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})? (?P<value>\S+)$"
)
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def metric_sum(text: str, name: str, **labels: str) -> float:
    """Σ of the samples of `name` whose labels include `labels` (Prometheus text format)."""
    total = 0.0
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m is None or m["name"] != name:
            continue
        have = dict(_LABEL.findall(m["labels"] or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(m["value"])
    return total


def kubelet_metrics(node: KubeletNode) -> str:
    """The kubelet's /metrics (HTTPS on its own port; anonymous AlwaysAllow on loopback)."""
    code, body = http_get(f"https://{LOOPBACK}:{node.port}/metrics")
    if code != 200:
        raise RuntimeError(f"kubelet /metrics of {node.name} answered {code}: {body[:200]}")
    return body


def grpc_seconds(node: KubeletNode, driver: str, method: str) -> tuple[float, float]:
    """(count, sum in seconds) of the kubelet's `dra_grpc_operations_duration_seconds` for
    `driver`'s `method` (PREPARE, UNPREPARE), every status code."""
    text = kubelet_metrics(node)
    base = "dra_grpc_operations_duration_seconds"
    want = {"driver_name": driver, "method_name": method}
    return metric_sum(text, f"{base}_count", **want), metric_sum(text, f"{base}_sum", **want)


def start_dra_node(
    cp: ControlPlane, name: str, labels: Mapping[str, str] | None = None, *, vmodule: str = ""
) -> KubeletNode:
    """A real-kubelet node, Ready, that DRA plugins can register with (no plugin yet);
    `vmodule`: the kubelet's `--vmodule` (`KubeletNode.vmodule`)."""
    from kubernetes import client

    node = KubeletNode(name, cp.bin_dir, cp.kubeconfig, dict(labels or {}), vmodule=vmodule)
    node.start()
    api = cp.api_client()
    try:
        core = client.CoreV1Api(api)

        def ready() -> bool:
            conditions = core.read_node(name).status.conditions or []
            return any(c.type == "Ready" and c.status == "True" for c in conditions)

        wait_for(ready, 90, f"node {name} Ready", detail=node.tails)
    except BaseException:
        node.stop()
        raise
    finally:
        api.close()
    return node
