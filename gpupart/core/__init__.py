"""Pure core of gpupart: domain types and functions, standard library only, no I/O."""
