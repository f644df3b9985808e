"""/ws's transport (server/ws_socket.py) in ONE process against the in-process engine core: a
stand-in WebSocket (the ASGI receive, send_text and close a Starlette socket has), no server
process. The frames, the close code chosen from a Failure, and the idle and duration clocks
checked by the timer."""

from __future__ import annotations

import asyncio
import json
import time

import numpy as np
import pytest

from nemo_serve.server.ws_socket import WsSocket

from . import helpers
from .helpers_session import context as _ctx
from .helpers_session import until_slots_free as _until_free
from .helpers_server import TEST_MODEL

PACKET = 1600


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


@pytest.fixture(scope="module")
def tiny():
    return helpers.model(TEST_MODEL)




def _run(engine, body):
    try:
        return asyncio.run(body())
    finally:
        engine.stop()


def test_a_stream_gets_ready_finals_done_and_close_1000_and_its_slot_back(tiny):
    audio = helpers.utterances(1, seed=3)[0]
    expected = [list(r.token_ids) for r in helpers.drive(helpers.new_engine(tiny, num_slots=2), [audio],
                                                         packet=PACKET).finals(0)]  # fmt: skip
    engine = helpers.new_engine(tiny, num_slots=2).start()

    async def body():
        ws = FakeWebSocket()
        ws.client_sends(json.dumps({"type": "config", "interim_results": False}))
        for i in range(0, len(audio), PACKET):
            ws.client_sends(audio[i : i + PACKET].astype("<f4").tobytes())
        ws.client_sends(json.dumps({"type": "end"}))
        async with asyncio.timeout(60):
            await WsSocket(ws, _ctx(engine)).run()
        await _until_free(engine)
        return ws

    ws = _run(engine, body)
    messages = ws.messages()
    assert messages[0]["type"] == "ready" and messages[-1]["type"] == "done"
    assert [m["token_ids"] for m in messages if m["type"] == "final"] == expected
    assert messages[-1]["reason"] == "end" and ws.closed[0] == 1000
    helpers.assert_engine_empty(engine)


def test_no_free_slot_is_said_with_an_error_frame_and_close_1013(tiny):
    engine = helpers.new_engine(tiny, num_slots=1).start()

    async def body():
        ctx = _ctx(engine)
        first, second = FakeWebSocket(), FakeWebSocket()
        first.client_sends(np.zeros(PACKET, "<f4").tobytes())
        holder = asyncio.create_task(WsSocket(first, ctx).run())
        async with asyncio.timeout(10):
            while engine.num_free_slots:
                await asyncio.sleep(0.01)
            second.client_sends(np.zeros(PACKET, "<f4").tobytes())
            await WsSocket(second, ctx).run()
        first.inbox.put_nowait({"type": "websocket.disconnect", "code": 1000})
        await holder
        await _until_free(engine)
        return second

    second = _run(engine, body)
    assert [m["type"] for m in second.messages()] == ["error"]
    assert second.closed[0] == 1013 and "no free slot" in second.messages()[0]["reason"]
    helpers.assert_engine_empty(engine)


def test_idle_clock_counts_from_the_last_frame_then_fails_with_1008(tiny):
    """Frames 0.2 s apart for longer than the 0.5 s idle timeout keep the socket open; silence
    then fails it about 0.5 s after the last frame."""
    engine = helpers.new_engine(tiny, num_slots=2).start()

    async def body():
        ws = FakeWebSocket()
        socket = asyncio.create_task(WsSocket(ws, _ctx(engine, idle_timeout_s=0.5)).run())
        for _ in range(6):
            ws.client_sends(np.zeros(PACKET, "<f4").tobytes())
            await asyncio.sleep(0.2)
        assert ws.closed is None  # 1.2 s of frames: not idle
        last_frame = time.monotonic() - 0.2
        async with asyncio.timeout(10):
            await socket
        await _until_free(engine)
        return ws, ws.closed_at - last_frame

    ws, idle_s = _run(engine, body)
    assert ws.closed[0] == 1008 and ws.messages()[-1]["type"] == "error"
    assert "idle timeout" in ws.messages()[-1]["reason"]
    assert 0.4 <= idle_s < 2.0
    helpers.assert_engine_empty(engine)


def test_duration_cap_shorter_than_the_idle_timeout_ends_input_on_time(tiny):
    """--max-stream-s 0.5 under a 20 s idle timeout: input ends at 0.5 s (the clock re-armed when
    the stream opened), the stream gets its final and `done` (max_stream_duration), close 1000."""
    engine = helpers.new_engine(tiny, num_slots=2).start()

    async def body():
        ws = FakeWebSocket()
        ws.client_sends(helpers.utterances(1)[0][:4000].astype("<f4").tobytes())
        opened = time.monotonic()
        async with asyncio.timeout(10):
            await WsSocket(ws, _ctx(engine, idle_timeout_s=20, max_stream_s=0.5)).run()
        await _until_free(engine)
        return ws, ws.closed_at - opened

    ws, ended_after_s = _run(engine, body)
    assert ws.messages()[-1]["type"] == "done" and ws.messages()[-1]["reason"] == "max_stream_duration"
    assert ws.closed[0] == 1000 and ended_after_s < 5.0
    helpers.assert_engine_empty(engine)


def test_a_socket_that_never_sends_fails_idle_with_1008(tiny):
    """No frame at all: the clock runs from the accept (armed in run, before any frame)."""
    engine = helpers.new_engine(tiny, num_slots=2).start()

    async def body():
        ws = FakeWebSocket()
        async with asyncio.timeout(10):
            await WsSocket(ws, _ctx(engine, idle_timeout_s=0.3)).run()
        return ws

    ws = _run(engine, body)
    assert ws.closed[0] == 1008 and [m["type"] for m in ws.messages()] == ["error"]
    assert "idle timeout" in ws.messages()[0]["reason"]
    helpers.assert_engine_empty(engine)
