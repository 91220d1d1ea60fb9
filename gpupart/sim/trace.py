"""Workload traces in Alibaba's `cluster-trace-gpu-v2023` CSV format: node and pod types, and parsing.

Parsing takes text already read by the shell and a source name for messages; it never opens a
file. Every rejected row raises `TraceError` naming the file and the 1-based line.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from gpupart.core.errors import InvalidInput
from gpupart.core.scheduling.scoring import MILLI, GpuShape

NODE_COLUMNS = ("sn", "cpu_milli", "memory_mib", "gpu", "model")
POD_COLUMNS_FULL = (
    "name",
    "cpu_milli",
    "memory_mib",
    "num_gpu",
    "gpu_milli",
    "gpu_spec",
    "qos",
    "pod_phase",
    "creation_time",
    "deletion_time",
    "scheduled_time",
)
POD_COLUMNS_SHORT = POD_COLUMNS_FULL[:5]
"""The `multigpu*` workloads carry only the resource columns."""


class TraceError(InvalidInput):
    """A trace file that cannot be replayed; `source` and `line` point at the offending row."""

    def __init__(self, source: str, line: int, problem: str) -> None:
        super().__init__(f"{source}:{line}" if line else source, problem)
        self.source = source
        self.line = line


@dataclass(frozen=True, slots=True)
class Node:
    """One machine of the simulated cluster; `model` is empty on a CPU-only node."""

    name: str
    cpu_milli: int
    memory_mib: int
    gpus: int
    model: str
    line: int = 0
    """Where the node was defined (1-based line of its file); 0 for generated nodes."""

    @property
    def gpu_milli(self) -> int:
        return self.gpus * MILLI


@dataclass(frozen=True, slots=True)
class Pod(GpuShape):
    """One workload request from a trace."""

    name: str
    cpu_milli: int
    memory_mib: int
    num_gpu: int
    gpu_milli: int
    gpu_spec: tuple[str, ...] = ()
    """GPU models the pod accepts; empty accepts any model."""
    line: int = 0
    qos: str = ""
    """LS, Burstable, BE or Guaranteed in the 11-column files; empty in the 5-column ones."""
    creation_time: int | None = None
    deletion_time: int | None = None
    """Seconds from the trace's start; None when the row has none (the 5-column files)."""


def parse_nodes(text: str, *, source: str) -> tuple[Node, ...]:
    """Nodes from a `sn,cpu_milli,memory_mib,gpu,model` CSV; raises `TraceError`."""
    nodes: list[Node] = []
    seen: set[str] = set()
    for line, row in _rows(text, source=source, allowed=(NODE_COLUMNS,)):
        name = row["sn"]
        if not name:
            raise TraceError(source, line, "empty node name in column 'sn'")
        if name in seen:
            raise TraceError(source, line, f"node {name!r} appears twice")
        seen.add(name)
        gpus = _count(row, "gpu", source=source, line=line)
        model = row["model"]
        if gpus > 0 and not model:
            raise TraceError(source, line, f"node {name!r} has {gpus} GPUs but no 'model'")
        nodes.append(
            Node(
                name=name,
                cpu_milli=_count(row, "cpu_milli", source=source, line=line),
                memory_mib=_count(row, "memory_mib", source=source, line=line),
                gpus=gpus,
                model=model if gpus > 0 else "",
                line=line,
            )
        )
    return tuple(nodes)


def parse_pods(text: str, *, source: str) -> tuple[Pod, ...]:
    """Pods from either pod column set (11 columns, or the 5 of `multigpu*`); raises `TraceError`."""
    pods: list[Pod] = []
    for line, row in _rows(text, source=source, allowed=(POD_COLUMNS_FULL, POD_COLUMNS_SHORT)):
        name = row["name"]
        if not name:
            raise TraceError(source, line, "empty pod name in column 'name'")
        num_gpu = _count(row, "num_gpu", source=source, line=line)
        gpu_milli = _count(row, "gpu_milli", source=source, line=line)
        if gpu_milli > MILLI:
            raise TraceError(source, line, f"gpu_milli {gpu_milli} is more than one GPU (1000)")
        if num_gpu == 0 and gpu_milli != 0:
            raise TraceError(source, line, f"gpu_milli {gpu_milli} with num_gpu 0")
        if num_gpu > 0 and gpu_milli == 0:
            raise TraceError(source, line, f"num_gpu {num_gpu} with gpu_milli 0")
        if num_gpu > 1 and gpu_milli != MILLI:
            raise TraceError(
                source, line, f"num_gpu {num_gpu} needs whole GPUs, got gpu_milli {gpu_milli}"
            )
        spec = tuple(part for part in row.get("gpu_spec", "").split("|") if part)
        created = deleted = None
        if row.get("creation_time") and row.get("deletion_time"):
            created = _count(row, "creation_time", source=source, line=line)
            deleted = _count(row, "deletion_time", source=source, line=line)
            if deleted < created:
                raise TraceError(
                    source, line, f"deletion_time {deleted} is before creation_time {created}"
                )
        pods.append(
            Pod(
                name=name,
                cpu_milli=_count(row, "cpu_milli", source=source, line=line),
                memory_mib=_count(row, "memory_mib", source=source, line=line),
                num_gpu=num_gpu,
                gpu_milli=gpu_milli,
                gpu_spec=spec,
                line=line,
                qos=row.get("qos", ""),
                creation_time=created,
                deletion_time=deleted,
            )
        )
    return tuple(pods)


def larger_than_any_node(nodes: Sequence[Node], pod: Pod) -> str:
    """Why no node could host `pod` even when empty, for a person; '' when one could.

    Such a pod fails in every policy, as in the FGD authors' simulator, which counts it as
    unschedulable and goes on; the replay reports it apart from pods that failed for want of room.
    """
    if any(
        node.cpu_milli >= pod.cpu_milli
        and node.memory_mib >= pod.memory_mib
        and node.gpus >= pod.num_gpu
        and (pod.num_gpu == 0 or pod.accepts(node.model))
        for node in nodes
    ):
        return ""
    return (
        f"pod {pod.name!r}"
        + (f" (line {pod.line})" if pod.line else "")
        + f": cpu {pod.cpu_milli}m, memory {pod.memory_mib} MiB, "
        f"{pod.num_gpu} x {pod.gpu_milli}m GPU"
        + (f" of {'|'.join(pod.gpu_spec)}" if pod.gpu_spec else "")
        + " is larger than any node"
    )


def _rows(
    text: str, *, source: str, allowed: tuple[tuple[str, ...], ...]
) -> Iterator[tuple[int, dict[str, str]]]:
    """Yield (line, row) after checking the header against one of the allowed column sets."""
    reader = csv.reader(io.StringIO(text))
    try:
        header = next(reader, None)
    except csv.Error as error:
        raise TraceError(source, 1, f"unreadable CSV header: {error}") from error
    if header is None or not any(cell.strip() for cell in header):
        raise TraceError(source, 1, "empty file: expected a CSV header")
    columns = tuple(cell.strip() for cell in header)
    if columns not in allowed:
        raise TraceError(source, 1, _describe_header(columns, allowed))
    count = 0
    while True:
        try:
            cells = next(reader, None)
        except csv.Error as error:
            raise TraceError(source, reader.line_num, f"unreadable CSV row: {error}") from error
        if cells is None:
            break
        line = reader.line_num
        if not cells or (len(cells) == 1 and not cells[0].strip()):
            continue  # blank line, e.g. a trailing newline pair
        if len(cells) != len(columns):
            raise TraceError(
                source,
                line,
                f"expected {len(columns)} fields ({','.join(columns)}), got {len(cells)}",
            )
        count += 1
        yield line, {column: cell.strip() for column, cell in zip(columns, cells, strict=True)}
    if count == 0:
        raise TraceError(source, 2, "no data rows after the header")


def _describe_header(columns: tuple[str, ...], allowed: tuple[tuple[str, ...], ...]) -> str:
    expected = " or ".join(",".join(option) for option in allowed)
    closest = min(allowed, key=lambda option: len(set(option) ^ set(columns)))
    missing = [column for column in closest if column not in columns]
    extra = [column for column in columns if column not in closest]
    details = []
    if missing:
        details.append(f"missing {', '.join(missing)}")
    if extra:
        details.append(f"unexpected {', '.join(extra)}")
    if not details:
        details.append("columns out of order")
    return f"bad header ({'; '.join(details)}): expected {expected}"


def _count(row: dict[str, str], column: str, *, source: str, line: int) -> int:
    """A non-negative integer cell; the trace writes every quantity as an integer."""
    text = row[column]
    try:
        value = int(text)
    except ValueError:
        raise TraceError(
            source, line, f"column {column!r}: {text!r} is not a whole number"
        ) from None
    if value < 0:
        raise TraceError(source, line, f"column {column!r}: {value} is negative")
    return value
