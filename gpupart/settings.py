"""Component settings from flags and GPUPART_* variables: a flag wins over its variable, a variable over the default."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from gpupart.core.errors import InvalidInput

T = TypeVar("T")

TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


@dataclass(frozen=True, slots=True)
class Setting(Generic[T]):
    """One setting: its flag, how its text becomes a value, its default (as text) and its help.

    `env` replaces the variable derived from the flag (prefix + FLAG_NAME) for the names that
    Kubernetes tooling already sets (NODE_NAME, KUBECONFIG, POD_NAME); the first one set wins.
    """

    flag: str
    parse: Callable[[str], T]
    default: str
    help: str
    env: tuple[str, ...] = ()
    boolean: bool = False
    """A bare `--flag` means true; `--flag=false` still works."""
    metavar: str | None = None

    @property
    def dest(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")


class SettingsTable:
    """The settings of one component: adds their flags and reads their values."""

    def __init__(self, prefix: str, settings: Sequence[Setting[Any]]) -> None:
        self.prefix = prefix
        """Prepended to FLAG_NAME to name each setting's variable (GPUPART_OPERATOR_, ...)."""
        self.settings = tuple(settings)
        flags = [s.flag for s in self.settings]
        if len(set(flags)) != len(flags):
            raise ValueError(f"a flag is listed twice: {flags}")

    def env_names(self, setting: Setting[Any]) -> tuple[str, ...]:
        return setting.env or (self.prefix + setting.dest.upper(),)

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Every flag, its help naming its variable and default; no default goes into `args`
        (None means "not given", so the variable and then the default apply)."""
        for setting in self.settings:
            shown = repr(setting.default) if setting.default else "unset"
            described = (
                f"{setting.help} [env {' or '.join(self.env_names(setting))}, default: {shown}]"
            )
            if setting.boolean:
                parser.add_argument(
                    setting.flag, nargs="?", const="true", metavar="BOOL", help=described
                )
            else:
                parser.add_argument(setting.flag, metavar=setting.metavar, help=described)

    def reader(
        self, args: argparse.Namespace, environ: Mapping[str, str] | None = None
    ) -> SettingsReader:
        return SettingsReader(self, args, os.environ if environ is None else environ)


class SettingsReader:
    """The values of one start: each from its flag, else its variable, else its default."""

    def __init__(
        self, table: SettingsTable, args: argparse.Namespace, environ: Mapping[str, str]
    ) -> None:
        self.table = table
        self.args = args
        self.environ = environ

    def given(self, setting: Setting[Any]) -> tuple[str, str] | None:
        """(where, text) of the flag or variable that set it; None when neither did."""
        flagged = getattr(self.args, setting.dest, None)
        if flagged is not None:
            return setting.flag, str(flagged)
        for name in self.table.env_names(setting):
            if name in self.environ:
                return name, self.environ[name]
        return None

    def __call__(self, setting: Setting[T]) -> T:
        where, text = self.given(setting) or (f"{setting.flag} (default)", setting.default)
        try:
            return setting.parse(text)
        except (ValueError, InvalidInput) as error:
            problem = error.problem if isinstance(error, InvalidInput) else str(error)
            raise InvalidInput(where, problem) from None


# --- parsers: text -> value, a ValueError says what was expected ---------------------------


def text(value: str) -> str:
    return value


def optional_text(value: str) -> str | None:
    return value or None


def integer(value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"expected an integer, got {value!r}") from None


def optional_integer(value: str) -> int | None:
    return integer(value) if value.strip() else None


def number(value: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"expected a number, got {value!r}") from None


def boolean(value: str) -> bool:
    word = value.strip().lower()
    if word in TRUE:
        return True
    if word in FALSE:
        return False
    raise ValueError(f"expected true or false, got {value!r}")


def integers(value: str) -> frozenset[int]:
    """A comma-separated set of integers (`13,31,43`)."""
    try:
        return frozenset(int(x) for x in value.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"expected comma-separated integers, got {value!r}") from None


KUBECONFIG = Setting(
    "--kubeconfig",
    optional_text,
    "",
    "kubeconfig file; unset: the in-cluster service account, else ~/.kube/config",
    env=("KUBECONFIG",),
    metavar="FILE",
)
"""The kubeconfig setting of the operator and the node agent (the variable kubectl reads)."""
