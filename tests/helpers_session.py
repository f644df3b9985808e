"""In-process session tests' shared pieces: a ServerContext over an in-process engine, and the
wait for every slot to come back, a scenario run beside a started engine, a stand-in Starlette
WebSocket, the next session event (test_stream_session.py, test_ws_socket.py, test_realtime_items.py,
test_riva_input_clock.py)."""

from __future__ import annotations

import asyncio
import json
import time

from nemo_serve.compose import server_context
from nemo_serve.config import Settings
from nemo_serve.server.stream_session import StreamSession


def context(engine, **settings):
    """The ServerContext the front end would build, with `settings` over the defaults."""
    return server_context(engine, Settings.from_sources(settings, {}))


def run_then_stop(engine, scenario):
    """asyncio.run(scenario()) beside a started engine, stopped whatever the scenario raised; its result."""
    try:
        return asyncio.run(scenario())
    finally:
        engine.stop()


async def until_slots_free(engine, timeout_s: float = 10.0) -> None:
    """Every slot free and no stream open (a release lands between steps)."""
    async with asyncio.timeout(timeout_s):
        while engine.num_free_slots < engine.num_slots or engine.num_open_streams:
            await asyncio.sleep(0.01)


class FakeWebSocket:
    """What WsSocket uses of starlette's WebSocket; the client side is `frames` and `closed`."""

    def __init__(self, query: dict | None = None) -> None:
        self.query_params = query or {}
        self.scope: dict = {}
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.frames: list[str] = []  # text frames the server wrote
        self.closed: tuple[int, str | None] | None = None
        self.closed_at = 0.0

    async def receive(self) -> dict:
        return await self.inbox.get()

    async def send_text(self, text: str) -> None:
        self.frames.append(text)

    async def close(self, code: int = 1000, reason: str | None = None) -> None:
        self.closed, self.closed_at = (code, reason), time.monotonic()

    def client_sends(self, data: bytes | str) -> None:
        key = "bytes" if isinstance(data, bytes) else "text"
        self.inbox.put_nowait({"type": "websocket.receive", key: data})

    def messages(self) -> list[dict]:
        return [json.loads(f) for f in self.frames]


PACKET = 1600


async def _next(session: StreamSession, timeout_s: float = 10.0):
    return await asyncio.wait_for(session.next_event(), timeout_s)
