"""Kubernetes API credentials, and the words of a refused request, one way for the operator, node agent and extender."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from gpupart.core.errors import InvalidInput

KUBECONFIG_SETTING = "--kubeconfig or KUBECONFIG"
"""How the operator and the node agent are told a kubeconfig (named in their errors)."""


def load_configuration(
    kubeconfig: str | Path | None = None,
    *,
    pool_size: int | None = None,
    setting: str = KUBECONFIG_SETTING,
) -> client.Configuration:
    """The kubeconfig if given, else the in-cluster service account, else $KUBECONFIG or
    ~/.kube/config; `pool_size` kept-alive connections (the client's default when None).

    No credentials, or a kubeconfig that cannot be read or used, is an InvalidInput naming the
    file, the problem and the `setting` to change (the client's own errors are a traceback or
    "No configuration found" with no file named)."""
    configuration = client.Configuration()
    if not kubeconfig:
        try:
            config.load_incluster_config(client_configuration=configuration)
        except config.ConfigException:
            kubeconfig = _default_kubeconfig(setting)
        else:
            kubeconfig = None
    if kubeconfig:
        _load_file(Path(kubeconfig), configuration, setting)
    if pool_size is not None:
        configuration.connection_pool_maxsize = pool_size
    return configuration


def _default_kubeconfig(setting: str) -> str:
    """Outside a pod: $KUBECONFIG (its first file, as kubectl would read it) or ~/.kube/config."""
    listed = [p for p in os.environ.get("KUBECONFIG", "").split(os.pathsep) if p]
    if listed:
        return listed[0]
    default = Path(os.path.expanduser("~/.kube/config"))
    if not default.exists():
        raise InvalidInput(
            "",
            "no Kubernetes credentials: not in a pod (no service account) and no kubeconfig "
            f"at {default}; set {setting} to a kubeconfig file",
        )
    return str(default)


def _load_file(path: Path, configuration: client.Configuration, setting: str) -> None:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise InvalidInput(
            str(path),
            f"cannot read the kubeconfig ({error.strerror or error}); set {setting} to a "
            "readable kubeconfig file",
        ) from None
    except UnicodeDecodeError:
        raise InvalidInput(
            str(path), f"is not a kubeconfig (not UTF-8 text); check {setting}"
        ) from None
    try:
        raw: Any = yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        raise InvalidInput(
            f"{path}{line}", f"is not a kubeconfig (malformed YAML); check {setting}"
        ) from None
    if not isinstance(raw, dict):
        raise InvalidInput(str(path), f"is not a kubeconfig (not a YAML mapping); check {setting}")
    try:
        # From the file, not the mapping read above: relative certificate paths in it are
        # relative to the file's folder.
        config.load_kube_config(config_file=str(path), client_configuration=configuration)
    except (config.ConfigException, ValueError, TypeError, KeyError) as error:
        problem = (
            str(error).removeprefix("Invalid kube-config file. ").strip() or type(error).__name__
        )
        raise InvalidInput(
            str(path), f"is not a usable kubeconfig: {problem}; check {setting}"
        ) from None


def describe_api_error(error: BaseException, *, limit: int = 500) -> str:
    """One line for a log or a status: an API refusal's code, reason and the API server's own
    message (the Status body says which field and why; "422 Unprocessable Entity" alone does
    not), else the error's type and first line."""
    if isinstance(error, ApiException):
        text = f"{error.status} {error.reason}"
        message = _status_message(error.body)
        return f"{text}: {message[:limit]}" if message else text
    first = (str(error).splitlines() or [""])[0][:limit]
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


def _status_message(body: object) -> str:
    """The `message` of a metav1.Status body, '' when the body is not one."""
    if isinstance(body, bytes):
        body = body.decode("utf-8", "replace")
    if not isinstance(body, str) or not body:
        return ""
    try:
        status = json.loads(body)
    except ValueError:
        return body.splitlines()[0] if body.strip() else ""
    message = status.get("message") if isinstance(status, dict) else None
    return str(message) if message else ""
