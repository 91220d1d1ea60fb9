"""`gpupart node`: builds the node agent's objects once, starts its threads, and runs the reconcile loop."""

from __future__ import annotations

import argparse
import gc
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable, Collection
from types import FrameType
from typing import TYPE_CHECKING

from gpupart import logs
from gpupart.core.api.provenance import config_map_ref
from gpupart.core.errors import GpupartError
from gpupart.keyfile import KeyFile, PublicKeySource
from gpupart.watch import Backoff
from gpupart_plugin import settings as node_settings
from gpupart_plugin.actuator import Actuator, NodePass
from gpupart_plugin.agent import NodeAgent
from gpupart_plugin.annotations import NodeAnnotations
from gpupart_plugin.backend import GpuBackend
from gpupart_plugin.checkpoint import Checkpoint
from gpupart_plugin.deviceplugin.allocator import Allocator
from gpupart_plugin.deviceplugin.hub import DeviceHub
from gpupart_plugin.deviceplugin.nodestatus import NodeStatusWriter
from gpupart_plugin.deviceplugin.registration import DevicePlugins
from gpupart_plugin.deviceplugin.sink import DevicePluginSink
from gpupart_plugin.dra.kubelet.plugin import DesiredTargets, DraKubeletPlugin
from gpupart_plugin.dra.publisher import PoolClient
from gpupart_plugin.dra.sink import DraSink
from gpupart_plugin.health import Boards, HealthMonitor
from gpupart_plugin.metrics import NodeMetrics, serve_http
from gpupart_plugin.mps import MpsDaemons
from gpupart_plugin.podresources import PodResourcesClient
from gpupart_plugin.simgpu import SimulatedGpus

if TYPE_CHECKING:
    from kubernetes.client import ApiClient

    from gpupart_plugin.kube import PassInput  # at run time only in `run`: loads the client

log = logging.getLogger("gpupart_plugin")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    node_settings.add_arguments(parser)


def _backend(settings: node_settings.NodeSettings) -> GpuBackend:
    if settings.simulate:
        return SimulatedGpus(
            [g.product for g in settings.simulate],
            node=settings.node_name,
            mig_enabled=[g.mig_enabled for g in settings.simulate],
            create_s=settings.simulate_create_s,
            destroy_s=settings.simulate_destroy_s,
            state_path=settings.simulate_state,
            faults_path=settings.simulate_faults,
        )
    from gpupart_plugin.nvml import NvmlGpus  # only on real nodes: loads libnvidia-ml

    return NvmlGpus()


class PassTrigger:
    """When the agent runs a pass: the desired or MIG plan annotation changed (or the watch relisted), a
    pod left, or a retry of a pass that left a GPU waiting is due.

    Triggers that come while a pass runs fold into one more pass; every pass reads the latest
    annotations, and none runs before they were read once. A pass that leaves a GPU Blocked
    or Pending (`NodePass.waiting`) is retried after `retry`'s backoff, without any event: a
    pod's devices leave the kubelet's PodResources some time after the pod leaves, and a GPU
    reset comes with no event at all. For the same reason a pod that left but that the pass still
    found in PodResources is retried too, until a pass no longer finds it: its MIG devices are
    then marked free in the inventory, not only at the next relist. A change of either
    annotation or a pod leaving starts the backoff over; a pass that leaves nothing waiting ends
    the retries.
    """

    def __init__(self, retry: Backoff) -> None:
        self._cond = threading.Condition()
        self._latest: PassInput | None = None
        self._read = False
        self._due = False
        self._retry = retry
        self._retry_at: float | None = None
        self._leaving: set[str] = set()
        """Pods that left (namespace/name) and that the last pass still found holding devices."""

    def read(self, value: PassInput) -> None:
        """The annotations as the Node watch saw them now (a change, or a relist)."""
        with self._cond:
            if value != self._latest:
                self._retry.reset()
            self._latest, self._read, self._due = value, True, True
            self._cond.notify_all()

    def wake(self, pod: str | None = None) -> None:
        """A pass now: `pod` left the node (what it held may be free soon)."""
        with self._cond:
            if pod is not None:
                self._leaving.add(pod)
            self._retry.reset()
            self._due = True
            self._cond.notify_all()

    def passed(self, waiting: bool, holders: Collection[str] = ()) -> float | None:
        """After a pass: the seconds until its retry when it left a GPU waiting, or found a pod
        that left among the `holders` of devices, else None."""
        with self._cond:
            self._leaving.intersection_update(holders)
            if not waiting and not self._leaving:
                self._retry.reset()
                self._retry_at = None
                return None
            delay = self._retry.next()
            self._retry_at = time.monotonic() + delay
            return delay

    def next(self, stop: threading.Event) -> tuple[bool, PassInput | None]:
        """(due, annotations) for the next pass; not due when `stop` came first or the
        annotations were never read (None until then)."""
        with self._cond:
            while not self._due and not stop.is_set():
                left = 0.5 if self._retry_at is None else self._retry_at - time.monotonic()
                if left <= 0:
                    self._due = True  # the retry of a waiting pass
                    break
                self._cond.wait(min(0.5, left))
            self._retry_at = None
            due, self._due = self._due and self._read, False
            return due, self._latest


def serve(
    passes: PassTrigger, reconcile: Callable[[PassInput], NodePass], stop: threading.Event
) -> None:
    """The reconcile loop: one pass per trigger until `stop`; a failed pass waits for the next."""
    while not stop.is_set():
        due, wanted = passes.next(stop)
        if not due or wanted is None:
            continue
        try:
            result = reconcile(wanted)
        except GpupartError as error:
            log.error("Failed to reconcile node", extra=logs.kv(err=error))
            continue
        delay = passes.passed(result.waiting, result.holders)
        if delay is not None:
            log.info("Scheduled retry of waiting GPUs", extra=logs.kv(retryAfter=f"{delay:g}s"))


def _public_keys(api: ApiClient, settings: node_settings.NodeSettings) -> PublicKeySource:
    """The extender's public keys: its ConfigMap through the API, else the key file."""
    if not settings.assignment_public_keys:
        return KeyFile.public(settings.assignment_key_file)
    namespace, name = config_map_ref(
        settings.assignment_public_keys, where="--assignment-public-keys"
    )
    from gpupart.publickeys import ConfigMapKeys, PublishedKeys  # loads the client

    config_map = ConfigMapKeys(api, namespace, name)
    return PublishedKeys(config_map.read, where=config_map.where)


def run(args: argparse.Namespace) -> int:
    logs.configure("INFO")
    from kubernetes import client

    from gpupart.kubeconfig import load_configuration
    from gpupart_plugin.kube import NodeClient, NodePods, node_writer

    # A bad setting, GPU list or kubeconfig: one line and exit code 2, as the other components.
    try:
        settings = node_settings.from_args(args)
        configuration = load_configuration(settings.kubeconfig)
        backend = _backend(settings)
    except GpupartError as error:
        sys.stderr.write(f"gpupart node: {error}\n")
        return 2
    # Reads as the agent's service account (it lists claims of every namespace, which a node
    # may not); writes as the node itself unless told otherwise (docs/adr-034).
    writer = (
        node_writer(configuration, settings.node_name)
        if settings.write_as_node
        else client.ApiClient(configuration)
    )
    node = NodeClient(
        client.ApiClient(configuration),
        settings.node_name,
        _public_keys(client.ApiClient(configuration), settings),
        writer=writer,
    )
    pod_resources = PodResourcesClient(str(settings.pod_resources_socket))
    hub, metrics = DeviceHub(), NodeMetrics()
    allocator = Allocator(
        hub,
        settings.node_name,
        node.shared_pods,
        node.record_allocation,
        Checkpoint(settings.state_dir, settings.node_name),
        warn=node.warn,
        cdi=settings.cdi,
    )
    plugins = DevicePlugins(
        hub,
        allocator,
        metrics,
        plugin_dir=settings.plugin_dir,
        kubelet_socket=settings.kubelet_socket,
    )
    pool = PoolClient(client.ApiClient(configuration), settings.node_name, writer=writer)
    dra = DraSink(pool, backend.model, taint_effect=settings.dra_taint_effect)
    actuator = Actuator(
        backend,
        pod_resources.list,
        MpsDaemons(settings.mps_root, settings.mps_control),
        dra.claim_use,
    )
    # In this order: a new device reaches the kubelet (served and registered) before the
    # inventory names it to the extender, and the Node status only once the kubelet holds it.
    # A GPU leaving the device plugin is withdrawn there before DRA publishes it.
    sinks = (
        DevicePluginSink(hub, plugins, metrics),
        dra,
        NodeAnnotations(node.publish),
        NodeStatusWriter(hub, pod_resources.allocatable, node.write_status),
    )
    agent = NodeAgent(actuator, sinks, metrics, published=node.last_inventory)
    targets = DesiredTargets(backend)
    passes = PassTrigger(Backoff(min(1.0, settings.relist_s), settings.relist_s))

    def pod_left(pod: str) -> None:
        log.info("Pod left node", extra=logs.kv(pod=pod))
        passes.wake(pod)

    # One raw watch of this node's pods: a pod that leaves asks for a pass, and the DRA pod
    # check asks it first.
    pods = NodePods(
        client.ApiClient(configuration),
        settings.node_name,
        relist_s=settings.relist_s,
        left=pod_left,
    )
    kubelet_plugin = None
    if settings.dra and not settings.once:
        try:
            kubelet_plugin = DraKubeletPlugin(
                client.ApiClient(configuration),
                settings.node_name,
                backend,
                actuator,
                targets,
                pods,
                state_dir=settings.state_dir,
                registry_dir=settings.plugins_registry_dir,
                plugins_dir=settings.dra_plugins_dir,
                cdi_root=settings.cdi_root,
            )
        except GpupartError as error:
            sys.stderr.write(f"gpupart node: DRA plugin: {error}\n")
            return 2

    def reconcile(wanted: PassInput) -> NodePass:
        if settings.simulate_auto_reset and isinstance(backend, SimulatedGpus):
            # Stands in for the admin's GPU reset that a real MIG mode change waits for.
            for index in backend.reset_idle():
                log.info(
                    "Reset simulated GPU",
                    extra=logs.kv(gpu=index, reason="pending MIG mode change"),
                )
        targets.read(wanted.desired)
        return agent.reconcile(wanted.desired, wanted.plan)

    if settings.once:
        reconcile(node.read_input())
        plugins.stop()
        return 0

    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("Received signal", extra=logs.kv(signal=signum))
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    # Everything built so far (the client's model classes, gRPC, protobuf) lives as long as
    # the agent: out of the collector's sight, a full collection no longer walks it. Without
    # this one took 50-65 ms, paid by whichever thread set it off, the one answering the
    # kubelet's NodePrepareResources too (ADR 031).
    gc.collect()
    gc.freeze()
    if kubelet_plugin is not None:
        kubelet_plugin.start()
    monitor = HealthMonitor(
        backend,
        hub if kubelet_plugin is None else Boards(hub, kubelet_plugin.health),
        ignored=settings.ignored_xids,
        quiet_s=settings.recovery_s,
        faults=dra,  # a faulty GPU's DRA devices are tainted in their slices (ADR 028)
    )
    threading.Thread(target=monitor.run, args=(stop,), name="health", daemon=True).start()

    def watch_kubelet() -> None:
        while not stop.wait(1.0):
            plugins.check_kubelet()
            if kubelet_plugin is not None:
                kubelet_plugin.check()

    threading.Thread(target=watch_kubelet, name="kubelet-watch", daemon=True).start()
    http = None
    if settings.metrics_port:

        def healthy() -> bool:
            last = agent.last_pass
            return last is not None and time.monotonic() - last < 3 * settings.relist_s + 60

        http = serve_http(
            metrics, healthy, host=settings.metrics_address, port=settings.metrics_port
        )

    def follow_node() -> None:
        for wanted in node.watch_input(stop, relist_s=settings.relist_s):
            passes.read(wanted)

    def follow_claims() -> None:
        for item in pool.watch_claims(stop, relist_s=settings.relist_s):
            dra.claims_seen(item)

    def follow_slices() -> None:
        for deleted in pool.watch_slices(stop, relist_s=settings.relist_s):
            dra.slice_deleted(deleted)

    dra.wake = passes.wake
    threading.Thread(target=follow_node, name="node-watch", daemon=True).start()
    pods.start()
    threading.Thread(target=follow_claims, name="claim-watch", daemon=True).start()
    threading.Thread(target=follow_slices, name="slice-watch", daemon=True).start()
    try:
        serve(passes, reconcile, stop)
    finally:
        plugins.stop()
        if kubelet_plugin is not None:
            kubelet_plugin.stop()
        pods.stop()
        pod_resources.close()
        if http is not None:
            http.shutdown()
    return 0
