"""One log line format for every component: klog text, `I0102 15:04:05.000000 pid file:line] "Msg" k="v"`."""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

_LETTERS = {"DEBUG": "D", "INFO": "I", "WARNING": "W", "ERROR": "E", "CRITICAL": "F"}


def kv(**fields: object) -> dict[str, Any]:
    """`log.info("Listed objects", extra=kv(kind="Pod", count=3))`: fields after the message."""
    return {"kv": fields}


class KlogFormatter(logging.Formatter):
    """The message quoted, then the record's `kv` fields (see `kv`) as key="value".

    kopf's per-object records carry `k8s_ref`; it becomes `object="namespace/name"`.
    """

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%m%d %H:%M:%S", time.localtime(record.created))
        micros = int((record.created % 1) * 1_000_000)
        head = (
            f"{_LETTERS.get(record.levelname, 'I')}{stamp}.{micros:06d} {os.getpid()} "
            f"{record.filename}:{record.lineno}]"
        )
        fields: dict[str, Any] = dict(getattr(record, "kv", None) or {})
        ref = getattr(record, "k8s_ref", None)
        if isinstance(ref, dict) and ref.get("name"):
            namespace = ref.get("namespace")
            fields["object"] = f"{namespace}/{ref['name']}" if namespace else ref["name"]
        parts = [head, json.dumps(record.getMessage())]
        parts += [
            f"{k}={json.dumps(v if isinstance(v, int | float) else str(v))}"
            for k, v in fields.items()
        ]
        if record.exc_info:
            parts.append(f"err={json.dumps(self.formatException(record.exc_info))}")
        return " ".join(parts)


def configure(level: str = "INFO") -> None:
    """Called once by each component's `run`: one stderr handler with the klog format."""
    handler = logging.StreamHandler()
    handler.setFormatter(KlogFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
