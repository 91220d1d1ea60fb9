"""The NVML backend reading every catalogued product from NVML-shaped answers gives back that product's table.

The driver is simulated (pynvml's functions answer as NVML does, from the catalogue entry:
profile info structs with engine counts, placement arrays filled through a count pointer), and
`NvmlGpus` reads it through its real code path. A difference means the catalogue and what the
node agent would read from NVML disagree on profiles, IDs, placements, engines or memory.
"""

from __future__ import annotations

import ctypes
from types import SimpleNamespace
from typing import Any

import pynvml
import pytest

from gpupart.core.mig.catalogue import GpuModel, catalogue, compare_models, require_gpu_model
from gpupart_plugin.nvml import NvmlGpus, pci_bus_id

NVML_NAME = {
    "A30-24GB": "NVIDIA A30",
    "A100-SXM4-40GB": "NVIDIA A100-SXM4-40GB",
    "A100-PCIE-40GB": "NVIDIA A100-PCIE-40GB",
    "A100-SXM4-80GB": "NVIDIA A100-SXM4-80GB",
    "A100-PCIE-80GB": "NVIDIA A100 80GB PCIe",
    "PG506-232": "NVIDIA PG506-232",
    "H100-SXM5-80GB": "NVIDIA H100 80GB HBM3",
    "H100-PCIE-80GB": "NVIDIA H100 PCIe",
    "H100-NVL-94GB": "NVIDIA H100 NVL",
    "H100-96GB": "NVIDIA GH200 480GB",
    "H20-96GB": "NVIDIA H20",
    "H200-141GB": "NVIDIA H200",
    "GH200-144GB": "NVIDIA GH200 144G HBM3e",
    "B200-180GB": "NVIDIA B200",
    "GB200-186GB": "NVIDIA GB200",
    "B300-269GB": "NVIDIA B300 SXM6 AC",
    "GB300-278GB": "NVIDIA GB300",
    "RTX-PRO-6000-96GB": "NVIDIA RTX PRO 6000 Blackwell Server Edition",
}


def test_every_product_has_an_nvml_name_here() -> None:
    assert set(NVML_NAME) == {m.product for m in catalogue()}


def simulate_driver(monkeypatch: pytest.MonkeyPatch, name: str, model: GpuModel) -> None:
    """pynvml answering for one GPU of `model` the way NVML does (MIG enabled)."""
    handle = object()
    unsupported = pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

    def profile_info(_: Any, index: int) -> Any:
        if index >= len(model.profiles):
            raise unsupported
        p = model.profiles[index]
        return SimpleNamespace(
            id=p.profile_id,
            instanceCount=p.max_count,
            sliceCount=p.compute_slices,
            memorySizeMB=p.memory_mib,
            name=f"MIG {p.name}".encode(),
            decoderCount=p.engines.decoders,
            encoderCount=p.engines.encoders,
            jpegCount=p.engines.jpeg,
            ofaCount=p.engines.ofa,
        )

    def placements(_: Any, profile_id: int, array: Any, count: Any) -> int:
        # NVML: a null array asks for the count; a smaller one than the count is refused.
        (p,) = [p for p in model.profiles if p.profile_id == profile_id]
        if array is None:
            count._obj.value = len(p.starts)
            return pynvml.NVML_SUCCESS
        if count._obj.value < len(p.starts):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
        for i, start in enumerate(p.starts):
            array[i].start, array[i].size = start, p.memory_slices
        count._obj.value = len(p.starts)
        return pynvml.NVML_SUCCESS

    answers = {
        "nvmlInit": lambda: None,
        "nvmlShutdown": lambda: None,
        "nvmlDeviceGetCount": lambda: 1,
        "nvmlDeviceGetHandleByIndex": lambda _: handle,
        "nvmlDeviceGetMigMode": lambda _: [1, 1],
        "nvmlDeviceGetNumaNodeId": lambda _: 0,
        "nvmlDeviceGetMemoryInfo": lambda _: SimpleNamespace(total=model.memory_mib * 2**20),
        "nvmlDeviceGetUUID": lambda _: "GPU-00000000-0000-0000-0000-000000000000",
        "nvmlDeviceGetName": lambda _: name,
        "nvmlDeviceGetMinorNumber": lambda _: 0,
        "nvmlDeviceGetPciInfo_v3": lambda _: SimpleNamespace(busId=b"00000000:3B:00.0"),
        "nvmlDeviceGetGpuInstanceProfileInfo": profile_info,
        "nvmlDeviceGetGpuInstancePossiblePlacements": placements,
    }
    for function, answer in answers.items():
        monkeypatch.setattr(pynvml, function, answer)


@pytest.mark.parametrize("product", sorted(NVML_NAME))
def test_nvml_answers_read_back_as_the_catalogue_table(
    monkeypatch: pytest.MonkeyPatch, product: str
) -> None:
    known = require_gpu_model(product)
    simulate_driver(monkeypatch, NVML_NAME[product], known)
    gpus = NvmlGpus(read_only=True)
    try:
        read = gpus.model(0)
    finally:
        gpus.close()
    assert compare_models(read, known) == []
    assert (read.product, read.engines, read.memory_slices, read.max_instances) == (
        known.product,
        known.engines,
        known.memory_slices,
        known.max_instances,
    )
    assert ctypes.sizeof(pynvml.c_nvmlGpuInstancePlacement_t) == 8  # the struct NVML fills


def test_the_bus_id_is_read_as_the_standard_attribute_wants_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    known = require_gpu_model("A100-SXM4-80GB")
    simulate_driver(monkeypatch, NVML_NAME["A100-SXM4-80GB"], known)
    gpus = NvmlGpus(read_only=True)
    try:
        (info,) = gpus.gpus()
    finally:
        gpus.close()
    assert info.pci_bus_id == "0000:3b:00.0"
    assert pci_bus_id("0000:AF:1F.7") == "0000:af:1f.7"
    assert pci_bus_id("not a bus") == pci_bus_id("100000000:3b:00.0") == ""
