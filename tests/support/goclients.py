"""Builds the benchmarks' Go programs (kubeletclient, schedulerclient, nullextender) once, cached.

A client is built with the `go` on PATH into ${XDG_CACHE_HOME:-~/.cache}/gpupart/bench/, under
a hash of its go.mod, go.sum and main.go; the pinned modules come from the Go module cache or
GOPROXY. `build` answers None (with the reason on stderr) when Go is missing or the build fails,
and the benchmark falls back to its Python client.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[1] / "bench"
"""Where the Go programs' sources live (tests/bench/<name>)."""


def build(name: str) -> Path | None:
    """The built binary of tests/bench/<name> (built now when not cached), or None."""
    source = HERE / name
    go = shutil.which("go")
    if go is None:
        print(f"{name}: no `go` on PATH; falling back to the Python client", file=sys.stderr)
        return None
    digest = hashlib.sha256()
    for part in ("go.mod", "go.sum", "main.go"):
        if (source / part).exists():  # no go.sum for a program of the standard library only
            digest.update((source / part).read_bytes())
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gpupart" / "bench"
    binary = cache / f"{name}-{digest.hexdigest()[:16]}"
    if binary.exists():
        return binary
    cache.mkdir(parents=True, exist_ok=True)
    partial = binary.with_name(f"{binary.name}.{os.getpid()}.tmp")
    try:
        subprocess.run(
            [go, "build", "-mod=readonly", "-buildvcs=false", "-trimpath", "-o", str(partial), "."],
            cwd=source,
            capture_output=True,
            text=True,
            timeout=600,
            check=True,
        )
    except (OSError, subprocess.SubprocessError) as error:
        stderr = getattr(error, "stderr", None)
        detail = stderr if isinstance(stderr, str) and stderr.strip() else str(error)
        partial.unlink(missing_ok=True)
        print(
            f"{name}: building the Go client failed ({detail.strip()}); "
            "falling back to the Python client",
            file=sys.stderr,
        )
        return None
    partial.replace(binary)
    return binary
