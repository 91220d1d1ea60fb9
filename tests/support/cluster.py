"""A real control plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kwok) as processes, helpers."""

from __future__ import annotations

import atexit
import base64
import contextlib
import datetime as dt
import ipaddress
import json
import os
import re
import secrets
import ssl
import subprocess
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml

from gpupart_testsupport.polling import wait_for
from gpupart_testsupport.ports import LOOPBACK, free_port
from gpupart_testsupport.processes import Proc, spawn

REPO = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO / "scripts" / "build-k8s-bins.sh"
STAGES_FILE = Path(__file__).with_name("kwok-stages.yaml")
CONTROL_PLANE_BINARIES = (
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kwok",
)
NODE_BINARIES = ("kubelet", "fakeruntime", "dra-example-kubeletplugin")
"""The real-kubelet nodes' programs (tests/support/kubelet.py), and the reference DRA driver's
kubelet plugin some of them run (tests/support/dra.py)."""
CLIENT_BINARIES = ("kubectl", "helm")
CONTROLLERS = (
    # A namespace's `default` ServiceAccount (the ServiceAccount admission plugin refuses pods
    # without it), the legacy token Secrets, and the CA bundle every pod's token volume mounts.
    "serviceaccount-controller",
    "serviceaccount-token-controller",
    "root-ca-certificate-publisher-controller",
    "namespace-controller",
    "garbage-collector-controller",
    # What `helm install` of the chart needs to get pods: Deployment -> ReplicaSet -> Pod, the
    # node agent's DaemonSet, and the operator's PodDisruptionBudget status.
    "deployment-controller",
    "replicaset-controller",
    "daemonset-controller",
    "disruption-controller",
    # DRA: claims from ResourceClaimTemplates, reservedFor cleared and claims of deleted pods
    # released (the scheduler's extended-resource claims go with their pod through the GC).
    "resourceclaim-controller",
    # DRA: pods whose devices get a NoExecute taint are evicted (device taints, GA in 1.37).
    "device-taint-eviction-controller",
)
"""The controllers kube-controller-manager runs here. Not the node lifecycle controller: kwok's
nodes renew no leases, so it would taint them unreachable and evict their pods."""
CONTROLLER_MANAGER_USER = "system:kube-controller-manager"
"""Its identity, as on a kubeadm cluster: the bootstrap RBAC role of that name lets it read and
mint each controller's own service-account token (--use-service-account-credentials)."""
NODE_AGENTS_USER = "gpupart-node-agents"
"""The identity of the node agents the tests run as processes (`ControlPlane.agent_kubeconfig`):
what the chart gives an agent's account, but writing as any node (`impersonate:arbitrary-node`),
since these agents are no pods with a node-bound token. Not the admin: for a superuser the API
server tries first the impersonation mode that last succeeded for it, so after a test's plain
(legacy) impersonation the admin's `Impersonate-User: system:node:x` would lose the node's
group and the Node authorizer would refuse it (k8s.io/apiserver, impersonationModesTracker)."""
NODE_AGENT_WRITES = (
    ("", ("nodes", "nodes/status", "pods/status"), ("patch",)),
    ("", ("events",), ("create",)),
    ("resource.k8s.io", ("resourceslices",), ("create", "update", "delete")),
)
"""What a node agent writes as its node (charts/gpupart/templates/rbac-node.yaml)."""

T = TypeVar("T")


# --- finding the binaries -------------------------------------------------------------------


def default_bin_dir() -> Path:
    """The cache directory the build script fills (it prints it without building anything)."""
    out = subprocess.run(
        [str(BUILD_SCRIPT), "--print-dir"], check=True, capture_output=True, text=True
    ).stdout
    return Path(out.strip())


def bin_dir_from_env() -> Path:
    """GPUPART_K8S_BIN if set (the Makefile sets it), else the build script's cache directory."""
    env = os.environ.get("GPUPART_K8S_BIN")
    return Path(env) if env else default_bin_dir()


def missing_binaries(bin_dir: Path) -> list[str]:
    """Names of the required programs that are not executable files in bin_dir."""
    return [
        name
        for name in CONTROL_PLANE_BINARIES + NODE_BINARIES + CLIENT_BINARIES
        if not os.access(bin_dir / name, os.X_OK)
    ]


def expected_k8s_version() -> str:
    """The k8s.io/kubernetes version pinned in tests/k8s/kubernetes/go.mod."""
    gomod = (REPO / "tests" / "k8s" / "kubernetes" / "go.mod").read_text()
    m = re.search(r"^\s*(?:require\s+)?k8s\.io/kubernetes (v\S+)", gomod, re.MULTILINE)
    assert m, "tests/k8s/kubernetes/go.mod has no k8s.io/kubernetes require line"
    return m.group(1)


# --- small utilities -------------------------------------------------------------------------


def http_get(url: str, *, token: str | None = None, ca_file: Path | None = None) -> tuple[int, str]:
    """GET a loopback URL: status and body (an HTTP error status is returned, not raised).

    HTTPS is verified against ca_file when given; without one it is not verified (the
    schedulers serve self-signed certificates, and every URL here is loopback).
    """
    ctx = None
    if url.startswith("https:"):
        if ca_file is not None:
            ctx = ssl.create_default_context(cafile=str(ca_file))
        else:
            ctx = ssl.create_default_context()
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
    req = urllib.request.Request(url)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=5, context=ctx) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def http_ok(url: str) -> bool:
    """The URL answers 200 (a refused connection raises, which `wait_for` counts as not yet)."""
    return http_get(url)[0] == 200


# --- certificates ----------------------------------------------------------------------------


def write_pki(d: Path) -> None:
    """Write ca.crt, apiserver.crt/.key (SANs 127.0.0.1, localhost) and sa.key into d."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec, rsa
    from cryptography.x509.oid import NameOID

    now = dt.datetime.now(dt.UTC)
    life = dt.timedelta(days=2)

    def pem_key(key: Any) -> bytes:
        return key.private_bytes(  # type: ignore[no-any-return]
            serialization.Encoding.PEM,
            serialization.PrivateFormat.TraditionalOpenSSL,
            serialization.NoEncryption(),
        )

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "gpupart-e2e-ca")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + life)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    srv_key = ec.generate_private_key(ec.SECP256R1())
    srv_cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kube-apiserver")]))
        .issuer_name(ca_name)
        .public_key(srv_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + life)
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address(LOOPBACK)), x509.DNSName("localhost")]
            ),
            critical=False,
        )
        .add_extension(
            x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    d.mkdir(parents=True, exist_ok=True)
    (d / "ca.crt").write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    (d / "apiserver.crt").write_bytes(srv_cert.public_bytes(serialization.Encoding.PEM))
    (d / "apiserver.key").write_bytes(pem_key(srv_key))
    # Service-account tokens are signed with RSA (RS256), the apiserver's default algorithm.
    (d / "sa.key").write_bytes(pem_key(rsa.generate_private_key(65537, 2048)))
    for key in ("apiserver.key", "sa.key"):
        (d / key).chmod(0o600)


# --- processes -------------------------------------------------------------------------------


def start_scheduler(
    bin_dir: Path,
    kubeconfig: Path,
    config: Mapping[str, Any],
    name: str,
    workdir: Path,
    *,
    qps: int = 1000,
    burst: int = 2000,
    verbosity: int = 2,
    extra: Sequence[str] = (),
) -> tuple[Proc, int]:
    """One more kube-scheduler with this KubeSchedulerConfiguration (leader election off), its
    file and log named after it in workdir; returns the process and its /healthz port."""
    config = {
        **config,
        "leaderElection": {"leaderElect": False},
        "clientConnection": {"kubeconfig": str(kubeconfig), "qps": qps, "burst": burst},
    }
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    port = free_port()
    args = [
        str(bin_dir / "kube-scheduler"),
        f"--config={path}",
        f"--bind-address={LOOPBACK}",
        f"--secure-port={port}",
        f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        "--authorization-always-allow-paths=/healthz",
        f"--v={verbosity}",
        *extra,
    ]
    return spawn(name, args, workdir), port


@dataclass
class ControlPlane:
    """etcd, kube-apiserver, optionally kube-controller-manager and kube-scheduler, and kwok,
    started in that order."""

    bin_dir: Path
    workdir: Path
    controller_manager: bool = False
    """Run kube-controller-manager (CONTROLLERS); then the ServiceAccount admission plugin is on
    and pods get their service-account token volume, as on a real cluster."""
    token: str = field(default_factory=lambda: secrets.token_hex(16))
    controller_manager_token: str = field(default_factory=lambda: secrets.token_hex(16))
    node_agents_token: str = field(default_factory=lambda: secrets.token_hex(16))
    procs: list[Proc] = field(default_factory=list)
    api_port: int = 0
    _stopped: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    # -- paths and clients --

    @property
    def api_url(self) -> str:
        return f"https://{LOOPBACK}:{self.api_port}"

    @property
    def kubeconfig(self) -> Path:
        return self.workdir / "kubeconfig"

    @property
    def agent_kubeconfig(self) -> Path:
        """The kubeconfig of the node agents run as processes (NODE_AGENTS_USER)."""
        return self.workdir / "node-agents.kubeconfig"

    @property
    def ca_file(self) -> Path:
        return self.workdir / "pki" / "ca.crt"

    @property
    def logs_dir(self) -> Path:
        return self.workdir / "logs"

    def env(self) -> dict[str, str]:
        """Environment for kubectl and helm: our kubeconfig, our binaries first on PATH."""
        env = dict(os.environ)
        env["KUBECONFIG"] = str(self.kubeconfig)
        env["PATH"] = f"{self.bin_dir}{os.pathsep}{env.get('PATH', '')}"
        # helm keeps caches and config under HOME; keep them inside the work dir.
        for var in ("HELM_CACHE_HOME", "HELM_CONFIG_HOME", "HELM_DATA_HOME"):
            env[var] = str(self.workdir / "helm" / var.lower())
        return env

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        """Run our kubectl against this control plane; raise with its stderr if check fails."""
        return self._run_client("kubectl", args, input, check, timeout)

    def helm(
        self, *args: str, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        """Run our helm against this control plane."""
        return self._run_client("helm", args, None, check, timeout)

    def _run_client(
        self, tool: str, args: Iterable[str], input: str | None, check: bool, timeout: float
    ) -> subprocess.CompletedProcess[str]:
        cmd = [str(self.bin_dir / tool), *args]
        res = subprocess.run(
            cmd, input=input, capture_output=True, text=True, env=self.env(), timeout=timeout
        )
        if check and res.returncode != 0:
            raise AssertionError(
                f"{' '.join(cmd)} exited {res.returncode}\nstdout:\n{res.stdout}\n"
                f"stderr:\n{res.stderr}"
            )
        return res

    def api_client(self) -> Any:
        """A kubernetes.client.ApiClient for this control plane (TLS verified against our CA)."""
        from kubernetes import client

        conf = client.Configuration()
        conf.host = self.api_url
        conf.ssl_ca_cert = str(self.ca_file)
        conf.api_key = {"authorization": f"Bearer {self.token}"}
        # The smoke tests create hundreds of objects from a thread pool.
        conf.connection_pool_maxsize = 32
        return client.ApiClient(conf)

    def log_tails(self, lines: int = 40) -> str:
        """The last lines of every process's log, for a failing test's report."""
        parts = []
        for p in self.procs:
            state = "running" if p.alive() else f"exited {p.popen.returncode}"
            parts.append(f"----- {p.name} ({state}) {p.log} -----\n{p.tail(lines)}")
        return "\n".join(parts)

    # -- start and stop --

    def start(
        self, scheduler_config: Mapping[str, Any] | None = None, scheduler: bool = True
    ) -> None:
        """Start everything and wait for each health endpoint; stop what started if one fails."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.logs_dir.mkdir(exist_ok=True)
        # Registered first, so even a crash half-way through start-up cleans up.
        atexit.register(self.stop)
        try:
            write_pki(self.workdir / "pki")
            etcd_url = self._start_etcd()
            self._start_apiserver(etcd_url)
            self._write_kubeconfig()
            self._grant_node_agents()
            if self.controller_manager:
                self._start_controller_manager()
            if scheduler:
                self._start_scheduler(scheduler_config or {})
            self._start_kwok()
        except BaseException:
            self.stop()
            raise

    def _spawn(self, name: str, args: list[str]) -> Proc:
        proc = spawn(name, args, self.logs_dir, cwd=self.workdir)
        self.procs.append(proc)
        return proc

    def _start_retrying(
        self,
        name: str,
        make_args: Callable[[], tuple[list[str], Callable[[], bool]]],
        timeout: float,
    ) -> None:
        """Start a process and wait until healthy; retry with new ports if a port was taken.

        Ports are picked free but released before the process binds them, so another
        process can grab one in between; the log then says "address already in use".
        """
        for attempt in range(3):
            args, healthy = make_args()
            proc = self._spawn(name, args)

            def ready(proc: Proc = proc, healthy: Callable[[], bool] = healthy) -> bool:
                if not proc.alive():
                    raise RuntimeError(f"{name} exited with {proc.popen.returncode}")
                return healthy()

            try:
                wait_for(ready, timeout, f"{name} to become healthy", interval=0.25)
                return
            except (TimeoutError, RuntimeError) as e:
                port_race = "address already in use" in proc.tail(200)
                proc.stop()
                self.procs.remove(proc)
                if port_race and attempt < 2:
                    continue
                raise RuntimeError(f"{name} did not start: {e}\n{proc.tail(60)}") from e

    def _start_etcd(self) -> str:
        url = ""

        def make() -> tuple[list[str], Callable[[], bool]]:
            nonlocal url
            client_port, peer_port = free_port(), free_port()
            url = f"http://{LOOPBACK}:{client_port}"
            peer = f"http://{LOOPBACK}:{peer_port}"
            data = self.workdir / "etcd"
            args = [
                str(self.bin_dir / "etcd"),
                "--name=default",
                f"--data-dir={data}",
                f"--listen-client-urls={url}",
                f"--advertise-client-urls={url}",
                f"--listen-peer-urls={peer}",
                f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=default={peer}",
                "--initial-cluster-state=new",
                # Throw-away data: skip fsync, the slowest part of etcd on a test machine.
                "--unsafe-no-fsync=true",
                "--quota-backend-bytes=2147483648",
                "--log-level=warn",
            ]
            return args, lambda: json.loads(http_get(f"{url}/health")[1]).get("health") == "true"

        self._start_retrying("etcd", make, timeout=30)
        return url

    def _start_apiserver(self, etcd_url: str) -> None:
        pki = self.workdir / "pki"
        tokens = self.workdir / "tokens.csv"
        # system:masters bypasses RBAC; RBAC stays on so chart roles can be tested later.
        tokens.write_text(
            f'{self.token},admin,admin-uid,"system:masters"\n'
            f"{self.controller_manager_token},{CONTROLLER_MANAGER_USER},kcm-uid\n"
            f"{self.node_agents_token},{NODE_AGENTS_USER},node-agents-uid\n"
        )
        tokens.chmod(0o600)

        def make() -> tuple[list[str], Callable[[], bool]]:
            self.api_port = free_port()
            args = [
                str(self.bin_dir / "kube-apiserver"),
                f"--etcd-servers={etcd_url}",
                f"--bind-address={LOOPBACK}",
                f"--secure-port={self.api_port}",
                # Without an advertise address the apiserver looks for a default route, which
                # offline machines lack; loopback needs the endpoint reconciler switched off.
                f"--advertise-address={LOOPBACK}",
                "--endpoint-reconciler-type=none",
                f"--cert-dir={pki}",
                f"--tls-cert-file={pki / 'apiserver.crt'}",
                f"--tls-private-key-file={pki / 'apiserver.key'}",
                f"--token-auth-file={tokens}",
                # As production clusters run: the Node authorizer and NodeRestriction confine
                # what a node (and a node agent writing as its node, ADR 034) may write.
                "--authorization-mode=Node,RBAC",
                "--enable-admission-plugins=NodeRestriction",
                "--service-account-issuer=https://kubernetes.default.svc",
                f"--service-account-key-file={pki / 'sa.key'}",
                f"--service-account-signing-key-file={pki / 'sa.key'}",
                "--service-cluster-ip-range=10.96.0.0/16",
                # TaintNodesByCondition taints each new node not-ready, and only the node
                # lifecycle controller (never run here) would take that taint off again.
                # ServiceAccount needs each namespace's `default` account, which only
                # kube-controller-manager makes: off without it.
                "--disable-admission-plugins="
                + ("" if self.controller_manager else "ServiceAccount,")
                + "TaintNodesByCondition",
                "--allow-privileged=true",
                # The smoke test bursts hundreds of writes; priority-and-fairness would queue them.
                "--enable-priority-and-fairness=false",
                "--max-requests-inflight=2000",
                "--max-mutating-requests-inflight=1000",
                "--profiling=false",
                "--v=1",
            ]

            def healthy() -> bool:
                code, _ = http_get(f"{self.api_url}/readyz", token=self.token, ca_file=self.ca_file)
                return code == 200

            return args, healthy

        self._start_retrying("kube-apiserver", make, timeout=90)

    @contextlib.contextmanager
    def apiserver_stopped(self, timeout: float = 90) -> Iterator[None]:
        """kube-apiserver stopped for the body, then started again with the same flags (same
        port, same etcd: its clients see connections refused, then the same server back);
        returns once it is ready again."""
        proc = next(p for p in self.procs if p.name == "kube-apiserver")
        given = proc.popen.args
        assert isinstance(given, list), given  # `_spawn` passes a list
        args = [str(a) for a in given]
        proc.stop()
        self.procs.remove(proc)
        try:
            yield
        finally:
            again = self._spawn("kube-apiserver", args)

            def ready() -> bool:
                if not again.alive():
                    raise RuntimeError(f"kube-apiserver exited with {again.popen.returncode}")
                code, _ = http_get(f"{self.api_url}/readyz", token=self.token, ca_file=self.ca_file)
                return code == 200

            wait_for(ready, timeout, "kube-apiserver to be ready again", interval=0.25)

    def _write_kubeconfig(self, path: Path | None = None, user: str = "admin") -> None:
        """A kubeconfig for `user` (admin, or the controller manager's own) at path."""
        ca = base64.b64encode(self.ca_file.read_bytes()).decode()
        token = {
            "admin": self.token,
            CONTROLLER_MANAGER_USER: self.controller_manager_token,
            NODE_AGENTS_USER: self.node_agents_token,
        }[user]
        cfg = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "e2e",
                    "cluster": {"server": self.api_url, "certificate-authority-data": ca},
                }
            ],
            "users": [{"name": user, "user": {"token": token}}],
            "contexts": [{"name": "e2e", "context": {"cluster": "e2e", "user": user}}],
            "current-context": "e2e",
        }
        path = path or self.kubeconfig
        path.write_text(yaml.safe_dump(cfg))
        path.chmod(0o600)

    def _grant_node_agents(self) -> None:
        """NODE_AGENTS_USER's rights (its reads, and its writes as any node), and its kubeconfig."""
        writes = [
            {
                "apiGroups": [group],
                "resources": list(resources),
                "verbs": [f"impersonate-on:arbitrary-node:{v}" for v in verbs],
            }
            for group, resources, verbs in NODE_AGENT_WRITES
        ]
        reads = [
            {
                "apiGroups": [""],
                "resources": ["nodes", "pods", "configmaps"],
                "verbs": ["get", "list", "watch"],
            },
            {
                "apiGroups": ["resource.k8s.io"],
                "resources": ["resourceslices", "resourceclaims"],
                "verbs": ["get", "list", "watch"],
            },
            {
                "apiGroups": ["authentication.k8s.io"],
                "resources": ["nodes"],
                "verbs": ["impersonate:arbitrary-node"],
            },
        ]
        from kubernetes import client

        rbac = client.RbacAuthorizationV1Api(self.api_client())
        rbac.create_cluster_role({"metadata": {"name": NODE_AGENTS_USER}, "rules": reads + writes})
        rbac.create_cluster_role_binding(
            {
                "metadata": {"name": NODE_AGENTS_USER},
                "roleRef": {
                    "apiGroup": "rbac.authorization.k8s.io",
                    "kind": "ClusterRole",
                    "name": NODE_AGENTS_USER,
                },
                "subjects": [
                    {
                        "kind": "User",
                        "name": NODE_AGENTS_USER,
                        "apiGroup": "rbac.authorization.k8s.io",
                    }
                ],
            }
        )
        self._write_kubeconfig(self.agent_kubeconfig, user=NODE_AGENTS_USER)

    def _start_controller_manager(self) -> None:
        """kube-controller-manager as itself (not the admin), then the `default` namespace's
        ServiceAccount and CA bundle, which every pod there needs."""
        pki = self.workdir / "pki"
        kubeconfig = self.workdir / "kube-controller-manager.kubeconfig"
        self._write_kubeconfig(kubeconfig, user=CONTROLLER_MANAGER_USER)

        def make() -> tuple[list[str], Callable[[], bool]]:
            port = free_port()
            args = [
                str(self.bin_dir / "kube-controller-manager"),
                f"--kubeconfig={kubeconfig}",
                f"--bind-address={LOOPBACK}",
                f"--secure-port={port}",
                # Its serving certificate is self-signed into its own directory; no delegated
                # authentication: only the health paths answer.
                f"--cert-dir={self.workdir / 'kube-controller-manager'}",
                "--authorization-always-allow-paths=/healthz,/readyz,/livez",
                f"--controllers={','.join(CONTROLLERS)}",
                "--use-service-account-credentials=true",
                f"--service-account-private-key-file={pki / 'sa.key'}",
                f"--root-ca-file={self.ca_file}",
                "--leader-elect=false",
                # The client default (20 qps) makes a namespace's deletion crawl.
                "--kube-api-qps=200",
                "--kube-api-burst=400",
                "--v=1",
            ]
            return args, lambda: http_ok(f"https://{LOOPBACK}:{port}/healthz")

        self._start_retrying("kube-controller-manager", make, timeout=90)
        self.wait_namespace_ready("default")

    def wait_namespace_ready(self, namespace: str, timeout: float = 60) -> None:
        """Until `namespace` has its `default` ServiceAccount and the CA bundle ConfigMap (made
        by kube-controller-manager; a pod created before is refused or cannot start)."""
        from kubernetes import client

        api = self.api_client()
        core = client.CoreV1Api(api)

        def ready() -> bool:
            names = {a.metadata.name for a in core.list_namespaced_service_account(namespace).items}
            maps = {m.metadata.name for m in core.list_namespaced_config_map(namespace).items}
            return "default" in names and "kube-root-ca.crt" in maps

        try:
            wait_for(ready, timeout, f"namespace {namespace}'s default ServiceAccount")
        finally:
            api.close()

    def _start_scheduler(self, user_config: Mapping[str, Any]) -> None:
        cfg: dict[str, Any] = {
            "apiVersion": "kubescheduler.config.k8s.io/v1",
            "kind": "KubeSchedulerConfiguration",
            "leaderElection": {"leaderElect": False},
        }
        cfg.update(user_config)
        conn = dict(cfg.get("clientConnection") or {})
        conn["kubeconfig"] = str(self.kubeconfig)
        # The client default (50 qps) makes binding 500 pods take tens of seconds.
        conn.setdefault("qps", 1000)
        conn.setdefault("burst", 2000)
        cfg["clientConnection"] = conn
        path = self.workdir / "kube-scheduler.yaml"
        path.write_text(yaml.safe_dump(cfg))

        def make() -> tuple[list[str], Callable[[], bool]]:
            port = free_port()
            args = [
                str(self.bin_dir / "kube-scheduler"),
                f"--config={path}",
                f"--bind-address={LOOPBACK}",
                f"--secure-port={port}",
                f"--authentication-kubeconfig={self.kubeconfig}",
                f"--authorization-kubeconfig={self.kubeconfig}",
                "--authorization-always-allow-paths=/healthz,/readyz,/livez",
                "--v=2",
            ]
            # The scheduler serves a self-signed certificate of its own: skip verification
            # for this loopback-only health probe.
            return (
                args,
                lambda: http_ok(f"https://{LOOPBACK}:{port}/healthz"),
            )

        self._start_retrying("kube-scheduler", make, timeout=60)

    def _start_kwok(self) -> None:
        def make() -> tuple[list[str], Callable[[], bool]]:
            port = free_port()
            args = [
                str(self.bin_dir / "kwok"),
                f"--kubeconfig={self.kubeconfig}",
                # Only nodes made by gpu_node(): real-kubelet nodes (tests/support/kubelet.py) are
                # the kubelet's own.
                "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
                # Pod IPs are fake, but must not run out: 500 pods need more than a /24.
                "--cidr=10.244.0.0/16",
                "--node-ip=10.243.0.1",
                f"--server-address={LOOPBACK}:{port}",
                f"--config={STAGES_FILE}",
            ]
            return args, lambda: http_ok(f"http://{LOOPBACK}:{port}/healthz")

        self._start_retrying("kwok", make, timeout=60)

    def stop(self) -> None:
        """Stop the processes we started, newest first. Safe to call twice."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        for proc in reversed(self.procs):
            proc.stop()
        with contextlib.suppress(Exception):
            atexit.unregister(self.stop)


# --- objects for tests -----------------------------------------------------------------------

MIG_1G = "nvidia.com/mig-1g.10gb"


def gpu_node(
    name: str,
    extended: Mapping[str, int] | None = None,
    labels: Mapping[str, str] | None = None,
    cpu: str = "64",
    memory: str = "512Gi",
    pods: str = "110",
) -> dict[str, Any]:
    """A Node manifest for kwok, with status: capacity (kwok keeps it) and GPU labels.

    allocatable must list cpu, memory and pods too, or the scheduler's fit check refuses
    the node for every pod.
    """
    resources = {"cpu": cpu, "memory": memory, "pods": pods}
    resources.update({k: str(v) for k, v in (extended or {}).items()})
    all_labels = {
        "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        "type": "kwok",
    }
    all_labels.update(labels or {})
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": all_labels,
            "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
        },
        "spec": {},
        "status": {"capacity": dict(resources), "allocatable": dict(resources)},
    }


def mig_labels(product: str = "NVIDIA-H100-80GB-HBM3", gpus: int = 1) -> dict[str, str]:
    """The labels NVIDIA's GPU feature discovery puts on a MIG node (mixed strategy)."""
    return {
        "nvidia.com/gpu.present": "true",
        "nvidia.com/gpu.product": product,
        "nvidia.com/gpu.count": str(gpus),
        "nvidia.com/mig.strategy": "mixed",
        "nvidia.com/mig.capable": "true",
    }


def pod_manifest(
    name: str,
    requests: Mapping[str, str | int],
    labels: Mapping[str, str] | None = None,
    node_selector: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """A single-container Pod; extended resources go in limits too, as Kubernetes requires."""
    res = {k: str(v) for k, v in requests.items()}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": dict(labels or {})},
        "spec": {
            "nodeSelector": dict(node_selector or {}),
            "containers": [
                {
                    "name": "main",
                    "image": "gpupart/sleep:0",
                    "resources": {"requests": res, "limits": res},
                }
            ],
            # No kubelet: nothing would ever honour a grace period.
            "terminationGracePeriodSeconds": 0,
        },
    }


def parallel(fn: Callable[[Any], T], items: Iterable[Any], workers: int = 16) -> list[T]:
    """Run fn over items in a thread pool (API writes are latency-bound, not CPU-bound)."""
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(fn, items))


def create_nodes(api_client: Any, manifests: Iterable[dict[str, Any]]) -> None:
    """Create Nodes with their status (the apiserver keeps status on create, like kubelet's)."""
    from kubernetes import client

    core = client.CoreV1Api(api_client)
    parallel(lambda m: core.create_node(m), list(manifests))


def condition(obj: Mapping[str, Any], ctype: str) -> Mapping[str, Any] | None:
    """The condition of the given type from a dict-shaped object's status, if present."""
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c.get("type") == ctype:
            return c  # type: ignore[no-any-return]
    return None


def wait_for_condition(
    get: Callable[[], Mapping[str, Any]],
    ctype: str,
    status: str = "True",
    timeout: float = 60,
) -> Mapping[str, Any]:
    """Wait until get() returns an object whose condition ctype has the given status."""

    def check() -> Mapping[str, Any] | None:
        obj = get()
        c = condition(obj, ctype)
        return obj if c is not None and c.get("status") == status else None

    return wait_for(check, timeout, f"condition {ctype}={status}")
