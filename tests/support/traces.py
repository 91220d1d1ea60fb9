"""CPU-heavier variants of the Alibaba default trace, generated the way its `cpuNNN` siblings differ from it.

The `cpu050` and `cpu100` traces hold the default trace's GPU pods unchanged and fewer CPU-only
pods (375 and 789 against 1,088). The variants here go the other way: every GPU pod kept, and
CPU-only pods resampled with replacement from the default trace's 1,088 until there are 1.5x,
2x and 2.5x as many (`cpu-x1.5`, `cpu-x2`, `cpu-x2.5`). A copy takes its resources, QoS, run time and
scheduling delay from the pod it copies and its creation time from another CPU-only pod drawn
at random, so arrivals spread over time as the originals do. All pods are then renumbered in
creation order, as in the published files. Seeded: the same seed writes the same bytes.

`tests/bench/cpu_heavy.py [--seed 16] [--out build/traces]` writes them; the policy benchmark
(`tests/bench/policies.py --all-traces`) calls `write_variants` itself.
"""

from __future__ import annotations

import csv
import io
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TRACE = (
    ROOT / ".." / "shared" / "traces" / "alibaba-gpu-v2023" / "openb_pod_list_default.csv"
)
OUT = ROOT / "build" / "traces"
SEED = 16
FACTORS = {"cpu-x1.5": 1.5, "cpu-x2": 2.0, "cpu-x2.5": 2.5}
"""Named apart from the authors' `cpuNNN` traces, whose numbers scale CPU-only demand otherwise
(`cpu100` holds 789 CPU-only pods, the default trace 1,088)."""


def variant(text: str, factor: float, rng: random.Random) -> str:
    """The trace `text` with its CPU-only pods resampled up to `factor` times their number."""
    reader = csv.DictReader(io.StringIO(text))
    columns = list(reader.fieldnames or ())
    rows = list(reader)
    cpu_only = [row for row in rows if int(row["num_gpu"]) == 0]
    target = round(factor * len(cpu_only))
    copies = []
    for _ in range(target - len(cpu_only)):
        source = dict(rng.choice(cpu_only))
        created = int(rng.choice(cpu_only)["creation_time"])
        shift = created - int(source["creation_time"])
        for column in ("creation_time", "deletion_time", "scheduled_time"):
            if source[column]:
                source[column] = str(int(source[column]) + shift)
        copies.append(source)
    every = sorted(
        [*rows, *copies], key=lambda row: int(row["creation_time"] or 0)
    )  # stable: originals before copies at the same time
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    for number, row in enumerate(every):
        writer.writerow(row | {"name": f"openb-pod-{number:04d}"})
    return out.getvalue()


def write_variants(out: Path = OUT, *, seed: int = SEED) -> dict[str, Path]:
    """Write every variant as `openb_pod_list_<name>.csv` under `out`; name -> path."""
    text = DEFAULT_TRACE.read_text()
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, factor in FACTORS.items():
        # one generator per variant, so each file depends only on the seed and its factor
        rng = random.Random(f"{seed}/{name}")
        path = out / f"openb_pod_list_{name}.csv"
        path.write_text(variant(text, factor, rng))
        paths[name] = path
    return paths
