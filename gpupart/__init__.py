"""gpupart: partition NVIDIA GPUs on Kubernetes and schedule pods onto MIG devices and shared GPUs.

Packages and modules (README.md's Architecture has the drawing):
- `gpupart.core`: the pure model, one room per kind of decision (`api`, `mig`, `cluster`,
  `node`, `scheduling`, `dynamic`). Standard library only, no I/O, no clocks, no environment.
- `gpupart.sim`: the simulator, pure as well (trace replays, MIG packing, dynamic MIG workloads).
- `gpupart.cli`: the one command line; its shells `gpupart.plancmd` (`gpupart plan`) and
  `gpupart.simulate` (`gpupart simulate`) parse files and flags and call the core or the
  simulator; it starts the components below by name.
- Adapters every component shares: `gpupart.settings`, `gpupart.watch`, `gpupart.logs`,
  `gpupart.kubeconfig`, `gpupart.keyfile`, `gpupart.podevents`.
- `gpupart_operator` (directory `operator/`): kopf operator, GpuPartition -> per-node desired
  configuration, dynamic MIG plans, status and Events.
- `gpupart_plugin` (directory `plugin/`): node agent, NVML actuator and kubelet device plugin.
- `gpupart_extender` (directory `extender/`): FastAPI kube-scheduler extender.
"""

__version__ = "0.1.0"
