"""Real kubelet nodes for the e2e tests: kubelet v1.37 and the fake CRI runtime, each in a private mount namespace.

A kubelet writes outside its root directory: the device-plugin directory is fixed at
`/var/lib/kubelet/device-plugins`, it creates `/var/log/pods` and `/var/log/containers`, and it
sets kernel sysctls (`kernel.panic`, `vm.overcommit_memory`, ...). So each kubelet runs in its
own mount namespace (`unshare -m --propagation private`) where `/var/lib`, `/var/log` and every
sysctl file it writes are bind mounts of this node's directory: the host is never changed.
Sockets made inside (the kubelet's registration socket, PodResources) stay reachable from
outside by their path in that directory, which is what the node agent is given.

The container runtime is `fakeruntime` (tests/k8s/kubernetes/fakeruntime): upstream's fake CRI
server that records every CreateContainer (env, device nodes, mounts, CDI devices) as a JSON
line in `created.jsonl`; a container whose env sets FAKE_RUNTIME_EXIT_CODE exits at once.

DRA plugins register where a kubelet expects them, under its root directory (which is in the
node's `/var/lib`): `plugins_registry/` and `plugins/<driver>/`. Their CDI spec files go to the
node's `cdi/` directory (`KubeletNode.cdi_dir`), which the runtime resolves each container's CDI
devices against (docs/adr-027-dra-test-bed.md): the same path inside the namespace and out, so
a plugin started outside it (the node agent) writes where the runtime reads. The host's own
`/etc/cdi` and `/var/run/cdi` are never read or written.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from gpupart_testsupport.polling import wait_for
from gpupart_testsupport.ports import LOOPBACK, free_port
from gpupart_testsupport.processes import Proc, spawn

SYSCTLS = (
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "kernel/panic",
    "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes",
)
"""What the kubelet's container manager sets (setupKernelTunables with protectKernelDefaults off)."""
EXIT_ENV = "FAKE_RUNTIME_EXIT_CODE"
DEVICE_PLUGIN_CDI_KIND = "nvidia.com/gpu"
"""The CDI kind of the device plugin's Allocate (`nvidia.com/gpu=<uuid>`). On a GPU node its specs
come from the NVIDIA container toolkit, which the test bed does not run: the runtime records
these IDs as unresolved instead of failing the container (every other kind must resolve)."""
_REGISTERED = re.compile(
    r'Got registration request from device plugin with resource".*?resourceName="([^"]+)"'
)


@dataclass
class KubeletNode:
    """One Node served by a real kubelet; `start()` registers it with the API server."""

    name: str
    bin_dir: Path
    kubeconfig: Path
    labels: dict[str, str] = field(default_factory=dict)
    directory: Path = field(
        default_factory=lambda: Path(tempfile.mkdtemp(prefix="gk-", dir="/tmp"))
    )
    """Short (unix socket paths are limited to ~107 bytes), under /tmp."""
    runtime: Proc | None = None
    kubelet: Proc | None = None
    port: int = field(default_factory=free_port)
    healthz_port: int = field(default_factory=free_port)
    agent_metrics_port: int = field(default_factory=free_port)
    """Where the node agent that serves this node's GPUs says its metrics."""
    vmodule: str = ""
    """klog's per-file verbosity (`--vmodule`): `dra_plugin=4` logs each DRA plugin call with
    its claims, as the DRA Prepare benchmark reads them."""
    node_status_s: int = 2
    """The kubelet's nodeStatusUpdateFrequency (and report frequency): its periodic node-status
    sync, where it writes device-plugin capacity (10 s by default on real clusters)."""

    # -- paths as seen from outside the namespace --

    @property
    def var_lib(self) -> Path:
        return self.directory / "var-lib"

    @property
    def plugin_dir(self) -> Path:
        return self.var_lib / "kubelet" / "device-plugins"

    @property
    def kubelet_socket(self) -> Path:
        return self.plugin_dir / "kubelet.sock"

    @property
    def pod_resources_socket(self) -> Path:
        return self.var_lib / "kubelet" / "pod-resources" / "kubelet.sock"

    @property
    def plugins_registry(self) -> Path:
        """Where a DRA plugin (or any kubelet plugin) puts its registration socket."""
        return self.var_lib / "kubelet" / "plugins_registry"

    @property
    def plugins(self) -> Path:
        """The kubelet plugins' own directory: a DRA driver serves `<driver>/dra.sock` there."""
        return self.var_lib / "kubelet" / "plugins"

    @property
    def cdi_dir(self) -> Path:
        """The node's CDI spec directory: DRA plugins write here, the runtime resolves from here."""
        return self.directory / "cdi"

    @property
    def runtime_socket(self) -> Path:
        return self.directory / "cri.sock"

    @property
    def logs(self) -> Path:
        return self.directory / "logs"

    # -- lifecycle --

    def start(self) -> None:
        for d in (
            self.var_lib,
            self.directory / "var-log",
            self.directory / "sysctl",
            self.logs,
            self.cdi_dir,
        ):
            d.mkdir(parents=True, exist_ok=True)
        for name in SYSCTLS:
            # Start from the host's values: the kubelet reads them before it writes.
            target = self.directory / "sysctl" / name.replace("/", ".")
            target.write_text(Path("/proc/sys", name).read_text())
        (self.directory / "kubelet.yaml").write_text(yaml.safe_dump(self._config()))
        self.start_runtime()
        self.start_kubelet()

    def start_runtime(self) -> None:
        self.runtime = spawn(
            "fakeruntime",
            self.in_namespace(
                [
                    str(self.bin_dir / "fakeruntime"),
                    f"--listen={self.runtime_socket}",
                    f"--record={self.directory / 'created.jsonl'}",
                    f"--cdi-spec-dir={self.cdi_dir}",
                    f"--cdi-unresolved-kind={DEVICE_PLUGIN_CDI_KIND}",
                ]
            ),
            self.logs,
        )
        wait_for(self.runtime_socket.exists, 30, f"fake runtime socket of {self.name}")

    def start_kubelet(self) -> None:
        """Start (or restart) the kubelet; its pods and checkpoints stay in the node's directory."""
        labels = ",".join(f"{k}={v}" for k, v in sorted(self.labels.items()))
        # Its working directory is empty: a kubelet's log clean-up globs relative paths there.
        work = self.directory / "cwd"
        work.mkdir(exist_ok=True)
        self.kubelet = spawn(
            "kubelet",
            self.in_namespace(
                [
                    str(self.bin_dir / "kubelet"),
                    f"--config={self.directory / 'kubelet.yaml'}",
                    f"--kubeconfig={self.kubeconfig}",
                    f"--container-runtime-endpoint=unix://{self.runtime_socket}",
                    f"--hostname-override={self.name}",
                    f"--node-labels={labels}",
                    "--v=2",
                    *([f"--vmodule={self.vmodule}"] if self.vmodule else []),
                ]
            ),
            self.logs,
            cwd=work,
        )

    def stop_kubelet(self) -> None:
        if self.kubelet is not None:
            self.kubelet.stop()

    def stop(self) -> None:
        self.stop_kubelet()
        if self.runtime is not None:
            self.runtime.stop()
        shutil.rmtree(self.directory, ignore_errors=True)

    def tails(self) -> str:
        return "\n".join(
            f"--- {p.name} of {self.name}\n{p.tail(30)}"
            for p in (self.runtime, self.kubelet)
            if p is not None
        )

    def kubelet_log(self) -> str:
        """The log of the kubelet's current run ("" before it started)."""
        if self.kubelet is None:
            return ""
        return self.kubelet.log.read_text(errors="replace").rsplit("\n=== ", 1)[-1]

    def registered(self) -> set[str]:
        """Resources whose device plugin registered with the kubelet's current run (its log)."""
        return set(_REGISTERED.findall(self.kubelet_log()))

    # -- what the kubelet handed to the runtime --

    def created(self) -> list[dict[str, Any]]:
        """Every CreateContainer the kubelet made on this node, oldest first."""
        path = self.directory / "created.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def environments(self, namespace: str, pod: str) -> dict[str, dict[str, str]]:
        """Each created container of the pod and the environment it was created with."""
        return {
            c["container"]: c["env"]
            for c in self.created()
            if (c["namespace"], c["pod"]) == (namespace, pod)
        }

    def container(self, namespace: str, pod: str, container: str) -> dict[str, Any] | None:
        """The latest CreateContainer of that container, None before the kubelet created it."""
        found = [
            c
            for c in self.created()
            if (c["namespace"], c["pod"], c["container"]) == (namespace, pod, container)
        ]
        return found[-1] if found else None

    # -- internals --

    def in_namespace(self, command: list[str]) -> list[str]:
        """`command` in a private mount namespace where the node's directory stands in for the host."""
        mounts = [
            f"mount --bind {shlex.quote(str(self.var_lib))} /var/lib",
            f"mount --bind {shlex.quote(str(self.directory / 'var-log'))} /var/log",
        ]
        for name in SYSCTLS:
            source = self.directory / "sysctl" / name.replace("/", ".")
            mounts.append(f"mount --bind {shlex.quote(str(source))} /proc/sys/{name}")
        script = " && ".join([*mounts, f"exec {shlex.join(command)}"])
        return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script]

    def _config(self) -> dict[str, Any]:
        return {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "address": LOOPBACK,
            "port": self.port,
            "readOnlyPort": 0,
            "healthzBindAddress": LOOPBACK,
            "healthzPort": self.healthz_port,
            "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
            "authorization": {"mode": "AlwaysAllow"},
            # This machine: cgroup v1, no systemd in charge, swap possibly on.
            "cgroupDriver": "cgroupfs",
            "failCgroupV1": False,
            "cgroupsPerQOS": False,
            "enforceNodeAllocatable": [],
            "failSwapOn": False,
            "protectKernelDefaults": False,
            "podLogsDir": "/var/log/pods",
            "volumePluginDir": "/var/lib/kubelet/volumeplugins",
            "evictionHard": {
                "memory.available": "1Mi",
                "nodefs.available": "1%",
                "nodefs.inodesFree": "1%",
                "imagefs.available": "1%",
            },
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "nodeStatusUpdateFrequency": f"{self.node_status_s}s",
            "nodeStatusReportFrequency": f"{self.node_status_s}s",
            "syncFrequency": "5s",
            "fileCheckFrequency": "5s",
            "serializeImagePulls": False,
            "registerNode": True,
            "maxPods": 110,
        }
