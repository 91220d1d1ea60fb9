"""A local gpupart playground: a real control plane, two real-kubelet nodes with simulated GPUs, and gpupart.

    python -P scripts/cluster.py up      # `make cluster`: starts everything in the background
    python -P scripts/cluster.py down    # `make cluster-down`: stops it and removes .cluster/

The same harness as the e2e tests (tests/e2e): etcd, kube-apiserver, kube-scheduler, kwok
(idle), the chart's `gpupart-scheduler` profile, `gpupart operator`, `gpupart extender`, and two
nodes, each a real kubelet with the fake CRI runtime in its own mount namespace served by `gpupart
node --simulate`: `gpu-a100` (one A100-SXM4-80GB in MIG mode, labelled like GPU Feature Discovery
does) and `gpu-h100` (two H100-SXM5-80GB without MIG). Everything listens on loopback only and
writes only under .cluster/ and /tmp; needs root (the kubelets' mount namespaces).
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
NODES = {
    "gpu-a100": ("A100-SXM4-80GB", "NVIDIA-A100-SXM4-80GB"),
    "gpu-h100": ("2xH100-SXM5-80GB:mig-off", "NVIDIA-H100-80GB-HBM3"),
}


def supervise() -> int:
    """Run the stack in the foreground until SIGTERM (the detached child of `up`)."""
    sys.path.insert(0, str(REPO))
    from tests.e2e.cluster import ControlPlane, bin_dir_from_env, missing_binaries
    from tests.e2e.stack import Stack

    bin_dir = bin_dir_from_env()
    missing = missing_binaries(bin_dir)
    if missing:
        print(f"missing {', '.join(missing)} in {bin_dir}: run `make k8s-bins`", flush=True)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    cp = ControlPlane(bin_dir=bin_dir, workdir=STATE / "control-plane")
    stack = None
    try:
        print("starting etcd, kube-apiserver, kube-scheduler, kwok", flush=True)
        cp.start(scheduler_config={})
        cp.kubectl("apply", "-f", str(REPO / "charts" / "gpupart" / "crds"))
        api = cp.api_client()
        (STATE / "stack").mkdir(exist_ok=True)
        stack = Stack(cp, api, STATE / "stack")
        print("starting gpupart operator, extender and gpupart-scheduler", flush=True)
        stack.start_operator()
        stack.start_scheduler(stack.start_extender())
        for name, (gpus, product) in NODES.items():
            print(f"starting node {name}: kubelet, fake runtime, gpupart node ({gpus})", flush=True)
            labels = {"nvidia.com/gpu.present": "true", "nvidia.com/gpu.product": product}
            stack.start_real_node(name, gpus, labels, auto_reset=True)
        (STATE / "kubectl").unlink(missing_ok=True)
        (STATE / "kubectl").symlink_to(bin_dir / "kubectl")
        READY.write_text(str(cp.kubeconfig))
        print("ready", flush=True)
        while True:
            time.sleep(3600)
    finally:
        if stack is not None:
            stack.stop()
        cp.stop()


def up() -> int:
    if PID.exists() and _alive(int(PID.read_text())):
        print(f"already running (pid {PID.read_text()}); `make cluster-down` stops it")
        return 0
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
    while not READY.exists():
        lines = LOG.read_text().splitlines()
        for line in lines[shown:]:
            if not line.startswith((" ", "\t")):
                print(f"cluster: {line}", flush=True)
        shown = len(lines)
        if child.poll() is not None or time.monotonic() > deadline:
            print(LOG.read_text()[-3000:], file=sys.stderr)
            print("cluster: the playground did not start (log above)", file=sys.stderr)
            down()
            return 1
        time.sleep(0.5)
    kubectl = STATE / "kubectl"
    print(
        f"""
The playground is up. In this shell:

    export KUBECONFIG={READY.read_text()}
    alias kubectl={kubectl}
    kubectl get nodes -L nvidia.com/gpu.product
    kubectl apply -f charts/gpupart/examples/mig-a100.yaml   # MIG slices on gpu-a100
    kubectl apply -f charts/gpupart/examples/mps-h100.yaml   # shared H100s on gpu-h100
    kubectl get gpup
    kubectl apply -f docs/examples/pod-mig.yaml -f docs/examples/pod-shared.yaml
    kubectl get pods -o wide

Logs: {STATE}/stack (gpupart), {STATE}/control-plane/logs; `make cluster-down` stops it all."""
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
    actions = {"up": up, "down": down, "supervise": supervise}
    if command not in actions:
        print(__doc__)
        sys.exit(2)
    sys.exit(actions[command]())
