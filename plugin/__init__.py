"""Node agent: NVML actuator, MPS daemons and the kubelet device plugin (gpupart_plugin)."""
