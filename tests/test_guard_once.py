"""The overload guard (admission.py) moves once per stream, where its slot is taken, on every
protocol: /ws (a handshake and a first message), the file API (a check before the upload and the
job's slot) and /v1/realtime (a handshake, then the session's items). In one process: the app over
the in-process engine, Starlette's test client, no server process. Riva gRPC's call admits once
(riva_grpc.RivaCall.open) and needs a gRPC server: tests/test_admission.py covers its numbers."""

from __future__ import annotations

import base64
import io
import json
import time

import numpy as np
import pytest
import soundfile

from nemo_serve.compose import server_context
from nemo_serve.config import Settings
from nemo_serve.server.app import create_app

from . import helpers
from .helpers_server import TEST_MODEL


@pytest.fixture(scope="module")
def tiny():
    return helpers.model(TEST_MODEL)


class _CountingDecisions:
    """engine.overload wrapped: the calls that move the guard (decide=True) are counted."""

    def __init__(self, engine) -> None:
        self.engine, self.decisions = engine, 0
        self._overload = engine.overload
        engine.overload = self

    def __call__(self, decide: bool = False, now: float | None = None):
        self.decisions += decide
        return self._overload(decide, now)


def _client(tiny):
    from starlette.testclient import TestClient

    engine = helpers.new_engine(tiny, num_slots=2, max_queue_delay_s=2.0).start()
    counter = _CountingDecisions(engine)
    app = create_app(server_context(engine, Settings.from_sources({}, {})))
    return engine, counter, TestClient(app)


def _wait_empty(engine, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (engine.num_open_streams or engine.num_free_slots < engine.num_slots) and time.monotonic() < deadline:
        time.sleep(0.01)


def test_ws_stream_moves_the_guard_once(tiny):
    engine, counter, client = _client(tiny)
    audio = helpers.utterances(1)[0][:16000]
    try:
        with client, client.websocket_connect("/ws") as ws:
            ws.send_text(json.dumps({"type": "config", "encoding": "f32le"}))
            assert ws.receive_json()["type"] == "ready"
            ws.send_bytes(audio.astype("<f4").tobytes())
            ws.send_text(json.dumps({"type": "end"}))
            while ws.receive_json()["type"] != "done":
                pass
        _wait_empty(engine)
    finally:
        engine.stop()
    assert counter.decisions == 1


def test_file_transcription_moves_the_guard_once(tiny):
    engine, counter, client = _client(tiny)
    wav = io.BytesIO()
    soundfile.write(wav, (helpers.utterances(1)[0][:16000] * 32767).astype("int16"), 16000, format="WAV")
    try:
        with client:
            r = client.post("/v1/audio/transcriptions", files={"file": ("a.wav", wav.getvalue()), "model": (None, "x")})
        assert r.status_code == 200, r.text
        _wait_empty(engine)
    finally:
        engine.stop()
    assert counter.decisions == 1


def test_realtime_session_moves_the_guard_once_for_several_items(tiny):
    """Two committed items: two slots taken, one stream admitted, one decision."""
    engine, counter, client = _client(tiny)
    pcm = (helpers.utterances(1)[0][:8000] * 32767).astype("<i2").tobytes()
    audio = base64.b64encode(pcm).decode()
    try:
        with client, client.websocket_connect("/v1/realtime?intent=transcription") as ws:
            assert ws.receive_json()["type"] in ("session.created", "transcription_session.created")
            for _ in range(2):
                ws.send_text(json.dumps({"type": "input_audio_buffer.append", "audio": audio}))
                ws.send_text(json.dumps({"type": "input_audio_buffer.commit"}))
            completed = 0
            while completed < 2:
                event = ws.receive_json()
                assert event["type"] != "error", event
                completed += event["type"].endswith("transcription.completed")
        _wait_empty(engine)
    finally:
        engine.stop()
    assert counter.decisions == 1
