"""The one log line format: klog text with the message quoted and fields as key="value"."""

from __future__ import annotations

import ast
import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import gpupart
import gpupart_extender
import gpupart_operator
import gpupart_plugin
from gpupart.logs import KlogFormatter, kv


def line(message: str, *args: object, **extra: object) -> str:
    record = logging.LogRecord(
        "gpupart.x", logging.WARNING, "/src/kube.py", 42, message, args, None
    )
    for key, value in extra.items():
        setattr(record, key, value)
    return KlogFormatter().format(record)


def test_head_message_and_fields_as_klog_writes_them() -> None:
    text = line("Watch failed; relisting", **kv(kind="Pod", count=3, err='a "quoted" reason'))
    head, rest = text.split("] ", 1)
    assert re.fullmatch(r"W\d{4} \d\d:\d\d:\d\d\.\d{6} \d+ kube\.py:42", head), head
    assert rest == r'"Watch failed; relisting" kind="Pod" count=3 err="a \"quoted\" reason"'
    assert "\n" not in line("two\nlines")


def test_printf_arguments_and_kopf_object_references() -> None:
    text = line("Reconciled node=%s", "n1", k8s_ref={"namespace": "", "name": "gpup-a"})
    assert text.endswith(f'{json.dumps("Reconciled node=n1")} object="gpup-a"')
    text = line("Handler", k8s_ref={"namespace": "ns", "name": "p"})
    assert text.endswith('object="ns/p"')


LEVELS = {"debug", "info", "warning", "error", "exception", "critical"}


def _log_calls() -> Iterator[tuple[str, ast.Call]]:
    """Every `log.<level>(...)` / `logger.<level>(...)` call in the components' source."""
    for package in (gpupart, gpupart_operator, gpupart_plugin, gpupart_extender):
        for path in sorted(Path(package.__file__).parent.rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr in LEVELS
                    and isinstance(node.func.value, ast.Name)
                    and node.func.value.id in {"log", "logger", "logging"}
                ):
                    yield f"{path.name}:{node.lineno}", node


def _messages(node: ast.expr) -> list[str] | None:
    """The message texts a call can log: a string constant, or a choice of two; else None."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.IfExp):
        body, orelse = _messages(node.body), _messages(node.orelse)
        return None if body is None or orelse is None else body + orelse
    return None


def test_every_log_call_has_a_constant_message_and_its_values_in_fields() -> None:
    calls = list(_log_calls())
    assert len(calls) > 40  # the walk found the call sites
    bad = []
    for where, call in calls:
        texts = _messages(call.args[0]) if call.args else None
        if len(call.args) != 1 or texts is None:
            bad.append(f"{where}: message not a constant (printf arguments or an f-string)")
        elif any(re.search(r"\w=|%[sdrgf]|\.$|^[a-z]", t) for t in texts):
            bad.append(f"{where}: {texts} (fields belong in extra=logs.kv(...))")
    assert not bad, "\n".join(bad)
