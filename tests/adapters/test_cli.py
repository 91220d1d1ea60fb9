"""The `gpupart` command line as a user meets it, each case a real subprocess of the installed
command: --version, one help style for every subcommand, the components' one-line start-up
errors (no credentials, an unreadable or unusable kubeconfig), a missing dependency named,
`nvml-report`'s help example as written, and what `make demo` installs."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
GPUPART = Path(sys.executable).with_name("gpupart")
SUBCOMMANDS = ("version", "plan", "simulate", "operator", "node", "nvml-report", "extender")


def gpupart(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(GPUPART), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env if env is not None else {"PATH": "/usr/bin:/bin", "COLUMNS": "1000"},
        cwd=cwd,
    )


def test_version_comes_from_the_package_metadata() -> None:
    expected = f"gpupart {metadata.version('gpupart')}\n"
    for args in (["--version"], ["version"]):
        done = gpupart(*args)
        assert (done.returncode, done.stdout, done.stderr) == (0, expected, "")


def _help_entries(text: str) -> dict[str, str]:
    """Option -> its help line(s) joined, from an argparse --help printed 1000 columns wide."""
    entries: dict[str, str] = {}
    for section in re.split(r"\n(?=\S[^\n]*:\n)", text)[1:]:
        title, _, body = section.partition("\n")
        if title.startswith("positional"):
            continue
        for entry in re.split(r"\n(?=  -)", body):
            if entry.strip():
                words = entry.split()
                entries[words[0].rstrip(",")] = " ".join(words)
    return entries


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_every_subcommand_has_one_help_style(command: str) -> None:
    done = gpupart(command, "--help")
    assert done.returncode == 0 and done.stderr == ""
    assert done.stdout.startswith(f"usage: gpupart {command} ")
    description = done.stdout.split("\n\n")[1]
    assert description[0].isupper() and not description.endswith("."), description
    entries = _help_entries(done.stdout)
    assert "-h" in entries
    for flag, entry in entries.items():
        if flag == "-h":
            continue
        # "--flag METAVAR  help ..." or "--flag  help ..." (a switch): help is never missing
        words = entry.split()
        takes_value = len(words) > 1 and (
            words[1].isupper()
            or words[1].startswith("[")
            or words[1].startswith("{")
            or words[1].endswith(".png")
        )
        help_text = " ".join(words[2:] if takes_value else words[1:])
        # one voice: a lower-case phrase ("print ...", "node list ..."), acronyms aside
        assert help_text and not re.match(r"[A-Z][a-z]", help_text), (command, flag, entry)
        if takes_value:
            assert re.search(r"\[(env [^\]]*, )?default: [^\]]+\]", help_text), (command, entry)


def test_nvml_report_help_example_works_as_written() -> None:
    help_text = gpupart("nvml-report", "--help").stdout
    (example,) = re.findall(r"e\.g\. (\S+?)\)", help_text)
    done = gpupart("nvml-report", "--simulate", example)
    assert done.returncode == 0, done.stderr
    assert '"catalogue_product": "H100-SXM5-80GB"' in done.stdout
    assert done.stdout.count('"index"') == int(example.split("x")[0])


BAD_KUBECONFIGS = {
    "missing": (
        "/nonexistent/kubeconfig",
        "{path}: cannot read the kubeconfig (No such file or "
        "directory); set --kubeconfig or KUBECONFIG to a readable kubeconfig file",
    ),
    "directory": (
        "{tmp}",
        "{path}: cannot read the kubeconfig (Is a directory); set --kubeconfig "
        "or KUBECONFIG to a readable kubeconfig file",
    ),
    "malformed": (
        "{tmp}/bad.yaml",
        "{path}:3: is not a kubeconfig (malformed YAML); check --kubeconfig or KUBECONFIG",
    ),
    "no-context": (
        "{tmp}/empty.yaml",
        "{path}: is not a usable kubeconfig: Expected key "
        "current-context in {path}; check --kubeconfig or KUBECONFIG",
    ),
}
COMPONENT_ARGS = {
    "operator": ["operator"],
    "extender": ["extender", "--port", "0", "--health-port", "0"],
    "node": ["node", "--node-name", "n1", "--simulate", "1xA100-SXM4-80GB"],
}


def _bare_env(home: Path) -> dict[str, str]:
    """No credentials of any kind: no KUBECONFIG, a HOME without ~/.kube, not in a pod."""
    return {"PATH": "/usr/bin:/bin", "HOME": str(home)}


@pytest.mark.parametrize("component", COMPONENT_ARGS)
def test_a_component_without_credentials_says_so_in_one_line(
    component: str, tmp_path: Path
) -> None:
    done = gpupart(*COMPONENT_ARGS[component], env=_bare_env(tmp_path), cwd=tmp_path)
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr == (
        f"gpupart {component}: no Kubernetes credentials: not in a pod (no service account) and "
        f"no kubeconfig at {tmp_path}/.kube/config; set --kubeconfig or KUBECONFIG to a "
        "kubeconfig file\n"
    )


@pytest.mark.parametrize(
    ("case", "given"), [*((case, "flag") for case in BAD_KUBECONFIGS), ("missing", "variable")]
)
@pytest.mark.parametrize("component", COMPONENT_ARGS)
def test_a_component_with_a_bad_kubeconfig_names_it_in_one_line(
    component: str, case: str, given: str, tmp_path: Path
) -> None:
    (tmp_path / "bad.yaml").write_text("apiVersion: v1\nclusters: [\n")
    (tmp_path / "empty.yaml").write_text("apiVersion: v1\nkind: Config\nclusters: []\n")
    template, message = BAD_KUBECONFIGS[case]
    path = template.format(tmp=tmp_path)
    env = _bare_env(tmp_path)
    args = list(COMPONENT_ARGS[component])
    if given == "flag":
        args += ["--kubeconfig", path]
    else:
        env["KUBECONFIG"] = path
    done = gpupart(*args, env=env, cwd=tmp_path)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == f"gpupart {component}: {message.format(path=path)}\n"


def test_a_missing_dependency_is_named_not_a_traceback(tmp_path: Path) -> None:
    # What a `make demo` environment (gpupart and PyYAML only) answers to `gpupart operator`.
    probe = (
        "import sys; sys.modules['kopf'] = None; from gpupart.cli import main; "
        "sys.exit(main(['operator']))"
    )
    done = subprocess.run(
        [sys.executable, "-P", "-c", probe],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 2
    assert done.stderr == (
        "gpupart operator: the Python package 'kopf' is not installed here; install gpupart "
        "with its dependencies (pip install gpupart, or pip install -e . in a checkout)\n"
    )


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_demo_installs_gpupart_alone_and_test_adds_the_test_extra(tmp_path: Path) -> None:
    def plan(target: str) -> str:
        return subprocess.run(
            ["make", "-n", "-C", str(ROOT), target, f"VENV={tmp_path}/venv"],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
            env={**os.environ, "MAKEFLAGS": ""},
        ).stdout

    demo = plan("demo")
    installs = [line for line in demo.splitlines() if " install " in line]
    assert installs == [
        f"{tmp_path}/venv/bin/python -P -m pip --disable-pip-version-check -q install "
        "--no-deps -e . 'pyyaml>=6.0'"
    ]
    assert f"{tmp_path}/venv/bin/gpupart simulate" in demo
    unit = plan("unit")
    assert "install -e '.[test]' -e tests/support" in unit


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["node"], "gpupart node: --node-name: is required (or env NODE_NAME)"),
        (
            ["node", "--node-name", "n1", "--simulate", "1xTesla-T4"],
            "gpupart node: unknown GPU product 'Tesla-T4': gpupart has no MIG profile table",
        ),
        (
            ["operator", "--resync-seconds", "soon"],
            "gpupart operator: --resync-seconds: expected a number, got 'soon'",
        ),
        (
            ["extender", "--port", "99999"],
            "gpupart extender: --port: Input should be less than or equal to 65535",
        ),
    ],
)
def test_a_component_with_a_bad_setting_says_so_in_one_line(
    args: list[str], message: str, tmp_path: Path
) -> None:
    (tmp_path / ".kube").mkdir()
    (tmp_path / ".kube" / "config").write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "clusters: [{name: c, cluster: {server: 'https://127.0.0.1:1'}}]\n"
        "users: [{name: u, user: {token: t}}]\n"
        "contexts: [{name: c, context: {cluster: c, user: u}}]\n"
    )
    done = gpupart(*args, env=_bare_env(tmp_path), cwd=tmp_path)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.startswith(message) and done.stderr.count("\n") == 1, done.stderr
