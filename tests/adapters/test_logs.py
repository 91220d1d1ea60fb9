"""The one log line format: klog text with the message quoted and fields as key="value"."""

from __future__ import annotations

import json
import logging
import re

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
