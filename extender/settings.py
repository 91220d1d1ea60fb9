"""Extender configuration: a YAML/JSON file, then GPUPART_EXTENDER_* variables, then flags, validated once."""

from __future__ import annotations

import argparse
import ipaddress
from collections.abc import Mapping
from pathlib import Path
from typing import Any, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from gpupart.core.errors import InvalidInput
from gpupart.core.scheduling.terms import AffinityScope, ScoringConfig, Strategy, Weights
from gpupart.settings import Setting, SettingsTable, optional_text, text


class WeightSettings(BaseModel):
    """Weight of each scoring term in the weighted mean (0 turns a term off)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)
    headroom: float = Field(1.0, ge=0, le=100)
    """weight of the free-memory headroom term"""
    priority: float = Field(1.0, ge=0, le=100)
    """weight of the priority term"""
    anti_affinity: float = Field(2.0, ge=0, le=100)
    """weight of the anti-affinity term"""
    fragmentation: float = Field(2.0, ge=0, le=100)
    """weight of the fragmentation term"""


class ExtenderSettings(BaseModel):
    """Everything `gpupart extender` can be told; unknown keys are errors.

    A plain model: constructing one reads nothing; `from_args` merges the file, the
    variables and the flags.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    host: str = "127.0.0.1"
    """Listen address of the verbs. Loopback (a sidecar of the scheduler) or, for a separate
    Deployment, any address with tls_client_ca_file set: the extender refuses to start on a
    non-loopback address without it, unless allow_unauthenticated is true."""
    port: int = Field(8888, ge=0, le=65535)
    """Listen port of the verbs (and of /healthz, /readyz and /metrics too)."""
    url_prefix: str = "/gpupart"
    """Verbs are served at <url_prefix>/filter, /prioritize, /bind (urlPrefix in the scheduler config)."""
    tls_cert_file: Path | None = None
    """Serve HTTPS with this certificate (with tls_key_file)."""
    tls_key_file: Path | None = None
    """The private key of tls_cert_file."""
    tls_client_ca_file: Path | None = None
    """Require a client certificate signed by this CA (PEM) on every connection of the verbs'
    listener (needs tls_cert_file and tls_key_file): a client without one gets no TLS
    handshake, so no answer at all."""
    tls_handshake_timeout_seconds: float = Field(5.0, gt=0, le=300)
    """A TLS connection whose handshake has not completed this long after its accept is
    dropped (asyncio's own bound is 60 s); kube-scheduler's own bound is 10 s and it reconnects
    at once."""
    max_connections: int = Field(1024, ge=1, le=1_000_000)
    """Connections open at once on the TLS listener, handshakes in flight included: a new one
    beyond takes the place of the oldest unfinished handshake, or is closed at once when every
    connection is established. The file-descriptor limit is raised to fit it, where allowed."""
    keep_alive_timeout_seconds: int = Field(120, ge=1, le=3600)
    """An HTTP connection idle this long (no request since its last answer, or since it was
    opened) is closed. Above kube-scheduler's 90 s (Go's IdleConnTimeout): the scheduler then
    closes its idle connections first, and never writes a request onto one being closed."""
    allow_unauthenticated: bool = False
    """Serve the verbs on a non-loopback host without client certificates (anyone who reaches
    the port can then bind pods): for test clusters only."""
    health_host: str = "0.0.0.0"
    """Listen address of the plain-HTTP health port."""
    health_port: int = Field(8889, ge=0, le=65535)
    """Plain-HTTP port serving only /healthz, /readyz and /metrics (aggregate counters, no pod
    or namespace names), for probes and scrapers that hold no client certificate; 0: off."""
    max_request_bytes: int = Field(2 << 20, ge=1024, le=256 << 20)
    """The largest request body read (413 beyond, refused before more is read). A filter at
    5,000 nodes (nodeCacheCapable) is ~100 KB; a full NodeList (nodeCacheCapable false) needs
    ~5 KB a node, and memory to match (docs/extender.md: the memory ceiling)."""
    max_request_nodes: int = Field(20_000, ge=1, le=100_000)
    """The most node names (or NodeList items, or preemption candidates) one request may name
    (413 beyond)."""
    max_concurrent_requests: int = Field(64, ge=1, le=10_000)
    """Requests served at once on the verbs' listener; one more is answered 503 at once (binds
    waiting for a node's admission hold theirs for up to admission_wait_seconds)."""
    assignment_key_file: Path | None = None
    """The Ed25519 private key(s) in PEM (PKCS#8; the first signs every shared-GPU assignment
    at bind) and any PEM public keys still accepted; every one verifies those the watch cache
    counts. Re-read when it changes. None or unreadable: shared-GPU binds are refused with the
    reason, and no assignment is trusted; a file with no private key: the extender refuses to
    start."""
    assignment_public_keys: str | None = Field(
        None, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?/[a-z0-9]([-.a-z0-9]*[a-z0-9])?$"
    )
    """NAMESPACE/NAME of the ConfigMap the public keys of `assignment_key_file` are published
    to (data key keys.pem), at start and whenever the file changes: the node agents read them
    there. None: not published (the agents then need the public keys in a file)."""
    scheduler_names: list[str] = Field(default_factory=lambda: ["gpupart-scheduler"], min_length=1)
    """Bind only pods whose spec.schedulerName is one of these (the scheduler(s) that call this
    extender); comma-separated in a flag or variable."""
    kubeconfig: Path | None = None
    """None: in-cluster service account, else ~/.kube/config."""
    log_level: str = Field("INFO", pattern="^(DEBUG|INFO|WARNING|ERROR)$")
    """DEBUG, INFO, WARNING or ERROR."""
    profile: Path | None = None
    """cProfile every thread and dump the merged stats to this file at shutdown."""

    strategy: Strategy = Strategy.BINPACK
    """binpack (fill the fullest GPU that fits) or spread."""
    reserve_fraction: float = Field(0.15, ge=0, le=1)
    """Per GPU, memory kept free for peaks: this share of the pod's memory request."""
    anti_affinity_label: str = "app"
    """Pods with the same value of this label avoid sharing a GPU (or node)."""
    anti_affinity_scope: AffinityScope = AffinityScope.GPU
    """gpu or node: where the anti-affinity term counts same-group pods."""
    high_priority: int = 1000
    """Pod priority at or above which the priority term is at its highest."""
    low_priority: int = 0
    """Pod priority at or below which the priority term is at its lowest."""
    weights: WeightSettings = WeightSettings()

    reservation_ttl_seconds: float = Field(30.0, gt=0, le=3600)
    """How long a filter decision (and an assumed binding) holds before it lapses."""
    admission_wait_seconds: float = Field(1.5, ge=0, le=60)
    """How long a bind waits for the node's previous shared-GPU pod to be served by its device
    plugin (one at a time per node); keep it below the scheduler's extender httpTimeout."""
    fragmentation_refresh_seconds: float = Field(60.0, gt=0)
    """How often the observed request mix behind the fragmentation term is rebuilt."""
    resync_seconds: int = Field(300, ge=10)
    """Server-side timeout of each watch; the watch then resumes (or relists after 410 Gone)."""
    memo_size: int = Field(200_000, ge=0)
    """Node verdicts kept between requests (keyed by node version and pod shape)."""
    pending_reasons_seconds: float = Field(5.0, ge=0, le=3600)
    """How often pods kube-scheduler left Unschedulable get gpupart's reason as an Event
    (docs/adr-019-pending-reasons.md); 0: never."""

    @model_validator(mode="after")
    def _check(self) -> ExtenderSettings:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together")
        if self.url_prefix and not self.url_prefix.startswith("/"):
            raise ValueError("url_prefix must start with /")
        if self.high_priority < self.low_priority:
            raise ValueError("high_priority must not be below low_priority")
        if self.tls_client_ca_file is not None and self.tls_cert_file is None:
            raise ValueError("tls_client_ca_file needs tls_cert_file and tls_key_file (HTTPS)")
        if (
            not is_loopback(self.host)
            and self.tls_client_ca_file is None
            and not self.allow_unauthenticated
        ):
            raise ValueError(
                f"host {self.host!r} is not a loopback address and tls_client_ca_file is unset: "
                "anyone reaching the port could bind pods; set tls_client_ca_file (with "
                "tls_cert_file and tls_key_file), listen on 127.0.0.1, or set "
                "allow_unauthenticated: true"
            )
        return self

    @property
    def prefix(self) -> str:
        return self.url_prefix.rstrip("/")

    def scoring(self) -> ScoringConfig:
        return ScoringConfig(
            weights=Weights(
                self.weights.headroom,
                self.weights.priority,
                self.weights.anti_affinity,
                self.weights.fragmentation,
            ),
            strategy=self.strategy,
            reserve_fraction=self.reserve_fraction,
            anti_affinity_scope=self.anti_affinity_scope,
            high_priority=self.high_priority,
            low_priority=self.low_priority,
            anti_affinity_label=self.anti_affinity_label,
        )


def is_loopback(host: str) -> bool:
    """Whether `host` names this machine only (127.0.0.0/8, ::1 or "localhost")."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: it may resolve to any address


ENV_PREFIX = "GPUPART_EXTENDER_"
CONFIG = Setting(
    "--config", optional_text, "", "YAML settings file (see docs/extender.md)", metavar="FILE"
)


def _table() -> tuple[SettingsTable, dict[str, tuple[str, ...]]]:
    """A flag per field, nested ones joined (`--weights-headroom`, env
    GPUPART_EXTENDER_WEIGHTS__HEADROOM); and each flag's path into the settings."""
    settings: list[Setting[Any]] = [CONFIG]
    paths: dict[str, tuple[str, ...]] = {}

    def add(model: type[BaseModel], path: tuple[str, ...]) -> None:
        for name, field in model.model_fields.items():
            here = (*path, name)
            nested = field.annotation
            if isinstance(nested, type) and issubclass(nested, BaseModel):
                add(nested, here)
                continue
            flag = "--" + "-".join(here).replace("_", "-")
            default = field.default
            shown = "" if default is None else str(default)
            env = (ENV_PREFIX + "__".join(here).upper(),)
            settings.append(Setting(flag, text, shown, _help(field.description or name), env=env))
            paths[flag] = here

    add(ExtenderSettings, ())
    return SettingsTable(ENV_PREFIX, settings), paths


def _help(docstring: str) -> str:
    """A field's docstring in the help voice of every gpupart flag: a lower-case phrase (an
    acronym such as DEBUG stays), no final full stop."""
    words = " ".join(docstring.split()).removesuffix(".")
    if len(words) > 1 and words[0].isupper() and words[1].islower():
        words = words[0].lower() + words[1:]
    return words


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _table()[0].add_arguments(parser)


def from_args(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> ExtenderSettings:
    """The settings file (--config), overridden by variables, overridden by flags."""
    table, paths = _table()
    read = table.reader(args, environ)
    config = read(CONFIG)
    values: dict[str, Any] = _file(Path(config)) if config else {}
    given: dict[tuple[str, ...], str] = {}
    for setting in table.settings:
        source = read.given(setting) if setting is not CONFIG else None
        if source is None:
            continue
        where, value = source
        path = paths[setting.flag]
        given[path] = where
        _put(values, path, _split(value) if path in _LISTS else value)
    try:
        return ExtenderSettings.model_validate(values)
    except ValidationError as error:
        first = error.errors()[0]
        path = tuple(str(p) for p in first["loc"])
        dotted = ".".join(path)
        where = given.get(path) or (f"{config}: {dotted}" if config and dotted else dotted)
        # A rule across fields (no loc) reads as a sentence, without pydantic's prefix.
        message = first["msg"].removeprefix("Value error, ")
        raise InvalidInput(where or config or "settings", message) from None


_LISTS = {
    (name,) for name, f in ExtenderSettings.model_fields.items() if get_origin(f.annotation) is list
}
"""Fields given as a comma-separated list in a flag or variable (scheduler_names)."""


def _split(value: str) -> list[str]:
    return [part.strip() for part in value.split(",") if part.strip()]


def _put(values: dict[str, Any], path: tuple[str, ...], value: object) -> None:
    """values[a][b] = value for path (a, b), copying the mappings on the way (the file's)."""
    target = values
    for key in path[:-1]:
        inner = target.get(key)
        target[key] = dict(inner) if isinstance(inner, Mapping) else {}
        target = target[key]
    target[path[-1]] = value


def _file(path: Path) -> dict[str, Any]:
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as error:
        raise InvalidInput(str(path), f"cannot read the settings file: {error}") from None
    if not isinstance(raw, dict):
        raise InvalidInput(str(path), "expected a mapping of settings")
    return raw


def load_settings(path: Path | None = None) -> ExtenderSettings:
    """What `gpupart extender --config=PATH` (no other flag) runs with."""
    return from_args(argparse.Namespace(config=str(path) if path is not None else None))
