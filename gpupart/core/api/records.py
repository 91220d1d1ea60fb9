"""Strict reading of untrusted JSON-like records (specs, annotations) with the field path in errors; API timestamps."""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from gpupart.core.errors import InvalidInput, shown

T = TypeVar("T")

MAX_INTEGER = 2**63 - 1
"""The largest whole number any field takes (an int64, as in Kubernetes' own objects)."""
_LONGEST_KEY = 64


class Record:
    """A mapping read at the edge: typed getters, and `done()` rejects fields nobody asked for."""

    def __init__(self, raw: object, where: str) -> None:
        if not isinstance(raw, Mapping):
            raise InvalidInput(where, f"must be a mapping, got {_kind(raw)}")
        odd = next((key for key in raw if not isinstance(key, str)), None)
        if odd is not None:
            raise InvalidInput(where, f"has a key that is not a string: {_kind(odd)}")
        self.raw: Mapping[str, Any] = raw
        self.where = where
        self._seen: set[str] = set()

    def path(self, key: str) -> str:
        if len(key) > _LONGEST_KEY:  # a path names its place; it never carries 100 KB
            key = f"{key[:_LONGEST_KEY]}…"
        return f"{self.where}.{key}" if self.where else key

    def has(self, key: str) -> bool:
        return self.raw.get(key) is not None

    def _get(self, key: str, required: bool) -> Any:
        self._seen.add(key)
        value = self.raw.get(key)
        if value is None and required:
            raise InvalidInput(self.path(key), "is required")
        return value

    def value(self, key: str) -> Any:
        """The raw value, for fields that another parser reads (quantities)."""
        return self._get(key, True)

    def string(self, key: str, default: str | None = None) -> str:
        value = self._get(key, default is None)
        if value is None:
            return default or ""
        if not isinstance(value, str):
            raise InvalidInput(self.path(key), f"must be a string, got {_kind(value)}")
        return value

    def boolean(self, key: str, default: bool) -> bool:
        value = self._get(key, False)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise InvalidInput(self.path(key), f"must be true or false, got {_kind(value)}")
        return value

    def integer(
        self,
        key: str,
        default: int | None = None,
        *,
        minimum: int | None = None,
        maximum: int = MAX_INTEGER,
    ) -> int:
        value = self._get(key, default is None)
        if value is None:
            assert default is not None
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidInput(self.path(key), f"must be a whole number, got {_kind(value)}")
        if minimum is not None and value < minimum:
            raise InvalidInput(self.path(key), f"must be ≥ {minimum}, got {_number(value)}")
        if value > maximum:
            raise InvalidInput(self.path(key), f"must be ≤ {maximum}, got {_number(value)}")
        return value

    def number(self, key: str, *, minimum: float) -> float:
        """A finite JSON number (whole or not), at least `minimum`; required."""
        value = self._get(key, True)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InvalidInput(self.path(key), f"must be a number, got {_kind(value)}")
        if isinstance(value, int) and abs(value) > MAX_INTEGER:
            raise InvalidInput(self.path(key), f"must be ≤ {MAX_INTEGER}, got {_number(value)}")
        number = float(value)
        if not math.isfinite(number) or number < minimum:
            raise InvalidInput(self.path(key), f"must be a finite number ≥ {minimum:g}")
        return number

    def optional_integer(
        self, key: str, *, minimum: int | None = None, maximum: int = MAX_INTEGER
    ) -> int | None:
        if self.has(key):
            return self.integer(key, minimum=minimum, maximum=maximum)
        return self._get(key, False)  # type: ignore[no-any-return]  # None: not set

    def optional_record(self, key: str) -> Record | None:
        value = self._get(key, False)
        return None if value is None else Record(value, self.path(key))

    def record(self, key: str) -> Record:
        return Record(self._get(key, True), self.path(key))

    def items(self, key: str, *, required: bool = False) -> list[Any]:
        value = self._get(key, required)
        if value is None:
            return []
        if not isinstance(value, list):
            raise InvalidInput(self.path(key), f"must be a list, got {_kind(value)}")
        return value

    def each(self, key: str, read: Callable[[Record], T], *, required: bool = False) -> list[T]:
        """`read` applied to each mapping in the list at `key`; each rejects fields nobody read."""
        values = []
        for position, raw in enumerate(self.items(key, required=required)):
            item = Record(raw, f"{self.path(key)}[{position}]")
            values.append(read(item))
            item.done()
        return values

    def done(self) -> None:
        unknown = sorted(set(self.raw) - self._seen)
        if unknown:
            raise InvalidInput(
                self.path(unknown[0]),
                f"unknown field (known here: {', '.join(sorted(self._seen))})",
            )


def _number(value: int) -> str:
    text = str(value) if abs(value) < 10**30 else f"a number of {len(str(abs(value)))} digits"
    return text


def _kind(value: object) -> str:
    if value is None:
        return "nothing"
    if isinstance(value, bool):
        return f"a boolean ({value})"
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, int):
        return f"int {_number(value)}"
    if isinstance(value, str):
        return f"str {shown(value)}"
    return f"{type(value).__name__} {shown(repr(value))[1:-1]}"


def find_time(timestamp: object) -> float | None:
    """An RFC 3339 timestamp of the API server (`creationTimestamp`, a condition's
    `lastTransitionTime`) as Unix seconds; None when absent or unreadable."""
    if not isinstance(timestamp, str):
        return None
    try:
        return dt.datetime.fromisoformat(timestamp).timestamp()
    except ValueError:
        return None
