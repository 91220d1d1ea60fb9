// NVIDIA's MIG profile parser (go-nvlib), pinned, for ./migref: the reference gpupart's
// profile names are tested against (scripts/build-k8s-bins.sh builds it).
module gpupart.test/k8sbins/nvlib

go 1.26.0

require github.com/NVIDIA/go-nvlib v0.13.0

require (
	github.com/NVIDIA/go-nvml v0.13.4-1 // indirect
	github.com/google/uuid v1.6.0 // indirect
)
