"""The security settings of `gpupart extender`: where they come from, and what it refuses to start with.

We test these aspects:
- `assignment_key_file` from the settings file, GPUPART_EXTENDER_ASSIGNMENT_KEY_FILE or the
  flag; `scheduler_names` as a list in the file and comma-separated in a variable;
- a non-loopback `host` without `tls_client_ca_file` is refused with one sentence naming the
  ways out, unless `allow_unauthenticated`; a client CA needs a serving certificate;
- the real command refuses such settings with one line on stderr and exit code 2, before it
  listens or talks to any API server.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest

from gpupart.core.errors import InvalidInput
from gpupart_extender import settings as extender_settings
from gpupart_extender.settings import ExtenderSettings


def read(*argv: str, environ: Mapping[str, str] | None = None) -> ExtenderSettings:
    parser = argparse.ArgumentParser()
    extender_settings.add_arguments(parser)
    return extender_settings.from_args(parser.parse_args(list(argv)), environ or {})


def test_the_key_file_comes_from_the_file_the_variable_or_the_flag(tmp_path: Path) -> None:
    config = tmp_path / "extender.yaml"
    config.write_text("assignment_key_file: /etc/gpupart/assignment-key/keys\n")
    assert read(f"--config={config}").assignment_key_file == Path(
        "/etc/gpupart/assignment-key/keys"
    )
    env = {"GPUPART_EXTENDER_ASSIGNMENT_KEY_FILE": "/run/keys"}
    assert read(f"--config={config}", environ=env).assignment_key_file == Path("/run/keys")
    flagged = read(f"--config={config}", "--assignment-key-file=/k", environ=env)
    assert flagged.assignment_key_file == Path("/k")
    assert read().assignment_key_file is None


def test_scheduler_names_are_a_list(tmp_path: Path) -> None:
    assert read().scheduler_names == ["gpupart-scheduler"]
    env = {"GPUPART_EXTENDER_SCHEDULER_NAMES": "gpupart-scheduler, team-scheduler"}
    assert read(environ=env).scheduler_names == ["gpupart-scheduler", "team-scheduler"]
    config = tmp_path / "extender.yaml"
    config.write_text("scheduler_names: [a, b]\n")
    assert read(f"--config={config}").scheduler_names == ["a", "b"]
    with pytest.raises(InvalidInput, match="GPUPART_EXTENDER_SCHEDULER_NAMES: List should have"):
        read(environ={"GPUPART_EXTENDER_SCHEDULER_NAMES": " , "})


def test_a_non_loopback_host_needs_client_certificates_or_an_explicit_opt_out() -> None:
    with pytest.raises(InvalidInput) as refused:
        read("--host=0.0.0.0")
    assert str(refused.value) == (
        "settings: host '0.0.0.0' is not a loopback address and tls_client_ca_file is unset: "
        "anyone reaching the port could bind pods; set tls_client_ca_file (with tls_cert_file "
        "and tls_key_file), listen on 127.0.0.1, or set allow_unauthenticated: true"
    )
    with pytest.raises(InvalidInput, match="host 'extender.example' is not a loopback"):
        read("--host=extender.example")
    assert read("--host=0.0.0.0", "--allow-unauthenticated=true").allow_unauthenticated
    for loopback in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        assert read(f"--host={loopback}").host == loopback
    secured = read(
        "--host=0.0.0.0",
        "--tls-cert-file=/c.crt",
        "--tls-key-file=/c.key",
        "--tls-client-ca-file=/ca.crt",
    )
    assert secured.tls_client_ca_file == Path("/ca.crt")
    with pytest.raises(InvalidInput, match="tls_client_ca_file needs tls_cert_file and tls_key"):
        read("--tls-client-ca-file=/ca.crt")


def test_the_command_refuses_to_start_with_one_line_and_exit_code_2(tmp_path: Path) -> None:
    config = tmp_path / "extender.yaml"
    config.write_text("host: 0.0.0.0\nport: 0\nhealth_port: 0\n")
    done = subprocess.run(
        [sys.executable, "-m", "gpupart.cli", "extender", f"--config={config}"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2, done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(
        f"gpupart extender: {config}: host '0.0.0.0' is not a loopback address and "
        "tls_client_ca_file is unset"
    ), lines
