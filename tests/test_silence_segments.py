"""Segments that silence alone ends (endpoint rule 1: trailing silence, nothing decoded in the
segment) on /ws and /v1/realtime, over the in-process engine core with the trained demo model (so
that silence decodes to no tokens). The stream: silence, an utterance, a pause long enough for
rule 2 (after text) and then rule 1 (the empty segment after it), the utterance again.

/ws sends every segment the engine closes, an empty one too (`text` "", end_reason `silence`), so
its segment numbers have no gaps and each segment starts where the one before it ended. /v1/realtime
sends no item for silence (docs/protocol.md); its `nemo_serve.segment` numbers the items it sends.
Before: it carried the session's internal segment key, which counts the hidden silent segments
too, so a client saw items 1 and 3."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import soundfile

from nemo_serve.engine.endpoint import EndpointConfig
from nemo_serve.engine.results import StreamResult
from nemo_serve.model import DEMO_MODEL_PATH
from nemo_serve.server.realtime import RealtimeFormat
from nemo_serve.server.stream_session import Failure
from nemo_serve.server.wire import NormalClose
from nemo_serve.server.ws_socket import WsSocket

from . import helpers
from .helpers_session import FakeWebSocket
from .helpers_session import context as _ctx
from .helpers_session import until_slots_free as _until_free
from .test_forced_ends import _run_to_done
from .test_nim_sessions import TRANSCRIPTION, UTTERANCES

RATE = 16000
PACKET = 1600
FRAME_S = 0.08  # the demo model's encoder frame


@pytest.fixture(scope="module")
def demo():
    return helpers.model(str(DEMO_MODEL_PATH))


def _stream() -> np.ndarray:
    """3 s of silence (rule 1 before anything is said), the utterance, 5 s of silence (rule 2 at
    1.2 s after the text, rule 1 2.4 s after that), the utterance: int16 samples."""
    pcm, rate = soundfile.read(UTTERANCES[0], dtype="int16")
    assert rate == RATE

    def silence(s: float) -> np.ndarray:
        return np.zeros(int(s * RATE), "int16")

    return np.concatenate([silence(3.0), pcm, silence(5.0), pcm])


def test_ws_sends_the_empty_rule1_final_segments_have_no_gaps(demo):
    pcm = _stream()
    engine = helpers.new_engine(demo, num_slots=1, endpoint=EndpointConfig()).start()

    async def body():
        ws = FakeWebSocket()
        ws.client_sends(json.dumps({"type": "config", "encoding": "pcm_s16le", "interim_results": False}))
        for i in range(0, len(pcm), PACKET):
            ws.client_sends(pcm[i : i + PACKET].astype("<i2").tobytes())
        ws.client_sends(json.dumps({"type": "end"}))
        async with asyncio.timeout(60):
            await WsSocket(ws, _ctx(engine)).run()
        await _until_free(engine)
        return ws

    try:
        ws = asyncio.run(body())
    finally:
        engine.stop()
    finals = [m for m in ws.messages() if m["type"] == "final"]
    said = finals[1]["text"]
    assert said, finals
    assert [(f["segment"], f["text"], f["end_reason"]) for f in finals] == [
        (0, "", "silence"), (1, said, "silence"), (2, "", "silence"), (3, said, "end_of_input")]  # fmt: skip
    for before, after in zip(finals, finals[1:]):  # each starts where the one before ended (to a frame)
        assert 0.0 <= after["start_time"] - before["audio_processed"] < FRAME_S, (before, after)
    helpers.assert_engine_empty(engine)


@pytest.mark.parametrize("dialect", ["rt", "nim"])
def test_realtime_items_skip_silence_and_are_numbered_without_gaps(demo, dialect):
    """Server VAD, every append in before the core steps (stepped by hand), then the end of
    input: two items, the utterances, numbered 0 and 1, each starting at the segment /ws gives it."""
    completed = [e for e in _events(demo, dialect, _stream()) if e["type"] == f"{TRANSCRIPTION}.completed"]
    got = [(e["nemo_serve"]["segment"], e["nemo_serve"]["end_reason"], e["nemo_serve"]["start_time"]) for e in completed]
    assert [g[:2] for g in got] == [(0, "silence"), (1, "end_of_input")], got
    assert completed[0]["transcript"] and completed[1]["transcript"] == completed[0]["transcript"]
    # The silent segments are in no item: the first item starts where the leading silence's ended,
    # the second where the silence after the first ended (after its rule-2 and rule-1 segments).
    first, second = (e["nemo_serve"] for e in completed)
    assert 2.4 <= first["start_time"] < first["timestamps"][0], first
    assert second["start_time"] >= first["audio_processed"] + 2.4, (first, second)


def _events(demo, dialect: str, pcm: np.ndarray, turn_detection: dict | None = None) -> list[dict]:
    """Every event a realtime session sends for `pcm` (server VAD; every append in before the
    core steps, stepped by hand; then the end of input), in order."""
    engine = helpers.new_engine(demo, num_slots=1, endpoint=EndpointConfig())  # not started: stepped by hand
    td = turn_detection or {"type": "server_vad"}
    if dialect == "nim":
        update = {"type": "transcription_session.update", "session": {
            "input_audio_format": "pcm16", "input_audio_params": {"sample_rate_hz": RATE, "num_channels": 1},
            "turn_detection": td}}  # fmt: skip
    else:
        update = {"type": "session.update", "session": {"type": "transcription", "audio": {"input": {
            "format": {"type": "audio/pcm", "rate": RATE}, "turn_detection": td}}}}  # fmt: skip

    async def run():
        wire = RealtimeFormat(_ctx(engine), dialect, {}, {})
        wire.on_text(json.dumps(update))
        for i in range(0, len(pcm), PACKET):
            audio = pcm[i : i + PACKET].astype("<i2").tobytes()
            wire.on_text(json.dumps({"type": "input_audio_buffer.append", "audio": _b64(audio)}))
        wire.on_text(json.dumps({"type": "input_audio_buffer.done"}))
        _run_to_done(engine)
        events = []
        async with asyncio.timeout(30):
            while not events or not events[-1].get("is_last_result"):
                item = await wire.session.next_event()
                assert not isinstance(item, (Failure, NormalClose)), item
                if isinstance(item, StreamResult):
                    events += map(json.loads, wire.render(item).frames)
                else:
                    events.append(json.loads(item.model_dump_json()))
        wire.session.close()
        await _until_free(engine)
        return events

    try:
        return asyncio.run(run())
    finally:
        helpers.assert_engine_empty(engine)


def _ids(events: list[dict], kind: str) -> list[str]:
    return [e["item_id"] for e in events if e["type"] == kind]


@pytest.mark.parametrize("dialect", ["rt", "nim"])
def test_speech_events_name_the_item_then_committed_and_completed(demo, dialect):
    """Speech begins while the leading silence's segment is still open in the engine (every
    append is read before the core steps, as a loaded core or a fast sender does): the silence
    segment closes with an empty final (rule 1) and the speech goes to the next engine segment.
    speech_started and speech_stopped must name the item that is then committed and completed
    (OpenAI's protocol; clients correlate by it), and name no item that never comes. Before: they
    named the segment the receive side was filling, the silence, whose item is never sent."""
    events = _events(demo, dialect, _stream())
    started, stopped = _ids(events, "input_audio_buffer.speech_started"), _ids(events, "input_audio_buffer.speech_stopped")
    committed = _ids(events, "input_audio_buffer.committed")
    completed = [e for e in events if e["type"] == f"{TRANSCRIPTION}.completed"]
    said = [e["item_id"] for e in completed if e["transcript"]]
    assert len(started) == 2 and len(said) == 2, [(e["type"], e.get("item_id"), e.get("transcript")) for e in events]
    assert started == stopped == said, (started, stopped, said)
    assert set(committed) >= set(said), (committed, said)
    for item_id in started:  # in the protocol's order: started, stopped, committed, completed
        kinds = [e["type"] for e in events if e.get("item_id") == item_id and e["type"] != f"{TRANSCRIPTION}.delta"]
        assert kinds == ["input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
                         "input_audio_buffer.committed", f"{TRANSCRIPTION}.completed"], (item_id, kinds)  # fmt: skip


def _b64(data: bytes) -> str:
    import base64

    return base64.b64encode(data).decode()
