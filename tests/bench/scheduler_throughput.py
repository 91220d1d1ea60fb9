"""Benchmark: pods/s through the real kube-scheduler with the gpupart extender against without it.

Starts the e2e control plane (etcd, kube-apiserver, default kube-scheduler, kwok), 1,000 kwok
nodes with 8 MPS GPUs each (inventory annotation + nvidia.com/gpu.shared allocatable), the real
`gpupart extender` process and three more kube-schedulers from the chart's configuration
file: "gpupart-scheduler" as shipped (with the extender), "gpupart-plain" (the same file with
the extender removed) and "unbatched" (gpupart-plain with opportunistic batching off, which
kube-scheduler does for any profile with an extender). The same batch of shared-GPU pods is
scheduled by each; throughput = pods / seconds until all are bound. `ratio` compares the two
that differ only by the extender; the unbatched and the default scheduler (which scores a
sample of the nodes, not all of them) are reported beside. A fifth, "null-extender", is the
shipped file pointed at tests/bench/nullextender (Go, standard library: every node passes,
every score 0, kube-scheduler binds), when Go can build it: the throughput of an extender that
costs nothing, the ceiling of any extender on this machine ("ratio_null_extender").
Needs the binaries from scripts/build-k8s-bins.sh (GPUPART_K8S_BIN or the build cache).
The last line is JSON: {"pods_per_s_with", "pods_per_s_without", "ratio",
"pods_per_s_without_batching", "pods_per_s_default_scheduler", "ratio_to_default_scheduler",
"pods_per_s_null_extender", "ratio_null_extender"} (the last two only when Go built it).

Run: .venv/bin/python tests/bench/scheduler_throughput.py [--nodes 1000] [--pods 500]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from gpupart.core.api.spec import Mode
from gpupart.core.api.wire import (
    INVENTORY_ANNOTATION,
    Inventory,
    InventoryGpu,
    encode_inventory,
)
from gpupart_testsupport import goclients
from gpupart_testsupport.cluster import (
    LOOPBACK,
    ControlPlane,
    Proc,
    bin_dir_from_env,
    create_nodes,
    free_port,
    gpu_node,
    http_get,
    http_ok,
    missing_binaries,
    parallel,
    spawn,
    start_scheduler,
    wait_for,
)
from gpupart_testsupport.objects import write_key_file

REPO = Path(__file__).resolve().parents[2]

CONFIG_FILE = REPO / "charts" / "gpupart" / "files" / "scheduler-config.yaml"
NULL_EXTENDER = "null-extender"


def _terminate(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)  # run the finally blocks that stop what we started


def _pod(name: str, scheduler: str) -> dict[str, Any]:
    limits = {"nvidia.com/gpu.shared": "1", "cpu": "10m"}
    if scheduler in ("gpupart-scheduler", NULL_EXTENDER):
        # Only pods of the extender's schedulers ask for it: the default scheduler has no
        # extender to place it per GPU.
        limits["gpupart.io/gpu-memory"] = "4096"
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": name.rsplit("-", 1)[0]}},
        "spec": {
            "schedulerName": scheduler,
            "terminationGracePeriodSeconds": 0,
            "containers": [
                {"name": "m", "image": "x", "resources": {"limits": limits, "requests": limits}}
            ],
        },
    }


def step(text: str) -> None:
    print(f"scheduler_throughput: {text}", file=sys.stderr, flush=True)


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """User+system CPU seconds of each process so far (Linux /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for name, pid in pids.items():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            out[name] = (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            out[name] = 0.0
    return out


def run_batch(
    core: Any,
    ns: str,
    prefix: str,
    scheduler: str,
    pods: int,
    manifest: Callable[[str, str], dict[str, Any]] = _pod,
) -> float:
    """Create `pods` pods of `manifest(name, scheduler)` (labelled app=prefix) and wait until
    every one is bound; pods per second from the first create to the last bind."""
    started = time.monotonic()
    parallel(
        lambda i: core.create_namespaced_pod(ns, manifest(f"{prefix}-{i}", scheduler)),
        range(pods),
    )

    def done() -> bool:
        # Only the pods still unbound, as raw JSON: listing (and deserialising) every pod of
        # the batch 5 times a second loaded the API server and this process more the longer a
        # batch took, slowing down the slower run most.
        response = core.list_namespaced_pod(
            ns,
            label_selector=f"app={prefix}",
            field_selector="spec.nodeName=",
            _preload_content=False,
        )
        return not json.loads(response.data).get("items")

    wait_for(done, 600, f"{pods} {prefix} pods bound", interval=0.2)
    return pods / (time.monotonic() - started)


def start_extender(kubeconfig: Path, workdir: Path) -> tuple[Proc, int]:
    """The real `gpupart extender` process, once its cache is ready; its port. It signs the
    assignments it binds with a key of its own (it binds no shared-GPU pod without one)."""
    port = free_port()
    keys = write_key_file(workdir / "assignment-keys")
    proc = spawn(
        "extender",
        [
            sys.executable,
            "-m",
            "gpupart.cli",
            "extender",
            "--kubeconfig",
            str(kubeconfig),
            "--port",
            str(port),
            "--log-level",
            "WARNING",
            f"--assignment-key-file={keys}",
        ],
        workdir,
    )
    try:
        wait_for(lambda: http_ok(f"http://{LOOPBACK}:{port}/readyz"), 120, "the extender's cache")
    except BaseException:
        proc.stop()
        raise
    return proc, port


def extender_config(port: int) -> dict[str, Any]:
    """The chart's scheduler configuration, pointed at the extender on `port`."""
    config: dict[str, Any] = yaml.safe_load(CONFIG_FILE.read_text())
    config["extenders"][0]["urlPrefix"] = f"http://{LOOPBACK}:{port}/gpupart"
    return config


def shared_gpu_nodes(count: int, prefix: str = "bench") -> list[dict[str, Any]]:
    """kwok nodes of 8 MPS GPUs each, as the node agent advertises them to the extender: the
    inventory annotation and the nvidia.com/gpu.shared and GPU memory/compute capacity."""
    gpus = tuple(InventoryGpu(i, f"GPU-{i}", "H100", 81559, Mode.MPS, (), 16) for i in range(8))
    inventory = encode_inventory(Inventory(gpus))
    manifests = []
    for n in range(count):
        # The capacity the node agent advertises: kube-scheduler counts it (ADR 005).
        capacity = {"gpupart.io/gpu-memory": 8 * 81559, "gpupart.io/gpu-compute": 800}
        m = gpu_node(f"{prefix}-{n:05d}", {"nvidia.com/gpu.shared": 128, **capacity})
        m["metadata"]["annotations"][INVENTORY_ANNOTATION] = inventory
        manifests.append(m)
    return manifests


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--pods", type=int, default=500)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, _terminate)
    bin_dir = bin_dir_from_env()
    missing = missing_binaries(bin_dir)
    if missing:
        print(
            f"scheduler_throughput: missing {', '.join(missing)} in {bin_dir}; "
            "build them with scripts/build-k8s-bins.sh",
            file=sys.stderr,
        )
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="gpupart-bench-"))
    cp = ControlPlane(bin_dir=bin_dir, workdir=workdir)
    procs: list[Proc] = []
    try:
        step("starting the control plane")
        cp.start(scheduler_config={})
        api = cp.api_client()
        from kubernetes import client

        core = client.CoreV1Api(api)
        step(f"creating {args.nodes} nodes")
        create_nodes(api, shared_gpu_nodes(args.nodes))
        step("starting the extender")
        extender, port = start_extender(cp.kubeconfig, workdir)
        procs.append(extender)
        config = extender_config(port)
        plain = {k: v for k, v in config.items() if k != "extenders"}
        plain["profiles"] = [{**config["profiles"][0], "schedulerName": "gpupart-plain"}]
        unbatched = {**plain, "profiles": [{**plain["profiles"][0], "schedulerName": "unbatched"}]}
        profiles: list[tuple[str, dict[str, Any], tuple[str, ...]]] = [
            ("gpupart-scheduler", config, ()),
            ("gpupart-plain", plain, ()),
            # kube-scheduler turns opportunistic batching (pods alike reuse the last cycle's
            # node ranking, KEP-5598) off in any profile with an extender: this one shows
            # what that alone costs.
            ("unbatched", unbatched, ("--feature-gates=OpportunisticBatching=false",)),
        ]
        null_binary = goclients.build("nullextender")
        if null_binary is not None:
            null = spawn("nullextender", [str(null_binary)], workdir)
            procs.append(null)
            address = wait_for(lambda: _address(null.log), 30, "the null extender's address")
            stub = {k: v for k, v in config["extenders"][0].items() if k != "bindVerb"}
            stub["urlPrefix"] = f"http://{address}"
            nothing = {**config, "extenders": [stub]}
            nothing["profiles"] = [{**config["profiles"][0], "schedulerName": NULL_EXTENDER}]
            profiles.append((NULL_EXTENDER, nothing, ()))
        for name, cfg, extra in profiles:
            proc, _ = start_scheduler(
                bin_dir, cp.kubeconfig, cfg, name, workdir, verbosity=1, extra=extra
            )
            procs.append(proc)
        ns = "bench"
        core.create_namespace({"metadata": {"name": ns}})
        pids = {p.name: p.popen.pid for p in cp.procs}
        pids.update({p.name: p.popen.pid for p in procs})
        before = cpu_seconds(pids)
        time.sleep(3)  # the schedulers' informers sync
        idle = cpu_seconds(pids)
        # Background load (kwok heartbeats of every node, informers) goes on during both batches.
        step(
            f"idle CPU seconds per second: { {k: round((idle[k] - before[k]) / 3, 2) for k in pids} }"
        )

        def batch(prefix: str, scheduler: str) -> float:
            before = cpu_seconds(pids)
            rate = run_batch(core, ns, prefix, scheduler, args.pods)
            after = cpu_seconds(pids)
            used = {k: round(after[k] - before[k], 1) for k in pids}
            step(f"{prefix}: {rate:.1f} pods/s, CPU seconds by process: {used}")
            return rate

        step("scheduling with the same configuration without the extender")
        without = batch("plain", "gpupart-plain")
        step("scheduling with the extender")
        with_ext = batch("gpupart", "gpupart-scheduler")
        step("scheduling with the same configuration, no extender, no opportunistic batching")
        unbatched = batch("unbatched", "unbatched")
        step("scheduling with the default scheduler")
        default = batch("default", "default-scheduler")
        floor: dict[str, float] = {}
        if null_binary is not None:
            step("scheduling through the null extender (an extender that costs nothing)")
            rate = batch("null", NULL_EXTENDER)
            floor = {"pods_per_s_null_extender": round(rate, 1)}
            floor["ratio_null_extender"] = round(rate / without, 3)
        step("extender verb latency: " + _verb_latency(f"http://{LOOPBACK}:{port}/metrics"))
        print(
            f"{args.nodes} nodes, {args.pods} pods: without {without:.1f} pods/s, "
            f"with {with_ext:.1f} pods/s, without batching {unbatched:.1f} pods/s, "
            f"default scheduler {default:.1f} pods/s"
        )
        print(
            json.dumps(
                {
                    "pods_per_s_with": round(with_ext, 1),
                    "pods_per_s_without": round(without, 1),
                    "ratio": round(with_ext / without, 3),
                    "pods_per_s_without_batching": round(unbatched, 1),
                    "pods_per_s_default_scheduler": round(default, 1),
                    "ratio_to_default_scheduler": round(with_ext / default, 3),
                    **floor,
                }
            )
        )
        return 0
    finally:
        for proc in reversed(procs):
            proc.stop()
        cp.stop()


def _address(log: Path) -> str | None:
    """The address the null extender prints first (after spawn's header), once it is there."""
    lines = log.read_text().splitlines(keepends=True) if log.exists() else []
    done = [line.strip() for line in lines if line.endswith("\n")]
    return next((line for line in done if line and not line.startswith("===")), None)


def _verb_latency(url: str) -> str:
    """Server-side count and mean seconds per verb, from the extender's own histogram."""
    text = http_get(url)[1]
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for line in text.splitlines():
        for suffix, into in (("_sum", sums), ("_count", counts)):
            head = f'gpupart_extender_request_duration_seconds{suffix}{{verb="'
            if line.startswith(head):
                verb = line[len(head) :].split('"', 1)[0]
                into[verb] = float(line.rsplit(" ", 1)[1])
    return ", ".join(
        f"{v} n={int(counts[v])} mean={1000 * sums[v] / counts[v]:.2f}ms"
        for v in counts
        if counts[v]
    )


if __name__ == "__main__":
    sys.exit(main())
