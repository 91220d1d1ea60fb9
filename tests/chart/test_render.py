"""The Helm chart renders and validates: each documented value combination, strict schemas, least-privilege RBAC."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import kubernetes_validate
import pytest
import yaml

from gpupart_testsupport.chart import IMAGE_FLAGS

from .conftest import CHART, Render

K8S_SCHEMA_VERSION = (
    "1.33.0"  # newest strict schema kubernetes-validate ships at or below our floor
)
# Kinds whose schema comes from a CRD, not from Kubernetes itself.
CRD_KINDS = {"ClusterKopfPeering", "ServiceMonitor", "Certificate"}
# Built-in ClusterRoles the second scheduler binds to (what the cluster's own scheduler has).
BUILTIN_ROLES = {
    "system:kube-scheduler",
    "system:volume-scheduler",
    "extension-apiserver-authentication-reader",
}

# Every value combination the chart documents (values.yaml comments, docs/install.md).
COMBINATIONS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "existing-scheduler": {
        "scheduler.mode": "existing",
        "extender.tls.secretName": "gpupart-extender-tls",
    },
    "existing-scheduler-cert-manager": {
        "scheduler.mode": "existing",
        "extender.tls.certManager.issuerRef": {"name": "gpupart-ca", "kind": "Issuer"},
        "extender.networkPolicy.from": [{"ipBlock": {"cidr": "10.0.0.0/24"}}],
        "extender.tls.urlHost": "10.96.0.20",
        "extender.settings": {"scheduler_names": ["default-scheduler", "batch"]},
        "serviceMonitor.enabled": True,
    },
    "own-assignment-key": {"assignmentKey.existingSecret": "my-gpupart-key"},
    "no-admission-policies": {"admissionPolicies.enabled": False},
    "node-agent-writes-as-its-account": {"node.writeAs": "serviceAccount"},
    "no-scheduler": {"scheduler.mode": "none", "extender.enabled": False},
    "simulated-gpus": {"node.simulate": "8xH200-141GB", "node.privileged": False},
    "simulated-shared-gpus": {
        "node.simulate": "2xA100-SXM4-80GB:mig-off,A30",
        "node.simulateAutoReset": True,
        "node.privileged": False,
    },
    "monitoring": {"serviceMonitor.enabled": True, "serviceMonitor.labels": {"release": "prom"}},
    "node-agent-only": {
        "operator.enabled": False,
        "extender.enabled": False,
        "scheduler.mode": "none",
    },
    "no-dashboard": {"grafanaDashboard.enabled": False},
    "operator-only": {
        "node.enabled": False,
        "extender.enabled": False,
        "scheduler.mode": "none",
        "operator.replicas": 1,
    },
    "spread-ha": {
        "extender.replicas": 2,
        "scheduler.replicas": 2,
        "extender.settings": {"strategy": "spread", "weights": {"fragmentation": 3}},
        "scheduler.ignorable": True,
        "scheduler.image.tag": "v1.33.4",
        "node.runtimeClassName": "nvidia",
        "imagePullSecrets": [{"name": "regcred"}],
        "commonLabels": {"team": "ml-platform"},
        "fullnameOverride": "gp",
    },
}


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def named(objects: list[dict[str, Any]], kind: str, suffix: str) -> dict[str, Any]:
    (found,) = [o for o in by_kind(objects, kind) if o["metadata"]["name"].endswith(suffix)]
    return found


def pod_specs(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {
        o["metadata"]["name"]: o["spec"]["template"]["spec"]
        for o in objects
        if o["kind"] in ("Deployment", "DaemonSet")
    }


def test_helm_lint_passes_with_defaults_and_strict(helm: Callable[..., Any]) -> None:
    result = helm("lint", "--strict", str(CHART), *IMAGE_FLAGS)
    assert "0 chart(s) failed" in result.stdout


@pytest.mark.parametrize("combination", sorted(COMBINATIONS))
def test_every_rendered_object_is_valid_against_the_kubernetes_schemas(
    render: Render, combination: str
) -> None:
    objects = render(COMBINATIONS[combination])
    assert objects
    for obj in objects:
        if obj["kind"] in CRD_KINDS:
            assert obj["apiVersion"] in (
                "kopf.dev/v1",
                "monitoring.coreos.com/v1",
                "cert-manager.io/v1",
            ), obj
            continue
        try:
            kubernetes_validate.validate(obj, K8S_SCHEMA_VERSION, strict=True)
        except kubernetes_validate.ValidationError as error:
            pytest.fail(
                f"{obj['kind']}/{obj['metadata']['name']}: {error.message} at {list(error.path)}"
            )


@pytest.mark.parametrize("combination", sorted(COMBINATIONS))
def test_rbac_has_no_wildcards_and_no_admin_roles(render: Render, combination: str) -> None:
    objects = render(COMBINATIONS[combination])
    ours = {o["metadata"]["name"] for o in objects if o["kind"] in ("Role", "ClusterRole")}
    for role in by_kind(objects, "Role") + by_kind(objects, "ClusterRole"):
        assert "aggregationRule" not in role
        for rule in role["rules"]:
            for key in ("verbs", "resources", "apiGroups", "resourceNames", "nonResourceURLs"):
                assert "*" not in rule.get(key, []), f"{role['metadata']['name']}: * in {key}"
                assert not any("*" in item for item in rule.get(key, [])), role["metadata"]["name"]
            # One delete: the node agent's of its own pool's ResourceSlices (the admission
            # policy confines it to its node and our driver).
            deletes = "delete" if rule.get("resources") == ["resourceslices"] else None
            assert not {"escalate", "bind", "impersonate", "delete", "deletecollection"} & (
                set(rule["verbs"]) - {deletes}
            ), role["metadata"]["name"]
            assert "secrets" not in rule.get("resources", []), role["metadata"]["name"]
    for binding in by_kind(objects, "RoleBinding") + by_kind(objects, "ClusterRoleBinding"):
        ref = binding["roleRef"]["name"]
        assert ref in ours or ref in BUILTIN_ROLES, f"{binding['metadata']['name']} -> {ref}"
        assert ref not in ("cluster-admin", "admin", "edit")


def rules_of(objects: list[dict[str, Any]], component: str) -> set[tuple[str, str, str, str]]:
    """(group, resource, name or "", verb) of the component's ClusterRole."""
    return role_grants(named(objects, "ClusterRole", f"-{component}"))


def role_grants(role: dict[str, Any]) -> set[tuple[str, str, str, str]]:
    """(group, resource, name or "", verb) of a Role's or ClusterRole's rules."""
    return {
        (group, resource, name, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for name in rule.get("resourceNames") or [""]
        for verb in rule["verbs"]
    }


def grants(
    group: str, resource: str, *verbs: str, name: str = ""
) -> set[tuple[str, str, str, str]]:
    return {(group, resource, name, verb) for verb in verbs}


def test_each_component_gets_exactly_what_its_code_calls(render: Render) -> None:
    objects = render()
    # The node agent's account reads; it writes as its node (ADR 034), these writes only.
    writes = (
        grants("", "nodes", "patch")  # its own Node: state, inventory
        | grants("", "nodes/status", "patch")  # capacity: extender-managed resources, new slices
        | grants("", "pods/status", "patch")  # the allocation record (a condition)
        | grants("", "events", "create")  # why an Allocate was refused
        | grants("resource.k8s.io", "resourceslices", "create", "update", "delete")  # its pool
    )
    reads = (
        grants("", "nodes", "get", "list", "watch")
        | grants("", "pods", "list", "watch")  # pods leaving
        # DRA: its pool's slices (plugin/dra/publisher.py), and the claims allocated from it
        | grants("resource.k8s.io", "resourceslices", "list", "watch")
        | grants("resource.k8s.io", "resourceclaims", "get", "list", "watch")
    )
    as_node = {(g, r, n, f"impersonate-on:associated-node:{v}") for g, r, n, v in writes}
    assert rules_of(objects, "node") == (
        reads | as_node | grants("authentication.k8s.io", "nodes", "impersonate:associated-node")
    )
    legacy = render({"node.writeAs": "serviceAccount"})
    assert rules_of(legacy, "node") == reads | writes
    assert rules_of(objects, "extender") == (
        grants("", "nodes", "list", "watch")
        | grants("", "pods", "get", "list", "watch")  # bind re-reads the live pod
        | grants("", "pods/binding", "create")  # its metadata carries the assignment annotation
        | grants("policy", "poddisruptionbudgets", "list", "watch")  # the preempt verb's PDBs
        | grants("", "events", "create")  # a pending pod's reason (ADR 019)
        | grants("", "namespaces", "list", "watch")  # anti-affinity terms' namespaceSelectors
        # A DRA pod's reasons: read only.
        | grants("resource.k8s.io", "resourceslices", "list", "watch")
        | grants("resource.k8s.io", "resourceclaims", "list", "watch")
        | grants("resource.k8s.io", "deviceclasses", "list", "watch")
    )
    assert rules_of(objects, "operator") == (
        grants("gpupart.io", "gpupartitions", "list", "watch", "patch")
        | grants("gpupart.io", "gpupartitions/status", "patch")
        | grants("", "nodes", "list", "watch", "patch")
        | grants("", "pods", "list", "watch")  # dynamic MIG reads pods and never writes them
        | grants("", "events", "create")
        | grants("kopf.dev", "clusterkopfpeerings", "list", "watch")
        | grants("kopf.dev", "clusterkopfpeerings", "patch", name="gp-gpupart")  # its own only
        | grants("apiextensions.k8s.io", "customresourcedefinitions", "list", "watch")
    )


@pytest.mark.parametrize("combination", sorted(COMBINATIONS))
def test_no_account_but_the_node_agent_may_update_pods_and_none_reads_secrets(
    render: Render, combination: str
) -> None:
    objects = render(COMBINATIONS[combination])
    for role in by_kind(objects, "ClusterRole") + by_kind(objects, "Role"):
        for rule in role["rules"]:
            if "" not in rule["apiGroups"]:
                continue
            assert "secrets" not in rule["resources"], role["metadata"]["name"]
            if "pods" in rule["resources"] and not role["metadata"]["name"].endswith("-node"):
                assert not {"patch", "update"} & set(rule["verbs"]), role["metadata"]["name"]


@pytest.mark.parametrize(
    ("combination", "accounts"),
    [
        # The dedicated scheduler's pod runs the extender: no account of its own.
        ("defaults", {"operator", "node", "scheduler"}),
        ("existing-scheduler", {"operator", "node", "extender"}),
        ("operator-only", {"operator"}),
    ],
)
def test_each_account_is_bound_to_its_own_roles_only(
    render: Render, combination: str, accounts: set[str]
) -> None:
    objects = render(COMBINATIONS[combination])
    names = {o["metadata"]["name"] for o in by_kind(objects, "ServiceAccount")}
    assert names == {f"gp-gpupart-{a}" for a in accounts}
    extender_account = "scheduler" if "scheduler" in accounts else "extender"
    for binding in by_kind(objects, "ClusterRoleBinding") + by_kind(objects, "RoleBinding"):
        (subject,) = binding["subjects"]
        assert subject["kind"] == "ServiceAccount" and subject["name"] in names
        account = subject["name"].rsplit("-", 1)[1]
        if binding["roleRef"]["name"].startswith("gp-gpupart-extender"):
            assert account == extender_account
        else:
            assert account in binding["metadata"]["name"], binding["metadata"]["name"]


def containers_of(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return list(spec["containers"]) + list(spec.get("initContainers") or [])


def test_only_the_node_pod_is_privileged_or_root(render: Render) -> None:
    for name, spec in pod_specs(render()).items():
        for container in containers_of(spec):
            where = f"{name}/{container['name']}"
            sc = container["securityContext"]
            assert container["resources"]["requests"], where
            assert "livenessProbe" in container and "readinessProbe" in container, where
            assert sc["readOnlyRootFilesystem"] is True, where
            if name.endswith("-node"):
                assert sc["privileged"] is True
                continue
            assert spec["securityContext"]["runAsNonRoot"] is True, where
            assert sc.get("runAsUser", spec["securityContext"]["runAsUser"]) != 0, where
            assert sc["allowPrivilegeEscalation"] is False, where
            assert sc["capabilities"] == {"drop": ["ALL"]}, where
        if not name.endswith("-node"):
            assert not any("hostPath" in v for v in spec.get("volumes", [])), name


def test_node_daemonset_mounts_the_kubelet_sockets_on_gpu_nodes_only(render: Render) -> None:
    spec = pod_specs(render())["gp-gpupart-node"]
    host_paths = {
        v["hostPath"]["path"]: v["hostPath"]["type"] for v in spec["volumes"] if "hostPath" in v
    }
    assert host_paths == {
        "/var/lib/kubelet/device-plugins": "Directory",
        "/var/lib/kubelet/pod-resources": "Directory",
        "/run/gpupart/mps": "DirectoryOrCreate",
        # The agent's admission checkpoint, beside the kubelet's device-plugin directory.
        "/var/lib/kubelet/plugins/gpupart.io": "DirectoryOrCreate",
    }
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec[
        "tolerations"
    ]
    (container,) = spec["containers"]
    args = container["args"]
    assert args[0] == "node" and not any(a.startswith("--simulate") for a in args)
    assert "--state-dir=/var/lib/kubelet/plugins/gpupart.io" in args
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert mounts["/var/lib/kubelet/plugins/gpupart.io"]["name"] == "state"
    env = {e["name"]: e for e in container["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    moved = pod_specs(render({"node.kubeletDir": "/var/lib/k0s/kubelet"}))["gp-gpupart-node"]
    assert "--state-dir=/var/lib/k0s/kubelet/plugins/gpupart.io" in moved["containers"][0]["args"]


def test_simulated_gpus_drop_privileges(render: Render) -> None:
    spec = pod_specs(render(COMBINATIONS["simulated-gpus"]))["gp-gpupart-node"]
    container = spec["containers"][0]
    assert "--simulate=8xH200-141GB" in container["args"]
    assert container["securityContext"]["privileged"] is False
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert not any(a.startswith("--simulate-auto-reset") for a in container["args"])


def test_simulated_gpus_without_mig_and_with_auto_reset_pass_through(render: Render) -> None:
    spec = pod_specs(render(COMBINATIONS["simulated-shared-gpus"]))["gp-gpupart-node"]
    args = spec["containers"][0]["args"]
    assert "--simulate=2xA100-SXM4-80GB:mig-off,A30" in args
    assert "--simulate-auto-reset=true" in args


def test_operator_runs_two_peered_replicas_with_a_disruption_budget(render: Render) -> None:
    objects = render()
    deployment = named(objects, "Deployment", "-operator")
    assert deployment["spec"]["replicas"] == 2
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    peering = next(a for a in args if a.startswith("--peering="))
    (peer,) = by_kind(objects, "ClusterKopfPeering")
    assert peering == f"--peering={peer['metadata']['name']}"
    deployments = {d["metadata"]["name"]: d for d in by_kind(objects, "Deployment")}
    budgets = {p["metadata"]["name"]: p for p in by_kind(objects, "PodDisruptionBudget")}
    assert set(budgets) == set(deployments)
    for name, budget in budgets.items():
        labels = deployments[name]["spec"]["template"]["metadata"]["labels"]
        assert budget["spec"]["selector"]["matchLabels"].items() <= labels.items()


def extender_settings(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (config_map,) = [
        c
        for c in by_kind(objects, "ConfigMap")
        if c["metadata"]["name"].endswith("-extender")
        and not c["metadata"]["name"].endswith("-scheduler-extender")
    ]
    settings: dict[str, Any] = yaml.safe_load(config_map["data"]["settings.yaml"])
    return settings


def test_dedicated_scheduler_calls_its_extender_sidecar_on_loopback(render: Render) -> None:
    objects = render()
    config = yaml.safe_load(named(objects, "ConfigMap", "-scheduler")["data"]["config.yaml"])
    assert config["kind"] == "KubeSchedulerConfiguration"
    assert config["profiles"][0]["schedulerName"] == "gpupart-scheduler"
    assert config["profiles"][0]["percentageOfNodesToScore"] == 100
    sampled = render({"scheduler.percentageOfNodesToScore": 0})
    sampled_config = named(sampled, "ConfigMap", "-scheduler")["data"]["config.yaml"]
    assert yaml.safe_load(sampled_config)["profiles"][0]["percentageOfNodesToScore"] == 0
    (extender,) = config["extenders"]
    assert extender["urlPrefix"] == "http://127.0.0.1:8888/gpupart"
    assert extender["enableHTTPS"] is False and "tlsConfig" not in extender
    assert extender["nodeCacheCapable"] is True and extender["ignorable"] is False
    # GPU memory and compute are counted in-tree too: that makes preemption see them (ADR 005).
    for counted in ("gpupart.io/gpu-memory", "gpupart.io/gpu-compute"):
        assert {"name": counted, "ignoredByScheduler": False} in extender["managedResources"]
    assert extender["preemptVerb"] == "preempt"
    assert config["leaderElection"]["resourceName"] == "gpupart-scheduler"
    lease = named(objects, "Role", "-scheduler-lease")
    assert lease["rules"][1]["resourceNames"] == ["gpupart-scheduler"]
    # Nothing but the scheduler's pod reaches the extender: no Service, no Deployment of its own.
    assert not [
        o
        for o in objects
        if o["metadata"]["name"].endswith("-extender") and o["kind"] in ("Service", "Deployment")
    ]
    pod = named(objects, "Deployment", "-scheduler")["spec"]["template"]["spec"]
    scheduler, sidecar = pod["containers"]
    assert scheduler["image"].rsplit(":", 1)[1].startswith("v1.")
    assert sidecar["name"] == "extender" and sidecar["args"][0] == "extender"
    assert [p["name"] for p in sidecar["ports"]] == ["health"]
    assert sidecar["livenessProbe"]["httpGet"]["port"] == "health"
    assert sidecar["readinessProbe"]["httpGet"]["port"] == "health"
    settings = extender_settings(objects)
    assert settings["host"] == "127.0.0.1" and settings["port"] == 8888
    assert settings["health_port"] == 8889 and settings["url_prefix"] == "/gpupart"
    assert settings["scheduler_names"] == ["gpupart-scheduler"]
    assert not any(k.startswith("tls_") for k in settings)
    # The sidecar (uid 10001) reads the key through the pod's fsGroup.
    assert pod["securityContext"]["fsGroup"] == 10001
    assert sidecar["securityContext"]["runAsUser"] == 10001


def test_existing_scheduler_gets_an_https_entry_with_a_client_certificate(render: Render) -> None:
    objects = render(COMBINATIONS["existing-scheduler"])
    assert not any(o["metadata"]["name"].endswith("-scheduler") for o in objects)
    entry = yaml.safe_load(
        named(objects, "ConfigMap", "-scheduler-extender")["data"]["extenders.yaml"]
    )
    (extender,) = entry["extenders"]
    service = named(objects, "Service", "-extender")
    name, namespace = service["metadata"]["name"], service["metadata"]["namespace"]
    assert extender["urlPrefix"] == f"https://{name}.{namespace}.svc:8888/gpupart"
    assert extender["enableHTTPS"] is True
    assert extender["tlsConfig"] == {
        "certFile": "/etc/kubernetes/gpupart/tls.crt",
        "keyFile": "/etc/kubernetes/gpupart/tls.key",
        "caFile": "/etc/kubernetes/gpupart/ca.crt",
        "serverName": f"{name}.{namespace}.svc",
    }
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {
        "https": 8888,
        "health": 8889,
    }
    settings = extender_settings(objects)
    assert settings["host"] == "0.0.0.0"
    assert settings["tls_cert_file"] == "/etc/gpupart/tls/tls.crt"
    assert settings["tls_key_file"] == "/etc/gpupart/tls/tls.key"
    assert settings["tls_client_ca_file"] == "/etc/gpupart/tls/ca.crt"
    assert settings["scheduler_names"] == ["default-scheduler"]
    pod = named(objects, "Deployment", "-extender")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[mounts["/etc/gpupart/tls"]]["secret"]["secretName"] == "gpupart-extender-tls"
    # No client can reach the verbs by default; the health port is open.
    (policy,) = by_kind(objects, "NetworkPolicy")
    assert (
        policy["spec"]["podSelector"]["matchLabels"].items()
        <= pod_labels(objects, "-extender").items()
    )
    assert policy["spec"]["ingress"] == [{"ports": [{"port": "health", "protocol": "TCP"}]}]
    assert not by_kind(objects, "Certificate")


def pod_labels(objects: list[dict[str, Any]], suffix: str) -> dict[str, str]:
    labels: dict[str, str] = named(objects, "Deployment", suffix)["spec"]["template"]["metadata"][
        "labels"
    ]
    return labels


def test_existing_scheduler_with_cert_manager_and_allowed_peers(render: Render) -> None:
    objects = render(COMBINATIONS["existing-scheduler-cert-manager"])
    certificates = {c["metadata"]["name"]: c["spec"] for c in by_kind(objects, "Certificate")}
    server, client = (
        certificates["gp-gpupart-extender"],
        certificates["gp-gpupart-scheduler-client"],
    )
    assert "gp-gpupart-extender.gpupart-system.svc" in server["dnsNames"]
    assert "server auth" in server["usages"] and "client auth" in client["usages"]
    assert server["issuerRef"] == client["issuerRef"] == {"name": "gpupart-ca", "kind": "Issuer"}
    pod = named(objects, "Deployment", "-extender")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["tls"]["secret"]["secretName"] == server["secretName"]
    (policy,) = by_kind(objects, "NetworkPolicy")
    assert policy["spec"]["ingress"][0] == {
        "ports": [{"port": "https", "protocol": "TCP"}],
        "from": [{"ipBlock": {"cidr": "10.0.0.0/24"}}],
    }
    entry = yaml.safe_load(
        named(objects, "ConfigMap", "-scheduler-extender")["data"]["extenders.yaml"]
    )
    (extender,) = entry["extenders"]
    assert extender["urlPrefix"] == "https://10.96.0.20:8888/gpupart"
    assert extender["tlsConfig"]["serverName"] == "gp-gpupart-extender.gpupart-system.svc"
    assert extender_settings(objects)["scheduler_names"] == ["default-scheduler", "batch"]
    (monitor,) = [
        m for m in by_kind(objects, "ServiceMonitor") if m["metadata"]["name"].endswith("-extender")
    ]
    assert monitor["spec"]["endpoints"][0]["port"] == "health"


def key_volumes(spec: dict[str, Any]) -> dict[str, str]:
    """container name -> the Secret mounted at the assignment key's directory."""
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    found = {}
    for container in containers_of(spec):
        for mount in container.get("volumeMounts", []):
            if mount["mountPath"] == "/etc/gpupart/assignment-key":
                assert mount["readOnly"] is True
                found[container["name"]] = volumes[mount["name"]]["secret"]["secretName"]
    return found


@pytest.mark.parametrize("combination", ["defaults", "existing-scheduler", "own-assignment-key"])
def test_the_private_key_reaches_the_extender_only_and_the_agents_read_public_keys(
    render: Render, combination: str
) -> None:
    from gpupart.signing import private_keys

    objects = render(COMBINATIONS[combination])
    own = COMBINATIONS[combination].get("assignmentKey.existingSecret")
    secret = own or "gp-gpupart-assignment-key"
    secrets = by_kind(objects, "Secret")
    if own:
        assert not secrets
    else:
        (made,) = secrets
        assert made["metadata"]["name"] == secret
        import base64

        # Helm's genPrivateKey "ed25519": one PKCS#8 PEM private key the extender reads.
        keys = base64.b64decode(made["data"]["keys"])
        assert len(private_keys(keys, where="the chart's Secret").key_ids()) == 1
    mounted = {name: key_volumes(spec) for name, spec in pod_specs(objects).items()}
    assert mounted["gp-gpupart-node"] == {}  # never the private key on a node
    assert mounted["gp-gpupart-operator"] == {}
    extender = (
        "gp-gpupart-scheduler" if "gp-gpupart-scheduler" in mounted else "gp-gpupart-extender"
    )
    assert mounted[extender] == {"extender": secret}  # not the kube-scheduler container
    for name, spec in pod_specs(objects).items():
        volumes = [v.get("secret", {}).get("secretName") for v in spec.get("volumes", [])]
        assert (secret in volumes) == (name == extender), name
    # The public keys: an empty ConfigMap the extender writes and the agents read.
    public = named(objects, "ConfigMap", "-assignment-public-keys")
    assert public["metadata"]["name"] == "gp-gpupart-assignment-public-keys"
    assert not public.get("data")
    namespace = public["metadata"]["namespace"]
    where = f"{namespace}/gp-gpupart-assignment-public-keys"
    settings = extender_settings(objects)
    assert settings["assignment_key_file"] == "/etc/gpupart/assignment-key/keys"
    assert settings["assignment_public_keys"] == where
    args = pod_specs(objects)["gp-gpupart-node"]["containers"][0]["args"]
    assert f"--assignment-public-keys={where}" in args
    assert not [a for a in args if a.startswith("--assignment-key-file")]


def namespaced_grants(
    objects: list[dict[str, Any]], role: str
) -> tuple[set[tuple[str, str, str, str]], set[str]]:
    """The Role's (group, resource, name, verb) and the accounts its RoleBinding binds."""
    (found,) = [r for r in by_kind(objects, "Role") if r["metadata"]["name"] == role]
    rules = role_grants(found)
    (binding,) = [b for b in by_kind(objects, "RoleBinding") if b["roleRef"]["name"] == role]
    assert binding["metadata"]["namespace"] == found["metadata"]["namespace"]
    return rules, {s["name"] for s in binding["subjects"]}


@pytest.mark.parametrize("combination", ["defaults", "existing-scheduler"])
def test_the_public_keys_configmap_is_written_by_the_extender_and_read_by_the_agents(
    render: Render, combination: str
) -> None:
    objects = render(COMBINATIONS[combination])
    name = "gp-gpupart-assignment-public-keys"
    extender = "gp-gpupart-scheduler" if combination == "defaults" else "gp-gpupart-extender"
    writes, writers = namespaced_grants(objects, "gp-gpupart-extender-assignment-public-keys")
    assert writes == grants("", "configmaps", "get", "update", "patch", name=name)
    assert writers == {extender}
    reads, readers = namespaced_grants(objects, "gp-gpupart-node-assignment-public-keys")
    assert reads == grants("", "configmaps", "get", name=name)
    assert readers == {"gp-gpupart-node"}


def test_the_generated_key_differs_per_render(render: Render) -> None:
    """helm template cannot look the Secret up: each render makes a fresh key (an upgrade of a
    release keeps its key: tests/e2e/test_chart.py)."""
    first, second = (by_kind(render(), "Secret")[0]["data"]["keys"] for _ in range(2))
    assert first != second


def policies(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {
        p["metadata"]["name"].removeprefix("gp-gpupart-"): p["spec"]
        for p in by_kind(objects, "ValidatingAdmissionPolicy")
    }


def expressions(spec: dict[str, Any]) -> str:
    parts = [v["expression"] for v in spec.get("variables", [])]
    parts += [c["expression"] for c in spec.get("matchConditions", [])]
    for v in spec["validations"]:
        parts += [v["expression"], v.get("messageExpression", "")]
    return "\n".join(parts)


@pytest.mark.parametrize(
    ("combination", "assigner"),
    [("defaults", "gp-gpupart-scheduler"), ("existing-scheduler", "gp-gpupart-extender")],
)
def test_admission_policies_name_the_release_accounts(
    render: Render, combination: str, assigner: str
) -> None:
    objects = render(COMBINATIONS[combination])
    found = policies(objects)
    assert set(found) == {"annotation-owners", "gpu-pods-scheduled", "node-agent", "shared-claims"}
    bindings = {
        b["spec"]["policyName"]: b["spec"]
        for b in by_kind(objects, "ValidatingAdmissionPolicyBinding")
    }
    assert set(bindings) == {f"gp-gpupart-{name}" for name in found}
    for name, spec in found.items():
        assert spec["failurePolicy"] == "Fail", name
        assert "paramKind" not in spec, name
        assert all(
            v.get("messageExpression") and v["reason"] == "Forbidden" for v in spec["validations"]
        ), name
        assert bindings[f"gp-gpupart-{name}"]["validationActions"] == ["Deny"]
    sa = "system:serviceaccount:gpupart-system:"
    owners = expressions(found["annotation-owners"])
    assert f"'gpupart.io/assignment': '{sa}{assigner}'" in owners
    assert "gpupart.io/allocation" not in owners  # nobody's since ADR 034
    assert f"'gpupart.io/desired': '{sa}gp-gpupart-operator'" in owners
    assert "'gpupart.io/state': 'system:node:' + variables.name" in owners  # the node itself
    agent = found["node-agent"]
    assert agent["matchConditions"] == [
        {
            "name": "the-node-agent",
            "expression": f"request.userInfo.username == '{sa}gp-gpupart-node'",
        }
    ]
    assert "authentication.kubernetes.io/node-name" in expressions(agent)
    hint = (
        "schedulerName: gpupart-scheduler"
        if combination == "defaults"
        else "let the scheduler place it"
    )
    assert hint in expressions(found["gpu-pods-scheduled"])


def test_admission_policies_leave_out_components_that_are_not_installed(render: Render) -> None:
    found = policies(render(COMBINATIONS["operator-only"]))
    assert set(found) == {"annotation-owners", "gpu-pods-scheduled"}
    owners = expressions(found["annotation-owners"])
    # Nobody may write the agent's or the extender's keys: no request has an empty user name.
    assert "'gpupart.io/assignment': ''" in owners and "'gpupart.io/state': ''" in owners
    assert not policies(render(COMBINATIONS["no-admission-policies"]))


def test_dashboard_has_the_sidecar_label_and_the_four_views(render: Render) -> None:
    dashboard = named(render(), "ConfigMap", "-dashboard")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    model = json.loads(dashboard["data"]["gpupart.json"])
    titles = " | ".join(p["title"] for p in model["panels"]).lower()
    for view in ("slices", "pending", "latency", "allocation per node"):
        assert view in titles
    exprs = " ".join(t["expr"] for p in model["panels"] for t in p["targets"])
    for metric in (
        "gpupart_node_devices",
        "gpupart_extender_filtered_nodes_total",
        "gpupart_extender_request_duration_seconds_bucket",
        "gpupart_node_allocations_total",
    ):
        assert metric in exprs


def test_service_monitors_scrape_each_component(render: Render) -> None:
    monitors = by_kind(render(COMBINATIONS["monitoring"]), "ServiceMonitor")
    assert {m["metadata"]["name"].rsplit("-", 1)[1] for m in monitors} == {
        "operator",
        "node",
        "extender",
    }
    assert all(m["metadata"]["labels"]["release"] == "prom" for m in monitors)
    # The dedicated scheduler's sidecar: only its health port is behind a Service.
    objects = render(COMBINATIONS["monitoring"])
    service = named(objects, "Service", "-extender-metrics")
    assert [p["name"] for p in service["spec"]["ports"]] == ["health"]
    assert service["spec"]["selector"]["app.kubernetes.io/component"] == "scheduler"


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"scheduler.mode": "second"}, "scheduler/mode"),
        ({"operator.replicas": 0}, "operator/replicas"),
        ({"operator.replica": 2}, "replica"),
        ({"extender.settings": {"strategy": "random"}}, "extender/settings/strategy"),
        ({"node.simulate": "8 x H200"}, "node/simulate"),
        ({"node.simulate": "A100-SXM4-80GB:mig-of"}, "node/simulate"),
        ({"node.simulateAutoReset": True}, "node.simulateAutoReset works only with node.simulate"),
        ({"extender.port": 70000}, "extender/port"),
        ({"operator.resources": {"requests": {"cpu": "lots"}}}, "operator/resources/requests/cpu"),
        ({"node.privileged": False}, "node.privileged=false works only with node.simulate"),
        ({"extender.enabled": False}, "needs extender.enabled=true"),
        ({"scheduler.mode": "existing"}, "set extender.tls.secretName"),
        (
            {
                "scheduler.mode": "existing",
                "extender.tls.secretName": "a",
                "extender.tls.certManager.issuerRef": {"name": "ca"},
            },
            "set secretName or certManager.issuerRef, not both",
        ),
        ({"scheduler.mode": "none"}, "set extender.enabled=false too"),
        ({"extender.settings": {"tls_cert_file": "/x"}}, "tls_cert_file"),
        ({"assignmentKey.existingSecret": "Not_A_Name"}, "assignmentKey/existingSecret"),
        ({"admissionPolicies.enable": True}, "enable"),
    ],
)
def test_a_wrong_value_fails_with_a_message_naming_it(
    helm: Callable[..., Any], values: dict[str, Any], message: str
) -> None:
    from .conftest import set_flags

    result = helm("template", "gp", str(CHART), *IMAGE_FLAGS, *set_flags(values), check=False)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr


@pytest.mark.parametrize(
    ("flags", "missing", "set_already"),
    [
        ((), ("image.repository", "scheduler.image.repository"), ()),
        (
            ("--set", "image.repository=r/gpupart"),
            ("scheduler.image.repository",),
            ("image.repository",),
        ),
        (("--set", "scheduler.image.repository=r/kube-scheduler"), ("image.repository",), ()),
        (
            ("--set", "scheduler.mode=existing", "--set", "extender.tls.secretName=tls"),
            ("image.repository",),
            ("scheduler.image.repository",),
        ),
    ],
)
def test_an_unset_image_fails_the_render_in_one_line_naming_every_value_to_set(
    helm: Callable[..., Any],
    flags: tuple[str, ...],
    missing: tuple[str, ...],
    set_already: tuple[str, ...],
) -> None:
    """No image default names a registry, so none would start: the chart refuses instead."""
    for command in (
        ("template", "gp", str(CHART)),
        ("install", "gp", str(CHART), "--dry-run=client"),
    ):
        result = helm(*command, *flags, check=False)
        assert result.returncode != 0
        (error,) = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
        assert "set the images first: " in error, result.stderr
        named = set(re.findall(r"(?:: |; )([a-z.]+) \(", error))
        assert named == set(missing), error
        assert not named & set(set_already)
        for value in missing:
            assert f"--set {value}=<your-registry>/" in error, error
        if "image.repository" in missing:
            assert "Dockerfile" in error and "docs/install.md" in error, error


def readme_helm_installs() -> list[list[str]]:
    """Every `helm install ... charts/gpupart ...` command README.md shows, as argv."""
    import shlex

    from .conftest import REPO

    text = (REPO / "README.md").read_text().replace("\\\n", " ")
    commands = []
    for line in text.splitlines():
        line = line.strip().removeprefix("$ ")
        if line.startswith("helm install ") and "charts/gpupart" in line:
            commands.append(shlex.split(line, comments=True))
    assert len(commands) >= 2, "README.md lost its helm install commands"
    return commands


@pytest.mark.parametrize("argv", readme_helm_installs(), ids=lambda a: " ".join(a[3:]))
def test_each_helm_install_the_readme_shows_renders_the_images_it_sets(
    helm: Callable[..., Any], argv: list[str]
) -> None:
    """As written (`<registry>` filled in), each renders, with exactly the images it names."""
    args = [a.replace("<registry>", "registry.test") for a in argv[1:]]
    args[args.index("charts/gpupart")] = str(CHART)
    result = helm("template", *args[1:])
    images = {
        c["image"].rsplit(":", 1)[0]
        for doc in yaml.safe_load_all(result.stdout)
        if doc and doc["kind"] in ("Deployment", "DaemonSet")
        for c in doc["spec"]["template"]["spec"]["containers"]
    }
    named = {
        a.split("=", 1)[1]
        for a in args
        if a.startswith(("image.repository=", "scheduler.image.repository="))
    }
    assert images == named


def test_the_images_render_as_set(render: Render) -> None:
    objects = render(
        {
            "image.repository": "r.example/team/gpupart",
            "image.tag": "1.2.3",
            "scheduler.image.repository": "m/kube-scheduler",
            "scheduler.image.tag": "v1.36.3",
        }
    )
    images = {
        c["image"]
        for o in objects
        if o["kind"] in ("Deployment", "DaemonSet")
        for c in o["spec"]["template"]["spec"]["containers"]
    }
    assert images == {"r.example/team/gpupart:1.2.3", "m/kube-scheduler:v1.36.3"}


def test_notes_tell_how_to_partition_and_request_a_slice(helm: Callable[..., Any]) -> None:
    result = helm(
        "install",
        "gp",
        str(CHART),
        *IMAGE_FLAGS,
        "--dry-run=client",
        "--namespace",
        "gpupart-system",
    )
    notes = result.stdout.split("NOTES:", 1)[1]
    assert "kubectl apply -f examples/mig-a100.yaml" in notes
    assert "schedulerName: gpupart-scheduler" in notes
    assert "nvidia.com/mig-1g.10gb: 1" in notes
    assert "images:    gpupart:0.1.0, kube-scheduler:v" in notes
    assert "spec.interface: dra" not in notes  # DRA's classes are off by default
    with_dra = helm(
        "install", "gp", str(CHART), *IMAGE_FLAGS, "--dry-run=client",
        "--namespace", "gpupart-system", "--set", "dra.enabled=true",
    )  # fmt: skip
    assert "spec.interface: dra (examples/dra/partition-*.yaml" in with_dra.stdout


def test_one_example_partition_per_mode() -> None:
    modes = {}
    for path in sorted((CHART / "examples").glob("*.yaml")):
        doc = yaml.safe_load(path.read_text())
        assert doc["kind"] == "GpuPartition" and doc["apiVersion"] == "gpupart.io/v1alpha1"
        modes[doc["spec"]["mode"]] = path.name
    assert set(modes) == {"MIG", "MPS", "TimeSlicing", "None"}


@pytest.mark.parametrize("combination", sorted(COMBINATIONS))
def test_the_components_accept_the_rendered_arguments_and_settings(
    render: Render, combination: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every flag the chart passes exists and validates; the extender's settings file loads."""
    from gpupart.cli import build_parser
    from gpupart_extender.settings import load_settings
    from gpupart_operator import settings as operator_settings
    from gpupart_plugin import settings as node_settings

    for var in ("NODE_NAME", "KUBECONFIG"):
        monkeypatch.delenv(var, raising=False)
    objects = render(COMBINATIONS[combination])
    containers = [
        (workload, container)
        for workload in by_kind(objects, "Deployment") + by_kind(objects, "DaemonSet")
        for container in workload["spec"]["template"]["spec"]["containers"]
        if "args" in container  # not kube-scheduler
    ]
    for workload, container in containers:
        args = container["args"]
        parsed = build_parser(args[0]).parse_args(args)
        if args[0] == "node":
            parsed.node_name = "gpu-node-1"  # the downward API's NODE_NAME
            settings = node_settings.from_args(parsed)
            assert settings.metrics_address == "0.0.0.0"
        elif args[0] == "operator":
            assert operator_settings.from_args(parsed).peering
        elif args[0] == "extender":
            path = tmp_path / "settings.yaml"
            path.write_text(yaml.safe_dump(extender_settings(objects)))
            extender = load_settings(path)
            sidecar = workload["metadata"]["name"].endswith("-scheduler")
            assert extender.host == ("127.0.0.1" if sidecar else "0.0.0.0")
            assert f"--config={container['volumeMounts'][0]['mountPath']}/settings.yaml" in args


MAP_API = ("--api-versions", "admissionregistration.k8s.io/v1/MutatingAdmissionPolicy")


def test_the_scheduler_name_policy_is_rendered_where_it_applies(render: Render) -> None:
    """Only with scheduler.mode=dedicated, setSchedulerName on, and the API served (v1.36)."""

    def mutating(values: dict[str, Any], extra: tuple[str, ...] = MAP_API) -> list[dict[str, Any]]:
        kinds = ("MutatingAdmissionPolicy", "MutatingAdmissionPolicyBinding")
        return [o for o in render(values, extra) if o["kind"] in kinds]

    found = mutating({"scheduler.schedulerName": "gpu-sched"})
    assert [o["kind"] for o in found] == [
        "MutatingAdmissionPolicy",
        "MutatingAdmissionPolicyBinding",
    ]
    policy, binding = found
    assert binding["spec"] == {"policyName": "gp-gpupart-scheduler-name"}
    assert policy["spec"]["matchConstraints"]["resourceRules"][0]["operations"] == ["CREATE"]
    (mutation,) = policy["spec"]["mutations"]
    assert mutation["applyConfiguration"]["expression"] == (
        "Object{spec: Object.spec{schedulerName: 'gpu-sched'}}"
    )
    assert {c["name"] for c in policy["spec"]["matchConditions"]} == {
        "no-scheduler-chosen",
        "not-bound",
        "asks-for-a-gpu",
    }
    assert not mutating({}, ())  # an API server without MutatingAdmissionPolicy v1
    assert not mutating({"admissionPolicies.setSchedulerName": False})
    assert not mutating({"admissionPolicies.enabled": False})
    assert not mutating(
        {"scheduler.mode": "existing", "extender.tls.secretName": "gpupart-extender-tls"}
    )
