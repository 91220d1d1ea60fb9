"""`gpupart operator`: flags -> frozen settings -> API clients -> kopf registry -> run until signalled."""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import dataclass

import kopf
from kubernetes import client

from gpupart import logs
from gpupart.core.errors import InvalidInput
from gpupart.kubeconfig import load_configuration
from gpupart_operator import settings as settings_module
from gpupart_operator.handlers import build_registry
from gpupart_operator.metrics import Metrics
from gpupart_operator.model import Resolutions
from gpupart_operator.reconciler import Reconciler
from gpupart_operator.rounds import DemandRounds
from gpupart_operator.settings import OperatorSettings
from gpupart_operator.writer import Writer

log = logging.getLogger("gpupart.operator")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    settings_module.add_arguments(parser)


@dataclass(frozen=True, slots=True)
class Operator:
    """The operator's parts, built once: one writer under the partition pass and the rounds."""

    settings: OperatorSettings
    metrics: Metrics
    writer: Writer
    reconciler: Reconciler
    rounds: DemandRounds
    registry: kopf.OperatorRegistry

    def close(self) -> None:
        self.writer.close()
        self.writer.core.api_client.close()


def build(settings: OperatorSettings) -> Operator:
    # One connection per parallel writer (partition passes and dynamic MIG rounds), or writes
    # queue for a connection.
    configuration = load_configuration(
        settings.kubeconfig, pool_size=2 * settings.write_workers + 4
    )
    metrics = Metrics()
    writer = Writer(client.ApiClient(configuration), settings, metrics)
    resolutions = Resolutions()
    reconciler = Reconciler(writer, metrics, resolutions)
    rounds = DemandRounds(writer, settings, metrics, resolutions)
    registry = build_registry(reconciler, writer, settings, rounds)
    return Operator(settings, metrics, writer, reconciler, rounds, registry)


def run(args: argparse.Namespace) -> int:
    try:
        settings = settings_module.from_args(args)
    except InvalidInput as error:
        sys.stderr.write(f"gpupart operator: {error}\n")
        return 2
    # The one log format of gpupart instead of kopf.configure's; kopf's per-object records
    # keep their object as a field.
    logs.configure("DEBUG" if settings.verbose else "INFO")
    logging.getLogger("asyncio").setLevel(logging.WARNING)  # its debug lines are kopf's noise
    try:
        operator = build(settings)
    except InvalidInput as error:  # no credentials, or a kubeconfig that cannot be used
        sys.stderr.write(f"gpupart operator: {error}\n")
        return 2
    if settings.metrics_port is not None:
        operator.metrics.serve(settings.bind_address, settings.metrics_port)
    log.info(
        "Starting operator",
        extra=logs.kv(
            peering=settings.peering or "(standalone)",
            priority=settings.priority,
            resync=f"{settings.drift_timer_seconds:g}s",
        ),
    )
    try:
        kopf.run(
            registry=operator.registry,
            clusterwide=True,
            standalone=settings.standalone,
            peering_name=settings.peering,
            priority=settings.priority,
            liveness_endpoint=settings.liveness_endpoint,
        )
    finally:
        operator.close()
    return 0
