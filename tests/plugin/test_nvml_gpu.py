"""Real NVML, read-only (never changes MIG settings): discovery, and NVML profiles and placements vs the catalogue."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

from gpupart.core.mig.catalogue import compare_models, find_gpu_model
from gpupart_plugin.backend import NvmlError

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def nvml() -> Iterator[object]:
    try:
        from gpupart_plugin.nvml import NvmlGpus

        gpus = NvmlGpus(read_only=True)
    except NvmlError as error:
        pytest.skip(f"no NVIDIA driver here: {error}")
    if not gpus.gpus():
        pytest.skip("NVML found no GPU")
    yield gpus
    gpus.close()


def test_discovery_and_read_only(nvml: object) -> None:
    from gpupart_plugin.nvml import NvmlGpus

    assert isinstance(nvml, NvmlGpus)
    for info in nvml.gpus():
        assert info.uuid.startswith("GPU-") and info.memory_mib > 0
        # As `resource.kubernetes.io/pciBusID` wants it (DRA), from nvmlDeviceGetPciInfo_v3.
        assert re.fullmatch(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]", info.pci_bus_id)
        with pytest.raises(NvmlError):
            nvml.set_mig_mode(info.index, info.mig_enabled)  # refused before reaching NVML


def test_nvml_profiles_and_placements_match_the_catalogue(nvml: object) -> None:
    from gpupart_plugin.nvml import NvmlGpus

    assert isinstance(nvml, NvmlGpus)
    for info in nvml.gpus():
        known = find_gpu_model(info.name)
        if not info.mig_capable or known is None:
            continue
        try:
            model = nvml.model(info.index)
        except NvmlError as error:
            pytest.skip(f"NVML gives no MIG profiles with MIG disabled here: {error}")
        differences = compare_models(model, known)
        for difference in differences:
            print(difference)  # memory MiB differences are informative: NVML wins at run time
        assert [d for d in differences if d.structural] == [], info.name


def test_one_gpu_read_alone_is_that_gpu_of_the_whole_read(nvml: object) -> None:
    """`gpu(i)` (a DRA prepare reads only its claim's GPUs) gives what `gpus()` gives for i."""
    from gpupart_plugin.nvml import NvmlGpus

    assert isinstance(nvml, NvmlGpus)
    every = nvml.gpus()
    assert nvml.indices() == tuple(g.index for g in every)
    for info in every:
        assert nvml.gpu(info.index) == info
    assert nvml.gpu(len(every)) is None
