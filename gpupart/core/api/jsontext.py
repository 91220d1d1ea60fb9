"""JSON from outside, read bounded: what nests deeper than a parser walks is cut in place, affecting only its object.

The API server stores JSON nested thousands of levels deep (a ResourceClaim's opaque
`parameters` are free-form, and so is an annotation's text), deeper than Python's `json`
walks: it raises RecursionError, which is no ValueError, and a whole list of objects fails
with the one. `loads` reads such text with every value nested deeper than `MAX_DEPTH` replaced
by the string `TOO_DEEP`: the rest of that object and every other object read as they are, and
a reader that looks inside the cut value finds a string where it expected more, and says so
with the field's path. What `loads` returns never nests deeper than the `json` module walks
(about 900 levels), so a walker of free-form values still bounds its own depth
(`check_size`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from gpupart.core.errors import InvalidInput

MAX_DEPTH = 100
"""Objects and lists nested deeper than this are cut when the text is too deep for `json`
(no Kubernetes object of gpupart's, nor any schema'd field, comes near it)."""
TOO_DEEP = f"<nested deeper than {MAX_DEPTH} levels: not read>"

# A string (with its escapes) or one bracket: what the cut has to see of the text.
_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]', re.DOTALL)
_CUT = json.dumps(TOO_DEEP)


def loads(text: str | bytes, where: str) -> Any:
    """The JSON value of `text`; InvalidInput naming `where` when it is not JSON."""
    try:
        return json.loads(text)
    except RecursionError:
        pass  # deeper than the parser walks: cut below, then read again
    except (TypeError, ValueError) as error:
        raise InvalidInput(where, f"not JSON ({error})") from None
    try:
        decoded = text.decode("utf-8") if isinstance(text, bytes) else text
        return json.loads(cut_deep(decoded))
    except (ValueError, RecursionError) as error:
        raise InvalidInput(where, f"not JSON ({error})") from None


def cut_deep(text: str, max_depth: int = MAX_DEPTH) -> str:
    """`text` with each object or list that opens deeper than `max_depth` replaced by the
    JSON string `TOO_DEEP`; brackets inside strings are not counted. Text that is not JSON
    stays not JSON (unbalanced brackets are left for the parser to refuse)."""
    pieces: list[str] = []
    depth = 0
    kept_to = 0  # text[:kept_to] is in pieces
    cut_from: int | None = None
    for match in _TOKEN.finditer(text):
        token = match.group()
        if token in "[{":
            depth += 1
            if depth == max_depth + 1 and cut_from is None:
                cut_from = match.start()
        elif token in "]}":
            if depth == max_depth + 1 and cut_from is not None:
                pieces.append(text[kept_to:cut_from])
                pieces.append(_CUT)
                kept_to = match.end()
                cut_from = None
            depth -= 1
    pieces.append(text[kept_to:])
    return "".join(pieces)


def check_size(value: object, where: str, *, max_bytes: int, max_depth: int = 32) -> None:
    """InvalidInput naming `where` when `value` (decoded JSON) would encode to more than about
    `max_bytes` or nests deeper than `max_depth`; walked without recursion, at most
    `max_bytes` steps."""
    size = 0
    stack: list[tuple[object, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if depth > max_depth:
            raise InvalidInput(where, f"nests deeper than {max_depth} levels")
        if isinstance(item, Mapping):
            size += 2
            for key, inner in item.items():
                size += len(str(key)) + 4
                stack.append((inner, depth + 1))
        elif isinstance(item, list):
            size += 2
            stack.extend((inner, depth + 1) for inner in item)
        else:
            size += len(str(item)) + 1
        if size > max_bytes:
            raise InvalidInput(where, f"is larger than {max_bytes} bytes")
