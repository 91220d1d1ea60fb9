"""Ports for test servers: a loopback port that nothing listens on right now."""

from __future__ import annotations

import socket

LOOPBACK = "127.0.0.1"  # every listener and every URL of the tests stays on loopback


def free_port(host: str = LOOPBACK) -> int:
    """A port that was free on `host` a moment ago (bind to 0, read it, release it).

    Also a port that refuses connections, for tests of an unreachable server.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
