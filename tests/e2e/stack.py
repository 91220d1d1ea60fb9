"""The gpupart stack as processes for full-stack e2e tests, and a fake kubelet that turns plugins into node capacity.

`gpupart operator`, `gpupart node` (simulated GPUs) and `gpupart extender` run as separate
processes from this venv's entrypoint; a second kube-scheduler runs the chart's rendered
KubeSchedulerConfiguration. kwok nodes have no kubelet, so `FakeKubelet` plays the parts of
it the device plugin talks to: the Registration service, ListAndWatch (whose healthy device
count it writes into the Node's status.capacity/allocatable, as the kubelet does), Allocate when
a pod is bound to the node, and the PodResources List the node agent asks who uses a device.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import yaml
from kubernetes import client, watch

from gpupart_plugin.api import deviceplugin_pb2 as api
from gpupart_plugin.api import deviceplugin_pb2_grpc as api_grpc
from gpupart_plugin.api import podresources_pb2 as pr
from gpupart_plugin.api import podresources_pb2_grpc as pr_grpc

from .cluster import (
    LOOPBACK,
    REPO,
    ControlPlane,
    Proc,
    free_port,
    http_ok,
    spawn,
    start_scheduler,
    wait_for,
)
from .kubelet import KubeletNode

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


# --- fake kubelet ----------------------------------------------------------------------------


@dataclass
class ContainerGot:
    resource: str
    device_ids: tuple[str, ...]
    envs: dict[str, str]


@dataclass
class PodAllocation:
    namespace: str
    name: str
    containers: dict[str, ContainerGot]
    """What each container that asked for a plugin resource got, by container name."""
    admitted_at: float = 0.0
    """time.monotonic() when its last Allocate returned."""


class FakeKubelet(api_grpc.RegistrationServicer, pr_grpc.PodResourcesListerServicer):
    """The kubelet's device-plugin side for one kwok node.

    Admission as the kubelet's device manager does it: pods one at a time, each batch of
    newly seen pods sorted by creation time (`HandlePodAdditions`), then for every container
    (init containers first) one GetPreferredAllocation and one Allocate per resource, an app
    container reusing what an init container got. A refused Allocate rejects the pod (kept
    in `rejected`) and fails it (phase Failed, UnexpectedAdmissionError), as the kubelet does.
    """

    def __init__(self, node: str, api_client: Any, directory: Path) -> None:
        self.node = node
        self.core = client.CoreV1Api(api_client)
        self.directory = directory
        self.devices: dict[str, list[tuple[str, str]]] = {}
        self.stubs: dict[str, api_grpc.DevicePluginStub] = {}
        self.allocations: dict[str, PodAllocation] = {}  # pod uid -> what Allocate gave it
        self.rejected: dict[str, str] = {}  # pod namespace/name -> the plugin's refusal
        self.errors: list[str] = []
        self._lock = threading.RLock()
        self._queue: list[Any] = []
        self._queued = threading.Condition(self._lock)
        self._channels: list[grpc.Channel] = []
        self._stop = threading.Event()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))

    @property
    def kubelet_socket(self) -> Path:
        return self.directory / "kubelet.sock"

    @property
    def pod_resources_socket(self) -> Path:
        return self.directory / "pod-resources.sock"

    def start(self) -> None:
        api_grpc.add_RegistrationServicer_to_server(self, self._server)
        pr_grpc.add_PodResourcesListerServicer_to_server(self, self._server)
        self._server.add_insecure_port(f"unix://{self.kubelet_socket}")
        self._server.add_insecure_port(f"unix://{self.pod_resources_socket}")
        self._server.start()
        threading.Thread(target=self._watch_pods, name=f"pods-{self.node}", daemon=True).start()
        threading.Thread(target=self._admit_loop, name=f"admit-{self.node}", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            self._queued.notify_all()
        self._server.stop(grace=None).wait(5)
        for channel in self._channels:
            channel.close()

    # Registration: dial the plugin, follow its ListAndWatch.
    def Register(self, request: api.RegisterRequest, _context: Any) -> api.Empty:  # noqa: N802
        threading.Thread(target=self._follow, args=(request,), daemon=True).start()
        return api.Empty()

    def _follow(self, request: api.RegisterRequest) -> None:
        channel = grpc.insecure_channel(f"unix://{self.directory / request.endpoint}")
        self._channels.append(channel)
        stub = api_grpc.DevicePluginStub(channel)
        resource = request.resource_name
        with self._lock:
            self.stubs[resource] = stub
        try:
            for response in stub.ListAndWatch(api.Empty()):
                devices = [(d.ID, d.health) for d in response.devices]
                with self._lock:
                    self.devices[resource] = devices
                self._publish(resource, sum(1 for _, h in devices if h == "Healthy"))
        except grpc.RpcError:
            pass  # plugin restarted or stopped; it registers again

    def _publish(self, resource: str, count: int) -> None:
        """What the kubelet's device manager does with a device list: node capacity."""
        body = {
            "status": {"capacity": {resource: str(count)}, "allocatable": {resource: str(count)}}
        }
        for _ in range(5):
            try:
                self.core.patch_node_status(self.node, body)
                return
            except client.ApiException as error:
                self.errors.append(f"patch capacity {resource}: {error.status}")
                time.sleep(0.2)

    # Pods bound here: admitted one at a time, as the kubelet does before it starts containers.
    def _watch_pods(self) -> None:
        while not self._stop.is_set():
            try:
                stream = watch.Watch().stream(
                    self.core.list_pod_for_all_namespaces,
                    field_selector=f"spec.nodeName={self.node}",
                    timeout_seconds=30,
                )
                for event in stream:
                    if self._stop.is_set():
                        return
                    pod = event["object"]
                    with self._lock:
                        if event["type"] == "DELETED":
                            self.allocations.pop(pod.metadata.uid, None)
                        elif pod.metadata.deletion_timestamp is None:
                            self._queue.append(pod)
                            self._queued.notify_all()
            except Exception as error:  # noqa: BLE001 - keep watching; the test reads errors
                self.errors.append(f"pod watch: {error!r}")
                self._stop.wait(0.5)

    def _admit_loop(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                while not self._queue and not self._stop.is_set():
                    self._queued.wait(1)
                # Like HandlePodAdditions: the pods seen since the last batch, oldest first.
                batch = sorted(self._queue, key=lambda p: p.metadata.creation_timestamp)
                self._queue = []
            for pod in batch:
                try:
                    self._admit(pod)
                except Exception as error:  # noqa: BLE001 - the test reads errors
                    self.errors.append(f"{pod.metadata.name}: admission: {error!r}")

    def _admit(self, pod: Any) -> None:
        uid = pod.metadata.uid
        key = f"{pod.metadata.namespace}/{pod.metadata.name}"
        with self._lock:
            if uid in self.allocations or key in self.rejected:
                return
        got: dict[str, ContainerGot] = {}
        reusable: dict[str, list[str]] = {}  # resource -> devices init containers held
        init = [(c, True) for c in pod.spec.init_containers or []]
        for container, is_init in [*init, *((c, False) for c in pod.spec.containers)]:
            limits = (container.resources.limits if container.resources else None) or {}
            for resource, quantity in sorted(limits.items()):
                with self._lock:
                    stub = self.stubs.get(resource)
                if stub is None:
                    continue
                count = int(quantity)
                reuse = [] if is_init else reusable.get(resource, [])[:count]
                if not is_init:
                    reusable[resource] = reusable.get(resource, [])[len(reuse) :]
                ids = self._devices(stub, resource, count, reuse, got, pod.metadata.name)
                if ids is None:
                    return
                try:
                    response = stub.Allocate(
                        api.AllocateRequest(
                            container_requests=[api.ContainerAllocateRequest(devices_ids=ids)]
                        ),
                        timeout=10,
                    )
                except grpc.RpcError as error:
                    self._reject(pod, f"Allocate failed: {error.details()}")
                    return
                got[container.name] = ContainerGot(
                    resource, tuple(ids), dict(response.container_responses[0].envs)
                )
                if is_init:
                    reusable.setdefault(resource, []).extend(ids)
        if got:
            with self._lock:
                self.allocations[uid] = PodAllocation(
                    pod.metadata.namespace, pod.metadata.name, got, time.monotonic()
                )

    def _reject(self, pod: Any, message: str) -> None:
        """As the kubelet does on a failed admission: the pod fails, and says why."""
        with self._lock:
            self.rejected[f"{pod.metadata.namespace}/{pod.metadata.name}"] = message
        body = {
            "status": {"phase": "Failed", "reason": "UnexpectedAdmissionError", "message": message}
        }
        try:
            self.core.patch_namespaced_pod_status(pod.metadata.name, pod.metadata.namespace, body)
        except client.ApiException as error:
            self.errors.append(f"{pod.metadata.name}: reject: {error.status}")

    def _devices(
        self,
        stub: Any,
        resource: str,
        count: int,
        reuse: list[str],
        got: dict[str, ContainerGot],
        pod_name: str,
    ) -> list[str] | None:
        """`count` device ids for one container: the reused ones, then the plugin's preference."""
        with self._lock:
            held = {
                d for a in self.allocations.values() for c in a.containers.values()
                for d in c.device_ids if c.resource == resource
            }  # fmt: skip
            mine = {d for c in got.values() if c.resource == resource for d in c.device_ids}
            free = [
                d
                for d, h in self.devices.get(resource, [])
                if h == "Healthy" and d not in held and d not in mine
            ]
        if len(free) < count - len(reuse):
            self.errors.append(f"{pod_name}: {count} {resource} asked, {len(free)} free")
            return None
        if len(reuse) == count:
            return reuse
        preferred = stub.GetPreferredAllocation(
            api.PreferredAllocationRequest(
                container_requests=[
                    api.ContainerPreferredAllocationRequest(
                        available_deviceIDs=[*reuse, *free],
                        must_include_deviceIDs=reuse,
                        allocation_size=count,
                    )
                ]
            ),
            timeout=10,
        )
        return list(preferred.container_responses[0].deviceIDs)

    def by_name(self, namespace: str, name: str) -> PodAllocation | None:
        with self._lock:
            found = [
                a for a in self.allocations.values() if (a.namespace, a.name) == (namespace, name)
            ]
        return found[0] if found else None

    # PodResources: who holds which device.
    def List(self, _request: Any, _context: Any) -> pr.ListPodResourcesResponse:  # noqa: N802
        with self._lock:
            allocations = list(self.allocations.values())
        return pr.ListPodResourcesResponse(
            pod_resources=[
                pr.PodResources(
                    name=a.name,
                    namespace=a.namespace,
                    containers=[
                        pr.ContainerResources(
                            name=name,
                            devices=[
                                pr.ContainerDevices(
                                    resource_name=c.resource, device_ids=list(c.device_ids)
                                )
                            ],
                        )
                        for name, c in a.containers.items()
                    ],
                )
                for a in allocations
            ]
        )


# --- the stack -------------------------------------------------------------------------------


@dataclass
class Stack:
    """Operator, node agents (+ fake kubelets), extender and gpupart-scheduler for some kwok nodes."""

    cp: ControlPlane
    api_client: Any
    work: Path
    processes: list[Proc] = field(default_factory=list)
    kubelets: dict[str, FakeKubelet] = field(default_factory=dict)
    real_nodes: dict[str, KubeletNode] = field(default_factory=dict)

    def tails(self) -> str:
        errors = [
            f"fake kubelet {n}: {k.errors[-10:]}" for n, k in self.kubelets.items() if k.errors
        ]
        real = [r.tails() for r in self.real_nodes.values()]
        return "\n".join(
            [f"----- {p.name} -----\n{p.tail()}" for p in self.processes] + errors + real
        )

    def start_operator(self) -> None:
        port = free_port()
        proc = spawn(
            "operator",
            [
                str(GPUPART), "operator", "--standalone", f"--kubeconfig={self.cp.kubeconfig}",
                "--resync-seconds=5", f"--liveness={port}", "--verbose",
            ],
            self.work,
        )  # fmt: skip
        self.processes.append(proc)
        self._healthy(proc, f"http://{LOOPBACK}:{port}/healthz")

    def start_node(self, node: str, gpus: str, *, auto_reset: bool = False) -> FakeKubelet:
        """The node agent with simulated GPUs, talking to a fake kubelet in a short directory.

        `gpus` is the `--simulate` spec (`A100-SXM4-80GB:mig-off` starts without MIG);
        `auto_reset` adds `--simulate-auto-reset`, so MIG mode changes take effect once idle.
        """
        directory = Path(tempfile.mkdtemp(prefix="gp-", dir="/tmp"))
        kubelet = FakeKubelet(node, self.api_client, directory)
        kubelet.start()
        self.kubelets[node] = kubelet
        self._start_agent(
            node, gpus, directory, kubelet.kubelet_socket, kubelet.pod_resources_socket,
            auto_reset=auto_reset,
        )  # fmt: skip
        return kubelet

    def start_real_node(
        self, node: str, gpus: str, labels: dict[str, str], *, auto_reset: bool = False
    ) -> KubeletNode:
        """A Node served by a real kubelet (tests/e2e/kubelet.py) and its node agent.

        The agent keeps the default 60 s resync: what it does sooner comes from its watches.
        Its metrics are served on `real.agent_metrics_port`.
        """
        real = KubeletNode(node, self.cp.bin_dir, self.cp.kubeconfig, labels)
        self.real_nodes[node] = real
        real.start()
        self._start_agent(
            node, gpus, real.plugin_dir, real.kubelet_socket, real.pod_resources_socket,
            auto_reset=auto_reset, resync_s=60, metrics_port=real.agent_metrics_port,
        )  # fmt: skip
        return real

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
    ) -> None:
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
                f"--resync-seconds={resync_s}", f"--metrics-port={metrics_port}",
                "--metrics-address=127.0.0.1",
                *(["--simulate-auto-reset"] if auto_reset else []),
            ],
            self.work,
            env={"KUBECONFIG": str(self.cp.kubeconfig)},
        )  # fmt: skip
        self.processes.append(proc)

    def start_extender(self) -> str:
        """`gpupart extender` with the chart's settings file; its URL prefix once /readyz says 200."""
        port = free_port()
        # The settings file the chart renders (host and port: the flags below win).
        rendered = self.cp.helm(
            "template", "gpupart", str(CHART), "--show-only", "templates/extender.yaml"
        ).stdout
        (config_map,) = [d for d in yaml.safe_load_all(rendered) if d and d["kind"] == "ConfigMap"]
        values = yaml.safe_load(config_map["data"]["settings.yaml"])
        values["fragmentation_refresh_seconds"] = 1
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
            "template", "gpupart", str(CHART), "--show-only", "templates/scheduler.yaml"
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
        for kubelet in self.kubelets.values():
            kubelet.stop()
            shutil.rmtree(kubelet.directory, ignore_errors=True)
        for real in self.real_nodes.values():
            real.stop()
