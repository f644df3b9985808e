"""/v1/realtime's item manager (server/realtime.py over StreamSessions) in ONE process against the
in-process engine core (core/inproc.py): no server process, no socket. Two items in flight at
once, the slot cap of two, an abort while an item is finishing, and a close right after appends
(issue 45's leak): every slot comes back after each."""

from __future__ import annotations

import asyncio
import base64
import json
import logging

import numpy as np
import pytest

from nemo_serve.engine.results import StreamResult
from nemo_serve.server import realtime
from nemo_serve.server.realtime import RealtimeFormat, realtime_wire
from nemo_serve.server.stream_session import Failure
from nemo_serve.server.wire import NormalClose
from nemo_serve.server.ws_socket import WsSocket

from . import helpers
from .helpers_session import context as _ctx
from .helpers_session import until_slots_free as _until_free
from .helpers_server import TEST_MODEL
from .helpers_session import FakeWebSocket, run_then_stop

log = logging.getLogger("test")
RATE = 24000  # the realtime API's PCM16 rate
PACKET = 2400  # 100 ms
COMPLETED = "conversation.item.input_audio_transcription.completed"
NO_TURN_DETECTION = json.dumps({"type": "session.update", "session": {"type": "transcription",
                                "audio": {"input": {"turn_detection": None}}}})  # fmt: skip


@pytest.fixture(scope="module")
def tiny():
    return helpers.model(TEST_MODEL)



def _appends(audio: np.ndarray) -> list[str]:
    pcm = np.clip(np.round(audio * 32768.0), -32768, 32767).astype("<i2")
    return [json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm[i : i + PACKET].tobytes()).decode()})
            for i in range(0, len(pcm), PACKET)]  # fmt: skip


def _commit() -> str:
    return json.dumps({"type": "input_audio_buffer.commit"})


def _wire(ctx) -> RealtimeFormat:
    wire = RealtimeFormat(ctx, "rt", {}, {})
    wire.on_text(NO_TURN_DETECTION)  # items end at commits only
    return wire


async def _completed(wire: RealtimeFormat, n: int, watch=None, timeout_s: float = 60.0) -> list[dict]:
    """Read the session's outbox as the send task does (results rendered) until `n` completed
    events; `watch()` is called at each event (what the test samples while items decode)."""
    done = []
    async with asyncio.timeout(timeout_s):
        while len(done) < n:
            item = await wire.session.next_event()
            assert not isinstance(item, (Failure, NormalClose)), item
            if watch is not None:
                watch()
            frames = wire.render(item).frames if isinstance(item, StreamResult) else [item.model_dump_json()]
            done += [e for e in map(json.loads, frames) if e["type"] == COMPLETED]
    return done



def _alone(tiny, audio: np.ndarray) -> list[int]:
    """The tokens of `audio` as the only item of a session."""
    engine = helpers.new_engine(tiny, num_slots=4).start()

    async def run():
        wire = _wire(_ctx(engine))
        for a in _appends(audio):
            wire.on_text(a)
        wire.on_text(_commit())
        (event,) = await _completed(wire, 1)
        wire.session.close()
        return event["nemo_serve"]["token_ids"]

    return run_then_stop(engine, run)


def test_two_items_in_flight_at_once_each_equal_to_its_audio_alone(tiny):
    first, second = helpers.utterances(2, sample_rate=RATE, seed=5)
    expected = [_alone(tiny, first), _alone(tiny, second)]
    engine = helpers.new_engine(tiny, num_slots=4).start()
    held = []

    async def run():
        wire = _wire(_ctx(engine))
        for audio in (first, second):  # all sent before the model decoded the first
            for a in _appends(audio):
                wire.on_text(a)
            wire.on_text(_commit())
        events = await _completed(wire, 2, watch=lambda: held.append(wire._num_held()))
        wire.session.close()
        await _until_free(engine)
        return events

    events = run_then_stop(engine, run)
    assert [e["nemo_serve"]["token_ids"] for e in events] == expected
    assert max(held) == 2  # both decoding at once, each in its own engine stream
    assert events[0]["item_id"] != events[1]["item_id"]


def test_slot_cap_two_a_third_item_waits_then_completes(tiny):
    clips = helpers.utterances(3, sample_rate=RATE, seed=2)
    engine = helpers.new_engine(tiny, num_slots=6).start()  # the cap is the session's, not the engine's
    held, engine_used = [], []

    async def run():
        wire = _wire(_ctx(engine))
        for audio in clips:
            for a in _appends(audio):
                wire.on_text(a)
            wire.on_text(_commit())
        assert wire._num_held() == 2 and wire.items[2].session is None and wire.items[2].waiting

        def watch():
            held.append(wire._num_held())
            engine_used.append(engine.num_slots - engine.num_free_slots)

        events = await _completed(wire, 3, watch=watch)
        wire.session.close()
        await _until_free(engine)
        return events

    events = run_then_stop(engine, run)
    assert len(events) == 3 and all(e["transcript"] for e in events)
    assert max(held) == realtime.MAX_SLOTS_PER_SESSION == 2
    assert max(engine_used) <= 2


def test_abort_while_an_item_is_finishing_frees_every_slot(tiny):
    """The session fails while its first item is finishing (committed, still decoding) and its
    second is open: both engine streams are aborted, the in-flight one too, and nothing reopens."""
    first, second = helpers.utterances(2, sample_rate=RATE, seed=7)
    engine = helpers.new_engine(tiny, num_slots=4)  # not started: nothing decodes until iterate()

    async def run():
        wire = _wire(_ctx(engine))
        for a in _appends(first):
            wire.on_text(a)
        wire.on_text(_commit())  # the first item finishing: in flight
        for a in _appends(second)[:5]:
            wire.on_text(a)  # the second holds a slot too
        assert [i.in_flight for i in wire.items] == [True, False] and engine.num_open_streams == 2
        wire.session.fail("test abort", "protocol")
        failure = await asyncio.wait_for(wire.session.next_event(), 5)
        engine.iterate()  # the loop takes the aborts between steps
        await asyncio.sleep(0.05)  # results handed over, if any, are dropped
        wire._retry_slot()
        wire.session.close()
        return failure, wire._num_opened

    failure, num_opened = asyncio.run(run())
    assert isinstance(failure, Failure) and failure.label == "protocol"
    assert num_opened == 2
    assert engine.num_free_slots == engine.num_slots and not engine.num_open_streams


def test_close_right_after_appends_frees_every_slot(tiny):
    """Issue 45: a client that appends and closes at once (the socket's `finally:` runs with
    appends just handled) leaves no engine stream behind, with one item decoding and one open."""
    first, second = helpers.utterances(2, sample_rate=RATE, seed=1)
    engine = helpers.new_engine(tiny, num_slots=4).start()

    async def run():
        ctx = _ctx(engine)
        ws = FakeWebSocket()
        ws.headers = {}
        socket = WsSocket(ws, ctx, realtime_wire)
        ws.client_sends(NO_TURN_DETECTION)
        for a in _appends(first)[:10]:
            ws.client_sends(a)
        ws.client_sends(_commit())
        for a in _appends(second)[:3]:
            ws.client_sends(a)
        ws.inbox.put_nowait({"type": "websocket.disconnect", "code": 1000})
        await asyncio.wait_for(socket.run(), 10)
        await _until_free(engine)
        return socket, ctx

    socket, ctx = run_then_stop(engine, run)
    assert socket.wire.num_items == 2 and socket.wire._num_opened == 2  # both took a slot
    assert engine.num_free_slots == engine.num_slots and not engine.num_open_streams
    assert not ctx.sessions  # the socket's session recorded once, and gone
