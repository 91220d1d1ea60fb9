"""The gpupart stack as processes for full-stack e2e tests and benchmarks, on real-kubelet nodes.

`gpupart operator`, `gpupart node` (simulated GPUs) and `gpupart extender` run as separate
processes from this venv's entrypoint; a second kube-scheduler runs the chart's rendered
KubeSchedulerConfiguration. Each GPU node is a real kubelet with the fake CRI runtime
(tests/support/kubelet.py), served by its node agent through the kubelet's own device-plugin
directory and PodResources socket.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from gpupart.signing import private_keys
from gpupart_testsupport.chart import IMAGE_FLAGS
from gpupart_testsupport.cluster import REPO, ControlPlane, http_ok, start_scheduler
from gpupart_testsupport.kubelet import KubeletNode
from gpupart_testsupport.objects import write_key_file
from gpupart_testsupport.polling import wait_for
from gpupart_testsupport.ports import LOOPBACK, free_port
from gpupart_testsupport.processes import Proc, spawn

GPUPART = Path(sys.executable).parent / "gpupart"
CHART = REPO / "charts" / "gpupart"

FAKE_MPS_CONTROL = """#!{python}
# Stands in for nvidia-cuda-mps-control: -d starts (writes the pid file), stdin carries one command.
import os, pathlib, sys
pipe = pathlib.Path(os.environ["CUDA_MPS_PIPE_DIRECTORY"])
pid = pipe / "nvidia-cuda-mps-control.pid"
if "-d" in sys.argv:
    pid.write_text(str(os.getpid()))
    sys.exit(0)
command = sys.stdin.read().strip()
if not pid.exists():
    print("Cannot find MPS control daemon process", file=sys.stderr)
    sys.exit(1)
if command == "quit":
    pid.unlink()
elif command.startswith("get_default_active_thread_percentage"):
    print("100.0")
"""


# --- the stack -------------------------------------------------------------------------------


@dataclass
class Stack:
    """Operator, node agents (+ fake kubelets), extender and gpupart-scheduler for some kwok nodes."""

    cp: ControlPlane
    api_client: Any
    work: Path
    processes: list[Proc] = field(default_factory=list)
    real_nodes: dict[str, KubeletNode] = field(default_factory=dict)
    _agents: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Each node agent's arguments, to start it again (`restart_agent`)."""

    @property
    def key_file(self) -> Path:
        """The Ed25519 private key the extender signs with (the chart's Secret), made once."""
        path = self.work / "assignment-keys"
        if not path.exists():
            write_key_file(path, secrets.token_bytes(32))
        return path

    @property
    def public_key_file(self) -> Path:
        """Its public key, what the agents verify with (the chart's agents read it from the
        extender's ConfigMap; `gpupart assignment-keys public` prints it)."""
        path = self.work / "assignment-public-keys"
        if not path.exists():
            path.write_text(private_keys(self.key_file.read_bytes(), where="stack").pem())
        return path

    def tails(self) -> str:
        real = [r.tails() for r in self.real_nodes.values()]
        return "\n".join([f"----- {p.name} -----\n{p.tail()}" for p in self.processes] + real)

    def start_operator(self) -> int:
        """`gpupart operator`, once /healthz answers; returns the port of its /metrics."""
        port, metrics = free_port(), free_port()
        proc = spawn(
            "operator",
            [
                str(GPUPART), "operator", "--standalone", f"--kubeconfig={self.cp.kubeconfig}",
                "--resync-seconds=5", f"--liveness={port}", f"--metrics-port={metrics}",
                "--verbose",
            ],
            self.work,
        )  # fmt: skip
        self.processes.append(proc)
        self._healthy(proc, f"http://{LOOPBACK}:{port}/healthz")
        return metrics

    def restart_operator(self) -> int:
        """The operator killed (SIGKILL: no cleanup) and started again; its new metrics port."""
        for proc in [p for p in self.processes if p.name == "operator"]:
            proc.popen.kill()
            proc.stop()
            self.processes.remove(proc)
        return self.start_operator()

    def restart_agent(self, node: str) -> None:
        """The node agent of `node` killed (SIGKILL, mid-plan if one runs) and started again."""
        (proc,) = [p for p in self.processes if p.name == f"node-{node}"]
        proc.popen.kill()
        proc.stop()
        self.processes.remove(proc)
        self._start_agent(**self._agents[node])

    def start_real_node(
        self,
        node: str,
        gpus: str,
        labels: dict[str, str],
        *,
        auto_reset: bool = False,
        create_s: float = 0.0,
        destroy_s: float = 0.0,
        node_status_s: int = 2,
    ) -> KubeletNode:
        """A Node served by a real kubelet (tests/support/kubelet.py) and its node agent.

        The agent keeps the default 60 s resync: what it does sooner comes from its watches.
        Its metrics are served on `real.agent_metrics_port`. `node_status_s`: the kubelet's
        nodeStatusUpdateFrequency.
        """
        real = KubeletNode(
            node, self.cp.bin_dir, self.cp.kubeconfig, labels, node_status_s=node_status_s
        )
        self.real_nodes[node] = real
        real.start()
        self._start_agent(
            node, gpus, real.plugin_dir, real.kubelet_socket, real.pod_resources_socket,
            auto_reset=auto_reset, resync_s=60, metrics_port=real.agent_metrics_port,
            create_s=create_s, destroy_s=destroy_s,
        )  # fmt: skip
        return real

    def faults_file(self, node: str) -> Path:
        """The file of NVML faults the simulated GPUs of a DRA node's agent read whenever it
        changes (`--simulate-faults`); `inject_faults` writes it."""
        return self.work / f"simfaults-{node}.json"

    def inject_faults(self, node: str, *faults: dict[str, Any]) -> None:
        """The node's simulated GPUs fail the calls `faults` name from their next call on (none:
        they fail nothing); written whole and renamed, so the agent reads all or nothing."""
        path = self.faults_file(node)
        partial = path.with_suffix(".partial")
        partial.write_text(json.dumps(list(faults)))
        os.replace(partial, path)

    def start_dra_agent(
        self,
        real: KubeletNode,
        gpus: str,
        *,
        create_s: float = 0.0,
        recovery_s: float = 60,
        destroy_s: float = 0.0,
        taint_effect: str = "",
    ) -> None:
        """The node agent of a running real-kubelet node (one the caller owns and stops) with
        its DRA kubelet plugin on: it registers in the node's `plugins_registry`, serves in its
        `plugins` and writes each claim's CDI spec to its `cdi_dir`. Its simulated GPUs read
        faults and Xids from `faults_file(node)`; a GPU is Healthy again `recovery_s` after its
        last Xid. `taint_effect`: `--dra-taint-effect` (empty: the agent's default)."""
        self._start_agent(
            real.name, gpus, real.plugin_dir, real.kubelet_socket, real.pod_resources_socket,
            auto_reset=True, resync_s=60, metrics_port=real.agent_metrics_port, create_s=create_s,
            destroy_s=destroy_s,
            extra=(
                "--dra", f"--plugins-registry-dir={real.plugins_registry}",
                f"--dra-plugins-dir={real.plugins}", f"--cdi-root={real.cdi_dir}",
                f"--simulate-faults={self.faults_file(real.name)}",
                f"--recovery-seconds={recovery_s:g}",
                *([f"--dra-taint-effect={taint_effect}"] if taint_effect else []),
            ),
        )  # fmt: skip

    def stop_real_node(self, node: str) -> None:
        """Its node agent and kubelet stopped (a Node deleted under a running kubelet comes back)."""
        for proc in [p for p in self.processes if p.name == f"node-{node}"]:
            proc.stop()
            self.processes.remove(proc)
        real = self.real_nodes.pop(node, None)
        if real is not None:
            real.stop()

    def _start_agent(
        self,
        node: str,
        gpus: str,
        plugin_dir: Path,
        kubelet_socket: Path,
        pod_resources_socket: Path,
        *,
        auto_reset: bool,
        resync_s: int = 3,
        metrics_port: int = 0,
        create_s: float = 0.0,
        destroy_s: float = 0.0,
        extra: tuple[str, ...] = (),
    ) -> None:
        self._agents[node] = {
            "node": node, "gpus": gpus, "plugin_dir": plugin_dir, "kubelet_socket": kubelet_socket,
            "pod_resources_socket": pod_resources_socket, "auto_reset": auto_reset,
            "resync_s": resync_s, "metrics_port": metrics_port, "create_s": create_s,
            "destroy_s": destroy_s, "extra": extra,
        }  # fmt: skip
        mps = self.work / f"mps-control-{node}"
        mps.write_text(FAKE_MPS_CONTROL.format(python=sys.executable))
        mps.chmod(0o755)
        proc = spawn(
            f"node-{node}",
            [
                str(GPUPART), "node", f"--node-name={node}", f"--simulate={gpus}",
                f"--plugin-dir={plugin_dir}", f"--kubelet-socket={kubelet_socket}",
                f"--pod-resources-socket={pod_resources_socket}",
                f"--mps-root={self.work / f'mps-{node}'}", f"--mps-control={mps}",
                f"--state-dir={self.work / f'state-{node}'}", f"--assignment-key-file={self.public_key_file}",
                f"--resync-seconds={resync_s}", f"--metrics-port={metrics_port}",
                "--metrics-address=127.0.0.1",
                *(["--simulate-auto-reset"] if auto_reset else []),
                # The simulated GPUs outlive a restart of their agent, as real ones do.
                f"--simulate-state={self.work / f'simgpu-{node}.json'}",
                *([f"--simulate-create-seconds={create_s}"] if create_s else []),
                *([f"--simulate-destroy-seconds={destroy_s}"] if destroy_s else []),
                *extra,
            ],
            self.work,
            env={"KUBECONFIG": str(self.cp.agent_kubeconfig)},
        )  # fmt: skip
        self.processes.append(proc)

    def start_extender(self) -> str:
        """`gpupart extender` with the chart's settings file; its URL prefix once /readyz says 200."""
        port = free_port()
        # The settings file the chart renders (host and port: the flags below win).
        rendered = self.cp.helm(
            "template",
            "gpupart",
            str(CHART),
            *IMAGE_FLAGS,
            "--show-only",
            "templates/extender.yaml",
        ).stdout
        (config_map,) = [d for d in yaml.safe_load_all(rendered) if d and d["kind"] == "ConfigMap"]
        values = yaml.safe_load(config_map["data"]["settings.yaml"])
        values["fragmentation_refresh_seconds"] = 1
        # The chart mounts its Secret there; here the stack's own key file. No health port:
        # the verbs' loopback listener serves /readyz too, and runs must not share a port.
        values["assignment_key_file"] = str(self.key_file)
        # The agents here read the public key from a file: nothing to publish.
        values.pop("assignment_public_keys", None)
        values["health_port"] = 0
        settings = self.work / "extender.yaml"
        settings.write_text(yaml.safe_dump(values))
        proc = spawn(
            "extender",
            [
                str(GPUPART), "extender", f"--config={settings}", f"--kubeconfig={self.cp.kubeconfig}",
                f"--host={LOOPBACK}", f"--port={port}",
            ],
            self.work,
        )  # fmt: skip
        self.processes.append(proc)
        self._healthy(proc, f"http://{LOOPBACK}:{port}/readyz")
        return f"http://{LOOPBACK}:{port}/gpupart"

    def start_scheduler(self, extender_url: str) -> None:
        """kube-scheduler with the KubeSchedulerConfiguration the chart renders."""
        rendered = self.cp.helm(
            "template",
            "gpupart",
            str(CHART),
            *IMAGE_FLAGS,
            "--show-only",
            "templates/scheduler.yaml",
        ).stdout
        (config_map,) = [d for d in yaml.safe_load_all(rendered) if d and d["kind"] == "ConfigMap"]
        config = yaml.safe_load(config_map["data"]["config.yaml"])
        config["extenders"][0]["urlPrefix"] = extender_url
        proc, port = start_scheduler(
            self.cp.bin_dir,
            self.cp.kubeconfig,
            config,
            "gpupart-scheduler",
            self.work,
            qps=200,
            burst=400,
        )
        self.processes.append(proc)
        self._healthy(proc, f"https://{LOOPBACK}:{port}/healthz")

    def _healthy(self, proc: Proc, url: str) -> None:
        def check() -> bool:
            if not proc.alive():
                raise RuntimeError(f"{proc.name} exited {proc.popen.returncode}\n{proc.tail()}")
            return http_ok(url)

        try:
            wait_for(check, 60, f"{proc.name} at {url}")
        except TimeoutError as error:
            raise TimeoutError(f"{error}\n{proc.tail()}") from None

    def stop(self) -> None:
        for proc in reversed(self.processes):
            proc.stop()
        for real in self.real_nodes.values():
            real.stop()
