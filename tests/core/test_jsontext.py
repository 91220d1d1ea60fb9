"""JSON from outside read bounded (gpupart.core.api.jsontext): deep values cut, the rest as `json` reads it."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpupart.core.api.jsontext import MAX_DEPTH, TOO_DEEP, check_size, cut_deep, loads
from gpupart.core.errors import InvalidInput

_SCALARS = st.none() | st.booleans() | st.integers() | st.text(alphabet='[]{}"\\ab\n')
_VALUES = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3), inner),
    max_leaves=40,
)


def _nested(depth: int, leaf: str = "1") -> str:
    return '{"a":' * depth + leaf + "}" * depth


def _depth_of(value: Any) -> int:
    depth = 0
    while isinstance(value, dict):
        value, depth = value["a"], depth + 1
    return depth


@given(_VALUES)
def test_law_text_the_parser_walks_reads_as_json_reads_it(value: Any) -> None:
    text = json.dumps(value)
    assert loads(text, "x") == json.loads(text)
    assert cut_deep(text) == text  # nothing here nests past MAX_DEPTH


def test_a_value_deeper_than_the_parser_walks_is_cut_at_the_bound() -> None:
    read = loads(_nested(20_000), "claim")
    assert _depth_of(read) == MAX_DEPTH
    inner = read
    for _ in range(MAX_DEPTH):
        inner = inner["a"]
    assert inner == TOO_DEEP


def test_one_deep_object_in_a_list_leaves_the_others_as_they_are() -> None:
    good = {"metadata": {"name": "good", "note": "[[[{{{"}, "spec": {"x": [1, 2, {"y": None}]}}
    text = json.dumps({"items": [good, "DEEP", good]}).replace('"DEEP"', _nested(5_000))
    items = loads(text, "the list")["items"]
    assert items[0] == good and items[2] == good
    assert _depth_of(items[1]) == MAX_DEPTH - 2  # the list and its object count too


def test_brackets_and_escapes_inside_strings_are_not_nesting() -> None:
    text = json.dumps(["[" * 5_000, '\\"{', {"k": "]" * 10}]) + " "
    assert cut_deep(text, max_depth=2) == text


@pytest.mark.parametrize(
    "text", ["", "{", "[1,]", _nested(5_000)[:-1], b"\xff\xfe\x00", "{" * 5_000 + "]" * 5_000]
)
def test_text_that_is_not_json_is_refused_naming_where(text: str | bytes) -> None:
    with pytest.raises(InvalidInput, match=r"^annotation gpupart\.io/x: not JSON"):
        loads(text, "annotation gpupart.io/x")


def test_check_size_refuses_deep_or_large_values_without_recursion() -> None:
    deep = json.loads(_nested(800))  # within what `json` walks, deeper than any walker should
    with pytest.raises(InvalidInput, match=r"^p: nests deeper than 32 levels"):
        check_size(deep, "p", max_bytes=10_000)
    with pytest.raises(InvalidInput, match=r"^p: is larger than 100 bytes"):
        check_size({"k": "v" * 200}, "p", max_bytes=100)
    check_size(json.loads(_nested(32)), "p", max_bytes=10_000)
    check_size({"k": ["v"] * 10}, "p", max_bytes=100)
