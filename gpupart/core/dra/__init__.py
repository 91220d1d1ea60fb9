"""DRA (Dynamic Resource Allocation): gpupart's GPUs as ResourceSlice devices, their order, and claims read back."""
