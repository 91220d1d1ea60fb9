"""Bad input to every parser of the core: refused as Kubernetes refuses it, as InvalidInput, whatever its size.

Aspects: nothing is stripped (spaces, newlines, control characters and other scripts' digits
are refused in quantities, profile names, label keys and values, int64 labels); huge inputs
(100,000-digit numbers, 10,000-entry lists) are refused promptly, never with Python's own
errors (its 4,300-digit integer limit, recursion, type errors); any JSON-shaped value through
any parser is read or refused with gpupart's error vocabulary only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpupart.core.api.pods import node_constraint, parse_pod_request, pod_cpu_milli
from gpupart.core.api.resources import (
    check_profile_name,
    find_mig_profile,
    parse_memory_mib,
    parse_quantity,
)
from gpupart.core.api.selectors import (
    check_label_key,
    check_label_value,
    parse_int64,
    parse_label_selector,
    parse_node_constraint,
    parse_pod_affinity_term,
)
from gpupart.core.api.spec import parse_partition
from gpupart.core.errors import GpupartError, InvalidInput
from gpupart.core.mig.catalogue import parse_profile_name
from gpupart.core.scheduling.demand import parse_demand
from gpupart.core.scheduling.preemption import parse_budget

HUGE = "9" * 100_000
"""Past Python's 4,300-digit limit for int(), and past every bound."""
JUNK = [" ", "\n", "\t", "\r", "\x00", "\x7f", "\u00a0", "\u2003", "\u0085", "١", "٣", "𝟘", "ⅷ"]
"""Whitespace (ASCII and not), control characters, other scripts' digits (Arabic-Indic,
mathematical, Roman numerals): Kubernetes' parsers take none of them."""


# --- nothing is stripped ------------------------------------------------------------------------


@pytest.mark.parametrize("junk", JUNK)
@pytest.mark.parametrize("text", ["5", "1Gi", "500m", "1e3", "0"])
@pytest.mark.parametrize("place", ["before", "after", "inside"])
def test_a_quantity_with_any_other_character_is_refused(junk: str, text: str, place: str) -> None:
    spelled = {"before": junk + text, "after": text + junk, "inside": text[:1] + junk + text[1:]}
    with pytest.raises(InvalidInput, match="^spec.x: .*not a Kubernetes quantity"):
        parse_quantity(spelled[place], where="spec.x")


@pytest.mark.parametrize("junk", JUNK)
@pytest.mark.parametrize("name", ["1g.10gb", "3g.40gb+me", "1c.2g.20gb"])
def test_a_profile_name_with_any_other_character_is_refused(junk: str, name: str) -> None:
    middle = len(name) // 2
    for spelled in (name + junk, junk + name, name[:middle] + junk + name[middle:]):
        with pytest.raises(InvalidInput, match="not a MIG profile name"):
            parse_profile_name(spelled, where="spec.mig.devices")


def test_other_scripts_digits_are_not_digits() -> None:
    assert "١٠".isdigit() and int("١٠") == 10, "what Python alone would accept"
    with pytest.raises(InvalidInput):
        parse_profile_name("1g.١٠gb")
    with pytest.raises(InvalidInput):
        parse_quantity("١٠", where="x")
    assert parse_int64("١٠") is None
    assert parse_int64("1_000") is None, "int() takes underscores; strconv.ParseInt does not"
    assert parse_int64(" 1") is None and parse_int64("1\n") is None


@pytest.mark.parametrize("junk", JUNK)
def test_label_keys_and_values_with_any_other_character_are_refused(junk: str) -> None:
    for key in (f"app{junk}", f"{junk}app", f"example.com/a{junk}b"):
        with pytest.raises(InvalidInput, match="not a label key"):
            check_label_key(key, where="k")
    with pytest.raises(InvalidInput, match="not a label value"):
        check_label_value(f"web{junk}", "v")


@pytest.mark.parametrize(
    "text",
    ["1e4294967297", "1e-4294967297", "1e-1000000000", "1e1000000000", "5E-9223372036854775807"],
)
def test_an_exponent_kubernetes_would_truncate_is_refused(text: str) -> None:
    """resource.Quantity keeps an exponent's low 32 bits (1e4294967297 is read as 10, and
    1e-4294967297 as 0.1); past ±999,999,999 gpupart refuses rather than misread."""
    with pytest.raises(InvalidInput, match="exponent is beyond"):
        parse_quantity(text, where="x")


@pytest.mark.parametrize("text", ["+", "-", ".", "+.", "Ki", "-Mi", ".e5", "k", "E"])
def test_a_spelling_without_digits_is_refused(text: str) -> None:
    """resource.Quantity reads these as 0 (its scanner puts a 0 where no digit is); gpupart
    follows the documented grammar, which needs a digit (docs/adr-002-bounded-inputs.md)."""
    with pytest.raises(InvalidInput, match="no digits|not a Kubernetes quantity"):
        parse_quantity(text, where="x")


@pytest.mark.timeout(30)  # milliseconds; without the tiny-value bound, hours
def test_an_exponent_within_the_bound_is_read() -> None:
    assert parse_quantity("1e-999999999", where="x") == parse_quantity("1n", where="x")
    assert parse_quantity("0e999999999", where="x") == 0


# --- Go's int64: the Gt/Lt bound and label --------------------------------------------------


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("0", 0), ("007", 7), ("+5", 5), ("-5", -5), ("9223372036854775807", 2**63 - 1),
        ("-9223372036854775808", -(2**63)), ("1700000000000000000", 1_700_000_000_000_000_000),
        ("0" * 5000 + "1", 1),
    ],
)  # fmt: skip
def test_int64_reads_as_strconv_parse_int(text: str, value: int) -> None:
    assert parse_int64(text) == value


@pytest.mark.parametrize(
    "text",
    ["", "+", "-", "9223372036854775808", "-9223372036854775809", HUGE, "1.0", "0x10", "1e3"],
)
def test_int64_refuses_what_strconv_parse_int_refuses(text: str) -> None:
    assert parse_int64(text) is None


# --- huge inputs, promptly, with our errors -----------------------------------------------------


@pytest.mark.parametrize(
    ("read", "value"),
    [
        (lambda v: parse_quantity(v, where="x"), HUGE),
        (lambda v: parse_quantity(v, where="x"), "1e-99999999999999999999"),
        (lambda v: parse_quantity(v, where="x"), "1e" + HUGE),
        (lambda v: parse_quantity(v, where="x"), 10**5000),  # an int from YAML
        (lambda v: parse_memory_mib(v, where="x"), "1" + "0" * 63),
        (lambda v: parse_profile_name(v, where="x"), f"1g.{HUGE}gb"),
        (lambda v: check_profile_name(v, where="x"), f"1g.{HUGE}gb"),
        (lambda v: check_label_key(v, where="x"), "a" * 100_000),
        (lambda v: parse_label_selector(v, "x"), {"matchLabels": {"a" * 100_000: "b"}}),
        (
            lambda v: parse_label_selector(v, "x"),
            {"matchExpressions": [{"key": "k", "operator": "In", "values": ["a" * 100_000]}]},
        ),
    ],
    ids=lambda case: (
        None
        if callable(case)
        else f"int of {case.bit_length()} bits"
        if isinstance(case, int)
        else repr(case)[:30]
    ),
)
def test_huge_input_is_invalid_input_never_a_python_error(
    read: Callable[[Any], object], value: object
) -> None:
    with pytest.raises(InvalidInput) as refused:
        read(value)
    assert len(str(refused.value)) < 300, "a message never echoes the whole input"


def test_a_profile_name_of_many_leading_zeros_is_read_within_bounds() -> None:
    assert parse_profile_name(f"1g.{'0' * 5000}10gb") == (1, 1, 10, "")


def test_huge_numbers_as_gt_bounds_and_labels_never_match_and_never_raise() -> None:
    term = {"matchExpressions": [{"key": "t", "operator": "Gt", "values": [HUGE]}]}
    pod = {
        "spec": {
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}
                }
            }
        }
    }
    constraint = node_constraint(pod)
    assert not constraint.allows({"t": "5"}, "n")
    lt = {"matchExpressions": [{"key": "t", "operator": "Lt", "values": ["5"]}]}
    pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"] = {
        "nodeSelectorTerms": [lt]
    }
    assert not node_constraint(pod).allows({"t": "-" + HUGE}, "n")
    assert node_constraint(pod).allows({"t": "4"}, "n")


def test_ten_thousand_terms_are_read_in_linear_time() -> None:
    many = [
        {"matchExpressions": [{"key": "k", "operator": "In", "values": [str(n)]}]}
        for n in range(10_000)
    ]
    pod = {
        "spec": {
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": many}
                }
            }
        }
    }
    constraint = node_constraint(pod)
    assert constraint.allows({"k": "9999"}, "n") and not constraint.allows({"k": "x"}, "n")


# --- any JSON-shaped value, any parser ----------------------------------------------------------

_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=-(10**40), max_value=10**40),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.sampled_from([HUGE, "1e99999999", "1e-99999999999999999999", "In", "Gt", "Exists", *JUNK]),
)
_FIELDS = [
    "metadata", "spec", "status", "labels", "namespace", "name", "affinity", "nodeAffinity",
    "podAntiAffinity", "requiredDuringSchedulingIgnoredDuringExecution",
    "preferredDuringSchedulingIgnoredDuringExecution", "nodeSelectorTerms", "matchExpressions",
    "matchFields", "matchLabels", "key", "operator", "values", "labelSelector", "namespaces",
    "namespaceSelector", "topologyKey", "podAffinityTerm", "weight", "nodeSelector", "selector",
    "containers", "resources", "limits", "requests", "nvidia.com/gpu.shared", "cpu",
    "disruptionsAllowed", "disruptedPods", "mode", "mig", "devices", "mps", "maxClients",
    "apiVersion", "kind",
]  # fmt: skip
json_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(
            st.one_of(st.sampled_from(_FIELDS), st.text(max_size=8)), inner, max_size=5
        ),
    ),
    max_leaves=30,
)

PARSERS: list[tuple[str, Callable[[Any], object]]] = [
    ("parse_quantity", lambda v: parse_quantity(v, where="x")),
    ("parse_memory_mib", lambda v: parse_memory_mib(v, where="x")),
    ("parse_profile_name", lambda v: parse_profile_name(v, where="x")),
    ("check_profile_name", lambda v: check_profile_name(v, where="x")),
    ("find_mig_profile", lambda v: find_mig_profile(v) if isinstance(v, str) else None),
    ("parse_label_selector", lambda v: parse_label_selector(v, "x")),
    ("parse_node_constraint", lambda v: parse_node_constraint(v) if isinstance(v, dict) else None),
    ("parse_pod_affinity_term", lambda v: parse_pod_affinity_term(v, "a", "x")),
    ("node_constraint", lambda v: node_constraint(v) if isinstance(v, dict) else None),
    (
        "parse_demand",
        lambda v: parse_demand(v, anti_affinity_label="app", namespace_labels={"a": {}}),
    ),
    ("parse_pod_request", lambda v: parse_pod_request(v) if isinstance(v, dict) else None),
    ("pod_cpu_milli", lambda v: pod_cpu_milli(v) if isinstance(v, dict) else None),
    ("parse_budget", lambda v: parse_budget(v) if isinstance(v, dict) else None),
    ("parse_partition", parse_partition),
]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(value=json_values, which=st.sampled_from(PARSERS))
def test_law_any_json_value_through_any_parser_is_read_or_refused_by_our_errors(
    value: object, which: tuple[str, Callable[[Any], object]]
) -> None:
    _, read = which
    with contextlib.suppress(GpupartError):
        read(value)


@settings(max_examples=300, deadline=None)
@given(
    shape=st.fixed_dictionaries(
        {
            "labelSelector": json_values,
            "namespaces": json_values,
            "namespaceSelector": json_values,
            "topologyKey": json_values,
        }
    ),
    namespaces=st.dictionaries(
        st.text(max_size=4), st.dictionaries(st.text(max_size=4), st.text(max_size=4))
    ),
)
def test_law_any_affinity_term_shape_resolves_or_is_refused(
    shape: dict[str, Any], namespaces: dict[str, dict[str, str]]
) -> None:
    try:
        term = parse_pod_affinity_term(shape, "a", "x")
    except InvalidInput as error:
        assert error.where.startswith("x")
        return
    resolved = term.resolve(namespaces)
    resolved.matches("a", {"app": "web"})
