"""The poison corpus: inputs a careless or hostile user can write, each with the field it breaks.

Shared by the unit tests (`gpupart plan`, the core parsers), the extender tests (watch cache and
request bodies) and the e2e tests (CRD admission, the operator). Every case must be refused
with a message naming its field, promptly, and must affect nothing but its own object.
"""

from __future__ import annotations

from typing import Any

HUGE = "9" * 100_000
"""A 100 KB number: past Python's integer digit limit, and past any field's bound."""
LONG = "x" * 100_000

ABSURD_QUANTITIES = [
    "1E",
    "1Ei",
    "12E",
    "9Ei",
    "1e99999999",
    "1E99999999",
    "-1e99999999",
    "1e-99999999",
    "1e4294967297",
    HUGE,
    f"0.{HUGE}",
    "-1",
    "-0.5",
    "0",
    "1.5",
    "100m",
    "0.000000001n",
    "",
    " ",
    ".",
    "+",
    "Ki",
    "1 Gi",
    "1GB",
    "NaN",
    "Infinity",
    "0x10",
    "1e",
    "١",  # an Arabic-Indic digit: str.isdigit() says yes, Kubernetes says no
]
"""Quantities to put where a pod or partition takes one; all but a few are refused."""


def partition(spec: dict[str, Any], name: str = "poison") -> dict[str, Any]:
    return {
        "apiVersion": "gpupart.io/v1alpha1",
        "kind": "GpuPartition",
        "metadata": {"name": name},
        "spec": spec,
    }


def _mps(**fields: Any) -> dict[str, Any]:
    return {"mode": "MPS", "mps": {"maxClients": 4, **fields}}


def _mig(devices: Any) -> dict[str, Any]:
    return {"mode": "MIG", "mig": {"devices": devices}}


def _sliced(replicas: Any) -> dict[str, Any]:
    return {"mode": "TimeSlicing", "timeSlicing": {"replicas": replicas}}


def _dynamic_dra(**dynamic: Any) -> dict[str, Any]:
    return {"mode": "MIG", "interface": "dra", "mig": {"dynamic": dynamic}}


def _selected(selector: Any) -> dict[str, Any]:
    return {"mode": "None", "nodeSelector": selector}


PARTITION_CASES: list[tuple[str, dict[str, Any], str]] = [
    # (id, spec, the field the refusal must name)
    *(
        (f"defaultMemory={q[:12]!r}", _mps(defaultMemory=q), "spec.mps.defaultMemory")
        for q in ABSURD_QUANTITIES
    ),
    ("defaultMemory=1.5 (a float)", _mps(defaultMemory=1.5), "spec.mps.defaultMemory"),
    ("defaultMemory=[]", _mps(defaultMemory=["1Gi"]), "spec.mps.defaultMemory"),
    ("defaultMemory=1 (a byte)", _mps(defaultMemory=1), "spec.mps.defaultMemory"),
    ("maxClients=0", _mps(maxClients=0), "spec.mps.maxClients"),
    ("maxClients=-1", _mps(maxClients=-1), "spec.mps.maxClients"),
    ("maxClients=2^63", _mps(maxClients=2**63), "spec.mps.maxClients"),
    ("maxClients=1.5", _mps(maxClients=1.5), "spec.mps.maxClients"),
    ("maxClients='4'", _mps(maxClients="4"), "spec.mps.maxClients"),
    ("defaultComputePercent=0", _mps(defaultComputePercent=0), "spec.mps.defaultComputePercent"),
    (
        "defaultComputePercent=101",
        _mps(defaultComputePercent=101),
        "spec.mps.defaultComputePercent",
    ),
    ("profile of 100000 digits", _mig({f"1g.{HUGE}gb": 1}), "spec.mig.devices"),
    ("profile of 100 KB", _mig({LONG: 1}), "spec.mig.devices"),
    ("empty profile", _mig({"": 1}), "spec.mig.devices"),
    ("profile count 8", _mig({"1g.10gb": 8}), "spec.mig.devices.1g.10gb"),
    ("profile count -1", _mig({"1g.10gb": -1}), "spec.mig.devices.1g.10gb"),
    ("profile count huge", _mig({"1g.10gb": 2**63}), "spec.mig.devices.1g.10gb"),
    ("profile count 1.5", _mig({"1g.10gb": 1.5}), "spec.mig.devices.1g.10gb"),
    ("profile count '1'", _mig({"1g.10gb": "1"}), "spec.mig.devices.1g.10gb"),
    ("devices not a map", _mig(["1g.10gb"]), "spec.mig.devices"),
    ("replicas=0", _sliced(0), "spec.timeSlicing.replicas"),
    ("replicas=-1", _sliced(-1), "spec.timeSlicing.replicas"),
    ("replicas=1025", _sliced(1025), "spec.timeSlicing.replicas"),
    ("replicas=2^63", _sliced(2**63), "spec.timeSlicing.replicas"),
    ("replicas=1.5", _sliced(1.5), "spec.timeSlicing.replicas"),
    ("gpus twice", {"mode": "None", "gpus": [0, 0]}, "spec.gpus"),
    ("gpus negative", {"mode": "None", "gpus": [-1]}, "spec.gpus[0]"),
    ("gpus 64", {"mode": "None", "gpus": [64]}, "spec.gpus[0]"),
    ("gpus huge", {"mode": "None", "gpus": [2**63]}, "spec.gpus[0]"),
    ("gpus 1.5", {"mode": "None", "gpus": [1.5]}, "spec.gpus[0]"),
    ("gpus '0'", {"mode": "None", "gpus": ["0"]}, "spec.gpus[0]"),
    ("gpus 100000 long", {"mode": "None", "gpus": list(range(100_000))}, "spec.gpus"),
    ("priority 2^31", {"mode": "None", "priority": 2**31}, "spec.priority"),
    ("priority -2^31-1", {"mode": "None", "priority": -(2**31) - 1}, "spec.priority"),
    ("priority 1.5", {"mode": "None", "priority": 1.5}, "spec.priority"),
    ("mode empty", {"mode": ""}, "spec.mode"),
    ("mode 100 KB", {"mode": LONG}, "spec.mode"),
    ("mode lower case", {"mode": "mig"}, "spec.mode"),
    ("mode a number", {"mode": 1}, "spec.mode"),
    ("disruption unknown", {"mode": "None", "disruption": "Sometimes"}, "spec.disruption"),
    (
        "restoreOnDelete a string",
        {"mode": "None", "restoreOnDelete": "yes"},
        "spec.restoreOnDelete",
    ),
    ("restoreOnDelete a number", {"mode": "None", "restoreOnDelete": 1}, "spec.restoreOnDelete"),
    ("label key with a space", _selected({"matchLabels": {"bad key": "x"}}), "matchLabels"),
    ("label key of 100 KB", _selected({"matchLabels": {LONG: "x"}}), "matchLabels"),
    ("label key two slashes", _selected({"matchLabels": {"a/b/c": "x"}}), "matchLabels"),
    ("label key empty", _selected({"matchLabels": {"": "x"}}), "matchLabels"),
    ("label value 64 long", _selected({"matchLabels": {"k": "v" * 64}}), "matchLabels.k"),
    ("label value bad", _selected({"matchLabels": {"k": "a b"}}), "matchLabels.k"),
    ("label value a number", _selected({"matchLabels": {"k": 1}}), "matchLabels.k"),
    (
        "expression key bad",
        _selected({"matchExpressions": [{"key": "-x-", "operator": "Exists"}]}),
        "matchExpressions[0].key",
    ),
    (
        "expression value 100 KB",
        _selected({"matchExpressions": [{"key": "k", "operator": "In", "values": [LONG]}]}),
        "matchExpressions[0].values[0]",
    ),
    (
        "expression operator unknown",
        _selected({"matchExpressions": [{"key": "k", "operator": "Gt", "values": ["1"]}]}),
        "matchExpressions[0].operator",
    ),
    (
        "too many expressions",
        _selected({"matchExpressions": [{"key": "k", "operator": "Exists"}] * 65}),
        "matchExpressions",
    ),
    ("selector not a map", _selected("all"), "spec.nodeSelector"),
    ("unknown field", {"mode": "None", "colour": "red"}, "spec.colour"),
    ("interface unknown", {"mode": "None", "interface": "both"}, "spec.interface"),
    ("interface upper case", {"mode": "None", "interface": "DRA"}, "spec.interface"),
    ("interface a number", {"mode": "None", "interface": 1}, "spec.interface"),
    ("dra with a warm mix", _dynamic_dra(warm={"1g.10gb": 1}), "spec.mig.dynamic.warm"),
    (
        "dra without carving idle GPUs",
        _dynamic_dra(carveIdleGpus=False),
        "spec.mig.dynamic.carveIdleGpus",
    ),
]

GOOD_SPECS: list[dict[str, Any]] = [
    _mig({"1g.10gb": 1, "3g.40gb": 1}),
    _mps(defaultMemory="10Gi"),
    _mps(defaultMemory="1Mi"),
    _sliced(4),
    {"mode": "None", "gpus": [0, 63], "priority": 2**31 - 1},
    _selected({"matchLabels": {"example.com/pool": "a-b.c_d", "k": ""}}),
    _dynamic_dra(profiles=["1g.10gb", "7g.80gb"], warm={"1g.10gb": 0}, carveIdleGpus=True),
    {**_mps(defaultMemory="10Gi"), "interface": "dra"},
]
"""At the bounds but valid: a refusal here would be a bound set too tight."""
