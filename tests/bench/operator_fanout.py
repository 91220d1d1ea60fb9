"""Benchmark: how fast `gpupart operator` writes desired state to 1,000 nodes, and what it writes when idle.

Starts the e2e control plane (etcd, kube-apiserver, kwok; no scheduler), applies the chart's
CRDs with kubectl, creates N kwok nodes with A100 GPU labels, starts the real
`gpupart operator` process (standalone) and waits for its first pass. Then:
- seconds: from the GpuPartition's create call until the operator has patched
  gpupart.io/desired onto every one of the N nodes (goal: under 10 s for 1,000);
- steady_writes: API writes per reconcile pass once settled, over several drift-timer
  resyncs (goal: 0), counted by the operator and cross-checked at the API server's /metrics.
Needs the binaries from scripts/build-k8s-bins.sh (GPUPART_K8S_BIN or the build cache).
The last line is JSON: {"nodes", "seconds", "steady_writes", ...}.

Run: .venv/bin/python tests/bench/operator_fanout.py [--nodes 1000] [--resyncs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from gpupart.core.api.wire import DESIRED_ANNOTATION
from gpupart_testsupport.cluster import (
    LOOPBACK,
    ControlPlane,
    Proc,
    bin_dir_from_env,
    create_nodes,
    free_port,
    gpu_node,
    http_get,
    mig_labels,
    parallel,
    spawn,
    wait_for,
)

REPO = Path(__file__).resolve().parents[2]

CRD_DIR = REPO / "charts" / "gpupart" / "crds"
RESYNC_SECONDS = 2.0


def scrape(url: str, token: str | None = None, ca: Path | None = None) -> str:
    status, text = http_get(url, token=token, ca_file=ca)
    if status != 200:
        raise RuntimeError(f"GET {url}: HTTP {status}: {text[:200]}")
    return text


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        match = re.match(rf"^{re.escape(name)}(?:\{{([^}}]*)\}})? (\S+)$", line)
        if not match:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(match.group(2))
    return total


def apiserver_writes(cp: ControlPlane) -> float:
    """Writes the operator could make: node metadata, GpuPartitions (+status), Events."""
    text = scrape(f"{cp.api_url}/metrics", cp.token, cp.ca_file)
    total = 0.0
    for verb in ("PATCH", "PUT", "POST"):
        total += metric(text, "apiserver_request_total", verb=verb, resource="gpupartitions")
        total += metric(text, "apiserver_request_total", verb=verb, resource="events")
        total += metric(
            text, "apiserver_request_total", verb=verb, resource="nodes", subresource=""
        )
    return total


def bare_patches(cp: ControlPlane, names: list[str]) -> float:
    """Seconds for one merge-patch per node (an unrelated annotation), 32 at a time."""
    import urllib3

    http = urllib3.PoolManager(maxsize=32, ca_certs=str(cp.ca_file))
    headers = {
        "Content-Type": "application/merge-patch+json",
        "Authorization": f"Bearer {cp.token}",
    }
    body = json.dumps({"metadata": {"annotations": {"bench.gpupart.io/baseline": "1"}}})

    def patch(name: str) -> None:
        response = http.request(
            "PATCH", f"{cp.api_url}/api/v1/nodes/{name}", body=body, headers=headers
        )
        if response.status != 200:
            raise SystemExit(f"baseline patch of {name}: HTTP {response.status}")

    started = time.monotonic()
    parallel(patch, names, workers=32)
    return time.monotonic() - started


def run(nodes: int, resyncs: int) -> dict[str, Any]:
    bin_dir = bin_dir_from_env()
    missing = [
        name
        for name in ("etcd", "kube-apiserver", "kwok", "kubectl")
        if not os.access(bin_dir / name, os.X_OK)
    ]
    if missing:
        raise SystemExit(
            f"operator_fanout: missing {', '.join(missing)} in {bin_dir}; build them with "
            "scripts/build-k8s-bins.sh, then set "
            'GPUPART_K8S_BIN="$(scripts/build-k8s-bins.sh --print-dir)"'
        )
    workdir = Path(tempfile.mkdtemp(prefix="gpupart-bench-operator-"))
    cp = ControlPlane(bin_dir=bin_dir, workdir=workdir)
    operator: Proc | None = None
    try:
        cp.start(scheduler=False)
        cp.kubectl("apply", "-f", str(CRD_DIR))
        cp.kubectl(
            "wait", "--for=condition=Established", "--timeout=60s", "crd/gpupartitions.gpupart.io"
        )
        api = cp.api_client()
        names = [f"bench-{i:04d}" for i in range(nodes)]
        labels = {**mig_labels("NVIDIA-A100-SXM4-80GB", gpus=8), "bench": "fanout"}
        create_nodes(api, [gpu_node(n, labels=labels) for n in names])
        from kubernetes import client

        core = client.CoreV1Api(api)

        def listed() -> list[dict[str, Any]]:
            body = json.loads(
                core.list_node(label_selector="bench=fanout", _preload_content=False).data
            )
            return list(body["items"])

        def all_running() -> bool:
            return sum(n["status"].get("phase") == "Running" for n in listed()) == nodes

        # Let kwok finish its own node writes first, so they do not share the measurement.
        wait_for(all_running, 120, f"{nodes} kwok nodes Running", interval=1)

        metrics_port = free_port()
        operator = spawn(
            "operator",
            [
                sys.executable,
                "-m",
                "gpupart.cli",
                "operator",
                "--standalone",
                f"--kubeconfig={cp.kubeconfig}",
                f"--metrics-port={metrics_port}",
                f"--resync-seconds={RESYNC_SECONDS}",
            ],
            workdir,
        )
        metrics_url = f"http://{LOOPBACK}:{metrics_port}/metrics"

        def op_metric(name: str, **want: str) -> float:
            if operator is not None and not operator.alive():
                raise SystemExit(
                    f"operator exited {operator.popen.returncode}:\n{operator.tail(60)}"
                )
            return metric(scrape(metrics_url), name, **want)

        wait_for(lambda: op_metric("gpupart_operator_reconciles_total") >= 1, 60, "first pass")

        partition = {
            "apiVersion": "gpupart.io/v1alpha1",
            "kind": "GpuPartition",
            "metadata": {"name": "fanout"},
            "spec": {
                "nodeSelector": {"matchLabels": {"bench": "fanout"}},
                "mode": "MIG",
                "mig": {"devices": {"3g.40gb": 1, "2g.20gb": 1, "1g.10gb": 2}},
            },
        }
        custom = client.CustomObjectsApi(api)
        started = time.monotonic()
        custom.create_cluster_custom_object("gpupart.io", "v1alpha1", "gpupartitions", partition)
        wait_for(
            lambda: op_metric("gpupart_operator_api_writes_total", kind="node") >= nodes,
            60,
            f"desired state on {nodes} nodes",
            interval=0.05,
        )
        seconds = time.monotonic() - started
        annotated = sum(
            DESIRED_ANNOTATION in (n["metadata"].get("annotations") or {}) for n in listed()
        )
        if annotated != nodes:
            raise SystemExit(f"operator_fanout: only {annotated} of {nodes} nodes annotated")

        # Settled: a full resync interval (and then some) with no write at all.
        def settled() -> bool:
            before = op_metric("gpupart_operator_api_writes_total")
            time.sleep(RESYNC_SECONDS * 1.5)
            return op_metric("gpupart_operator_api_writes_total") == before

        wait_for(settled, 60, "the operator to settle", interval=0)
        writes0 = op_metric("gpupart_operator_api_writes_total")
        passes0 = op_metric("gpupart_operator_reconciles_total")
        server0 = apiserver_writes(cp)
        time.sleep(RESYNC_SECONDS * resyncs + 1)
        passes = op_metric("gpupart_operator_reconciles_total") - passes0
        writes = op_metric("gpupart_operator_api_writes_total") - writes0
        server = apiserver_writes(cp) - server0
        pass_seconds = op_metric("gpupart_operator_reconcile_duration_seconds_sum") / max(
            op_metric("gpupart_operator_reconcile_duration_seconds_count"), 1
        )
        # The floor on this machine: the same number of bare merge-patches from a plain client.
        baseline = bare_patches(cp, names)
        return {
            "nodes": nodes,
            "seconds": round(seconds, 2),
            "steady_writes": round(writes / passes, 3) if passes else None,
            "steady_passes": int(passes),
            "steady_apiserver_writes": int(server),
            "mean_pass_seconds": round(pass_seconds, 3),
            "bare_patch_seconds": round(baseline, 2),
            "cpus": os.cpu_count(),
            "load_average": round(os.getloadavg()[0], 1),
        }
    finally:
        if operator is not None:
            operator.stop(15)
        cp.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--resyncs", type=int, default=3, help="drift-timer periods to watch")
    args = parser.parse_args()
    figures = run(args.nodes, args.resyncs)
    print(yaml.safe_dump(figures, sort_keys=False).strip())
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
