module gpupart/tests/bench/nullextender

go 1.26.0
