"""Extender configuration: a YAML/JSON file, then GPUPART_EXTENDER_* variables, then flags, validated once."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path
from typing import Any

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
    """Listen address; a separate Deployment (not a sidecar of kube-scheduler) needs 0.0.0.0."""
    port: int = Field(8888, ge=0, le=65535)
    """Listen port."""
    url_prefix: str = "/gpupart"
    """Verbs are served at <url_prefix>/filter, /prioritize, /bind (urlPrefix in the scheduler config)."""
    tls_cert_file: Path | None = None
    """Serve HTTPS with this certificate (with tls_key_file)."""
    tls_key_file: Path | None = None
    """The private key of tls_cert_file."""
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

    @model_validator(mode="after")
    def _check(self) -> ExtenderSettings:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together")
        if self.url_prefix and not self.url_prefix.startswith("/"):
            raise ValueError("url_prefix must start with /")
        if self.high_priority < self.low_priority:
            raise ValueError("high_priority must not be below low_priority")
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
            group_label=self.anti_affinity_label,
        )


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
            settings.append(Setting(flag, text, shown, field.description or name, env=env))
            paths[flag] = here

    add(ExtenderSettings, ())
    return SettingsTable(ENV_PREFIX, settings), paths


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
        _put(values, path, value)
    try:
        return ExtenderSettings.model_validate(values)
    except ValidationError as error:
        first = error.errors()[0]
        path = tuple(str(p) for p in first["loc"])
        where = given.get(path) or (f"{config}: {'.'.join(path)}" if config else ".".join(path))
        raise InvalidInput(where, first["msg"]) from None


def _put(values: dict[str, Any], path: tuple[str, ...], value: str) -> None:
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
