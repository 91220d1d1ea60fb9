"""`gpupart plan`: reads GpuPartition YAML, asks the core for each GPU's layout, prints it or why it can't be."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from gpupart.core.api.resources import mig_resource_name
from gpupart.core.api.selectors import Operator
from gpupart.core.api.spec import Interface, Mode, PartitionSpec, parse_partition, plan_gpu
from gpupart.core.errors import GpupartError, InvalidInput
from gpupart.core.mig.catalogue import GpuModel, find_gpu_model, require_gpu_model
from gpupart.core.mig.layout import Layout

PRODUCT_LABEL = "nvidia.com/gpu.product"
"""The node label (GPU Feature Discovery's) whose value names a node's GPU product."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", type=Path, help="GpuPartition YAML file (one or more documents)")
    parser.add_argument(
        "--product",
        metavar="NAME",
        help="GPU product as NVML or the GFD label nvidia.com/gpu.product names it "
        "(e.g. 'NVIDIA A100-SXM4-80GB', NVIDIA-H100-80GB-HBM3, H200-141GB); needed for MIG and "
        "for MPS with defaultMemory [default: the product(s) that spec.nodeSelector names in "
        f"{PRODUCT_LABEL}]",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object per partition")


def run(args: argparse.Namespace) -> int:
    try:
        documents = _read_documents(args.file)
    except GpupartError as error:
        print(f"gpupart plan: {error}", file=sys.stderr)
        return 2
    status = 0
    for number, document in enumerate(documents, start=1):
        where = f"{args.file}" + (f" (document {number})" if len(documents) > 1 else "")
        try:
            spec = parse_partition(document)
            products = [args.product] if args.product else _selected_products(spec)
        except GpupartError as error:
            status = _refused(args, where, error)
            continue
        for product in products or [None]:
            try:
                model = _model(spec, product)
                layout = plan_gpu(spec, model) if model is not None else ()
            except GpupartError as error:
                status = _refused(args, where, error)
                continue
            shown = model.product if model is not None else product
            if args.json:
                print(json.dumps(_as_json(spec, shown, model, layout), sort_keys=True))
            else:
                print(_as_text(spec, shown, model, layout))
    return status


def _refused(args: argparse.Namespace, where: str, error: GpupartError) -> int:
    print(f"gpupart plan: {where}: {error}", file=sys.stderr)
    if args.json:
        print(json.dumps({"file": str(args.file), "feasible": False, "reason": str(error)}))
    return 2


def _selected_products(spec: PartitionSpec) -> list[str]:
    """The GPU products a partition's nodeSelector admits through `PRODUCT_LABEL` (matchLabels,
    or matchExpressions `In`), in their order; [] when it does not name them."""
    products: list[str] | None = None
    for requirement in spec.node_selector.requirements:
        if requirement.key == PRODUCT_LABEL and requirement.operator is Operator.IN:
            values = list(requirement.values)
            products = values if products is None else [v for v in products if v in values]
    return products or []


def _model(spec: PartitionSpec, product: str | None) -> GpuModel | None:
    """The catalogue entry `spec` needs for `product`: MIG needs its profile table, MPS with
    defaultMemory its memory; TimeSlicing, None and MPS without defaultMemory need neither."""
    config = spec.config
    needs_model = config.mode is Mode.MIG or (
        config.mps is not None and config.mps.default_memory_mib is not None
    )
    if product is None:
        if needs_model:
            what = "MIG layouts" if config.mode is Mode.MIG else "MPS defaultMemory"
            raise InvalidInput(
                "spec.nodeSelector",
                f"names no {PRODUCT_LABEL}, and {what} depend on the GPU: give --product NAME",
            )
        return None
    if config.mode is Mode.MPS and needs_model:
        model = find_gpu_model(product)
        if model is None:
            raise InvalidInput(
                "spec.mps.defaultMemory",
                f"gpupart knows no memory size of a {product!r} to check {config.replicas} "
                "clients × defaultMemory against; leave defaultMemory out, or plan for a "
                "catalogued product (--product)",
            )
        return model
    if needs_model:
        return require_gpu_model(product)
    return find_gpu_model(product)


MAX_FILE_BYTES = 3 << 20
"""The API server's own request limit (3 MiB): a bigger partition file could never be applied."""
_LONGEST_INTEGER = 30
"""Digits of the longest YAML integer read (any field's bound has fewer than 20)."""


class _StrictLoader(yaml.SafeLoader):
    """YAML as the API server would take it: a key given twice, or a 100,000-digit integer,
    is an error at its line (PyYAML keeps the last key, and the integer costs seconds)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[object] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, str | int | float | bool):
                continue  # unhashable keys are refused by the constructor itself
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r:.60}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        if len(node.value) > _LONGEST_INTEGER:
            raise yaml.constructor.ConstructorError(
                None, None, f"an integer of {len(node.value)} digits", node.start_mark
            )
        return super().construct_yaml_int(node)


_StrictLoader.add_constructor("tag:yaml.org,2002:int", _StrictLoader.construct_yaml_int)


def _read_documents(path: Path) -> list[dict[str, Any]]:
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            raise InvalidInput(str(path), f"is larger than {MAX_FILE_BYTES >> 20} MiB")
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise InvalidInput(str(path), f"cannot read: {error.strerror}") from None
    except UnicodeDecodeError as error:
        raise InvalidInput(
            str(path), f"is not UTF-8 text (byte {error.start}: {error.reason})"
        ) from None
    try:
        documents = [d for d in yaml.load_all(text, Loader=_StrictLoader) if d is not None]
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(error, "problem", None) or str(error)
        raise InvalidInput(f"{path}{line}", f"malformed YAML: {problem}") from None
    if not documents:
        raise InvalidInput(str(path), "holds no GpuPartition")
    for number, document in enumerate(documents, start=1):
        if not isinstance(document, dict):
            raise InvalidInput(f"{path} (document {number})", "must be a mapping (a GpuPartition)")
    return documents


def _gpus_text(spec: PartitionSpec) -> str:
    if spec.gpus is None:
        return "every GPU"
    return "GPU " + ", ".join(str(i) for i in spec.gpus)


def _as_text(
    spec: PartitionSpec, product: str | None, model: GpuModel | None, layout: Layout
) -> str:
    config = spec.config
    on = f"on {product}" if product else "on any GPU product"
    lines = [f"GpuPartition {spec.name}: {config.mode} {on}, {_gpus_text(spec)} of each node"]
    if config.interface is Interface.DRA:
        lines[0] += ", through DRA (driver gpu.gpupart.io)"
    if config.mode is Mode.MIG and model is not None:
        lines.append(f"  {'slots':<7}{'profile':<16}{'memory':>10}  resource")
        used: set[int] = set()
        for instance in layout:
            profile = model.require_profile(instance.profile)
            start, size = instance.placement.start, instance.placement.size
            used.update(range(start, start + size))
            slots = str(start) if size == 1 else f"{start}-{start + size - 1}"
            lines.append(
                f"  {slots:<7}{profile.name:<16}{profile.memory_mib:>6} MiB  "
                f"{mig_resource_name(profile.name)}"
            )
        free = [s for s in range(model.memory_slices) if s not in used]
        if free:
            lines.append(f"  free memory slots: {', '.join(map(str, free))}")
        if spec.dynamic is not None and config.interface is Interface.DRA:
            allowed = spec.dynamic.profiles
            lines += [
                "  dynamic MIG through DRA: every placement of "
                + (", ".join(allowed) if allowed else f"every {model.product} profile"),
                "  is a device; the scheduler allocates them, the node agent makes the instance",
            ]
        elif spec.dynamic is not None:
            allowed = spec.dynamic.profiles
            lines += [
                "  dynamic MIG: the warm mix above is kept on idle GPUs; pending pods get",
                "  instances of "
                + (", ".join(allowed) if allowed else f"every {model.product} profile"),
            ]
    elif config.mode is Mode.MPS and config.mps is not None:
        memory, compute = config.mps.default_memory_mib, config.mps.default_compute_percent
        lines.append(
            f"  up to {config.replicas} MPS clients per GPU (nvidia.com/gpu.shared)"
            + (f", {memory} MiB each by default" if memory else "")
            + (f", {compute}% of SMs each" if compute else "")
        )
    elif config.mode is Mode.TIME_SLICING:
        lines.append(f"  {config.replicas} time-sliced replicas per GPU (nvidia.com/gpu.shared)")
    else:
        lines.append("  whole GPUs, no partitioning (nvidia.com/gpu)")
    return "\n".join(lines)


def _as_json(
    spec: PartitionSpec, product: str | None, model: GpuModel | None, layout: Layout
) -> dict[str, Any]:
    result: dict[str, Any] = {
        "partition": spec.name,
        "product": product,
        "mode": spec.config.mode.value,
        "interface": spec.config.interface.value,
        "gpus": "all" if spec.gpus is None else list(spec.gpus),
        "feasible": True,
        "layout": [
            {
                "profile": i.profile,
                "start": i.placement.start,
                "size": i.placement.size,
                "memoryMiB": model.require_profile(i.profile).memory_mib,
                "resource": mig_resource_name(i.profile),
            }
            for i in layout
            if model is not None
        ],
    }
    config = spec.config
    if config.mps is not None:
        result["mps"] = {
            "maxClients": config.replicas,
            "defaultMemoryMiB": config.mps.default_memory_mib,
            "defaultComputePercent": config.mps.default_compute_percent,
        }
    if config.mode is Mode.TIME_SLICING:
        result["replicas"] = config.replicas
    return result
