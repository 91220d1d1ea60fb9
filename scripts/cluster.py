"""A local gpupart playground: a real control plane, two real-kubelet nodes with simulated GPUs, and gpupart.

    python -P scripts/cluster.py check   # can this machine run it (root, mount namespaces)?
    python -P scripts/cluster.py up      # `make cluster`: starts everything in the background
    python -P scripts/cluster.py down    # `make cluster-down`: stops it and removes .cluster/

The same harness as the e2e tests (tests/support/playground.py): etcd, kube-apiserver,
kube-controller-manager, kube-scheduler, kwok (idle), the chart's `gpupart-scheduler` profile,
`gpupart operator`, `gpupart extender`, and two nodes, each a real kubelet with the fake CRI
runtime in its own mount namespace served by `gpupart node --simulate`: `gpu-a100` (one
A100-SXM4-80GB in MIG mode) and `gpu-h100` (two H100-SXM5-80GB without MIG), labelled as GPU
Feature Discovery labels such nodes. Everything listens on loopback only and writes only under
.cluster/ and /tmp; needs root (the kubelets' mount namespaces).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STATE = REPO / ".cluster"
PID = STATE / "supervisor.pid"
READY = STATE / "ready"
LOG = STATE / "supervisor.log"
BIN = STATE / "bin"


def check() -> int:
    """Say in one line why this machine cannot run the playground; 0 when it can.

    `make cluster` runs this before it builds anything: the build takes half an hour the
    first time, and these are what would stop the playground at its end.
    """
    if os.geteuid() != 0:
        print(
            "cluster: needs root: each node's kubelet runs in its own mount namespace "
            "(unshare --mount); run `sudo make cluster`",
            file=sys.stderr,
        )
        return 1
    if shutil.which("unshare") is None:
        print(
            "cluster: needs `unshare` (util-linux) on PATH for the kubelets' mount namespaces",
            file=sys.stderr,
        )
        return 1
    probe = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "true"], capture_output=True, text=True
    )
    if probe.returncode != 0:
        why = (
            probe.stderr.strip().splitlines()[-1]
            if probe.stderr.strip()
            else f"exit {probe.returncode}"
        )
        print(
            f"cluster: cannot make a mount namespace here ({why}); in a container that needs "
            "CAP_SYS_ADMIN (e.g. a privileged container)",
            file=sys.stderr,
        )
        return 1
    return 0


def supervise() -> int:
    """Run the playground in the foreground until SIGTERM (the detached child of `up`)."""
    from gpupart_testsupport.cluster import bin_dir_from_env, missing_binaries
    from gpupart_testsupport.playground import Playground

    bin_dir = bin_dir_from_env()
    missing = missing_binaries(bin_dir)
    if missing:
        print(f"missing {', '.join(missing)} in {bin_dir}: run `make k8s-bins`", flush=True)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    playground = Playground(bin_dir, STATE, say=lambda line: print(line, flush=True))
    try:
        playground.start()
        # The clients the README's commands run, on PATH without the rest of the cache.
        BIN.mkdir(exist_ok=True)
        for tool in ("kubectl", "helm"):
            (BIN / tool).unlink(missing_ok=True)
            (BIN / tool).symlink_to(bin_dir / tool)
        READY.write_text(str(playground.control_plane.kubeconfig))
        print("ready", flush=True)
        while True:
            time.sleep(3600)
    finally:
        playground.stop()


def up() -> int:
    if PID.exists() and _alive(int(PID.read_text())):
        print(f"already running (pid {PID.read_text()}); `make cluster-down` stops it")
        return 0
    if check() != 0:
        return 1
    shutil.rmtree(STATE, ignore_errors=True)
    STATE.mkdir()
    with LOG.open("w") as log:
        child = subprocess.Popen(
            [sys.executable, "-P", __file__, "supervise"],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # outlives `make`; `down` signals it
        )
    PID.write_text(str(child.pid))
    shown = 0
    deadline = time.monotonic() + 300

    def show_new_lines() -> None:
        nonlocal shown
        lines = LOG.read_text().splitlines()
        for line in lines[shown:]:
            if not line.startswith((" ", "\t")):
                print(f"cluster: {line}", flush=True)
        shown = len(lines)

    while not READY.exists():
        show_new_lines()
        if child.poll() is not None or time.monotonic() > deadline:
            print(LOG.read_text()[-3000:], file=sys.stderr)
            print("cluster: the playground did not start (log above)", file=sys.stderr)
            down()
            return 1
        time.sleep(0.5)
    show_new_lines()
    print(
        f"""
The playground is up. In this shell:

    export KUBECONFIG={READY.read_text()}
    export PATH={BIN}:$PATH    # its kubectl and helm
    kubectl get nodes -L nvidia.com/gpu.product -L nvidia.com/gpu.count

then README.md's "A local playground" section. Logs: {STATE}/stack (gpupart),
{STATE}/control-plane/logs; `make cluster-down` stops it all."""
    )
    return 0


def down() -> int:
    if not PID.exists():
        print("no playground running")
        return 0
    pid = int(PID.read_text())
    if _alive(pid):
        os.kill(pid, signal.SIGTERM)
        for _ in range(100):
            if not _alive(pid):
                break
            time.sleep(0.2)
        else:
            os.killpg(pid, signal.SIGKILL)
    shutil.rmtree(STATE, ignore_errors=True)
    print("playground stopped")
    return 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


if __name__ == "__main__":
    command = sys.argv[1] if len(sys.argv) > 1 else ""
    actions = {"check": check, "up": up, "down": down, "supervise": supervise}
    if command not in actions:
        print(__doc__)
        sys.exit(2)
    sys.exit(actions[command]())
