"""The DRA kubelet plugin and ResourceSlice publisher, served for the GPUs a partition puts on DRA."""
