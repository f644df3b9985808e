"""A front-end process tunes the cyclic collector once it serves (nemo_serve/collector.py, called
at the end of server/runner.py DrainingServer.startup; issue 48: at 256 paced streams each
oldest pass over the front end's start-up heap took 39-90 ms of CPU, frontend_gc_256_cpu.json), and garbage made while
serving is still collected: memory stays bounded."""

from __future__ import annotations

import asyncio
import gc
import socket
import threading
import time
import types
import weakref

import pytest
import uvicorn

from nemo_serve.collector import GC_YOUNG_THRESHOLD
from nemo_serve.server.runner import DrainingServer


class _Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the cyclic collector frees it


async def _app(scope, receive, send):  # the lifespan and nothing else: the collector is what is tested
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})


@pytest.fixture
def serving():
    """A DrainingServer serving in a thread of this process (the collector is per process)."""
    thresholds = gc.get_threshold()
    gc.collect()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(_app, lifespan="on", log_level="warning")
    server = DrainingServer(config, types.SimpleNamespace(settings=types.SimpleNamespace(grpc_port=None)))
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


def test_a_serving_front_end_leaves_its_startup_heap_out_and_passes_less_often(serving):
    assert gc.get_freeze_count() > 10_000  # this process's imports: uvicorn, FastAPI's app modules, ...
    assert gc.get_threshold()[0] == GC_YOUNG_THRESHOLD


def test_a_cycle_made_while_serving_is_collected_without_being_asked(serving):
    passes = gc.get_stats()[0]["collections"]
    cycle = _Node()
    gone = weakref.ref(cycle)
    del cycle
    churn = [[i] for i in range(GC_YOUNG_THRESHOLD + 1_000)]  # one young pass's worth of containers
    del churn
    assert gc.get_stats()[0]["collections"] > passes  # the pass ran on its own: no gc.collect() here
    assert gone() is None
