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

from nemo_serve.server import stream_session
from nemo_serve.server.ws_socket import WsSocket

from . import helpers
from .helpers_session import FakeWebSocket
from .helpers_session import context as _ctx
from .helpers_session import until_slots_free as _until_free
from .helpers_server import TEST_MODEL

PACKET = 1600


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


class HandingWebSocket(FakeWebSocket):
    """A transport with the "take_frames" hook, as picows_listener.AppConnection: a data frame goes
    to the socket's handler first when nothing is queued, else (or when it declines) to the inbox."""

    def __init__(self) -> None:
        super().__init__()
        self.handler = None
        self.scope = {"extensions": {"nemo_serve.connection": {"take_frames": self._take_frames}}}
        self.num_handed = self.num_queued = 0

    def _take_frames(self, handler) -> None:
        self.handler = handler

    def hand(self, data: bytes | str) -> bool:
        if self.handler is not None and self.inbox.empty() and self.handler(data):
            self.num_handed += 1
            return True
        self.num_queued += 1
        self.client_sends(data)
        return False


def test_frames_handed_over_in_the_callback_are_handled_at_once_with_the_queued_paths_tokens(tiny):
    """Each frame handed to the parked socket is handled before the hand-over returns (no task
    switch: the samples are pushed already), and the finals equal the engine's own on that audio."""
    audio = helpers.utterances(1, seed=3)[0]
    expected = [list(r.token_ids) for r in helpers.drive(helpers.new_engine(tiny, num_slots=2), [audio],
                                                         packet=PACKET).finals(0)]  # fmt: skip
    engine = helpers.new_engine(tiny, num_slots=2).start()

    async def body():
        ws = HandingWebSocket()
        ws.client_sends(json.dumps({"type": "config", "interim_results": False}))
        socket = WsSocket(ws, _ctx(engine))
        running = asyncio.create_task(socket.run())
        await asyncio.sleep(0.2)  # the config read; the receive task parked
        pushed_at_once = []
        for i in range(0, len(audio), PACKET):
            before = socket.session.pushed_s
            ws.hand(audio[i : i + PACKET].astype("<f4").tobytes())
            pushed_at_once.append(socket.session.pushed_s > before)
            await asyncio.sleep(0.005)  # paced: the socket's task runs between packets
        ws.hand(json.dumps({"type": "end"}))
        async with asyncio.timeout(60):
            await running
        await _until_free(engine)
        return ws, pushed_at_once

    ws, pushed_at_once = _run(engine, body)
    assert all(pushed_at_once) and ws.num_queued == 0 and ws.num_handed == len(pushed_at_once) + 1
    messages = ws.messages()
    assert [m["token_ids"] for m in messages if m["type"] == "final"] == expected
    assert messages[-1]["type"] == "done" and ws.closed[0] == 1000
    assert ws.handler is None  # run() took its handler back at the end
    helpers.assert_engine_empty(engine)


def test_a_frame_that_finds_the_model_behind_is_queued_and_handled_only_once_it_caught_up(tiny, monkeypatch):
    """Backpressure through the hand-over: with the stream MAX_AHEAD_S ahead of the model the
    socket declines the next frame; queued, it is not handled (not pushed) until the model consumed
    enough, as a frame read by the receive task never was."""
    monkeypatch.setattr(stream_session, "MAX_AHEAD_S", 2.0)  # the test model's chunk is 1.12 s
    audio = np.tile(helpers.utterances(1, seed=1)[0], 4)[: 4 * 16000]
    engine = helpers.new_engine(tiny, num_slots=2)  # not started: the model consumes nothing yet

    async def body():
        ws = HandingWebSocket()
        socket = WsSocket(ws, _ctx(engine))
        running = asyncio.create_task(socket.run())
        await asyncio.sleep(0.1)
        took_first = ws.hand(audio.astype("<f4").tobytes())  # 4 s: now 4 s ahead
        await asyncio.sleep(0.1)
        took_second = ws.hand(audio[:PACKET].astype("<f4").tobytes())
        await asyncio.sleep(0.3)
        pushed_while_behind = socket.session.pushed_s
        engine.start()
        async with asyncio.timeout(30):
            while socket.session.pushed_s < 4.05:  # the queued frame, once the model caught up
                await asyncio.sleep(0.01)
        ws.hand(json.dumps({"type": "end"}))
        async with asyncio.timeout(60):
            await running
        await _until_free(engine)
        return took_first, took_second, pushed_while_behind, socket.session.pushed_s

    took_first, took_second, pushed_while_behind, pushed = _run(engine, body)
    assert took_first and not took_second
    assert pushed_while_behind == pytest.approx(4.0) and pushed == pytest.approx(4.1)
    helpers.assert_engine_empty(engine)
