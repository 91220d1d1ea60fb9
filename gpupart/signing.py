"""Ed25519 for the assignment signatures: the `cryptography` adapter behind the core's protocols.

`gpupart.core.api.provenance` says what is signed and how keys are written; this module does
the arithmetic. The extender loads `PrivateKeys` (it signs, and verifies what it reads back
from pods); a node agent loads `PublicKeys` only, and refuses a file with a private key in it:
an agent must never be able to sign (docs/adr-035-asymmetric-assignment-signatures.md).
"""

from __future__ import annotations

from collections.abc import Iterable

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from gpupart.core.api.provenance import key_id, parse_keys, public_pem
from gpupart.core.errors import InvalidInput


class PublicKeys:
    """Ed25519 public keys by key id (the core's `AssignmentKeys`): any of them verifies."""

    def __init__(self, public: Iterable[bytes]) -> None:
        self._raw = tuple(dict.fromkeys(public))  # in order, each once
        self._keys = {key_id(raw): Ed25519PublicKey.from_public_bytes(raw) for raw in self._raw}
        self._ids = frozenset(self._keys)

    def key_ids(self) -> frozenset[str]:
        return self._ids

    def verify(self, key_id: str, message: bytes, signature: bytes) -> bool:
        key = self._keys.get(key_id)
        if key is None:
            return False
        try:
            key.verify(signature, message)
        except InvalidSignature:
            return False
        return True

    def public_raw(self) -> tuple[bytes, ...]:
        """The raw 32-byte public keys, in order (the signing key's first)."""
        return self._raw

    def pem(self) -> str:
        """Every public key as a PEM block, in order: what the extender publishes."""
        return "".join(public_pem(raw) for raw in self._raw)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(sorted(self._ids))})"


class PrivateKeys(PublicKeys):
    """The extender's keys (the core's `Signer` and `AssignmentKeys`): the first private key
    signs; its public key, the other private keys' and any public keys listed verify."""

    def __init__(self, private: tuple[bytes, ...], public: Iterable[bytes] = ()) -> None:
        if not private:
            raise InvalidInput("assignment keys", "no private key to sign with")
        self._signer = Ed25519PrivateKey.from_private_bytes(private[0])
        derived = [
            Ed25519PrivateKey.from_private_bytes(raw)
            .public_key()
            .public_bytes(Encoding.Raw, PublicFormat.Raw)
            for raw in private
        ]
        super().__init__([*derived, *public])
        self._key_id = key_id(derived[0])

    @property
    def key_id(self) -> str:
        return self._key_id

    def sign(self, message: bytes) -> bytes:
        return self._signer.sign(message)


def private_keys(text: bytes, *, where: str) -> PrivateKeys:
    """The extender's key file: at least one PEM private key (the first signs), and any
    public keys still to verify with. InvalidInput naming `where` otherwise."""
    material = parse_keys(text, where=where)
    if not material.private:
        raise InvalidInput(
            where,
            f"holds {len(material.public)} public key(s) and no private key: the extender "
            "signs assignments and needs the Ed25519 private key (PEM PRIVATE KEY)",
        )
    return PrivateKeys(material.private, material.public)


def public_keys(text: bytes, *, where: str) -> PublicKeys:
    """A node agent's keys: PEM public keys only. A private key is refused, never used: an
    agent that holds one could sign what every other node believes."""
    material = parse_keys(text, where=where)
    if material.private:
        raise InvalidInput(
            where,
            "holds a private key; a node agent must hold the extender's public keys only "
            "(`gpupart assignment-keys public PRIVATE.pem` prints them)",
        )
    return PublicKeys(material.public)


def generate_private_pem() -> str:
    """A new Ed25519 private key in PEM (PKCS#8), as Helm's genPrivateKey "ed25519" writes."""
    from cryptography.hazmat.primitives.serialization import NoEncryption, PrivateFormat

    key = Ed25519PrivateKey.generate()
    return key.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption()).decode()
