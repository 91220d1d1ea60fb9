"""Provenance of the extender's shared-GPU assignments: an Ed25519 signature bound to the pod's UID and node.

A pod's annotations are its tenant's to write, so the node agent never takes a
`gpupart.io/assignment` at its word: the extender signs each one with an Ed25519 private key that
only it holds, over the exact fields the agent acts on, the pod UID and node it was made for and
the id of the key. Node agents hold public keys only, so a compromised node cannot sign an
assignment another node believes. A copy onto another pod, an edited amount, or one made up by
the tenant does not verify (docs/adr-015-tenant-proof-admission.md,
docs/adr-035-asymmetric-assignment-signatures.md).

This module is the standard library only: the signed bytes, the key ids, the key file format
(PEM, PKCS#8 private and SPKI public Ed25519 keys) and the `signature` field's text. The
arithmetic is behind `Signer` and `AssignmentKeys`, implemented outside the core
(`gpupart.signing`, with the `cryptography` package).

The `signature` field is `<key id>:<signature>`: the key id is 16 lowercase hex digits (the
first 8 bytes of SHA-256 over the raw 32-byte public key), the signature the standard base64
(padded, 88 characters) of the 64-byte Ed25519 signature.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
from dataclasses import dataclass, replace
from typing import Protocol

from gpupart.core.api.wire import WIRE_VERSION, PodAssignment
from gpupart.core.errors import InvalidInput

MAX_KEYS = 8
"""Keys in one file or ConfigMap: the first private key signs, every public key verifies."""
MAX_KEY_FILE_BYTES = 64 * 1024
DOMAIN = b"gpupart.io/assignment\n"
"""Prefixed to every signed message, so no other use of the key can produce a valid one."""
KEY_ID_BYTES = 8
RAW_KEY_BYTES = 32
SIGNATURE_BYTES = 64
PRIVATE_PEM = "PRIVATE KEY"
PUBLIC_PEM = "PUBLIC KEY"
_PKCS8_PREFIX = bytes.fromhex("302e020100300506032b657004220420")
"""DER of a PKCS#8 Ed25519 private key (RFC 8410) before its 32 raw bytes: what `openssl genpkey
-algorithm ed25519`, Helm's `genPrivateKey "ed25519"` and `cryptography` write."""
_SPKI_PREFIX = bytes.fromhex("302a300506032b6570032100")
"""DER of a SubjectPublicKeyInfo Ed25519 public key before its 32 raw bytes."""
_PEM_BLOCK = re.compile(rb"-----BEGIN ([A-Z0-9 ]+)-----(.*?)-----END ([A-Z0-9 ]+)-----", re.DOTALL)
_KEY_ID = re.compile(r"[0-9a-f]{16}")
_GENERATE = 'openssl genpkey -algorithm ed25519, or Helm\'s genPrivateKey "ed25519"'


def key_id(public_key: bytes) -> str:
    """The id of a raw 32-byte Ed25519 public key: its SHA-256's first 8 bytes, in hex."""
    return hashlib.sha256(public_key).digest()[:KEY_ID_BYTES].hex()


class Signer(Protocol):
    """The extender's private key (`gpupart.signing.PrivateKeys`): signs with its first key."""

    @property
    def key_id(self) -> str: ...

    def sign(self, message: bytes) -> bytes:
        """The 64-byte Ed25519 signature of `message`."""
        ...


class AssignmentKeys(Protocol):
    """The public keys that verify assignments, by key id (`gpupart.signing.PublicKeys`)."""

    def key_ids(self) -> frozenset[str]: ...

    def verify(self, key_id: str, message: bytes, signature: bytes) -> bool:
        """Whether `signature` is the signature of `message` by the key `key_id` (False when
        that key is not one of these)."""
        ...


@dataclass(frozen=True, slots=True)
class KeyMaterial:
    """What a key file holds: raw 32-byte Ed25519 keys, in the file's order."""

    private: tuple[bytes, ...]
    public: tuple[bytes, ...]

    def __repr__(self) -> str:  # never print a key
        return f"KeyMaterial(<{len(self.private)} private, {len(self.public)} public>)"


def parse_keys(text: bytes, *, where: str) -> KeyMaterial:
    """The Ed25519 keys of a PEM text: PKCS#8 `PRIVATE KEY` and SPKI `PUBLIC KEY` blocks, in
    order; nothing else but whitespace between them. InvalidInput naming `where` and the
    problem otherwise (an old HMAC key line, an RSA or encrypted key, a truncated block)."""
    if len(text) > MAX_KEY_FILE_BYTES:
        raise InvalidInput(where, f"{len(text)} bytes; a key file has at most {MAX_KEY_FILE_BYTES}")
    private: list[bytes] = []
    public: list[bytes] = []
    blocks = list(_PEM_BLOCK.finditer(text))
    if not blocks:
        raise InvalidInput(
            where, f"holds no PEM key (Ed25519 keys in PEM, e.g. from {_GENERATE}; the HMAC keys "
            "of gpupart before ADR 035 are no longer read)"
        )  # fmt: skip
    end = 0
    for number, block in enumerate(blocks, 1):
        _outside(text[end : block.start()], where)
        end = block.end()
        label, closing = (block.group(i).decode("ascii", "replace") for i in (1, 3))
        if label != closing:
            raise InvalidInput(where, f"PEM block {number}: BEGIN {label} ends with END {closing}")
        try:
            der = base64.b64decode(b"".join(block.group(2).split()), validate=True)
        except (binascii.Error, ValueError):
            raise InvalidInput(where, f"PEM block {number} ({label}): not base64") from None
        if label == PRIVATE_PEM and der.startswith(_PKCS8_PREFIX):
            raw, kept = der[len(_PKCS8_PREFIX) :], private
        elif label == PUBLIC_PEM and der.startswith(_SPKI_PREFIX):
            raw, kept = der[len(_SPKI_PREFIX) :], public
        elif label in (PRIVATE_PEM, PUBLIC_PEM):
            raise InvalidInput(
                where,
                f"PEM block {number} ({label}) is not an Ed25519 key (make one with {_GENERATE})",
            )
        else:
            raise InvalidInput(
                where,
                f"PEM block {number} is {label}; only Ed25519 {PRIVATE_PEM} (PKCS#8, "
                f"unencrypted) and {PUBLIC_PEM} blocks are read",
            )
        if len(raw) != RAW_KEY_BYTES:
            raise InvalidInput(where, f"PEM block {number} ({label}): truncated or extended key")
        kept.append(raw)
    _outside(text[end:], where)
    if len(private) + len(public) > MAX_KEYS:
        raise InvalidInput(where, f"{len(private) + len(public)} keys; at most {MAX_KEYS}")
    return KeyMaterial(tuple(private), tuple(public))


def _outside(text: bytes, where: str) -> None:
    stray = text.strip()
    if stray:
        start = stray[:20].decode("ascii", "replace")
        raise InvalidInput(where, f"text outside a PEM block ({start!r}...)")


def public_pem(public_key: bytes) -> str:
    """The PEM `PUBLIC KEY` block (SPKI) of a raw Ed25519 public key, with its newline."""
    if len(public_key) != RAW_KEY_BYTES:
        raise InvalidInput("public key", f"{len(public_key)} bytes; Ed25519's are {RAW_KEY_BYTES}")
    body = base64.b64encode(_SPKI_PREFIX + public_key).decode()
    return f"-----BEGIN {PUBLIC_PEM}-----\n{body}\n-----END {PUBLIC_PEM}-----\n"


def private_pem(private_key: bytes) -> str:
    """The PEM `PRIVATE KEY` block (PKCS#8) of a raw Ed25519 private key (the tests' keys)."""
    if len(private_key) != RAW_KEY_BYTES:
        raise InvalidInput(
            "private key", f"{len(private_key)} bytes; Ed25519's are {RAW_KEY_BYTES}"
        )
    body = base64.b64encode(_PKCS8_PREFIX + private_key).decode()
    return f"-----BEGIN {PRIVATE_PEM}-----\n{body}\n-----END {PRIVATE_PEM}-----\n"


def config_map_ref(text: str, *, where: str) -> tuple[str, str]:
    """(namespace, name) of `NAMESPACE/NAME`, where the extender publishes its public keys;
    InvalidInput naming `where` otherwise."""
    namespace, slash, name = text.partition("/")
    if not slash or not namespace or not name or "/" in name:
        raise InvalidInput(where, f"{text!r} is not NAMESPACE/NAME of a ConfigMap")
    return namespace, name


def _message(assignment: PodAssignment, key: str) -> bytes:
    fields = {
        "version": WIRE_VERSION,
        "keyID": key,
        "podUID": assignment.pod_uid,
        "node": assignment.node,
        "gpu": assignment.gpu,
        "gpuUUID": assignment.gpu_uuid,
        "memoryMiB": assignment.memory_mib,
        "computePercent": assignment.compute_percent,
    }
    return DOMAIN + json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()


def sign(assignment: PodAssignment, signer: Signer) -> PodAssignment:
    """The assignment with its signature (over every field, the pod UID and the key id) set."""
    if not assignment.pod_uid:
        raise InvalidInput("assignment", "a pod UID is needed to sign an assignment")
    key = signer.key_id
    signature = signer.sign(_message(assignment, key))
    if len(signature) != SIGNATURE_BYTES:
        raise InvalidInput("assignment signer", f"{len(signature)}-byte signature, not Ed25519's")
    return replace(assignment, signature=f"{key}:{base64.b64encode(signature).decode()}")


def split_signature(text: str) -> tuple[str, bytes]:
    """The key id and the 64 signature bytes of a `signature` field; InvalidInput if malformed."""
    key, colon, encoded = text.partition(":")
    if not colon or not _KEY_ID.fullmatch(key):
        raise InvalidInput("signature", "is not <16 hex digits of key id>:<base64 signature>")
    try:
        signature = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidInput("signature", "its signature part is not base64") from None
    if len(signature) != SIGNATURE_BYTES:
        raise InvalidInput("signature", f"{len(signature)} bytes, not an Ed25519 signature's 64")
    return key, signature


def forgery(assignment: PodAssignment, keys: AssignmentKeys, *, pod_uid: str, node: str) -> str:
    """Why `assignment` was not made by the extender for pod `pod_uid` on `node`; "" if it was."""
    if not assignment.signature:
        return "it carries no signature (gpupart's extender signs every assignment it writes)"
    try:
        key, signature = split_signature(assignment.signature)
    except InvalidInput as error:
        return f"its signature is unreadable: {error} (not written by gpupart's extender)"
    if not keys.verify(key, _message(assignment, key), signature):
        if key not in keys.key_ids():
            return (
                f"it is signed with key {key}, which is not one of the extender's published "
                "public keys (not written by gpupart's extender, or its key was retired)"
            )
        return "its signature does not verify (not written by gpupart's extender, or edited)"
    if assignment.pod_uid != pod_uid:
        return f"it was made for pod UID {assignment.pod_uid!r}, not this pod's {pod_uid!r}"
    if assignment.node != node:
        return f"it was made for node {assignment.node!r}, not {node!r}"
    return ""
