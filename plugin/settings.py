"""Node agent settings: read once from flags (falling back to GPUPART_* environment variables), validated, frozen."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from gpupart.core.api.provenance import config_map_ref
from gpupart.core.dra.taints import TaintEffect
from gpupart.core.errors import InvalidInput
from gpupart.core.node.devices import DEFAULT_IGNORED_XIDS
from gpupart.settings import (
    KUBECONFIG,
    Setting,
    SettingsTable,
    boolean,
    integer,
    integers,
    number,
    text,
)


@dataclass(frozen=True, slots=True)
class SimulatedGpu:
    product: str
    mig_enabled: bool = True
    """The MIG mode the GPU starts in (as a real GPU keeps it across driver reloads)."""


MIG_SUFFIXES = {"mig-on": True, "mig-off": False}
"""`--simulate` product suffixes (`A100-SXM4-80GB:mig-off`) for the initial MIG mode."""


@dataclass(frozen=True, slots=True)
class NodeSettings:
    node_name: str
    """This node's name (env NODE_NAME from the downward API)."""
    plugin_dir: Path
    """Kubelet device-plugin directory; our sockets go here."""
    kubelet_socket: Path
    pod_resources_socket: Path
    state_dir: Path
    """Host directory of the agent's own records (the admission checkpoint); it survives restarts."""
    assignment_key_file: Path
    """The extender's public keys in PEM, when not read from `assignment_public_keys`:
    shared-GPU pods are served only when their assignment verifies."""
    assignment_public_keys: str
    """NAMESPACE/NAME of the ConfigMap the extender publishes its public keys to (the chart's),
    read through the API; "" to read `assignment_key_file` instead."""
    mps_root: Path
    """Host directory for MPS pipe, log and shm directories (hostPath mounted at the same path)."""
    mps_control: tuple[str, ...]
    simulate: tuple[SimulatedGpu, ...]
    """Simulated GPUs (e.g. 8 × H200-141GB) instead of NVML; empty for real GPUs."""
    simulate_auto_reset: bool
    """Simulated GPUs only: a pending MIG mode change takes effect on the next pass once idle."""
    simulate_create_s: float
    """Simulated GPUs only: seconds a GPU instance create (with its compute instance) takes."""
    simulate_destroy_s: float
    """Simulated GPUs only: seconds a GPU instance destroy takes."""
    simulate_state: Path | None
    """Simulated GPUs only: a file that keeps their MIG modes and instances across restarts of
    the agent, as a real GPU keeps them; None: they start empty with each process."""
    simulate_faults: Path | None
    """Simulated GPUs only: a JSON file of NVML faults to inject and Xids to raise, read again
    whenever it changes (how a test fails a call in a running agent); None: none."""
    ignored_xids: frozenset[int]
    recovery_s: float
    relist_s: float
    """The Node and pod watches restart (relist) at least this often (`--resync-seconds`), and
    each restart of the Node watch is a pass: drift is repaired even without a change."""
    metrics_address: str
    metrics_port: int
    cdi: bool
    dra: bool
    """Serve the DRA kubelet plugin for the GPUs whose partition says `interface: dra`."""
    plugins_registry_dir: Path
    """The kubelet's plugin registration directory (`<driver>-reg.sock` goes there)."""
    dra_plugins_dir: Path
    """The kubelet's plugins directory (`<driver>/dra.sock` goes there)."""
    cdi_root: Path
    """Where the container runtime reads CDI specs (one transient spec per prepared claim)."""
    once: bool
    dra_taint_effect: TaintEffect = TaintEffect.NO_SCHEDULE
    """The effect of the taint a faulty GPU's DRA devices carry (docs/adr-028)."""
    kubeconfig: str | None = None
    """None: the in-cluster service account, else ~/.kube/config."""
    write_as_node: bool = True
    """Make every write as this node (`system:node:<node>`, by constrained impersonation of
    the node the agent's pod runs on), so the API server confines the writes to this node's
    objects; False: as the agent's own service account (clusters before Kubernetes 1.36,
    where only the chart's admission policy confines them; docs/adr-034)."""


NODE_NAME = Setting(
    "--node-name",
    text,
    "",
    "this node's name (required; the downward API sets NODE_NAME)",
    env=("NODE_NAME",),
)
PLUGIN_DIR = Setting(
    "--plugin-dir", text, "/var/lib/kubelet/device-plugins", "kubelet device-plugin directory"
)
KUBELET_SOCKET = Setting(
    "--kubelet-socket",
    text,
    "",
    "kubelet registration socket (unset: <plugin-dir>/kubelet.sock)",
    env=("KUBELET_SOCKET",),
)
POD_RESOURCES_SOCKET = Setting(
    "--pod-resources-socket",
    text,
    "/var/lib/kubelet/pod-resources/kubelet.sock",
    "kubelet PodResources socket",
)
STATE_DIR = Setting(
    "--state-dir",
    text,
    "/var/lib/kubelet/plugins/gpupart.io",
    "host directory for the agent's admission checkpoint (not the device-plugin directory, "
    "which the kubelet empties when it starts)",
)
DEFAULT_PUBLIC_KEY_FILE = "/etc/gpupart/assignment-public-keys/keys.pem"
ASSIGNMENT_KEY_FILE = Setting(
    "--assignment-key-file",
    text,
    DEFAULT_PUBLIC_KEY_FILE,
    "the extender's Ed25519 public keys in PEM (`gpupart assignment-keys public` prints them; "
    "a private key is refused): only shared-GPU assignments signed with one of them are "
    "served; unused with --assignment-public-keys",
)
ASSIGNMENT_PUBLIC_KEYS = Setting(
    "--assignment-public-keys",
    text,
    "",
    "NAMESPACE/NAME of the ConfigMap the extender publishes its public keys to, read through "
    "the API (the chart's); empty: read --assignment-key-file",
)
MPS_ROOT = Setting(
    "--mps-root", text, "/run/gpupart/mps", "host directory for MPS pipe/log/shm directories"
)
MPS_CONTROL = Setting("--mps-control", text, "nvidia-cuda-mps-control", "MPS control command")
SIMULATE = Setting(
    "--simulate",
    text,
    "",
    "simulated GPUs instead of NVML, e.g. 8xH200-141GB or A100-SXM4-80GB,A30; a suffix "
    ":mig-off (or :mig-on, the default) sets the MIG mode they start in",
)
SIMULATE_AUTO_RESET = Setting(
    "--simulate-auto-reset",
    boolean,
    "false",
    "simulated GPUs only: reset an idle GPU with a pending MIG mode change before each "
    "pass, as an administrator would, so the change takes effect",
    boolean=True,
)
SIMULATE_CREATE = Setting(
    "--simulate-create-seconds",
    number,
    "0",
    "simulated GPUs only: seconds each MIG instance create (GPU and compute instance) takes, "
    "standing in for NVML's (the dynamic MIG simulator assumes 1.0); a GPU's steps run one "
    "at a time, GPUs in parallel",
)
SIMULATE_DESTROY = Setting(
    "--simulate-destroy-seconds",
    number,
    "0",
    "simulated GPUs only: seconds each MIG instance destroy takes (the simulator assumes 0.5)",
)
SIMULATE_STATE = Setting(
    "--simulate-state",
    text,
    "",
    "simulated GPUs only: a file keeping their MIG modes and instances across restarts of the "
    "agent (a real GPU keeps them); empty: they start empty with each process",
)
SIMULATE_FAULTS = Setting(
    "--simulate-faults",
    text,
    "",
    'simulated GPUs only: a JSON file of NVML faults to inject ({"operation": '
    '"CreateComputeInstance", "kind": "InsufficientResources", "times": 1}) and Xids to '
    'raise once ({"xid": 79, "gpu": 1}), read again whenever it changes; empty: none',
)
IGNORED_XIDS = Setting(
    "--ignored-xids",
    integers,
    ",".join(map(str, sorted(DEFAULT_IGNORED_XIDS))),
    "NVIDIA Xid errors that do not make a device unhealthy",
)
RECOVERY = Setting(
    "--recovery-seconds",
    number,
    "60",
    "quiet time before a recovered GPU's devices are Healthy again",
)
RELIST = Setting(
    "--resync-seconds", number, "60", "reconcile at least this often, even without a change"
)
METRICS_ADDRESS = Setting("--metrics-address", text, "0.0.0.0", "address for /metrics and /healthz")
METRICS_PORT = Setting("--metrics-port", integer, "9402", "port for /metrics and /healthz (0: off)")
CDI = Setting(
    "--cdi",
    boolean,
    "true",
    "also return CDI device names nvidia.com/gpu=<uuid> from Allocate",
    boolean=True,
)
DRA = Setting(
    "--dra",
    boolean,
    "false",
    "serve the DRA kubelet plugin (driver gpu.gpupart.io) for GPUs whose partition sets "
    "interface: dra",
    boolean=True,
)
PLUGINS_REGISTRY_DIR = Setting(
    "--plugins-registry-dir",
    text,
    "/var/lib/kubelet/plugins_registry",
    "kubelet plugin registration directory (DRA)",
)
DRA_PLUGINS_DIR = Setting(
    "--dra-plugins-dir", text, "/var/lib/kubelet/plugins", "kubelet plugins directory (DRA)"
)


def taint_effect(value: str) -> TaintEffect:
    """`NoSchedule` or `NoExecute` (the API's spelling)."""
    try:
        return TaintEffect(value)
    except ValueError:
        raise ValueError(f"expected one of {', '.join(TaintEffect)}") from None


DRA_TAINT_EFFECT = Setting(
    "--dra-taint-effect",
    taint_effect,
    "NoSchedule",
    "effect of the taint a DRA device gets while its GPU (or GPU instance) is faulty: "
    "NoSchedule keeps new claims off it, NoExecute also evicts the pods using it",
)
CDI_ROOT = Setting(
    "--cdi-root", text, "/var/run/cdi", "directory the container runtime reads CDI specs from"
)


def write_as(value: str) -> bool:
    """`node` (True) or `service-account` (False)."""
    choices = {"node": True, "service-account": False}
    if value not in choices:
        raise ValueError(f"expected one of {', '.join(choices)}")
    return choices[value]


WRITE_AS = Setting(
    "--write-as",
    write_as,
    "node",
    "whose identity the agent writes with: node (as its node, system:node:<name>, which the "
    "API server confines to the node's own objects; Kubernetes 1.36+) or service-account",
)
ONCE = Setting("--once", boolean, "false", "run one reconcile pass and exit", boolean=True)

SETTINGS = SettingsTable(
    "GPUPART_",
    (
        NODE_NAME, PLUGIN_DIR, KUBELET_SOCKET, POD_RESOURCES_SOCKET, STATE_DIR,
        ASSIGNMENT_KEY_FILE, ASSIGNMENT_PUBLIC_KEYS, MPS_ROOT, MPS_CONTROL,
        SIMULATE, SIMULATE_AUTO_RESET, SIMULATE_CREATE, SIMULATE_DESTROY, SIMULATE_STATE,
        SIMULATE_FAULTS, IGNORED_XIDS, RECOVERY,
        RELIST, METRICS_ADDRESS, METRICS_PORT, CDI, DRA, PLUGINS_REGISTRY_DIR, DRA_PLUGINS_DIR,
        CDI_ROOT, DRA_TAINT_EFFECT, KUBECONFIG, WRITE_AS, ONCE,
    ),
)  # fmt: skip
"""Every flag of `gpupart node`; each falls back to a GPUPART_* variable (the node agent's
names predate the per-component prefix; see docs/adr-012-one-settings-convention.md)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    SETTINGS.add_arguments(parser)


def simulated_gpus(text: str) -> tuple[SimulatedGpu, ...]:
    """`8xH200-141GB`, `A100-SXM4-80GB:mig-off,2xA30`: one entry per GPU, in order."""
    gpus: list[SimulatedGpu] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        spec, _, suffix = part.partition(":")
        if suffix and suffix not in MIG_SUFFIXES:
            raise InvalidInput(
                "--simulate",
                f"{part!r}: unknown suffix {suffix!r} (known: {', '.join(MIG_SUFFIXES)})",
            )
        mig = MIG_SUFFIXES.get(suffix, True)
        count, sep, product = spec.partition("x")
        if sep and count.isdigit():
            gpus += [SimulatedGpu(product, mig)] * int(count)
        else:
            gpus.append(SimulatedGpu(spec, mig))
    return tuple(gpus)


def from_args(args: argparse.Namespace) -> NodeSettings:
    """The frozen settings; InvalidInput names the flag or variable of a bad value."""
    read = SETTINGS.reader(args)
    node = read(NODE_NAME)
    if not node:
        raise InvalidInput("--node-name", "is required (or env NODE_NAME)")
    plugin_dir = Path(read(PLUGIN_DIR))
    simulate = read(SIMULATE)
    gpus = simulated_gpus(simulate)
    auto_reset = read(SIMULATE_AUTO_RESET)
    if auto_reset and not gpus:
        raise InvalidInput(
            "--simulate-auto-reset", "works only with --simulate (real GPUs are reset by an admin)"
        )
    latencies = {setting: read(setting) for setting in (SIMULATE_CREATE, SIMULATE_DESTROY)}
    for setting, seconds in latencies.items():
        where = (read.given(setting) or (setting.flag, ""))[0]  # the flag or variable that set it
        if not seconds >= 0:  # also NaN
            raise InvalidInput(where, f"must be a number of seconds ≥ 0, got {seconds:g}")
        if seconds and not gpus:
            raise InvalidInput(where, "works only with --simulate (NVML takes its own time)")
    state = read(SIMULATE_STATE)
    if state and not gpus:
        raise InvalidInput("--simulate-state", "works only with --simulate")
    faults = read(SIMULATE_FAULTS)
    if faults and not gpus:
        raise InvalidInput("--simulate-faults", "works only with --simulate")
    published = read(ASSIGNMENT_PUBLIC_KEYS)
    if published:
        config_map_ref(published, where="--assignment-public-keys")
        if read.given(ASSIGNMENT_KEY_FILE):
            raise InvalidInput(
                "--assignment-public-keys", "give it or --assignment-key-file, not both"
            )
    return NodeSettings(
        node_name=node,
        plugin_dir=plugin_dir,
        kubelet_socket=Path(read(KUBELET_SOCKET) or plugin_dir / "kubelet.sock"),
        pod_resources_socket=Path(read(POD_RESOURCES_SOCKET)),
        state_dir=Path(read(STATE_DIR)),
        assignment_key_file=Path(read(ASSIGNMENT_KEY_FILE)),
        assignment_public_keys=published,
        mps_root=Path(read(MPS_ROOT)),
        mps_control=tuple(read(MPS_CONTROL).split()),
        simulate=gpus,
        simulate_auto_reset=auto_reset,
        simulate_create_s=latencies[SIMULATE_CREATE],
        simulate_destroy_s=latencies[SIMULATE_DESTROY],
        simulate_state=Path(state) if state else None,
        simulate_faults=Path(faults) if faults else None,
        ignored_xids=read(IGNORED_XIDS),
        recovery_s=read(RECOVERY),
        relist_s=read(RELIST),
        metrics_address=read(METRICS_ADDRESS),
        metrics_port=read(METRICS_PORT),
        cdi=read(CDI),
        dra=read(DRA),
        plugins_registry_dir=Path(read(PLUGINS_REGISTRY_DIR)),
        dra_plugins_dir=Path(read(DRA_PLUGINS_DIR)),
        cdi_root=Path(read(CDI_ROOT)),
        dra_taint_effect=read(DRA_TAINT_EFFECT),
        once=read(ONCE),
        kubeconfig=read(KUBECONFIG),
        write_as_node=read(WRITE_AS),
    )
