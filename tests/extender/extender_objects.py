"""The extender tests' fakes: a binder that records the API writes a bind makes, and ExtenderArgs."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any


class FakeBinder:
    """Answers the live pods it was given (`live`) and records the API writes a bind would
    make; `fail` makes the next bind raise."""

    def __init__(self) -> None:
        self.annotations: list[tuple[str, str, str, dict[str, str]]] = []
        self.bindings: list[tuple[str, str, str, str]] = []
        self.fail: Exception | None = None
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}
        self.reads = 0

    def live(self, p: dict[str, Any]) -> dict[str, Any]:
        """Make `p` the pod the API server holds under its namespace and name; returns it."""
        meta = p["metadata"]
        self.pods[meta.get("namespace") or "default", meta["name"]] = copy.deepcopy(p)
        return p

    def pod(self, namespace: str, name: str) -> Mapping[str, Any]:
        self.reads += 1
        found = self.pods.get((namespace, name))
        if found is None:
            raise LookupError(f'pods "{name}" not found in namespace {namespace!r}')
        return copy.deepcopy(found)

    def bind(self, namespace: str, name: str, uid: str, node: str, annotations: Any) -> None:
        if self.fail is not None:
            raise self.fail
        if annotations:
            self.annotations.append((namespace, name, uid, dict(annotations)))
        self.bindings.append((namespace, name, uid, node))
        bound = self.pods.get((namespace, name))
        if bound is not None:  # as the API server does: the pod is bound from now on
            bound["spec"]["nodeName"] = node
            bound["metadata"].setdefault("annotations", {}).update(annotations)


def args(p: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """ExtenderArgs as kube-scheduler sends them with nodeCacheCapable: true."""
    return {"Pod": p, "Nodes": None, "NodeNames": names}
