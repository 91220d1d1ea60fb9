"""The extender app served by real uvicorn on a loopback port, for the tests that need real HTTP."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import uvicorn
from fastapi import FastAPI

from gpupart_extender.main import listen


@contextmanager
def served(app: FastAPI) -> Iterator[httpx.Client]:
    """An HTTP client of `app`, served on 127.0.0.1 until the block ends."""
    sock = listen("127.0.0.1", 0)
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5) as http:
            yield http
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
