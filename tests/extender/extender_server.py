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

from gpupart_extender.main import listen, server
from gpupart_extender.settings import ExtenderSettings


@contextmanager
def served(app: FastAPI, settings: ExtenderSettings | None = None) -> Iterator[httpx.Client]:
    """An HTTP client of `app`, served on 127.0.0.1 until the block ends; with `settings`, by
    the uvicorn set-up `gpupart extender` uses (its HTTP protocol and limits), else uvicorn's
    defaults."""
    sock = listen("127.0.0.1", 0)
    port = sock.getsockname()[1]
    runner = (
        uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        if settings is None
        else server(app, settings)
    )
    thread = threading.Thread(target=lambda: asyncio.run(runner.serve(sockets=[sock])), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not runner.started and time.monotonic() < deadline:
            time.sleep(0.02)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5) as http:
            yield http
    finally:
        runner.should_exit = True
        thread.join(10)
        sock.close()
