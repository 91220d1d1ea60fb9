"""Provenance of the extender's shared-GPU assignments: an HMAC bound to the pod's UID and node.

A pod's annotations are its tenant's to write, so the node agent never takes a
`gpupart.io/assignment` at its word: the extender signs each one with a key that only it and
the node agents can read (a Secret mounted into both), over the exact fields the agent acts on
and the pod UID and node it was made for. A copy onto another pod, an edited amount, or one made
up by the tenant does not verify (docs/adr-015-tenant-proof-admission.md).
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass, replace

from gpupart.core.api.wire import WIRE_VERSION, PodAssignment
from gpupart.core.errors import InvalidInput

MIN_KEY_BYTES = 32
"""A shorter key is refused: HMAC-SHA256 is only as strong as its key (the chart makes 64)."""
MAX_KEYS = 8
"""Keys in one file: the first signs, every one verifies (rotation: add the new key first)."""
MAX_KEY_FILE_BYTES = 64 * 1024
DOMAIN = b"gpupart.io/assignment\n"
"""Prefixed to every signed message, so no other use of the key can produce a valid one."""


@dataclass(frozen=True, slots=True)
class AssignmentKeys:
    """The shared keys: `keys[0]` signs, any of them verifies."""

    keys: tuple[bytes, ...]

    def __post_init__(self) -> None:
        if not self.keys:
            raise InvalidInput("assignment key", "no key given")
        for number, key in enumerate(self.keys, 1):
            if len(key) < MIN_KEY_BYTES:
                raise InvalidInput(
                    f"assignment key {number}",
                    f"{len(key)} bytes; at least {MIN_KEY_BYTES} are needed",
                )

    def __repr__(self) -> str:  # never print a key
        return f"AssignmentKeys(<{len(self.keys)} key(s)>)"


def parse_keys(text: bytes, *, where: str) -> AssignmentKeys:
    """Keys from a key file: one per line (blank lines ignored), each at least 32 bytes."""
    if len(text) > MAX_KEY_FILE_BYTES:
        raise InvalidInput(where, f"{len(text)} bytes; a key file has at most {MAX_KEY_FILE_BYTES}")
    keys = tuple(line.strip() for line in text.splitlines() if line.strip())
    if not keys:
        raise InvalidInput(where, "holds no key")
    if len(keys) > MAX_KEYS:
        raise InvalidInput(where, f"{len(keys)} keys; at most {MAX_KEYS}")
    try:
        return AssignmentKeys(keys)
    except InvalidInput as error:
        raise InvalidInput(where, error.problem) from None


def _message(assignment: PodAssignment) -> bytes:
    fields = {
        "version": WIRE_VERSION,
        "podUID": assignment.pod_uid,
        "node": assignment.node,
        "gpu": assignment.gpu,
        "gpuUUID": assignment.gpu_uuid,
        "memoryMiB": assignment.memory_mib,
        "computePercent": assignment.compute_percent,
    }
    return DOMAIN + json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()


def _mac(key: bytes, assignment: PodAssignment) -> str:
    return hmac.new(key, _message(assignment), hashlib.sha256).hexdigest()


def sign(assignment: PodAssignment, keys: AssignmentKeys) -> PodAssignment:
    """The assignment with its signature (over every field and the pod UID) set."""
    if not assignment.pod_uid:
        raise InvalidInput("assignment", "a pod UID is needed to sign an assignment")
    return replace(assignment, signature=_mac(keys.keys[0], assignment))


def forgery(assignment: PodAssignment, keys: AssignmentKeys, *, pod_uid: str, node: str) -> str:
    """Why `assignment` was not made by the extender for pod `pod_uid` on `node`; "" if it was."""
    if not assignment.signature:
        return "it carries no signature (gpupart's extender signs every assignment it writes)"
    if not any(
        hmac.compare_digest(_mac(key, assignment), assignment.signature) for key in keys.keys
    ):
        return "its signature does not verify (not written by gpupart's extender, or edited)"
    if assignment.pod_uid != pod_uid:
        return f"it was made for pod UID {assignment.pod_uid!r}, not this pod's {pod_uid!r}"
    if assignment.node != node:
        return f"it was made for node {assignment.node!r}, not {node!r}"
    return ""
