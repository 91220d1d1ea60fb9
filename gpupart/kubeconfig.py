"""Kubernetes API credentials, loaded one way by the operator, node agent and extender."""

from __future__ import annotations

from pathlib import Path

from kubernetes import client, config


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
