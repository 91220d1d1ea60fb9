"""MIG geometry: the product catalogue, layouts and their exact solver, and the NVML steps of a plan."""
