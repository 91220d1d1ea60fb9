"""`gpupart nvml-report`: what NVML says of this node's GPUs, read-only, as JSON, against the catalogue.

For support and for checking the catalogue on new hardware: GPUs, MIG modes, and for each
MIG-capable GPU the profiles and placements NVML offers, with every difference from the
catalogue entry of that product. It opens NVML read-only: nothing on the GPU changes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from gpupart.core.errors import GpupartError
from gpupart.core.mig.catalogue import compare_models, find_gpu_model
from gpupart_plugin.backend import GpuBackend
from gpupart_plugin.settings import simulated_gpus
from gpupart_plugin.simgpu import SimulatedGpus


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--simulate",
        metavar="GPUS",
        help="report on simulated GPUs instead of NVML, as `gpupart node` takes them "
        "(e.g. 2xH100-SXM5-80GB) [default: the real GPUs, through NVML]",
    )


def report(backend: GpuBackend) -> dict[str, Any]:
    """The report of every GPU the backend sees (only reads)."""
    gpus = []
    for info in backend.gpus():
        entry: dict[str, Any] = dataclasses.asdict(info)
        known = find_gpu_model(info.name)
        entry["catalogue_product"] = known.product if known else None
        if info.mig_capable:
            try:
                model = backend.model(info.index)
            except GpupartError as error:
                # NVML answers profile queries only in some MIG modes on some drivers.
                entry["profiles_error"] = str(error)
            else:
                entry["profiles"] = [dataclasses.asdict(p) for p in model.profiles]
                if known is not None:
                    entry["differences"] = [str(d) for d in compare_models(model, known)]
        gpus.append(entry)
    return {"gpus": gpus}


def run(args: argparse.Namespace) -> int:
    try:
        if args.simulate:
            gpus = simulated_gpus(args.simulate)
            backend: GpuBackend = SimulatedGpus(
                [g.product for g in gpus], node="report", mig_enabled=[g.mig_enabled for g in gpus]
            )
        else:
            from gpupart_plugin.nvml import NvmlGpus  # loads libnvidia-ml

            backend = NvmlGpus(read_only=True)
        print(json.dumps(report(backend), indent=2))
    except GpupartError as error:
        print(f"gpupart nvml-report: {error}", file=sys.stderr)
        return 2
    return 0
