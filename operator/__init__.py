"""kopf operator: reconciles GpuPartition resources into per-node desired layouts (gpupart_operator)."""
