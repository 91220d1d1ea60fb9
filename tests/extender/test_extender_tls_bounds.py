"""The extender's TLS listener: anonymous clients refused, idle, half-open and excess connections bounded.

We test these aspects, each against a real `gpupart extender` process on a loopback port
with client certificates required (the certificates of test_extender_tls.py):
- a client without a certificate gets no HTTP answer (the handshake is refused), one with the
  right certificate does;
- a connection that sends nothing, or half a ClientHello, is closed once its handshake has
  not completed within `tls_handshake_timeout_seconds`;
- a connection idle after an answer, or established and never asked anything, is closed after
  `keep_alive_timeout_seconds`;
- with `max_connections` reached by half-open connections, a client with the right
  certificate is still answered (it takes the place of the oldest half-open one, and the
  newer ones stay); with every connection established, a new one gets no answer, and is
  answered again once one of them closes.

Every wait polls for what it asserts, with a deadline well above the bound it waits on.
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
from test_extender_tls import Extender, client_context, start_extender, tls_answer

from gpupart_testsupport.polling import wait_for
from gpupart_testsupport.ports import LOOPBACK

PARTIAL_CLIENT_HELLO = b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 16
"""A TLS record header announcing a 512-byte ClientHello, and its first bytes only."""


def answer(extender: Extender, cert: tuple[Path, Path] | None) -> bytes:
    return tls_answer(extender.port, client_context(extender.pki, cert), "filter")


def answered(extender: Extender) -> bool:
    """Whether a client with the right certificate gets an HTTP answer (to an empty body)."""
    return answer(extender, extender.pki.client).startswith(b"HTTP/1.1 400 ")


@pytest.fixture(scope="module")
def brief(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Extender]:
    """Short bounds: 1 s for a handshake, 1 s of idleness."""
    yield from start_extender(
        tmp_path_factory.mktemp("tls-brief"),
        tls_handshake_timeout_seconds=1,
        keep_alive_timeout_seconds=1,
    )


@pytest.fixture(scope="module")
def capped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Extender]:
    """Four connections at most; bounds far longer than any wait here (120 s)."""
    yield from start_extender(
        tmp_path_factory.mktemp("tls-capped"),
        max_connections=4,
        tls_handshake_timeout_seconds=120,
        keep_alive_timeout_seconds=120,
    )


def closed(sock: socket.socket) -> bool:
    """Whether the server has closed `sock` (an EOF or a reset waits to be read)."""
    sock.setblocking(False)
    try:
        while True:
            if not sock.recv(65536):
                return True
    except BlockingIOError:
        return False
    except (ConnectionResetError, ssl.SSLError):
        return True


def half_open(port: int, sent: bytes = b"") -> socket.socket:
    sock = socket.create_connection((LOOPBACK, port), timeout=10)
    if sent:
        sock.sendall(sent)
    return sock


def established(extender: Extender) -> ssl.SSLSocket:
    """A TLS connection with the right certificate, asked /healthz once and kept open."""
    raw = socket.create_connection((LOOPBACK, extender.port), timeout=10)
    tls = client_context(extender.pki, extender.pki.client).wrap_socket(
        raw, server_hostname=LOOPBACK
    )
    tls.sendall(f"GET /healthz HTTP/1.1\r\nHost: {LOOPBACK}\r\n\r\n".encode())
    answer = b""
    while not answer.endswith(b"\r\n\r\nok"):
        chunk = tls.recv(65536)
        assert chunk, answer
        answer += chunk
    assert answer.startswith(b"HTTP/1.1 200 "), answer
    return tls


def test_an_anonymous_client_gets_no_answer_and_a_certified_one_does(brief: Extender) -> None:
    assert answer(brief, None) == b""
    assert answered(brief)


@pytest.mark.parametrize("sent", [b"", PARTIAL_CLIENT_HELLO], ids=["nothing", "half a hello"])
def test_a_half_open_connection_is_closed_after_the_handshake_bound(
    brief: Extender, sent: bytes
) -> None:
    with half_open(brief.port, sent) as sock:
        wait_for(lambda: closed(sock), 30, "the server to close the half-open connection")


def test_an_idle_connection_is_closed_after_the_keep_alive_bound(brief: Extender) -> None:
    with established(brief) as tls:
        wait_for(lambda: closed(tls), 30, "the server to close the idle connection")


def test_a_connection_that_never_asks_is_closed_after_the_keep_alive_bound(
    brief: Extender,
) -> None:
    raw = socket.create_connection((LOOPBACK, brief.port), timeout=10)
    context = client_context(brief.pki, brief.pki.client)
    with context.wrap_socket(raw, server_hostname=LOOPBACK) as tls:
        wait_for(lambda: closed(tls), 30, "the server to close the silent connection")


def test_at_the_cap_half_open_connections_give_way_to_a_certified_client(
    capped: Extender,
) -> None:
    with ExitStack() as stack:
        flood = [stack.enter_context(half_open(capped.port)) for _ in range(8)]
        assert wait_for(lambda: answered(capped), 30, "an answer beside 8 half-open connections")
        wait_for(lambda: closed(flood[0]), 30, "the oldest half-open connection to be dropped")
        # The newest ones wait for their handshake (120 s): the oldest made room, not these.
        assert not closed(flood[-1])


def test_at_the_cap_with_every_connection_established_a_new_one_gets_no_answer(
    capped: Extender,
) -> None:
    with ExitStack() as stack:
        held = [stack.enter_context(established(capped)) for _ in range(4)]
        assert answer(capped, capped.pki.client) == b""
        held.pop().close()
        assert wait_for(lambda: answered(capped), 30, "an answer once a connection closed")
