"""`gpupart extender` as a real process with least privilege: what it trusts, binds and survives.

The extender runs as its own process against the session's API server (RBAC on), with a
ServiceAccount token whose ClusterRole holds only what it needs (nodes list/watch; pods
get/list/watch; pods/binding create; poddisruptionbudgets and namespaces list/watch; events create),
and a Role for its one public-keys ConfigMap (get, update, patch). The test plays
kube-scheduler over real HTTP (filter, then bind); kwok nodes carry the node agent's inventory.

We test these aspects:
- the extender publishes the public keys of its Ed25519 private keys into its ConfigMap, and
  again when its key file changes; a node agent's reader of that ConfigMap (public keys only)
  verifies what it signs, before and after a rotation (key B first: new assignments signed
  with B verify at once, through the re-read an unknown key id makes; A's still verify);
- bind re-reads the pod from the API server: it binds a pending pod of `gpupart-scheduler` with
  an assignment signed for the pod's UID and node (it verifies with the key), and refuses, with
  a sentence, a pod of another scheduler, a bound pod, a replaced pod (another UID), and a
  filter body that lied about the amounts (the retry with the real pod then binds it right);
- a tenant's pod with `spec.nodeName` preset and a forged assignment (1 MiB on GPU 0) counts
  with its spec's amounts on no GPU in particular, never as its annotation says;
- 100 oversized or hostile bodies (declared and streamed huge bodies, deep nesting, 10^6 and
  10^5 node names, wrong types, the costliest JSON for its size, an endless header), each kind
  sent 10 at a time, leave the process's peak RSS (VmHWM, reset before) under the ceiling
  docs/extender.md states, and its answers to normal requests afterwards are what they were.
"""

from __future__ import annotations

import base64
import json
import socket
import sys
import time
from collections.abc import Callable, Generator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from gpupart.core.api.provenance import forgery
from gpupart.core.api.spec import Mode
from gpupart.core.api.wire import (
    ASSIGNMENT_ANNOTATION,
    INVENTORY_ANNOTATION,
    Inventory,
    InventoryGpu,
    PodAssignment,
    decode_assignment,
    encode_assignment,
    encode_inventory,
)
from gpupart.publickeys import DATA_KEY, ConfigMapKeys, PublishedKeys
from gpupart.signing import PrivateKeys, PublicKeys
from gpupart_extender.limits import memory_allowance
from gpupart_extender.settings import ExtenderSettings
from gpupart_testsupport.cluster import ControlPlane, create_nodes, gpu_node
from gpupart_testsupport.objects import write_key_file
from gpupart_testsupport.polling import wait_for
from gpupart_testsupport.ports import LOOPBACK, free_port
from gpupart_testsupport.processes import Proc, spawn

pytestmark = pytest.mark.e2e

KEY = b"gpupart-e2e-extender-security-01"
"""The extender's raw Ed25519 private key (32 bytes); KEY_B: the one a rotation brings."""
KEY_B = b"gpupart-e2e-extender-security-02"
PUBLIC_KEYS = "gpupart-assignment-public-keys"
"""The ConfigMap the extender publishes its public keys to (the chart makes it empty)."""
SCHEDULER = "gpupart-scheduler"
H100 = "NVIDIA H100 80GB HBM3"
RULES = [
    {"apiGroups": [""], "resources": ["nodes"], "verbs": ["list", "watch"]},
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
    {"apiGroups": [""], "resources": ["pods/binding"], "verbs": ["create"]},
    {"apiGroups": ["policy"], "resources": ["poddisruptionbudgets"], "verbs": ["list", "watch"]},
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
    {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["list", "watch"]},
]
"""All the extender asks of the API server (its watch, the live pod at bind, the Binding)."""


@dataclass
class Running:
    proc: Proc
    url: str
    health: str
    core: Any
    ns: str
    nodes: tuple[str, str]
    key_file: Path

    def rss(self, field: str = "VmRSS") -> int:
        """The process's resident memory (or its peak, VmHWM) in bytes."""
        for line in Path(f"/proc/{self.proc.popen.pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
        raise AssertionError(f"no {field} for the extender: it exited?\n{self.proc.tail()}")


def _service_account_kubeconfig(cp: ControlPlane, core: Any, ns: str, path: Path) -> None:
    from kubernetes import client

    rbac = client.RbacAuthorizationV1Api(cp.api_client())
    name = f"{ns}-extender"
    core.create_namespaced_service_account(ns, {"metadata": {"name": "extender"}})
    rbac.create_cluster_role({"metadata": {"name": name}, "rules": RULES})
    rbac.create_cluster_role_binding(
        {
            "metadata": {"name": name},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": name,
            },
            "subjects": [{"kind": "ServiceAccount", "name": "extender", "namespace": ns}],
        }
    )
    # Its public keys' ConfigMap, as the chart's Role grants: that one, by name, no create.
    core.create_namespaced_config_map(ns, {"metadata": {"name": PUBLIC_KEYS}})
    rules = [
        {
            "apiGroups": [""],
            "resources": ["configmaps"],
            "resourceNames": [PUBLIC_KEYS],
            "verbs": ["get", "update", "patch"],
        }
    ]
    rbac.create_namespaced_role(ns, {"metadata": {"name": "extender"}, "rules": rules})
    rbac.create_namespaced_role_binding(
        ns,
        {
            "metadata": {"name": "extender"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "Role",
                "name": "extender",
            },
            "subjects": [{"kind": "ServiceAccount", "name": "extender", "namespace": ns}],
        },
    )
    token = core.create_namespaced_service_account_token(
        "extender", ns, {"spec": {"expirationSeconds": 3600}}
    ).status.token
    ca = base64.b64encode(cp.ca_file.read_bytes()).decode()
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {
                        "name": "e2e",
                        "cluster": {"server": cp.api_url, "certificate-authority-data": ca},
                    }
                ],
                "users": [{"name": "extender", "user": {"token": token}}],
                "contexts": [{"name": "e2e", "context": {"cluster": "e2e", "user": "extender"}}],
                "current-context": "e2e",
            }
        )
    )
    path.chmod(0o600)


def _node(name: str) -> dict[str, Any]:
    gpus = [InventoryGpu(g, f"GPU-{name}-{g}", H100, 40000, Mode.MPS, (), 16) for g in (0, 1)]
    manifest = gpu_node(
        name,
        {
            "nvidia.com/gpu.shared": 32,
            "gpupart.io/gpu-memory": 80000,
            "gpupart.io/gpu-compute": 200,
        },
        {"gpupart.io/e2e": "extender-security"},
    )
    manifest["metadata"]["annotations"][INVENTORY_ANNOTATION] = encode_inventory(
        Inventory(tuple(gpus))
    )
    return manifest


def _pod(
    name: str, memory: int, *, scheduler: str = SCHEDULER, node: str | None = None
) -> dict[str, Any]:
    limits = {"nvidia.com/gpu.shared": "1", "gpupart.io/gpu-memory": str(memory)}
    spec: dict[str, Any] = {
        "schedulerName": scheduler,
        "terminationGracePeriodSeconds": 0,
        "containers": [
            {"name": "main", "image": "gpupart/sleep:0", "resources": {"limits": limits}}
        ],
    }
    if node:
        spec["nodeName"] = node
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


@pytest.fixture(scope="module")
def extender(k8s_control_plane: ControlPlane) -> Generator[Running, None, None]:
    from kubernetes import client

    cp = k8s_control_plane
    core = client.CoreV1Api(cp.api_client())
    run = f"sec{int(time.time()) % 100000}"
    ns = f"e2e-{run}"
    core.create_namespace({"metadata": {"name": ns}})
    work = cp.workdir / run
    work.mkdir()
    kubeconfig = work / "extender.kubeconfig"
    _service_account_kubeconfig(cp, core, ns, kubeconfig)
    write_key_file(work / "keys", KEY)
    port, health_port = free_port(), free_port()
    config = work / "extender.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "host": LOOPBACK,
                "port": port,
                "health_host": LOOPBACK,
                "health_port": health_port,
                "kubeconfig": str(kubeconfig),
                "assignment_key_file": str(work / "keys"),
                "assignment_public_keys": f"{ns}/{PUBLIC_KEYS}",
            }
        )
    )
    nodes = (f"{run}-a", f"{run}-b")
    create_nodes(cp.api_client(), [_node(n) for n in nodes])
    proc = spawn(
        "extender-security",
        [sys.executable, "-m", "gpupart.cli", "extender", f"--config={config}"],
        cp.logs_dir,
    )
    health = f"http://{LOOPBACK}:{health_port}"
    try:
        # Ready: the service account's rights were enough to list and watch.
        wait_for(
            lambda: httpx.get(f"{health}/readyz", timeout=5).status_code == 200,
            60,
            "the extender's watch cache to sync under its service account",
            detail=proc.tail,
        )
        url = f"http://{LOOPBACK}:{port}/gpupart"
        yield Running(proc, url, health, core, ns, nodes, work / "keys")
    finally:
        proc.stop()
        core.delete_collection_namespaced_pod(ns, grace_period_seconds=0)
        for n in nodes:
            core.delete_node(n)
        core.delete_namespace(ns)
        rbac = client.RbacAuthorizationV1Api(cp.api_client())
        rbac.delete_cluster_role_binding(f"{ns}-extender")
        rbac.delete_cluster_role(f"{ns}-extender")


def _live(ext: Running, name: str) -> dict[str, Any]:
    """The pod as the API server has it (what kube-scheduler sends: its own copy of it)."""
    raw = ext.core.read_namespaced_pod(name, ext.ns, _preload_content=False)
    return json.loads(raw.data)  # type: ignore[no-any-return]


def _filter(http: httpx.Client, ext: Running, pod: dict[str, Any], node: str) -> dict[str, Any]:
    answer = http.post(f"{ext.url}/filter", json={"Pod": pod, "NodeNames": [node]})
    assert answer.status_code == 200, answer.text
    return answer.json()  # type: ignore[no-any-return]


def _bind(http: httpx.Client, ext: Running, name: str, uid: str, node: str) -> str:
    body = {"PodName": name, "PodNamespace": ext.ns, "PodUID": uid, "Node": node}
    answer = http.post(f"{ext.url}/bind", json=body)
    assert answer.status_code == 200, answer.text
    return str(answer.json()["Error"])


def _published(ext: Running) -> str:
    found = ext.core.read_namespaced_config_map(PUBLIC_KEYS, ext.ns).data or {}
    return str(found.get(DATA_KEY) or "")


def test_the_public_keys_are_published_and_verify_across_a_rotation(
    extender: Running, k8s_control_plane: ControlPlane
) -> None:
    ext, core, ns = extender, extender.core, extender.ns
    a, b = PrivateKeys((KEY,)), PrivateKeys((KEY_B,))
    wait_for(
        lambda: _published(ext) == a.pem(), 30, "A's public key published", detail=ext.proc.tail
    )
    reader = ConfigMapKeys(k8s_control_plane.api_client(), ns, PUBLIC_KEYS)
    agent = PublishedKeys(reader.read, where=reader.where, ttl_s=3600, min_reread_s=0)
    assert agent.keys().key_ids() == {a.key_id}
    assert not hasattr(agent, "sign")  # the agent's side can verify only

    def bound(name: str) -> PodAssignment:
        core.create_namespaced_pod(ns, _pod(name, 1000))
        live = _live(ext, name)
        with httpx.Client(timeout=30) as http:
            assert _filter(http, ext, live, ext.nodes[1])["NodeNames"] == [ext.nodes[1]]
            assert _bind(http, ext, name, live["metadata"]["uid"], ext.nodes[1]) == ""
        annotations = core.read_namespaced_pod(name, ns).metadata.annotations
        assignment = decode_assignment(annotations[ASSIGNMENT_ANNOTATION])
        assert forgery(assignment, agent, pod_uid=live["metadata"]["uid"], node=ext.nodes[1]) == ""
        return assignment

    try:
        by_a = bound("rot-a")
        assert by_a.signature.startswith(f"{a.key_id}:")
        # Rotation, step 1: B added after A. A still signs; both are published.
        write_key_file(ext.key_file, KEY, KEY_B)
        wait_for(lambda: _published(ext) == a.pem() + b.pem(), 30, "A's and B's public keys")
        assert bound("rot-a2").signature.startswith(f"{a.key_id}:")
        # Step 2: B moved first. New assignments are signed with B and verify with the
        # agent's copy, read again at once for B's id; A's earlier ones still verify.
        write_key_file(ext.key_file, KEY_B, KEY)
        wait_for(lambda: _published(ext) == b.pem() + a.pem(), 30, "B's public key first")
        assert bound("rot-b").signature.startswith(f"{b.key_id}:")
        assert agent.key_ids() == {a.key_id, b.key_id}
        assert forgery(by_a, agent, pod_uid=by_a.pod_uid, node=by_a.node) == ""
    finally:
        write_key_file(ext.key_file, KEY)
        wait_for(lambda: _published(ext) == a.pem(), 30, "A's public key alone again")
        for name in ("rot-a", "rot-a2", "rot-b"):
            core.delete_namespaced_pod(name, ns, grace_period_seconds=0)


def test_bind_checks_the_live_pod_and_signs_what_it_writes(extender: Running) -> None:
    ext, core, ns = extender, extender.core, extender.ns
    a = ext.nodes[0]
    with httpx.Client(timeout=30) as http:
        core.create_namespaced_pod(ns, _pod("ours", 10000))
        ours = _live(ext, "ours")
        assert _filter(http, ext, ours, a)["NodeNames"] == [a]
        uid = ours["metadata"]["uid"]
        assert _bind(http, ext, "ours", uid, a) == ""
        bound = core.read_namespaced_pod("ours", ns)
        assert bound.spec.node_name == a
        assignment = decode_assignment(bound.metadata.annotations[ASSIGNMENT_ANNOTATION])
        public = PublicKeys(PrivateKeys((KEY,)).public_raw())  # what a node agent holds
        assert forgery(assignment, public, pod_uid=uid, node=a) == ""
        assert assignment.memory_mib == 10000
        # Bound already: a replayed filter (of the pod as it was) and bind are refused.
        _filter(http, ext, ours, ext.nodes[1])
        assert _bind(http, ext, "ours", uid, ext.nodes[1]) == (
            f"pod {ns}/ours is already bound to node {a!r}; not bound again"
        )

        core.create_namespaced_pod(ns, _pod("theirs", 1000, scheduler="someone-else"))
        theirs = _live(ext, "theirs")
        _filter(http, ext, theirs, a)
        refused = _bind(http, ext, "theirs", theirs["metadata"]["uid"], a)
        assert refused == (
            f"pod {ns}/theirs is for scheduler 'someone-else'; this extender binds only pods of "
            "'gpupart-scheduler' (setting scheduler_names)"
        )
        assert core.read_namespaced_pod("theirs", ns).spec.node_name is None

        core.create_namespaced_pod(ns, _pod("big", 30000))
        big = _live(ext, "big")
        lie = json.loads(json.dumps(big))
        lie["spec"]["containers"][0]["resources"]["limits"]["gpupart.io/gpu-memory"] = "1"
        lie["spec"]["containers"][0]["resources"]["requests"]["gpupart.io/gpu-memory"] = "1"
        _filter(http, ext, lie, a)
        refused = _bind(http, ext, "big", big["metadata"]["uid"], a)
        assert refused.startswith(f"pod {ns}/big asks for 1 shared-GPU slot(s), 30000 MiB"), refused
        assert "but the filter call was for 1 shared-GPU slot(s), 1 MiB" in refused, refused
        assert _bind(http, ext, "big", "not-its-uid", a).startswith("no filter decision")
        _filter(http, ext, big, a)  # the scheduler's retry, with the real pod
        assert _bind(http, ext, "big", big["metadata"]["uid"], a) == ""
        written = core.read_namespaced_pod("big", ns).metadata.annotations[ASSIGNMENT_ANNOTATION]
        assert decode_assignment(written).memory_mib == 30000

        # Replaced under the same name: the filter's UID is not the live pod's.
        core.create_namespaced_pod(ns, _pod("again", 1000))
        first = _live(ext, "again")
        core.delete_namespaced_pod("again", ns, grace_period_seconds=0)
        wait_for(
            lambda: "again" not in {p.metadata.name for p in core.list_namespaced_pod(ns).items},
            30,
            "the first pod named again gone",
        )
        core.create_namespaced_pod(ns, _pod("again", 1000))
        _filter(http, ext, first, a)
        refused = _bind(http, ext, "again", first["metadata"]["uid"], a)
        assert refused.startswith(f"pod {ns}/again now has UID "), refused
        assert core.read_namespaced_pod("again", ns).spec.node_name is None


def test_a_forged_assignment_counts_on_no_gpu_with_the_pods_own_amounts(
    extender: Running,
) -> None:
    ext, core, ns = extender, extender.core, extender.ns
    b = ext.nodes[1]
    forged = _pod("forged", 45000, node=b)
    claim = PodAssignment(b, 0, f"GPU-{b}-0", 1, 1, "made-up", "0" * 64)
    forged["metadata"]["annotations"] = {ASSIGNMENT_ANNOTATION: encode_assignment(claim)}
    core.create_namespaced_pod(ns, forged)
    with httpx.Client(timeout=30) as http:
        # Taken at its word, 1 MiB on GPU 0 would leave GPU 1 (40000 MiB) free for this pod;
        # counted as it asks (45000 MiB on the node), 35000 MiB are left: it does not fit.
        asking = {"metadata": {"name": "asking", "namespace": ns, "uid": "u-asking"},
                  "spec": _pod("asking", 40000)["spec"]}  # fmt: skip

        def reason() -> str | None:
            failed = _filter(http, ext, asking, b)["FailedNodes"]
            return failed.get(b)

        why = wait_for(reason, 30, "the extender to count the forged pod", interval=0.5)
    assert f"45000 MiB used by pods without a GPU assignment ({ns}/forged)" in why, why


def _send(data: bytes, port: int) -> str:
    """One hostile request on its own connection: the status line, or how it ended."""
    try:
        with socket.create_connection((LOOPBACK, port), timeout=60) as sock:
            sock.sendall(data)
            answer = b""
            # Up to the status line: a request answered in full may keep its connection open
            # (keep_alive_timeout_seconds), so the server need not close it.
            while b"\r\n" not in answer and (chunk := sock.recv(65536)):
                answer += chunk
            return answer.split(b"\r\n", 1)[0].decode(errors="replace") or "closed"
    except OSError as error:  # the server closed while we were still sending
        return type(error).__name__


def _post(path: str, body: bytes, *, length: int | None = None) -> bytes:
    head = f"POST /gpupart/{path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    if length is None:
        length = len(body)
    return (head + f"Content-Length: {length}\r\n\r\n").encode() + body


def _chunked(path: str, size: int) -> bytes:
    head = (
        f"POST /gpupart/{path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        "Transfer-Encoding: chunked\r\n\r\n"
    ).encode()
    chunk = b"%x\r\n" % (1 << 20) + b" " * (1 << 20) + b"\r\n"
    return head + chunk * (size >> 20) + b"0\r\n\r\n"


def _hostile(max_bytes: int) -> list[tuple[str, Callable[[int], bytes]]]:
    """Requests no scheduler sends, by kind: the n-th (0-9) of each kind."""
    names_1e6 = json.dumps({"Pod": {}, "NodeNames": [f"n{i:06d}" for i in range(10**6)]})
    names_1e5 = json.dumps({"Pod": {}, "NodeNames": ["n"] * 10**5})
    empties = "[" + ",".join(["{}"] * ((max_bytes - 100) // 3)) + "]"
    costly_pod = '{"metadata":{"name":"x"},"spec":{"x":' + empties + "}}"
    costly = [  # diagnose and preempt are answered on the thread pool, holding what was parsed
        ("filter", f'{{"Pod":{costly_pod},"NodeNames":[]}}'.encode()),
        ("preempt", f'{{"Pod":{costly_pod},"NodeNameToMetaVictims":{{}}}}'.encode()),
        ("diagnose", costly_pod.encode()),
    ]
    deep = b'{"Pod":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    victims = b'{"Pod":{},"NodeNameToMetaVictims":{"n":{"Pods":"x"}}}'
    return [
        ("declared 1 GB", lambda _: _post("filter", b'{"Pod":' + b" " * 4096, length=10**9)),
        ("streamed 16 MiB, no length", lambda _: _chunked("prioritize", 16 << 20)),
        ("10^6 node names", lambda _: _post("filter", names_1e6.encode())),
        ("10^5 node names", lambda _: _post("prioritize", names_1e5.encode())),
        ("nested 100,000 deep", lambda _: _post("filter", deep)),
        ("wrong types", lambda _: _post("filter", b'{"Pod": 5, "NodeNames": "all"}')),
        ("wrong types in bind", lambda _: _post("bind", b'{"PodName": [], "PodUID": {}, "Node": 7}')),
        ("victims of the wrong shape", lambda _: _post("preempt", victims)),
        ("the costliest JSON for its size", lambda n: _post(*costly[n % 3])),
        ("an endless header", lambda _: b"GET /healthz HTTP/1.1\r\nX-A: " + b"a" * (1 << 20)),
    ]  # fmt: skip


def test_hostile_bodies_leave_memory_under_the_ceiling_and_answers_right(
    extender: Running,
) -> None:
    ext, core, ns = extender, extender.core, extender.ns
    a = ext.nodes[0]
    port = int(ext.url.split(":")[2].split("/")[0])
    normal = {"metadata": {"name": "normal", "namespace": ns, "uid": "u-normal"},
              "spec": _pod("normal", 20000)["spec"]}  # fmt: skip
    with httpx.Client(timeout=30) as http:
        before = _filter(http, ext, normal, a)
        scores = http.post(f"{ext.url}/prioritize", json={"Pod": normal, "NodeNames": [a]}).json()
    assert before["NodeNames"] == [a], before

    max_bytes = ExtenderSettings().max_request_bytes
    ceiling = ext.rss() + memory_allowance(max_bytes)
    Path(f"/proc/{ext.proc.popen.pid}/clear_refs").write_text("5")  # VmHWM := VmRSS
    outcomes = []
    with ThreadPoolExecutor(10) as pool:
        for kind, make in _hostile(max_bytes):
            sent = [make(n) for n in range(10)]
            # Ten at once: ten of the costliest bodies, parsed, are ~650 MiB.
            outcomes += [(kind, o) for o in pool.map(lambda data: _send(data, port), sent)]
    assert len(outcomes) == 100
    peak = ext.rss("VmHWM")
    assert ext.proc.alive(), ext.proc.tail()
    answered: dict[str, set[str]] = {}
    for kind, outcome in outcomes:
        answered.setdefault(kind, set()).add(outcome)
    # None of them was served as a scheduler's request would be.
    for kind, seen in answered.items():
        assert not {o for o in seen if o.startswith("HTTP/1.1 2")} or kind in (
            "the costliest JSON for its size"  # valid JSON: a pod asking nothing, answered
        ), (kind, seen)
    assert answered["declared 1 GB"] == {"HTTP/1.1 413 Request Entity Too Large"}, answered
    assert answered["10^5 node names"] <= {"HTTP/1.1 413 Request Entity Too Large",
                                           "HTTP/1.1 503 Service Unavailable"}, answered  # fmt: skip
    assert answered["wrong types"] == {"HTTP/1.1 400 Bad Request"}, answered
    assert peak <= ceiling, (
        f"peak RSS {peak >> 20} MiB over the ceiling {ceiling >> 20} MiB: {answered}"
    )

    with httpx.Client(timeout=30) as http:
        assert _filter(http, ext, normal, a) == before
        again = http.post(f"{ext.url}/prioritize", json={"Pod": normal, "NodeNames": [a]}).json()
        assert again == scores
        core.create_namespaced_pod(ns, _pod("after", 20000))
        after = _live(ext, "after")
        assert _filter(http, ext, after, a)["NodeNames"] == [a]
        assert _bind(http, ext, "after", after["metadata"]["uid"], a) == ""
    print(f"peak RSS {peak >> 20} MiB, ceiling {ceiling >> 20} MiB; answers: {answered}")
