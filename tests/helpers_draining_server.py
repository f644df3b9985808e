"""A DrainingServer (server/runner.py) serving a lifespan-only app in a thread of the test process:
for what a front end does to its own process once it serves (the collector, the heap trim)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import socket
import threading
import time
import types
from collections.abc import Iterator

import uvicorn

from nemo_serve.server.runner import DrainingServer


async def _app(scope, receive, send):  # the lifespan and nothing else: the process's own tuning is what is tested
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})


@contextlib.contextmanager
def draining_server(heap_trim_period_s: float = 0.0) -> Iterator[DrainingServer]:
    """Started (and one loop tick past its start-up) on entry, shut down on exit; the collector's
    settings restored afterwards (the start-up tuning is per process)."""
    thresholds = gc.get_threshold()
    gc.collect()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(_app, lifespan="on", log_level="warning")
    server = DrainingServer(config, types.SimpleNamespace(settings=types.SimpleNamespace(grpc_port=None, fast_grpc_port=None)))
    server.heap_trim_period_s = heap_trim_period_s
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.started
        # `started` is set inside startup(); what follows it runs before the loop's next task
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0), server._loop).result(10)
        yield server
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
        gc.unfreeze()
        gc.set_threshold(*thresholds)
