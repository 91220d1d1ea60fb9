"""Every verb's reply as the bytes its caller reads: filter, prioritize, preempt, bind, diagnose, errors.

The HTTP edge (`app.py`) parses requests and calls the service; what goes back is written here.
Filter and prioritize join the JSON pieces the memo keeps per node (`answers.Batch`: at 5,000
nodes, serialising a reply afresh would cost more than the decision): filter's three parts are
joined here, prioritize's HostPriorityList is the service's `prioritize_json` as it comes. The
other verbs' replies are small and written whole. The bytes are pinned: each
shape below is what kube-scheduler's extender client (k8s.io/kube-scheduler/extender/v1)
decodes, byte for byte as before (the spacing of each shape included).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from .models import DiagnosisResult, ExtenderBindingResult
from .preemption import NodeVictims
from .service import Diagnosis, FilterOutcome


def filter_reply(passed: str, failed: str, unresolvable: str) -> str:
    """An ExtenderFilterResult (nodeCacheCapable) from the JSON text of its three parts."""
    return (
        f'{{"NodeNames":{passed},"FailedNodes":{failed},'
        f'"FailedAndUnresolvableNodes":{unresolvable},"Error":""}}'
    )


def filter_text(outcome: FilterOutcome, nodes: Mapping[str, Any] | None) -> str:
    """The filter reply in the shape the request asked for: `nodes` is the NodeList the
    scheduler sent (nodeCacheCapable false), None when it sent names only."""
    if outcome.error:
        return json.dumps(
            {
                "NodeNames": None if nodes is not None else [],
                "FailedNodes": {},
                "FailedAndUnresolvableNodes": {},
                "Error": outcome.error,
            }
        )
    if nodes is not None:
        # nodeCacheCapable false: the survivors go back as a NodeList.
        keep = set(outcome.passed)
        survivors = dict(nodes)
        survivors["items"] = [
            n for n in nodes.get("items") or [] if (n.get("metadata") or {}).get("name") in keep
        ]
        return json.dumps(
            {
                "Nodes": survivors,
                "NodeNames": None,
                "FailedNodes": outcome.failed,
                "FailedAndUnresolvableNodes": outcome.unresolvable,
                "Error": "",
            }
        )
    assert outcome.encoded is not None  # every outcome without an error carries it
    return filter_reply(*outcome.encoded)


def preempt_text(kept: Mapping[str, NodeVictims]) -> str:
    """An ExtenderPreemptionResult (nodeCacheCapable form): the victims kept per node."""
    return json.dumps(
        {
            "NodeNameToMetaVictims": {
                node: {
                    "Pods": [{"UID": uid} for uid in victims.uids],
                    "NumPDBViolations": victims.violations,
                }
                for node, victims in kept.items()
            }
        }
    )


def bind_result(error: str) -> ExtenderBindingResult:
    """An ExtenderBindingResult: "" bound, else why not."""
    return ExtenderBindingResult(Error=error)


def diagnose_text(found: Diagnosis) -> str:
    """A DiagnosisResult: every asked node's verdict for the pod, reasons in full."""
    result = DiagnosisResult(
        Pod=found.pod,
        Scores=found.scores,
        FailedNodes=found.failed,
        FailedAndUnresolvableNodes=found.unresolvable,
        Unreadable=found.unreadable,
    )
    return result.model_dump_json()


def error_text(message: str) -> str:
    """`{"Error": message}`, the body of every refusal (4xx) and failure (500), compact as
    the HTTP framework's own JSON answers are."""
    return json.dumps(
        {"Error": message}, ensure_ascii=False, allow_nan=False, separators=(",", ":")
    )
