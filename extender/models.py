"""The extender wire protocol (k8s.io/kube-scheduler/extender/v1) as pydantic models with Go field names.

Only the HTTP edge uses these; handlers turn them into core types on their first line. The Go
structs carry no json tags, so keys are PascalCase (`Pod`, `NodeNames`, `FailedNodes`).
Go's decoder is case-insensitive, so camelCase keys are accepted on input too.
"""

from __future__ import annotations

from typing import Any

from pydantic import AliasChoices, BaseModel, ConfigDict, Field

MAX_NODE_NAMES = 100_000
"""The hard cap on names in one list, whatever the settings: the setting max_request_nodes
(at most this) is checked after parsing, the body's size (max_request_bytes) before."""


_QUANTITY: dict[str, Any] = {"type": "string", "format": "quantity"}
_AMOUNTS: dict[str, Any] = {
    "type": "object",
    "properties": dict.fromkeys(
        (
            "nvidia.com/gpu",
            "nvidia.com/gpu.shared",
            "nvidia.com/mig-1g.10gb",
            "gpupart.io/gpu-memory",
            "gpupart.io/gpu-compute",
            "cpu",
        ),
        _QUANTITY,
    ),
    "additionalProperties": _QUANTITY,
}
_CONTAINER: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "resources": {
            "type": "object",
            "properties": {"limits": _AMOUNTS, "requests": _AMOUNTS},
        },
    },
}
POD_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "A v1.Pod; only the fields gpupart reads are described, others are ignored.",
    "properties": {
        "metadata": {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "namespace": {"type": "string"},
                "uid": {"type": "string"},
                "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            },
        },
        "spec": {
            "type": "object",
            "properties": {
                "containers": {"type": "array", "items": _CONTAINER},
                "initContainers": {"type": "array", "items": _CONTAINER},
                "overhead": _AMOUNTS,
                "priority": {"type": "integer"},
            },
        },
    },
}
"""OpenAPI of the Pod in a request: documents what is read, and lets schemathesis generate
quantities (format `quantity`) where gpupart parses them."""


def _alias(name: str) -> Any:
    lower = name[0].lower() + name[1:]
    return Field(default=None, validation_alias=AliasChoices(name, lower), serialization_alias=name)


class NodeList(BaseModel):
    """A v1.NodeList as sent when nodeCacheCapable is false; items stay raw Kubernetes JSON."""

    model_config = ConfigDict(extra="allow")
    items: list[dict[str, Any]] | None = Field(default=None, max_length=MAX_NODE_NAMES)


class ExtenderArgs(BaseModel):
    """Body of filter and prioritize."""

    # cache_strings="keys": pydantic's cache of parsed JSON strings thrashes on 5,000 node
    # names, different from request to request, and tripled the parse (0.6 against 0.2 ms).
    model_config = ConfigDict(extra="ignore", populate_by_name=True, cache_strings="keys")
    Pod: dict[str, Any] = Field(
        validation_alias=AliasChoices("Pod", "pod"), json_schema_extra=POD_SCHEMA
    )
    Nodes: NodeList | None = _alias("Nodes")
    NodeNames: list[str] | None = Field(
        default=None,
        validation_alias=AliasChoices("NodeNames", "nodeNames", "nodenames"),
        max_length=MAX_NODE_NAMES,
    )


class ExtenderFilterResult(BaseModel):
    model_config = ConfigDict(populate_by_name=True)
    Nodes: NodeList | None = None
    NodeNames: list[str] | None = None
    FailedNodes: dict[str, str] = Field(default_factory=dict)
    FailedAndUnresolvableNodes: dict[str, str] = Field(default_factory=dict)
    Error: str = ""


class HostPriority(BaseModel):
    Host: str
    Score: int = Field(ge=0, le=10)


class ExtenderBindingArgs(BaseModel):
    model_config = ConfigDict(populate_by_name=True)
    PodName: str = Field(
        validation_alias=AliasChoices("PodName", "podName"), min_length=1, max_length=253
    )
    PodNamespace: str = Field(
        validation_alias=AliasChoices("PodNamespace", "podNamespace"), min_length=1, max_length=63
    )
    PodUID: str = Field(validation_alias=AliasChoices("PodUID", "podUID", "podUid"), max_length=64)
    Node: str = Field(validation_alias=AliasChoices("Node", "node"), min_length=1, max_length=253)


class ExtenderBindingResult(BaseModel):
    Error: str = ""


MAX_VICTIMS = 10_000
"""Victims per node in a preempt request: far above the pods a node can run."""


class MetaPod(BaseModel):
    model_config = ConfigDict(populate_by_name=True)
    UID: str = Field(validation_alias=AliasChoices("UID", "uid"), max_length=128)


class MetaVictims(BaseModel):
    """Victims named by UID (nodeCacheCapable)."""

    model_config = ConfigDict(populate_by_name=True)
    Pods: list[MetaPod] | None = Field(
        default=None, validation_alias=AliasChoices("Pods", "pods"), max_length=MAX_VICTIMS
    )
    NumPDBViolations: int = Field(
        default=0, validation_alias=AliasChoices("NumPDBViolations", "numPDBViolations")
    )


class Victims(BaseModel):
    """Victims as full Pods (nodeCacheCapable false); pods stay raw Kubernetes JSON."""

    model_config = ConfigDict(populate_by_name=True)
    Pods: list[dict[str, Any]] | None = Field(
        default=None, validation_alias=AliasChoices("Pods", "pods"), max_length=MAX_VICTIMS
    )
    NumPDBViolations: int = Field(
        default=0, validation_alias=AliasChoices("NumPDBViolations", "numPDBViolations")
    )


class ExtenderPreemptionArgs(BaseModel):
    """Body of preempt: the pod, and per candidate node the victims kube-scheduler's dry run
    chose (by UID when nodeCacheCapable, else as full Pods)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True, cache_strings="keys")
    Pod: dict[str, Any] = Field(
        validation_alias=AliasChoices("Pod", "pod"), json_schema_extra=POD_SCHEMA
    )
    NodeNameToVictims: dict[str, Victims | None] | None = Field(
        default=None,
        validation_alias=AliasChoices("NodeNameToVictims", "nodeNameToVictims"),
        max_length=MAX_NODE_NAMES,
    )
    NodeNameToMetaVictims: dict[str, MetaVictims | None] | None = Field(
        default=None,
        validation_alias=AliasChoices("NodeNameToMetaVictims", "nodeNameToMetaVictims"),
        max_length=MAX_NODE_NAMES,
    )


class ExtenderPreemptionResult(BaseModel):
    """Always the MetaVictims form: kube-scheduler finds each UID among the node's pods."""

    NodeNameToMetaVictims: dict[str, MetaVictims] = Field(default_factory=dict)


class DiagnosisResult(BaseModel):
    """Body of `POST <prefix>/diagnose` (gpupart's own verb, not kube-scheduler's): per node, the
    score (0-10) where the pod fits and the full reason where it does not."""

    Pod: str
    Scores: dict[str, int] = Field(default_factory=dict)
    FailedNodes: dict[str, str] = Field(default_factory=dict)
    FailedAndUnresolvableNodes: dict[str, str] = Field(default_factory=dict)
    Unreadable: dict[str, str] = Field(default_factory=dict)
    """Objects the watch cache skipped ("Pod ns/name") or keeps with a problem ("Node name"),
    and why: what the verdicts above could not count."""
