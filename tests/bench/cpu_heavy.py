"""Write the CPU-heavier variants of the Alibaba default trace (`gpupart_testsupport.traces`).

Run as `.venv/bin/python tests/bench/cpu_heavy.py [--seed 16] [--out build/traces]`.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

from gpupart_testsupport.traces import OUT, SEED, write_variants


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    for name, path in write_variants(args.out, seed=args.seed).items():
        rows = list(csv.DictReader(path.open()))
        cpu = sum(1 for row in rows if row["num_gpu"] == "0")
        sys.stdout.write(f"{name}: {len(rows)} pods, {cpu} CPU-only -> {path}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
