"""`gpupart assignment-keys`: the extender's Ed25519 assignment keys for those who bring their own.

`public PRIVATE.pem` prints the PEM public keys of a private key file (what the extender
publishes, and what a node agent's `--assignment-key-file` holds); `generate` prints a new
private key (PKCS#8 PEM, as the chart's `genPrivateKey "ed25519"`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gpupart.core.api.provenance import MAX_KEY_FILE_BYTES
from gpupart.core.errors import InvalidInput


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    public = sub.add_parser(
        "public",
        help="print the PEM public keys of a file of Ed25519 private keys",
        description="Print the PEM public keys of a file of Ed25519 private keys (the "
        "extender's assignment_key_file): the first is the signing key's.",
    )
    public.add_argument("private_file", metavar="PRIVATE.pem", type=Path)
    sub.add_parser(
        "generate",
        help="print a new Ed25519 private key (PKCS#8 PEM)",
        description="Print a new Ed25519 private key (PKCS#8 PEM) for the extender.",
    )


def run(args: argparse.Namespace) -> int:
    from gpupart.signing import generate_private_pem, private_keys

    if args.action == "generate":
        sys.stdout.write(generate_private_pem())
        return 0
    path: Path = args.private_file
    try:
        try:
            with open(path, "rb") as f:
                text = f.read(MAX_KEY_FILE_BYTES + 1)
        except OSError as error:
            raise InvalidInput(str(path), f"cannot read it: {error.strerror}") from None
        keys = private_keys(text, where=str(path))
    except InvalidInput as error:
        sys.stderr.write(f"gpupart assignment-keys: {error}\n")
        return 2
    sys.stdout.write(keys.pem())
    return 0
