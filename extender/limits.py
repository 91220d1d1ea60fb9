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

import json
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

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

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._head_bytes = 0
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._in_head = True
        super().on_message_complete()
