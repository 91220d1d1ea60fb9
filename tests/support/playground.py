"""The playground `make cluster` runs (scripts/cluster.py) and tests/e2e/test_readme.py walks.

A control plane with kube-controller-manager, the CRDs, the chart's MutatingAdmissionPolicy (GPU
pods that name no scheduler get gpupart's), gpupart's operator, extender and the
chart's gpupart-scheduler as processes, and two nodes, each a real kubelet with the fake CRI
runtime and `gpupart node --simulate`, labelled as NVIDIA's GPU Feature Discovery labels a node
with those GPUs (so partitions select them and dynamic MIG counts their GPUs as on a real
cluster).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from gpupart_testsupport.chart import IMAGE_FLAGS
from gpupart_testsupport.cluster import REPO, ControlPlane
from gpupart_testsupport.stack import Stack


@dataclass(frozen=True)
class GpuModel:
    """What GPU Feature Discovery reads from NVML for one kind of GPU."""

    product: str
    """`nvidia.com/gpu.product`: NVML's name with spaces as dashes."""
    memory_mib: int
    """`nvidia.com/gpu.memory`: NVML's memory size in MiB."""
    family: str
    compute: tuple[int, int]
    mig_capable: bool


A100_80GB = GpuModel("NVIDIA-A100-SXM4-80GB", 81920, "ampere", (8, 0), True)
H100_80GB = GpuModel("NVIDIA-H100-80GB-HBM3", 81559, "hopper", (9, 0), True)


def gfd_labels(gpu: GpuModel, count: int) -> dict[str, str]:
    """The labels GPU Feature Discovery (MIG strategy `mixed`) puts on a node with `count` of
    these GPUs, as its README's table names them; `nvidia.com/gpu.present` is the GPU operator's
    (or NFD's) label that GFD's own DaemonSet selects on.

    Left out: the driver and CUDA versions (there is no driver here), the machine type, and the
    per-MIG-type `nvidia.com/mig-<profile>.count` labels, which GFD rewrites as instances come
    and go and which gpupart does not read.
    """
    return {
        "nvidia.com/gpu.present": "true",
        "nvidia.com/gpu.product": gpu.product,
        "nvidia.com/gpu.count": str(count),
        "nvidia.com/gpu.memory": str(gpu.memory_mib),
        "nvidia.com/gpu.family": gpu.family,
        "nvidia.com/gpu.compute.major": str(gpu.compute[0]),
        "nvidia.com/gpu.compute.minor": str(gpu.compute[1]),
        "nvidia.com/gpu.mode": "compute",
        "nvidia.com/gpu.replicas": "1",
        "nvidia.com/gpu.sharing-strategy": "none",
        "nvidia.com/mig.capable": "true" if gpu.mig_capable else "false",
        "nvidia.com/mig.strategy": "mixed",
    }


@dataclass(frozen=True)
class PlaygroundNode:
    name: str
    simulate: str
    """`gpupart node --simulate=`: the GPUs and whether they start in MIG mode."""
    labels: dict[str, str]


NODES = (
    PlaygroundNode("gpu-a100", "A100-SXM4-80GB", gfd_labels(A100_80GB, 1)),
    PlaygroundNode("gpu-h100", "2xH100-SXM5-80GB:mig-off", gfd_labels(H100_80GB, 2)),
)
"""gpu-a100: one A100 80GB in MIG mode; gpu-h100: two H100 80GB without MIG (MIG-capable: the
simulated GPUs reset themselves when idle, so a partition can switch them to MIG)."""


@dataclass
class Playground:
    """Everything `make cluster` starts, in the order it starts it; `stop()` ends it all."""

    bin_dir: Path
    workdir: Path
    say: Callable[[str], None] = print
    cp: ControlPlane | None = None
    stack: Stack | None = None
    _closers: list[Callable[[], None]] = field(default_factory=list)

    @property
    def control_plane(self) -> ControlPlane:
        assert self.cp is not None, "the playground has not started"
        return self.cp

    def start(self) -> None:
        """Start the playground; on any failure, stop what started and raise."""
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> None:
        self.say("starting etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kwok")
        self.cp = ControlPlane(
            bin_dir=self.bin_dir, workdir=self.workdir / "control-plane", controller_manager=True
        )
        self.cp.start(scheduler_config={})
        self.cp.kubectl("apply", "-f", str(REPO / "charts" / "gpupart" / "crds"))
        self._apply_scheduler_name_policy()
        api = self.cp.api_client()
        self._closers.append(api.close)
        (self.workdir / "stack").mkdir(parents=True, exist_ok=True)
        self.stack = Stack(self.cp, api, self.workdir / "stack")
        self.say("starting gpupart operator, extender and gpupart-scheduler")
        self.stack.start_operator()
        self.stack.start_scheduler(self.stack.start_extender())
        for node in NODES:
            self.say(
                f"starting node {node.name}: kubelet, fake runtime, gpupart node ({node.simulate})"
            )
            self.stack.start_real_node(node.name, node.simulate, dict(node.labels), auto_reset=True)

    def _apply_scheduler_name_policy(self) -> None:
        """The chart's MutatingAdmissionPolicy alone: GPU pods that name no scheduler get the
        gpupart one, as in a cluster with the chart. (Its validating policies would refuse
        the playground's gpupart processes, which run with the admin's credentials.)"""
        rendered = self.control_plane.helm(
            "template",
            "gpupart",
            str(REPO / "charts" / "gpupart"),
            *IMAGE_FLAGS,
            "--show-only",
            "templates/admission-policies.yaml",
            "--api-versions",
            "admissionregistration.k8s.io/v1/MutatingAdmissionPolicy",
        ).stdout
        mutating = [
            d
            for d in yaml.safe_load_all(rendered)
            if isinstance(d, dict) and str(d.get("kind", "")).startswith("MutatingAdmissionPolicy")
        ]
        assert len(mutating) == 2, "the chart renders no MutatingAdmissionPolicy and binding"
        self.control_plane.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(mutating))

    def stop(self) -> None:
        """Stop gpupart and the nodes, then the control plane. Safe to call twice."""
        if self.stack is not None:
            self.stack.stop()
            self.stack = None
        for close in reversed(self._closers):
            close()
        self._closers.clear()
        if self.cp is not None:
            self.cp.stop()
