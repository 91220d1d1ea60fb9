"""One settings convention for all components: flag > variable > default, named errors, a full --help."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gpupart.core.errors import InvalidInput
from gpupart.settings import SettingsTable
from gpupart_extender import settings as extender_settings
from gpupart_operator import settings as operator_settings
from gpupart_plugin import settings as node_settings

KUBERNETES_NAMES = {"NODE_NAME", "KUBELET_SOCKET", "KUBECONFIG", "POD_NAME", "HOSTNAME"}
"""Variables that Kubernetes or its tooling already sets; every other one is GPUPART_*."""


def tables() -> dict[str, SettingsTable]:
    return {
        "operator": operator_settings.SETTINGS,
        "node": node_settings.SETTINGS,
        "extender": extender_settings._table()[0],
    }


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for table in tables().values():
        for setting in table.settings:
            for name in table.env_names(setting):
                monkeypatch.delenv(name, raising=False)


def parse(module: object, *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)  # type: ignore[attr-defined]
    return parser.parse_args(list(argv))


def operator(*argv: str) -> operator_settings.OperatorSettings:
    return operator_settings.from_args(parse(operator_settings, *argv))


def node(*argv: str) -> node_settings.NodeSettings:
    return node_settings.from_args(parse(node_settings, "--node-name=n1", *argv))


def extender(*argv: str) -> extender_settings.ExtenderSettings:
    return extender_settings.from_args(parse(extender_settings, *argv))


def test_a_flag_wins_over_its_variable_and_a_variable_over_the_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert operator().drift_timer_seconds == 60
    monkeypatch.setenv("GPUPART_OPERATOR_RESYNC_SECONDS", "30")
    assert operator().drift_timer_seconds == 30
    assert operator("--resync-seconds=10").drift_timer_seconds == 10

    assert node().relist_s == 60
    monkeypatch.setenv("GPUPART_RESYNC_SECONDS", "30")
    assert node().relist_s == 30
    assert node("--resync-seconds=10").relist_s == 10

    assert extender().resync_seconds == 300
    monkeypatch.setenv("GPUPART_EXTENDER_RESYNC_SECONDS", "30")
    assert extender().resync_seconds == 30
    assert extender("--resync-seconds=20").resync_seconds == 20


def test_the_extender_file_is_below_variables_and_flags(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "settings.yaml"
    config.write_text("port: 9000\nmemo_size: 5\nweights: {headroom: 3, priority: 4}\n")
    settings = extender(f"--config={config}")
    assert (settings.port, settings.memo_size, settings.weights.headroom) == (9000, 5, 3)
    monkeypatch.setenv("GPUPART_EXTENDER_PORT", "9001")
    monkeypatch.setenv("GPUPART_EXTENDER_WEIGHTS__HEADROOM", "7")
    settings = extender(f"--config={config}", "--memo-size=6")
    assert (settings.port, settings.memo_size) == (9001, 6)
    # A nested variable replaces one key; the file's other keys stay.
    assert (settings.weights.headroom, settings.weights.priority) == (7, 4)
    monkeypatch.setenv("GPUPART_EXTENDER_CONFIG", str(config))
    assert extender().memo_size == 5


def test_variables_are_gpupart_names_but_for_the_kubernetes_ones() -> None:
    for component, table in tables().items():
        for setting in table.settings:
            for name in table.env_names(setting):
                assert name.startswith("GPUPART_") or name in KUBERNETES_NAMES, (component, name)
    # The names the docs and the chart already use.
    names = {
        name
        for table in tables().values()
        for setting in table.settings
        for name in table.env_names(setting)
    }
    assert {
        "GPUPART_OPERATOR_PEERING",
        "GPUPART_OPERATOR_LIVENESS_PORT",
        "GPUPART_OPERATOR_RELEASE_TIMEOUT_SECONDS",
        "GPUPART_PLUGIN_DIR",
        "GPUPART_SIMULATE_AUTO_RESET",
        "GPUPART_EXTENDER_WEIGHTS__FRAGMENTATION",
        "GPUPART_EXTENDER_PROFILE",
        "NODE_NAME",
        "KUBECONFIG",
        "POD_NAME",
    } <= names


def test_the_kubernetes_names_are_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POD_NAME", "gpupart-operator-7d9")
    monkeypatch.setenv("KUBECONFIG", "/etc/k/config")
    settings = operator()
    assert (settings.instance, settings.kubeconfig) == ("gpupart-operator-7d9", "/etc/k/config")
    monkeypatch.setenv("NODE_NAME", "gpu-7")
    parsed = parse(node_settings)
    assert node_settings.from_args(parsed).node_name == "gpu-7"


@pytest.mark.parametrize(
    ("read", "argv", "env", "where"),
    [
        (operator, ["--resync-seconds=soon"], {}, "--resync-seconds: expected a number, got 'soon'"),
        (operator, [], {"GPUPART_OPERATOR_LIVENESS_PORT": "x"}, "GPUPART_OPERATOR_LIVENESS_PORT: expected an integer"),
        (operator, ["--priority=high"], {}, "--priority: expected an integer or 'auto'"),
        (operator, ["--write-workers=0"], {}, "write_workers must be ≥ 1"),
        (node, ["--cdi=maybe"], {}, "--cdi: expected true or false, got 'maybe'"),
        (node, [], {"GPUPART_IGNORED_XIDS": "13,x"}, "GPUPART_IGNORED_XIDS: expected comma-separated integers"),
        (node, ["--metrics-port=http"], {}, "--metrics-port: expected an integer"),
        (extender, ["--port=eighty"], {}, "--port: Input should be a valid integer"),
        (extender, [], {"GPUPART_EXTENDER_RESERVE_FRACTION": "2"}, "GPUPART_EXTENDER_RESERVE_FRACTION: Input"),
        (extender, ["--weights-fragmentation=-1"], {}, "--weights-fragmentation: Input should be greater than"),
        (extender, ["--strategy=densest"], {}, "--strategy: Input should be 'binpack' or 'spread'"),
    ],
)  # fmt: skip
def test_a_bad_value_is_refused_naming_its_flag_or_variable(
    read: object,
    argv: list[str],
    env: dict[str, str],
    where: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(InvalidInput) as refused:
        read(*argv)  # type: ignore[operator]
    assert where in str(refused.value)


def test_a_bad_settings_file_names_the_file_and_key(tmp_path: Path) -> None:
    config = tmp_path / "settings.yaml"
    config.write_text("weights: {headroom: lots}\n")
    with pytest.raises(InvalidInput, match=r"settings.yaml: weights.headroom: Input should be"):
        extender(f"--config={config}")
    config.write_text("- a list\n")
    with pytest.raises(InvalidInput, match="expected a mapping of settings"):
        extender(f"--config={config}")
    with pytest.raises(InvalidInput, match="cannot read the settings file"):
        extender(f"--config={tmp_path / 'absent.yaml'}")


def test_boolean_flags_bare_or_valued(monkeypatch: pytest.MonkeyPatch) -> None:
    assert node().cdi and not node("--cdi=false").cdi and node("--cdi").cdi
    assert operator("--verbose").verbose and not operator().verbose
    monkeypatch.setenv("GPUPART_OPERATOR_VERBOSE", "yes")
    assert operator().verbose and not operator("--verbose=no").verbose
    assert operator("--peering=p", "--standalone").standalone


@pytest.mark.parametrize("component", ["operator", "node", "extender"])
def test_help_lists_every_setting_with_its_variable_and_default(component: str) -> None:
    table = tables()[component]
    shown = subprocess.run(
        [str(Path(sys.executable).parent / "gpupart"), component, "--help"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "COLUMNS": "1000"},
    ).stdout
    # One entry per option: its line and the indented help lines under it.
    entries = {
        entry.split()[0]: " ".join(entry.split())
        for entry in re.split(r"\n(?=  -)", shown.split("options:", 1)[1])
        if entry.strip()
    }
    for setting in table.settings:
        entry = entries.get(setting.flag, "")
        assert entry, f"{setting.flag} missing from `gpupart {component} --help`"
        for name in table.env_names(setting):
            assert name in entry, (setting.flag, name, entry)
        default = repr(setting.default) if setting.default else "unset"
        assert f"default: {default}" in entry, (setting.flag, entry)
