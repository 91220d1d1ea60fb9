"""The Helm chart renders and validates: each documented value combination, strict schemas, least-privilege RBAC."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import kubernetes_validate
import pytest
import yaml

from .conftest import CHART, Render

K8S_SCHEMA_VERSION = (
    "1.33.0"  # newest strict schema kubernetes-validate ships at or below our floor
)
# Kinds whose schema comes from a CRD, not from Kubernetes itself.
CRD_KINDS = {"ClusterKopfPeering", "ServiceMonitor"}
# Built-in ClusterRoles the second scheduler binds to (what the cluster's own scheduler has).
BUILTIN_ROLES = {
    "system:kube-scheduler",
    "system:volume-scheduler",
    "extension-apiserver-authentication-reader",
}

# Every value combination the chart documents (values.yaml comments, docs/install.md).
COMBINATIONS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "existing-scheduler": {"scheduler.mode": "existing"},
    "no-scheduler": {"scheduler.mode": "none", "extender.enabled": False},
    "simulated-gpus": {"node.simulate": "8xH200-141GB", "node.privileged": False},
    "simulated-shared-gpus": {
        "node.simulate": "2xA100-SXM4-80GB:mig-off,A30",
        "node.simulateAutoReset": True,
        "node.privileged": False,
    },
    "monitoring": {"serviceMonitor.enabled": True, "serviceMonitor.labels": {"release": "prom"}},
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
    result = helm("lint", "--strict", str(CHART))
    assert "0 chart(s) failed" in result.stdout


@pytest.mark.parametrize("combination", sorted(COMBINATIONS))
def test_every_rendered_object_is_valid_against_the_kubernetes_schemas(
    render: Render, combination: str
) -> None:
    objects = render(COMBINATIONS[combination])
    assert objects
    for obj in objects:
        if obj["kind"] in CRD_KINDS:
            assert obj["apiVersion"] in ("kopf.dev/v1", "monitoring.coreos.com/v1"), obj
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
            assert not {"escalate", "bind", "impersonate", "delete", "deletecollection"} & set(
                rule["verbs"]
            ), role["metadata"]["name"]
            assert "secrets" not in rule.get("resources", []), role["metadata"]["name"]
    for binding in by_kind(objects, "RoleBinding") + by_kind(objects, "ClusterRoleBinding"):
        ref = binding["roleRef"]["name"]
        assert ref in ours or ref in BUILTIN_ROLES, f"{binding['metadata']['name']} -> {ref}"
        assert ref not in ("cluster-admin", "admin", "edit")


def rules_of(objects: list[dict[str, Any]], component: str) -> set[tuple[str, str, str]]:
    role = named(objects, "ClusterRole", f"-{component}")
    return {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def test_each_component_gets_exactly_what_its_code_calls(render: Render) -> None:
    objects = render()
    assert rules_of(objects, "node") == {
        ("", "nodes", v) for v in ("get", "list", "watch", "patch")
    } | {
        ("", "nodes/status", "patch")  # capacity: extender-managed resources, new MIG slices
    } | {("", "pods", v) for v in ("list", "watch", "patch")}  # pods leaving; the allocation record
    assert rules_of(objects, "extender") == {
        ("", "nodes", "list"),
        ("", "nodes", "watch"),
        ("", "pods", "list"),
        ("", "pods", "watch"),
        ("", "pods/binding", "create"),  # its metadata carries the assignment annotation
        ("policy", "poddisruptionbudgets", "list"),  # the preempt verb's PDB count
        ("policy", "poddisruptionbudgets", "watch"),
    }
    operator = rules_of(objects, "operator")
    assert ("gpupart.io", "gpupartitions/status", "patch") in operator
    assert ("", "nodes", "patch") in operator and ("", "events", "create") in operator
    assert ("kopf.dev", "clusterkopfpeerings", "patch") in operator
    # Dynamic MIG reads pods (demand and slices in use) and never writes them.
    assert {r for r in operator if r[1].startswith("pods")} == {
        ("", "pods", "get"),
        ("", "pods", "list"),
        ("", "pods", "watch"),
    }
    # Each ServiceAccount is bound to its own component's role only.
    for binding in by_kind(objects, "ClusterRoleBinding"):
        (subject,) = binding["subjects"]
        component = subject["name"].rsplit("-", 1)[1]
        assert component in binding["metadata"]["name"]


def test_only_the_node_pod_is_privileged_or_root(render: Render) -> None:
    for name, spec in pod_specs(render()).items():
        (container,) = spec["containers"]
        sc = container["securityContext"]
        assert container["resources"]["requests"], name
        assert "livenessProbe" in container and "readinessProbe" in container, name
        assert sc["readOnlyRootFilesystem"] is True, name
        if name.endswith("-node"):
            assert sc["privileged"] is True
            continue
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        assert spec["securityContext"]["runAsUser"] != 0, name
        assert sc["allowPrivilegeEscalation"] is False, name
        assert sc["capabilities"] == {"drop": ["ALL"]}, name
        assert not any("hostPath" in v for v in spec.get("volumes", [])), name


def test_node_daemonset_mounts_the_kubelet_sockets_on_gpu_nodes_only(render: Render) -> None:
    spec = pod_specs(render())["gp-gpupart-node"]
    host_paths = {v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    assert host_paths == {
        "/var/lib/kubelet/device-plugins",
        "/var/lib/kubelet/pod-resources",
        "/run/gpupart/mps",
    }
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec[
        "tolerations"
    ]
    args = spec["containers"][0]["args"]
    assert args[0] == "node" and not any(a.startswith("--simulate") for a in args)
    env = {e["name"]: e for e in spec["containers"][0]["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"


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


def test_dedicated_scheduler_calls_the_extender_service(render: Render) -> None:
    objects = render()
    config = yaml.safe_load(named(objects, "ConfigMap", "-scheduler")["data"]["config.yaml"])
    assert config["kind"] == "KubeSchedulerConfiguration"
    assert config["profiles"][0]["schedulerName"] == "gpupart-scheduler"
    assert config["profiles"][0]["percentageOfNodesToScore"] == 100
    sampled = render({"scheduler.percentageOfNodesToScore": 0})
    sampled_config = named(sampled, "ConfigMap", "-scheduler")["data"]["config.yaml"]
    assert yaml.safe_load(sampled_config)["profiles"][0]["percentageOfNodesToScore"] == 0
    (extender,) = config["extenders"]
    service = named(objects, "Service", "-extender")
    port = service["spec"]["ports"][0]["port"]
    name, namespace = service["metadata"]["name"], service["metadata"]["namespace"]
    assert extender["urlPrefix"] == f"http://{name}.{namespace}.svc:{port}/gpupart"
    assert extender["nodeCacheCapable"] is True and extender["ignorable"] is False
    # GPU memory and compute are counted in-tree too: that makes preemption see them (ADR 005).
    for counted in ("gpupart.io/gpu-memory", "gpupart.io/gpu-compute"):
        assert {"name": counted, "ignoredByScheduler": False} in extender["managedResources"]
    assert extender["preemptVerb"] == "preempt"
    assert config["leaderElection"]["resourceName"] == "gpupart-scheduler"
    lease = named(objects, "Role", "-scheduler-lease")
    assert lease["rules"][1]["resourceNames"] == ["gpupart-scheduler"]
    settings = yaml.safe_load(named(objects, "ConfigMap", "-extender")["data"]["settings.yaml"])
    assert settings["host"] == "0.0.0.0" and settings["port"] == port
    image = named(objects, "Deployment", "-scheduler")["spec"]["template"]["spec"]["containers"][0]
    assert image["image"].rsplit(":", 1)[1].startswith("v1.")


def test_existing_scheduler_gets_only_the_extenders_entry(render: Render) -> None:
    objects = render(COMBINATIONS["existing-scheduler"])
    assert not any(o["metadata"]["name"].endswith("-scheduler") for o in objects)
    entry = yaml.safe_load(
        named(objects, "ConfigMap", "-scheduler-extender")["data"]["extenders.yaml"]
    )
    assert entry["extenders"][0]["urlPrefix"].endswith(".svc:8888/gpupart")


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
    ],
)
def test_a_wrong_value_fails_with_a_message_naming_it(
    helm: Callable[..., Any], values: dict[str, Any], message: str
) -> None:
    from .conftest import set_flags

    result = helm("template", "gp", str(CHART), *set_flags(values), check=False)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr


def test_notes_tell_how_to_partition_and_request_a_slice(helm: Callable[..., Any]) -> None:
    result = helm("install", "gp", str(CHART), "--dry-run=client", "--namespace", "gpupart-system")
    notes = result.stdout.split("NOTES:", 1)[1]
    assert "kubectl apply -f examples/mig-a100.yaml" in notes
    assert "schedulerName: gpupart-scheduler" in notes
    assert "nvidia.com/mig-1g.10gb: 1" in notes


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
    for workload in by_kind(objects, "Deployment") + by_kind(objects, "DaemonSet"):
        (container,) = workload["spec"]["template"]["spec"]["containers"]
        if "args" not in container:
            continue  # kube-scheduler
        args = container["args"]
        parsed = build_parser(args[0]).parse_args(args)
        if args[0] == "node":
            parsed.node_name = "gpu-node-1"  # the downward API's NODE_NAME
            settings = node_settings.from_args(parsed)
            assert settings.metrics_address == "0.0.0.0"
        elif args[0] == "operator":
            assert operator_settings.from_args(parsed).peering
        elif args[0] == "extender":
            name = workload["metadata"]["name"]
            (config_map,) = [
                c for c in by_kind(objects, "ConfigMap") if c["metadata"]["name"] == name
            ]
            path = tmp_path / "settings.yaml"
            path.write_text(config_map["data"]["settings.yaml"])
            extender = load_settings(path)
            assert extender.host == "0.0.0.0"
            assert f"--config={container['volumeMounts'][0]['mountPath']}/settings.yaml" in args
