"""DRA test objects without a cluster: DeviceClasses, H100 views, pool documents, claims, pods."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from gpupart.core.api.spec import Mode
from gpupart.core.dra import names
from gpupart.core.dra.devices import DraGpu, GpuFacts, Order, gpu_devices
from gpupart.core.dra.pool import Slice, pool_slices
from gpupart.core.dra.read import AllocationResult
from gpupart.core.mig.catalogue import require_gpu_model
from gpupart.core.node.devices import OfferedGpu

from .cluster import REPO

H100 = require_gpu_model("H100-SXM5-80GB")
H100_NAME = "NVIDIA H100 80GB HBM3"
FACTS = GpuFacts(pci_bus_id="0000:18:00.0", driver_version="570.86.05")
DOMAIN = f'device.attributes["{names.DRIVER}"]'
CHART = REPO / "charts" / "gpupart"


def h100(index: int, mode: Mode = Mode.MIG, uuid: str = "", **kw: Any) -> OfferedGpu:
    """One H100 as the node agent offers it."""
    return OfferedGpu(
        index, uuid or f"GPU-{index:04d}", H100_NAME, H100.memory_mib, index, 0, mode, **kw
    )


def dynamic_h100(index: int, uuid: str = "") -> DraGpu:
    return DraGpu(h100(index, Mode.MIG, uuid), H100, dynamic=True, facts=FACTS)


def pool(
    node: str, node_uid: str, gpus: Sequence[DraGpu], order: Order = Order.GPUPART
) -> list[Slice]:
    """The node's ResourceSlice documents, as the node agent publishes them."""
    return list(pool_slices(node, node_uid, [gpu_devices(g, order=order) for g in gpus]))


def device_classes() -> list[dict[str, Any]]:
    """The chart's DeviceClasses (templates/dra-deviceclasses.yaml with dra.extendedResources)
    as documents, without helm: the same selectors, one per kind and one per MIG profile."""
    found = []
    for kind in ("gpu", "mig", "shared"):
        expression = f'device.driver == "{names.DRIVER}" && {DOMAIN}.type == "{kind}"'
        extra = {"extendedResourceName": "nvidia.com/gpu"} if kind == "gpu" else {}
        found.append(_device_class(f"{kind}.gpupart.io", expression, extra))
    listing = json.loads((CHART / "files" / "dra-mig-profiles.json").read_text())
    for entry in listing["profiles"]:
        expression = (
            f'device.driver == "{names.DRIVER}" && {DOMAIN}.type == "mig" && '
            f'{DOMAIN}.profile == "{entry["profile"]}"'
        )
        found.append(
            _device_class(
                f"mig-{entry['label']}.gpupart.io",
                expression,
                {"extendedResourceName": entry["extendedResourceName"]},
            )
        )
    return found


def _device_class(name: str, expression: str, extra: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": names.API_VERSION,
        "kind": "DeviceClass",
        "metadata": {"name": name, "resourceVersion": "1"},
        "spec": {"selectors": [{"cel": {"expression": expression}}], **extra},
    }


def claim(
    namespace: str,
    name: str,
    device_class: str,
    *,
    results: Sequence[AllocationResult] = (),
    reserved_for: Sequence[str] = (),
    selector: str = "",
) -> dict[str, Any]:
    """A ResourceClaim of one request `dev`; allocated with `results`, reserved for the pods
    named in `reserved_for`."""
    exactly: dict[str, Any] = {"deviceClassName": device_class}
    if selector:
        exactly["selectors"] = [{"cel": {"expression": selector}}]
    body: dict[str, Any] = {
        "apiVersion": names.API_VERSION,
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}"},
        "spec": {"devices": {"requests": [{"name": "dev", "exactly": exactly}]}},
    }
    if results:
        body["status"] = {
            "allocation": {
                "devices": {
                    "results": [
                        {
                            "request": r.request,
                            "driver": r.driver,
                            "pool": r.pool,
                            "device": r.device,
                        }
                        for r in results
                    ]
                }
            },
            "reservedFor": [
                {"resource": "pods", "name": p, "uid": f"uid-{namespace}-{p}"} for p in reserved_for
            ],
        }
    return body


def claim_pod(
    namespace: str,
    name: str,
    *,
    template: str = "",
    claim_name: str = "",
    made: str = "",
    node_selector: Mapping[str, str] | None = None,
    scheduler: str = "default-scheduler",
) -> dict[str, Any]:
    """A pod with one claim `dev`, from a template (`made`: the claim the controller made from
    it) or by name."""
    source = (
        {"resourceClaimTemplateName": template} if template else {"resourceClaimName": claim_name}
    )
    spec: dict[str, Any] = {
        "schedulerName": scheduler,
        "terminationGracePeriodSeconds": 0,
        "resourceClaims": [{"name": "dev", **source}],
        "containers": [
            {"name": "main", "image": "gpupart/sleep:0", "resources": {"claims": [{"name": "dev"}]}}
        ],
    }
    if node_selector:
        spec["nodeSelector"] = dict(node_selector)
    status: dict[str, Any] = {"phase": "Pending"}
    if made:
        status["resourceClaimStatuses"] = [{"name": "dev", "resourceClaimName": made}]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{namespace}-{name}"},
        "spec": spec,
        "status": status,
    }
