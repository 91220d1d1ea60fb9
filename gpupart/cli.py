"""The `gpupart` command line: parses flags and files at the edge, then calls the core or starts a component."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from importlib import metadata
from typing import Protocol, cast

from gpupart import __version__

# Subcommands that live in their own shell module: name -> module exposing
# `add_arguments(parser) -> None` and `run(args) -> int`. Imported only when chosen, so
# `gpupart plan` never pays for kopf, grpc or FastAPI.
COMPONENTS: dict[str, tuple[str, str]] = {
    "plan": (
        "gpupart.plancmd",
        "Show what a GpuPartition gives each GPU (MIG layout, MPS, time-slicing) or why it cannot",
    ),
    "simulate": (
        "gpupart.simulate",
        "Replay a workload on a simulated cluster and score the policy",
    ),
    "operator": ("gpupart_operator.main", "Run the GpuPartition operator (kopf)"),
    "node": ("gpupart_plugin.main", "Run the node agent and kubelet device plugin"),
    "nvml-report": (
        "gpupart_plugin.report",
        "Print what NVML reports of this node's GPUs (read-only) against the catalogue",
    ),
    "extender": ("gpupart_extender.main", "Run the kube-scheduler extender (FastAPI)"),
    "assignment-keys": (
        "gpupart.keycmd",
        "Print the public keys of the extender's assignment private keys, or a new private key",
    ),
}


class Component(Protocol):
    """What a subcommand's module provides."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...
    def run(self, args: argparse.Namespace) -> int: ...


def version() -> str:
    """The installed distribution's version (its metadata), else the source tree's."""
    try:
        return metadata.version("gpupart")
    except metadata.PackageNotFoundError:
        return __version__


class MissingModule(Exception):
    """A subcommand's module needs a package this environment lacks."""


def build_parser(chosen: str | None) -> argparse.ArgumentParser:
    """Only the chosen subcommand's module is imported, to add its flags."""
    parser = argparse.ArgumentParser(
        prog="gpupart", description="Partition NVIDIA GPUs on Kubernetes."
    )
    parser.add_argument(
        "--version", action="version", version=f"gpupart {version()}", help="print the version"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    sub.add_parser(
        "version", help="Print the gpupart version", description="Print the gpupart version"
    )
    for name, (module_name, help_text) in COMPONENTS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        sub_parser.set_defaults(module=module_name)
        if name == chosen:
            load_component(module_name).add_arguments(sub_parser)
    return parser


def load_component(module_name: str) -> Component:
    try:
        return cast(Component, importlib.import_module(module_name))
    except ModuleNotFoundError as error:
        if error.name is None or error.name.split(".")[0] in (
            "gpupart",
            "gpupart_operator",
            "gpupart_plugin",
            "gpupart_extender",
        ):
            raise
        raise MissingModule(error.name.split(".")[0]) from None


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    chosen = arguments[0] if arguments else None
    try:
        args = build_parser(chosen).parse_args(arguments)
        if args.command == "version":
            print(f"gpupart {version()}")
            return 0
        return load_component(args.module).run(args)
    except MissingModule as error:
        # `make demo` installs only what `simulate` and `plan` import.
        sys.stderr.write(
            f"gpupart {chosen}: the Python package {str(error)!r} is not installed here; "
            "install gpupart with its dependencies (pip install gpupart, or pip install -e . "
            "in a checkout)\n"
        )
        return 2


if __name__ == "__main__":
    sys.exit(main())
