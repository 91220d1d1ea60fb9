"""Kubernetes-style (klog text) structured log lines: `I0102 15:04:05.000000 pid file:line] "Msg" k="v"`."""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

_LEVELS = {"DEBUG": "D", "INFO": "I", "WARNING": "W", "ERROR": "E", "CRITICAL": "F"}


class KlogFormatter(logging.Formatter):
    """Message quoted, then the `kv` mapping passed as `extra={"kv": {...}}` as key="value"."""

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%m%d %H:%M:%S", time.localtime(record.created))
        micros = int((record.created % 1) * 1_000_000)
        head = (
            f"{_LEVELS.get(record.levelname, 'I')}{stamp}.{micros:06d} {os.getpid()} "
            f"{record.filename}:{record.lineno}]"
        )
        parts = [head, json.dumps(record.getMessage())]
        kv: dict[str, Any] = getattr(record, "kv", {}) or {}
        parts += [
            f"{k}={json.dumps(v if isinstance(v, int | float) else str(v))}" for k, v in kv.items()
        ]
        if record.exc_info:
            parts.append(f"err={json.dumps(self.formatException(record.exc_info))}")
        return " ".join(parts)


def configure(level: str) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(KlogFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
