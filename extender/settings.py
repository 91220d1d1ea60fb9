"""Extender configuration: a YAML/JSON file, then GPUPART_EXTENDER_* environment, validated once at start."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from gpupart.core.scheduling.terms import AffinityScope, ScoringConfig, Strategy, Weights


class WeightSettings(BaseModel):
    """Weight of each scoring term in the weighted mean (0 turns a term off)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    headroom: float = Field(1.0, ge=0, le=100)
    priority: float = Field(1.0, ge=0, le=100)
    anti_affinity: float = Field(2.0, ge=0, le=100)
    fragmentation: float = Field(2.0, ge=0, le=100)


class ExtenderSettings(BaseSettings):
    """Everything `gpupart extender` can be told; unknown keys are errors."""

    model_config = SettingsConfigDict(
        env_prefix="GPUPART_EXTENDER_", env_nested_delimiter="__", extra="forbid", frozen=True
    )

    host: str = "127.0.0.1"
    """Listen address; a separate Deployment (not a sidecar of kube-scheduler) needs 0.0.0.0."""
    port: int = Field(8888, ge=0, le=65535)
    url_prefix: str = "/gpupart"
    """Verbs are served at <url_prefix>/filter, /prioritize, /bind (urlPrefix in the scheduler config)."""
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    kubeconfig: Path | None = None
    """None: in-cluster service account, else ~/.kube/config."""
    log_level: str = Field("INFO", pattern="^(DEBUG|INFO|WARNING|ERROR)$")

    strategy: Strategy = Strategy.BINPACK
    reserve_fraction: float = Field(0.15, ge=0, le=1)
    """Per GPU, memory kept free for peaks: this share of the pod's memory request."""
    anti_affinity_label: str = "app"
    anti_affinity_scope: AffinityScope = AffinityScope.GPU
    high_priority: int = 1000
    low_priority: int = 0
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


def load_settings(path: Path | None = None, **overrides: Any) -> ExtenderSettings:
    """File values, overridden by environment, overridden by explicit (flag) values."""
    values: dict[str, Any] = {}
    if path is not None:
        raw = yaml.safe_load(path.read_text()) or {}
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: expected a mapping of settings")
        values.update(raw)
    env = ExtenderSettings()  # environment (and defaults) only
    merged = {**values, **env.model_dump(exclude_unset=True)}
    merged.update({k: v for k, v in overrides.items() if v is not None})
    return ExtenderSettings.model_validate(merged)
