"""FastAPI kube-scheduler extender: filter, prioritize and bind GPU pods (gpupart_extender)."""
