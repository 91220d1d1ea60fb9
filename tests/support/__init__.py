"""gpupart's shared test helpers, installed as `gpupart_testsupport` (never shipped in the gpupart wheel)."""
