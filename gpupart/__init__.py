"""gpupart: partition NVIDIA GPUs on Kubernetes and schedule pods onto the slices.

Architecture in brief (see DESIGN.md-derived notes in README.md):
- `gpupart.core`: the pure model (GPU catalogue, MIG layouts, solver, plans, resource names,
  annotation wire formats). Standard library only, no I/O, no clocks, no environment.
- `gpupart.cli`: the one command line; it parses files and flags, calls the core, and starts
  the components below by name.
- `gpupart_operator` (directory `operator/`): kopf operator, GpuPartition -> per-node desired layout.
- `gpupart_plugin` (directory `plugin/`): node agent, NVML actuator and kubelet device plugin.
- `gpupart_extender` (directory `extender/`): FastAPI kube-scheduler extender.
"""

__version__ = "0.1.0"
