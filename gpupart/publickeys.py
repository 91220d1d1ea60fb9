"""The extender's public keys in a ConfigMap: published by the extender, read by the node agents.

Helm cannot derive a public key, so the chart makes the private key's Secret (mounted into the
extender only) and an empty ConfigMap `<fullname>-assignment-public-keys`; the extender writes
the PEM public keys of its key file there at start and whenever the file changes
(`KeyPublisher`), and each node agent reads them through the API (`PublishedKeys`: a short
cache, and a re-read at once when a signature names a key id it does not hold). RBAC: the
extender may get, update and patch that one ConfigMap, each agent only get it
(docs/adr-035-asymmetric-assignment-signatures.md).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kubernetes import client
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

from gpupart import logs
from gpupart.core.errors import InvalidInput
from gpupart.kubeconfig import describe_api_error
from gpupart.signing import PrivateKeys, PublicKeys, public_keys

log = logging.getLogger(__name__)

DATA_KEY = "keys.pem"
"""The ConfigMap's data key: the PEM public keys, the signing key's first."""
_ERRORS = (ApiException, HTTPError, OSError)


class ConfigMapKeys:
    """Reads and writes the one ConfigMap (the API calls only; no caching)."""

    def __init__(
        self, api: client.ApiClient, namespace: str, name: str, *, timeout_s: float = 10.0
    ) -> None:
        self.core = client.CoreV1Api(api)
        self.namespace, self.name = namespace, name
        self.timeout_s = timeout_s
        self.where = f"ConfigMap {namespace}/{name}"

    def read(self) -> str:
        """The published PEM text ("" when none yet); InvalidInput when it cannot be read."""
        try:
            found = self.core.read_namespaced_config_map(
                self.name, self.namespace, _request_timeout=self.timeout_s
            )
        except _ERRORS as error:
            raise InvalidInput(
                self.where, f"cannot read the extender's public keys: {describe_api_error(error)}"
            ) from None
        return str((found.data or {}).get(DATA_KEY) or "")

    def write(self, pem: str) -> bool:
        """Publish `pem` unless the ConfigMap holds it already (True when written). A missing
        ConfigMap is created where RBAC allows it (outside the chart); the chart makes it and
        gives the extender no create, so there a missing one is an error, retried."""
        if self.read_or_none() == pem:
            return False
        body = {"data": {DATA_KEY: pem}}
        try:
            self.core.patch_namespaced_config_map(
                self.name, self.namespace, body, _request_timeout=self.timeout_s
            )
        except ApiException as error:
            if error.status != 404:
                raise
            created = client.V1ConfigMap(
                metadata=client.V1ObjectMeta(name=self.name, namespace=self.namespace),
                data={DATA_KEY: pem},
            )
            self.core.create_namespaced_config_map(
                self.namespace, created, _request_timeout=self.timeout_s
            )
        return True

    def read_or_none(self) -> str | None:
        try:
            return self.read()
        except InvalidInput:
            return None


class KeyPublisher:
    """The extender's side: publishes its key file's public keys, at start and when they change.

    `run` checks every `period_s` (the key file is re-read only when it changed); an API
    failure is logged and retried on the next round, never fatal.
    """

    def __init__(
        self, keys: Callable[[], PrivateKeys], target: ConfigMapKeys, *, period_s: float = 10.0
    ) -> None:
        self.keys = keys
        self.target = target
        self.period_s = period_s
        self.published = ""
        """The PEM text last written or found there (checked every round: a ConfigMap reset
        by hand or by an upgrade is written again)."""

    def once(self) -> None:
        try:
            pem = self.keys().pem()
        except InvalidInput as error:
            log.warning("Cannot publish the assignment public keys", extra=logs.kv(err=error))
            return
        try:
            written = self.target.write(pem)
        except _ERRORS as error:
            log.warning(
                "Cannot publish the assignment public keys",
                extra=logs.kv(configMap=self.target.where, err=describe_api_error(error)),
            )
            return
        self.published = pem
        if written:
            log.info(
                "Published the assignment public keys",
                extra=logs.kv(configMap=self.target.where, keys=pem.count("BEGIN")),
            )

    def run(self, stopping: threading.Event) -> None:
        while not stopping.is_set():
            self.once()
            stopping.wait(self.period_s)


class PublishedKeys:
    """A node agent's side: the extender's published public keys (the core's `AssignmentKeys`).

    `keys()` answers them, re-read when older than `ttl_s`; `verify` re-reads at once (at most
    every `min_reread_s`, so a tenant's made-up key ids cannot flood the API server) when a
    signature names a key id not held. A failed re-read keeps the keys last read; with none
    read yet, `keys()` raises InvalidInput saying why (no assignment is then served).
    """

    def __init__(
        self,
        read: Callable[[], str],
        *,
        where: str,
        ttl_s: float = 30.0,
        min_reread_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.read = read
        self.where = where
        self.ttl_s = ttl_s
        self.min_reread_s = min_reread_s
        self.clock = clock
        self._lock = threading.Lock()
        self._keys: PublicKeys | None = None
        self._read_at: float | None = None
        self._text = ""

    def keys(self) -> PublishedKeys:
        with self._lock:
            at = self._read_at
            if self._keys is None or at is None or self.clock() - at >= self.ttl_s:
                self._refresh(raise_=self._keys is None)
            return self

    def key_ids(self) -> frozenset[str]:
        with self._lock:
            return frozenset() if self._keys is None else self._keys.key_ids()

    def verify(self, key_id: str, message: bytes, signature: bytes) -> bool:
        with self._lock:
            held = self._keys
            at = self._read_at
            if (held is None or key_id not in held.key_ids()) and (
                at is None or self.clock() - at >= self.min_reread_s
            ):
                self._refresh(raise_=False)
                held = self._keys
        return held is not None and held.verify(key_id, message, signature)

    def _refresh(self, *, raise_: bool) -> None:
        self._read_at = self.clock()
        try:
            text = self.read()
            if text != self._text or self._keys is None:
                if not text.strip():
                    raise InvalidInput(
                        self.where,
                        "holds no public key yet (the extender publishes them when it starts)",
                    )
                self._keys = public_keys(text.encode(), where=self.where)
                self._text = text
        except InvalidInput as error:
            if raise_:
                raise
            log.warning("Kept the assignment public keys last read", extra=logs.kv(err=error))
