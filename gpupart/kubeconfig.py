"""Kubernetes API credentials, and the words of a refused request, one way for the operator, node agent and extender."""

from __future__ import annotations

import json
from pathlib import Path

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException


def load_configuration(
    kubeconfig: str | Path | None = None, *, pool_size: int | None = None
) -> client.Configuration:
    """The kubeconfig if given, else the in-cluster service account, else $KUBECONFIG or
    ~/.kube/config; `pool_size` kept-alive connections (the client's default when None)."""
    configuration = client.Configuration()
    if kubeconfig:
        config.load_kube_config(config_file=str(kubeconfig), client_configuration=configuration)
    else:
        try:
            config.load_incluster_config(client_configuration=configuration)
        except config.ConfigException:
            config.load_kube_config(client_configuration=configuration)
    if pool_size is not None:
        configuration.connection_pool_maxsize = pool_size
    return configuration


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
