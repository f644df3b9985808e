"""A WebSocket relay that records both directions: put between a client and the server, it lets
a test see exactly what an unchanged client sent (and what it got), without touching the client.

Runs its own event loop in a thread, so tests may drive clients synchronously (subprocesses).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import websockets

from .helpers_server import free_port

FORWARDED_HEADERS = ("authorization", "openai-beta")


class WireRecorder:
    """`with WireRecorder(upstream_ws_base) as rec:` clients dial `rec.ws_base` (or `rec.http_base`)
    instead of the server; `rec.messages` holds ("client" | "server", parsed JSON) in order, each
    message with "_t" (when) and "_c" (its connection: an index into `rec.paths`)."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")  # ws://host:port
        self.port = free_port()
        self.messages: list[tuple[str, dict]] = []
        self.paths: list[str] = []  # request path + query of each connection
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    @property
    def ws_base(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    @property
    def http_base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "WireRecorder":
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def client_events(self, connection: int | None = None) -> list[dict]:
        return [m for side, m in self.messages if side == "client" and connection in (None, m["_c"])]

    def server_events(self, connection: int | None = None) -> list[dict]:
        return [m for side, m in self.messages if side == "server" and connection in (None, m["_c"])]

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._serve())

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        async with websockets.serve(self._relay, "127.0.0.1", self.port, max_size=None):
            self._ready.set()
            await self._stop.wait()

    async def _relay(self, client) -> None:
        path = client.request.path
        connection = len(self.paths)
        self.paths.append(path)
        headers = {k: v for k, v in client.request.headers.raw_items() if k.lower() in FORWARDED_HEADERS}
        async with websockets.connect(self.upstream + path, additional_headers=headers, max_size=None) as server:

            async def pump(src, dst, side: str) -> None:
                try:
                    async for text in src:
                        self.messages.append((side, {**json.loads(text), "_t": time.monotonic(), "_c": connection}))
                        await dst.send(text)
                except websockets.ConnectionClosed:
                    pass
                finally:
                    await dst.close()

            await asyncio.gather(pump(client, server, "client"), pump(server, client, "server"))
