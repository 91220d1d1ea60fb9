"""What one request may cost the extender: its head, its body, and how many (and how much) are served at once.

Whatever arrives, memory stays under the ceiling docs/extender.md states: a body is refused
(413) before more than `max_request_bytes` of it is read, the bodies held at once never add up
to more than `BODY_BUDGET_FACTOR` of the largest one allowed (503 beyond, at once, before the
body is read), no more than `max_concurrent_requests` requests are served at once (503), and a
request head (request line and headers) longer than `MAX_HEAD_BYTES` closes the connection
(431). A parsed body costs a bounded multiple of its size (`PARSE_FACTOR`), so these bounds
bound the memory: `memory_allowance` above what the process holds at rest.

All counting happens on the event loop's thread: no locks.
"""

from __future__ import annotations

import asyncio
import asyncio.sslproto
import json
import ssl
from collections.abc import Callable
from typing import Any, cast

import uvloop
import uvloop.loop
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from .metrics import Metrics

BODY_BUDGET_FACTOR = 2
"""Bodies held at once (read, and being answered) add up to at most this many of the largest
one allowed: two maximal bodies at a time, or any number of the small ones the scheduler sends."""
MAX_HEAD_BYTES = 64 * 1024
"""The longest request line and headers read (kube-scheduler's are a few hundred bytes);
httptools itself has no limit, and would buffer a header of any length."""
PARSE_FACTOR = 40
"""A body costs at most this many times its size while it is parsed and answered: measured
for the worst JSON for its size (arrays of empty objects, `[{},{},...]`: a 2 MiB body took the
process up by 79 MiB, two at once by 128 MiB); names and quantities cost far less."""
SLACK_BYTES = 64 << 20
"""Connections, threads and allocator arenas on top (the bind pool runs 40 threads)."""


def memory_allowance(max_request_bytes: int) -> int:
    """How far above its resting size (the watch cache and the memo) requests can take the
    process, whatever arrives: every body held at once, parsed, plus `SLACK_BYTES`."""
    return BODY_BUDGET_FACTOR * max_request_bytes * PARSE_FACTOR + SLACK_BYTES


class RequestLimits:
    """ASGI middleware: refuse what is too large or too many, before reading more of it.

    The body is read here, within the bounds, and handed to the app as one message; it is
    counted against the budget until the app has answered (its parsed form lives as long).
    """

    def __init__(
        self, app: ASGIApp, *, max_body: int, max_concurrent: int, metrics: Metrics
    ) -> None:
        self.app = app
        self.max_body = max_body
        self.max_concurrent = max_concurrent
        self.budget = BODY_BUDGET_FACTOR * max_body
        self.metrics = metrics
        self.in_flight = 0
        self.held = 0
        """Bytes of the bodies held by the requests in flight."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.in_flight >= self.max_concurrent:
            await self._refuse(
                send,
                503,
                "busy",
                f"{self.in_flight} requests in flight, at most {self.max_concurrent} "
                "(setting max_concurrent_requests); retry",
            )
            return
        self.in_flight += 1
        held = 0
        try:
            length = _content_length(scope)
            if length is not None and length > self.max_body:
                await self._too_large(send, f"{length} bytes")
                return
            if length:
                if self.held + length > self.budget:
                    await self._busy_bodies(send)
                    return
                held = length
                self.held += held
            chunks: list[bytes] = []
            size = 0
            more = True
            while more:
                message = await receive()
                if message["type"] != "http.request":
                    return  # the client went away
                chunk = message.get("body", b"")
                more = message.get("more_body", False)
                size += len(chunk)
                if size > self.max_body:
                    await self._too_large(send, f"more than {self.max_body} bytes")
                    return
                if size > held:  # no (or a wrong) Content-Length: counted as it arrives
                    if self.held + size - held > self.budget:
                        await self._busy_bodies(send)
                        return
                    self.held += size - held
                    held = size
                if chunk:
                    chunks.append(chunk)
            body = b"".join(chunks)
            del chunks
            await self.app(scope, _replay(body, receive), send)
        finally:
            self.in_flight -= 1
            self.held -= held

    async def _too_large(self, send: Send, size: str) -> None:
        await self._refuse(
            send,
            413,
            "too_large",
            f"request body of {size}; at most {self.max_body} (setting max_request_bytes)",
        )

    async def _busy_bodies(self, send: Send) -> None:
        await self._refuse(
            send,
            503,
            "busy",
            f"the bodies in flight would exceed {self.budget} bytes "
            f"({BODY_BUDGET_FACTOR} x max_request_bytes); retry",
        )

    async def _refuse(self, send: Send, status: int, reason: str, text: str) -> None:
        self.metrics.refused.labels(reason).inc()
        body = json.dumps({"Error": text}).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", b"%d" % len(body)),
            # The body is left unread: closing spares reading (and dropping) the rest of it,
            # and uvicorn would keep such a connection open with no keep-alive timeout.
            (b"connection", b"close"),
        ]
        if status == 503:
            headers.append((b"retry-after", b"1"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers") or ():
        if name == b"content-length":
            try:
                return max(0, int(value))
            except ValueError:
                return None
    return None


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that answers the body read, then what the client does next."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


class BoundedHttpTools(HttpToolsProtocol):
    """uvicorn's httptools protocol with a bounded request head: a request line and headers
    still incomplete after `MAX_HEAD_BYTES` get a 431 and the connection is closed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True
        self._head_bytes = 0

    def data_received(self, data: bytes) -> None:
        if self.transport.is_closing():
            return
        if self._in_head:
            self._head_bytes += len(data)
        super().data_received(data)
        if self._in_head and self._head_bytes > MAX_HEAD_BYTES:
            text = b"request line and headers longer than %d bytes" % MAX_HEAD_BYTES
            self.transport.write(
                b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
                b"content-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(text), text)
            )
            self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # uvicorn arms its keep-alive timer only once a response is sent: a connection that
        # never sends a request (after its TLS handshake, or on plain HTTP) would stay open.
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler
        )

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._head_bytes = 0
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._in_head = True
        super().on_message_complete()


class Connections:
    """One TLS listener's open connections, and the bounds they are held to.

    Counted from the accept, handshake included: `handshaking` holds the connections whose TLS
    handshake is in flight (oldest first, a dict keeps insertion order) and `established` is
    uvicorn's own set of the connections its HTTP protocol serves (`ServerState.connections`,
    filled by its `connection_made`, emptied by its `connection_lost`).

    At `max_connections`, a new connection takes the place of the oldest handshake still in
    flight (that one is aborted): a flood of clients that connect and never finish their
    handshake then only ever evicts its own, older, connections, and a client whose handshake
    completes in less time than the flood takes to open `max_connections` more is served. Only
    when every connection is established is the new one closed at once.
    """

    def __init__(
        self, context: ssl.SSLContext, *, handshake_timeout: float, max_connections: int
    ) -> None:
        self.context = context
        self.handshake_timeout = handshake_timeout
        self.max_connections = max_connections
        self.handshaking: dict[asyncio.Transport, asyncio.Task[None] | None] = {}

    def admit(self, transport: asyncio.Transport, established: int) -> bool:
        """Whether `transport`, just accepted, may handshake; oldest handshakes are dropped to
        make room."""
        while self.handshaking and len(self.handshaking) + established >= self.max_connections:
            self.drop(next(iter(self.handshaking)))
        if len(self.handshaking) + established >= self.max_connections:
            return False
        self.handshaking[transport] = None
        return True

    def drop(self, transport: asyncio.Transport) -> None:
        del self.handshaking[transport]
        transport.abort()  # a reset: the descriptor is freed now, no TLS alert, no linger


def gated(protocol: Callable[..., asyncio.Protocol], connections: Connections) -> type[TlsGate]:
    """The protocol class to give uvicorn (`Config(http=...)`) for a TLS listener: every
    connection starts as a `TlsGate`, which puts the SSL protocol and, inside it, a `protocol`
    (built with uvicorn's arguments) in its place. uvicorn is then given no TLS settings."""

    class Gate(TlsGate):
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(connections, lambda: protocol(**kwargs), kwargs["server_state"])

    return Gate


class TlsGate(asyncio.Protocol):
    """The first protocol of a connection on the TLS listener: it counts the connection from
    its accept, and puts the loop's own SSL protocol in its place, with the handshake bounded.

    Why not uvicorn's `loop.create_server(..., ssl=context)`: there the HTTP protocol, and so
    uvicorn's count of connections, hears of a TLS connection only once its handshake has
    completed (asyncio's and uvloop's SSL protocol call `connection_made` then, and nothing at
    all when the handshake fails), and the handshake bound is 60 s: a client that connects
    and sends nothing holds a descriptor for a minute, uncounted. Here the listener is plain
    TCP and this protocol sees the accept; it then does what the loop does for an SSL server
    (the same SSL protocol class, wrapping the same HTTP protocol), with our bounds.

    Not `loop.start_tls`: it swaps the protocol only in a later step, and uvloop starts
    reading as soon as `connection_made` returns, so the ClientHello could reach this
    protocol instead of the SSL one. Swapping here, before the first read, loses nothing.
    """

    def __init__(
        self,
        connections: Connections,
        protocol: Callable[[], asyncio.Protocol],
        server_state: ServerState,
    ) -> None:
        self.connections = connections
        self.protocol = protocol
        self.established = server_state.connections

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        raw = cast(asyncio.Transport, transport)  # a TCP listener's: a stream transport
        connections = self.connections
        if not connections.admit(raw, len(self.established)):
            raw.abort()
            return
        loop = asyncio.get_running_loop()
        handshake = loop.create_future()

        def ended(done: asyncio.Future[None]) -> None:
            # Completed (the HTTP protocol now counts it), refused, timed out or dropped.
            connections.handshaking.pop(raw, None)
            if not done.cancelled() and done.exception() is not None:
                raw.abort()  # as the loop's own SSL server does; mostly closed already

        handshake.add_done_callback(ended)
        tls = _ssl_protocol(loop)(
            loop,
            self.protocol(),  # its connection_made comes once the handshake has completed
            connections.context,
            handshake,
            server_side=True,
            ssl_handshake_timeout=connections.handshake_timeout,
            # A client gone silent after the keep-alive timeout's close_notify: the same bound.
            ssl_shutdown_timeout=connections.handshake_timeout,
        )
        raw.set_protocol(tls)
        tls.connection_made(raw)


def _ssl_protocol(loop: asyncio.AbstractEventLoop) -> Callable[..., asyncio.BaseProtocol]:
    """The SSL protocol class the loop's own SSL servers use: uvloop's for a uvloop loop (as
    `gpupart extender` runs), asyncio's for asyncio's."""
    if isinstance(loop, uvloop.Loop):
        ssl_protocol: Callable[..., asyncio.BaseProtocol] = uvloop.loop.SSLProtocol  # type: ignore[attr-defined]
        return ssl_protocol
    return asyncio.sslproto.SSLProtocol
