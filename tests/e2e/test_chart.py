"""`helm install` into the real API server, each account's RBAC against docs/install.md, uninstall keeps only the CRDs.

No container images exist here, and the control plane runs no controller-manager, so no chart
pod ever runs: the test checks what the API server accepts and stores.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import pytest
import yaml

from gpupart.signing import private_keys
from gpupart_testsupport.chart import IMAGE_FLAGS
from gpupart_testsupport.cluster import REPO, ControlPlane

from .admission import admin_probes, service_account, wait_lifted

pytestmark = pytest.mark.e2e

CHART = REPO / "charts" / "gpupart"
RELEASE = "gpupart"
NAMESPACE = "gpupart-chart-e2e"
CRDS = ("gpupartitions.gpupart.io", "clusterkopfpeerings.kopf.dev")


def _ref(obj: dict[str, Any]) -> list[str]:
    """kubectl get arguments for one rendered object."""
    kind = obj["kind"]
    group = obj["apiVersion"].split("/")[0] if "/" in obj["apiVersion"] else ""
    resource = f"{kind.lower()}.{group}" if group else kind.lower()
    args = [resource, obj["metadata"]["name"]]
    if obj["metadata"].get("namespace"):
        args += ["-n", obj["metadata"]["namespace"]]
    return args


@pytest.fixture(scope="module")
def installed(k8s_control_plane: ControlPlane) -> Generator[list[dict[str, Any]], None, None]:
    """The release installed with default values; its manifest's objects."""
    cp = k8s_control_plane
    cp.helm(
        "install", RELEASE, str(CHART), *IMAGE_FLAGS, "--namespace", NAMESPACE, "--create-namespace",
        "--timeout", "60s",
    )  # fmt: skip
    api = cp.api_client()
    try:
        manifest = cp.helm("get", "manifest", RELEASE, "--namespace", NAMESPACE).stdout
        yield [doc for doc in yaml.safe_load_all(manifest) if doc]
    finally:
        cp.helm("uninstall", RELEASE, "--namespace", NAMESPACE, "--timeout", "60s", check=False)
        # Its admission policies refuse what later modules write as the admin.
        wait_lifted(admin_probes(api, "default"))
        api.close()


def test_install_creates_every_object_and_the_crds(
    k8s_control_plane: ControlPlane, installed: list[dict[str, Any]]
) -> None:
    kinds = {o["kind"] for o in installed}
    assert {
        "Deployment",
        "DaemonSet",
        "Secret",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
        "ClusterRole",
        "ClusterRoleBinding",
        "ServiceAccount",
        "PodDisruptionBudget",
        "ConfigMap",
        "ClusterKopfPeering",
    } <= kinds
    for obj in installed:
        k8s_control_plane.kubectl("get", *_ref(obj), "-o", "name")
    for crd in CRDS:
        k8s_control_plane.kubectl("get", "crd", crd, "-o", "name")
    status = json.loads(
        k8s_control_plane.helm("status", RELEASE, "-n", NAMESPACE, "-o", "json").stdout
    )
    assert status["info"]["status"] == "deployed"


def test_the_example_partitions_are_accepted_by_the_installed_crd(
    k8s_control_plane: ControlPlane, installed: list[dict[str, Any]]
) -> None:
    assert installed
    for path in sorted((CHART / "examples").glob("*.yaml")):
        k8s_control_plane.kubectl("apply", "--dry-run=server", "-f", str(path))


# -- RBAC: what `kubectl auth can-i --list` says each account may do, against docs/install.md --

DOCS = REPO / "docs" / "install.md"
Grant = tuple[str, str, str]
"""(resource as `kubectl auth can-i --list` names it, resource name or "", verb)"""


@dataclass(frozen=True)
class DocRow:
    account: str
    resource: str
    names: tuple[str, ...]
    verbs: tuple[str, ...]
    where: str


def documented_rows() -> list[DocRow]:
    """The RBAC table of docs/install.md, cell by cell."""
    section = DOCS.read_text().split("### RBAC", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        if not line.startswith("| `<"):
            continue
        account, resource, names, verbs, where, _why = (
            c.strip() for c in line.strip("|").split("|")
        )
        rows.append(
            DocRow(
                account=account.strip("`"),
                resource=resource,
                names=tuple(n.strip("` ") for n in names.split(",") if n.strip()),
                verbs=tuple(v.strip() for v in verbs.split(",")),
                where=where,
            )
        )
    assert len(rows) > 20, "docs/install.md lost its RBAC table"
    return rows


def expand(rules: list[dict[str, Any]]) -> set[Grant]:
    """A Role's rules as grants, named as `kubectl auth can-i --list` names resources."""
    grants = set()
    for rule in rules:
        for group in rule.get("apiGroups") or []:
            for resource in rule.get("resources") or []:
                base, _, sub = resource.partition("/")
                name = f"{base}.{group}" if group else base
                name += f"/{sub}" if sub else ""
                for verb in rule["verbs"]:
                    for one in rule.get("resourceNames") or [""]:
                        grants.add((name, one, verb))
    return grants


def can_i_list(cp: ControlPlane, user: str, namespace: str) -> set[Grant]:
    """`kubectl auth can-i --list` as `user` in `namespace`, resource rows only."""
    out = cp.kubectl("auth", "can-i", "--list", f"--as={user}", "-n", namespace).stdout.splitlines()
    header = out[0]
    cols = [header.index(h) for h in ("Non-Resource URLs", "Resource Names", "Verbs")]
    grants = set()
    for line in out[1:]:
        resource = line[: cols[0]].strip()
        if not resource:
            continue  # a non-resource URL
        names = line[cols[1] : cols[2]].strip().strip("[]").split() or [""]
        for verb in line[cols[2] :].strip().strip("[]").split():
            grants.update((resource, name, verb) for name in names)
    return grants


def documented_grants(
    cp: ControlPlane, release: Release, account: str, namespace: str
) -> set[Grant]:
    """What the docs table grants `account` (the release's, e.g. gpupart-node) in `namespace`."""
    extender = f"{release.fullname}-{'scheduler' if release.mode == 'dedicated' else 'extender'}"
    names = {"<peering>": release.fullname, "<schedulerName>": "gpupart-scheduler"}
    grants: set[Grant] = set()
    for row in documented_rows():
        who = row.account.replace("<fullname>", release.fullname).replace("<extender>", extender)
        applies = {"cluster": True, "release namespace": namespace == release.namespace}
        if who != account or not applies.get(row.where, namespace == row.where):
            continue
        kind, _, builtin = row.resource.partition(" ")
        if kind in ("ClusterRole", "Role"):
            ref = [kind.lower(), builtin.strip("`")]
            if kind == "Role":
                ref += ["-n", row.where]
            grants |= expand(json.loads(cp.kubectl("get", *ref, "-o", "json").stdout)["rules"])
            continue
        for verb in row.verbs:
            for name in row.names or ("",):
                named = names.get(name, name).replace("<fullname>", release.fullname)
                grants.add((row.resource.strip("`"), named, verb))
    return grants


@dataclass(frozen=True)
class Release:
    name: str
    namespace: str
    mode: str
    objects: list[dict[str, Any]]

    @property
    def fullname(self) -> str:
        return self.name  # every release name here contains the chart's name

    @property
    def accounts(self) -> set[str]:
        return {o["metadata"]["name"] for o in self.objects if o["kind"] == "ServiceAccount"}


@pytest.fixture(scope="module")
def existing(k8s_control_plane: ControlPlane) -> Generator[Release, None, None]:
    """A second release for scheduler.mode=existing (the extender as its own Deployment); its
    admission policies off, so that the first release's stay the only ones."""
    cp = k8s_control_plane
    name, namespace = "gpupart-existing", "gpupart-existing-e2e"
    cp.helm(
        "install", name, str(CHART), *IMAGE_FLAGS, "--namespace", namespace, "--create-namespace",
        "--set", "scheduler.mode=existing", "--set", "extender.tls.secretName=gpupart-extender-tls",
        "--set", "admissionPolicies.enabled=false",
    )  # fmt: skip
    try:
        manifest = cp.helm("get", "manifest", name, "--namespace", namespace).stdout
        yield Release(name, namespace, "existing", [d for d in yaml.safe_load_all(manifest) if d])
    finally:
        cp.helm("uninstall", name, "--namespace", namespace, "--timeout", "60s", check=False)


@pytest.mark.parametrize("mode", ["dedicated", "existing"])
def test_each_account_can_do_exactly_what_docs_install_md_says(
    request: pytest.FixtureRequest, k8s_control_plane: ControlPlane, mode: str
) -> None:
    cp = k8s_control_plane
    if mode == "dedicated":
        release = Release(RELEASE, NAMESPACE, mode, request.getfixturevalue("installed"))
    else:
        release = request.getfixturevalue("existing")
    component = "scheduler" if mode == "dedicated" else "extender"
    assert release.accounts == {f"{release.fullname}-{c}" for c in ("operator", "node", component)}
    for namespace in (release.namespace, "kube-system", "default"):
        # What every service account may do (discovery, self reviews): not the chart's doing.
        everyone = can_i_list(cp, service_account(release.namespace, "gpupart-nobody"), namespace)
        for account in sorted(release.accounts):
            actual = can_i_list(cp, service_account(release.namespace, account), namespace)
            documented = documented_grants(cp, release, account, namespace)
            assert actual - everyone == documented - everyone, (
                f"{account} in {namespace}: not documented {sorted(actual - documented - everyone)}, "
                f"documented but not granted {sorted(documented - actual)}"
            )


@pytest.mark.parametrize("action", ["patch pods", "update pods", "get secrets", "list secrets"])
def test_no_account_may_write_pods_and_none_reads_secrets(
    k8s_control_plane: ControlPlane, installed: list[dict[str, Any]], action: str
) -> None:
    accounts = {o["metadata"]["name"] for o in installed if o["kind"] == "ServiceAccount"}
    for account in sorted(accounts):
        who = f"--as={service_account(NAMESPACE, account)}"
        for namespace in (NAMESPACE, "kube-system"):
            answer = k8s_control_plane.kubectl(
                "auth", "can-i", *action.split(), who, "-n", namespace, check=False
            ).stdout.strip()
            # The node agent writes pods' status only, as its node (ADR 034).
            assert answer == "no", f"{account} {action} in {namespace}: {answer}"


@pytest.mark.usefixtures("installed")
def test_the_assignment_key_is_made_once_and_kept_across_upgrades(
    k8s_control_plane: ControlPlane,
) -> None:
    cp = k8s_control_plane
    name = f"{RELEASE}-assignment-key"

    def key() -> str:
        data = json.loads(cp.kubectl("get", "secret", name, "-n", NAMESPACE, "-o", "json").stdout)
        return base64.b64decode(data["data"]["keys"]).decode()

    before = key()
    assert len(private_keys(before.encode(), where=name).key_ids()) == 1  # Ed25519, PEM
    cp.helm("upgrade", RELEASE, str(CHART), "--namespace", NAMESPACE, "--reuse-values")
    assert key() == before
    # A key from before ADR 035 (an HMAC secret) is replaced by an Ed25519 one at upgrade.
    # As that chart wrote it: applied by Helm (its field manager, so the upgrade may change it).
    old = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "data": {"keys": base64.b64encode(b"x" * 64).decode()},
    }
    managers = json.loads(
        cp.kubectl(
            "get", "secret", name, "-n", NAMESPACE, "-o", "json", "--show-managed-fields"
        ).stdout
    )["metadata"]["managedFields"]
    (helm,) = {m["manager"] for m in managers if m["operation"] == "Apply"}
    cp.kubectl(
        "apply", "--server-side", "--force-conflicts", f"--field-manager={helm}", "-f", "-",
        input=json.dumps(old),
    )  # fmt: skip
    assert key() == "x" * 64
    cp.helm("upgrade", RELEASE, str(CHART), "--namespace", NAMESPACE, "--reuse-values")
    replaced = key()
    assert replaced != before and len(private_keys(replaced.encode(), where=name).key_ids()) == 1
    status = json.loads(cp.helm("status", RELEASE, "-n", NAMESPACE, "-o", "json").stdout)
    assert status["info"]["status"] == "deployed" and status["version"] == 3


def test_uninstall_removes_everything_but_the_crds(k8s_control_plane: ControlPlane) -> None:
    cp = k8s_control_plane
    release = f"{RELEASE}-uninstall"
    cp.helm(
        "install", release, str(CHART), *IMAGE_FLAGS, "--namespace", NAMESPACE, "--create-namespace"
    )
    manifest = cp.helm("get", "manifest", release, "--namespace", NAMESPACE).stdout
    objects = [doc for doc in yaml.safe_load_all(manifest) if doc]
    assert len(objects) > 20
    cp.helm("uninstall", release, "--namespace", NAMESPACE, "--timeout", "60s")
    for obj in objects:
        result = cp.kubectl("get", *_ref(obj), "-o", "name", check=False)
        assert result.returncode != 0 and "NotFound" in result.stderr, (
            f"left behind: {obj['kind']}/{obj['metadata']['name']}"
        )
    for crd in CRDS:
        cp.kubectl("get", "crd", crd, "-o", "name")
    listed = cp.helm("list", "--namespace", NAMESPACE, "-o", "json").stdout
    assert release not in {r["name"] for r in json.loads(listed)}
