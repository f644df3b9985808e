"""A positional forced end (NIM's force_eou, engine/forced_ends.py) after the endpointer already
ended the speech: nothing was said since, so it closes nothing (no empty final; the segment goes
on from where the speech ended), whether the engine is behind the point or caught up with it. A
forced end after new speech still ends that speech at its point, and one before anything was said
answers with an empty final as /ws's force_final does. The trained demo model, so that silence
decodes to no tokens and the endpointer fires where a client would see it."""

from __future__ import annotations

import asyncio
import base64
import json

import numpy as np
import pytest
import soundfile

from nemo_serve.engine.endpoint import EndpointConfig
from nemo_serve.engine.geometry import whole_chunk_frames
from nemo_serve.engine.results import StreamResult
from nemo_serve.model import DEMO_MODEL_PATH
from nemo_serve.server.realtime import RealtimeFormat
from nemo_serve.server.stream_session import Failure
from nemo_serve.server.wire import NormalClose

from . import helpers
from .helpers_nim import riva_args, run_riva_client
from .helpers_session import context as _ctx
from .helpers_session import until_slots_free as _until_free
from .test_forced_ends import _idle, _run_to_done
from .test_nim_sessions import TRANSCRIPTION, UTTERANCES, ws_finals

RATE = 16000
PACKET = 1600  # NIM's client: 100 ms appends
SILENCE_S = 4.0  # after the utterance: the endpoint (rule 2, 1.2 s) fires, rule 1 (2.4 s after it) not yet
FORCE_AFTER_S = 3.6  # the forced append, this far into the silence: a chunk after the endpoint's step


@pytest.fixture(scope="module")
def demo():
    return helpers.model(str(DEMO_MODEL_PATH))


def _speech_then_silence(k: int = 0) -> np.ndarray:
    pcm, rate = soundfile.read(UTTERANCES[k], dtype="int16")
    assert rate == RATE
    return np.concatenate([pcm, np.zeros(int(SILENCE_S * RATE), "int16")])


def _forced_sample(pcm: np.ndarray) -> int:
    """The end of the packet the client forces on, as the NIM session counts it."""
    speech = len(pcm) - int(SILENCE_S * RATE)
    return ((speech + int(FORCE_AFTER_S * RATE)) // PACKET + 1) * PACKET


def _finals(results) -> list[tuple[list[int], float, float, str]]:
    return [(r.token_ids, r.segment_start_s, r.audio_processed_s, r.end_reason) for r in results if r.is_final]


def _engine_finals(demo, audio: np.ndarray, points: list[int], caught_up: bool) -> list:
    """Finals of one stream with the endpointer on, forced at `points`: all the audio in before
    the engine steps once (behind), or each force sent once the audio before it is decoded."""
    eng = helpers.new_engine(demo, 1, endpoint=EndpointConfig())
    got = []
    s = eng.open_stream(got.append)
    start = 0
    for at in points:
        eng.push(s, audio[start:at])
        if caught_up:
            _idle(eng)
        eng.force_final(s, at_sample=at)
        start = at
    eng.push(s, audio[start:])
    eng.finish(s)
    _run_to_done(eng)
    helpers.assert_engine_empty(eng)
    return _finals(got)


@pytest.mark.parametrize("caught_up", [False, True], ids=["engine_behind", "engine_caught_up"])
def test_a_forced_end_after_the_endpoint_in_silence_closes_nothing(demo, caught_up):
    pcm = _speech_then_silence()
    audio, at = pcm.astype(np.float32) / 32768.0, _forced_sample(pcm)
    finals = _engine_finals(demo, audio, [at], caught_up)
    forced_end_s = whole_chunk_frames(demo.geometry, at, helpers.new_engine(demo, 1).engine.model_info.feature_margin)
    forced_end_s *= demo.geometry.hop_samples / RATE
    endpointed = finals[0]
    assert endpointed[0] and endpointed[3] == "silence" and endpointed[2] < forced_end_s  # the case: speech ended first
    # The finals of the stream never forced: the speech, then the rest of the audio as one segment
    # from where it ended (before: an empty "force_final" final at the forced point in between)
    assert finals == _engine_finals(demo, audio, [], caught_up) and len(finals) == 2, finals


def test_a_forced_end_after_new_speech_still_ends_it_at_its_point(demo):
    """Utterance, silence (endpoint), a second utterance forced right after its end: the forced
    end closes the second utterance with its tokens, before its own endpoint would."""
    second, _ = soundfile.read(UTTERANCES[3], dtype="int16")
    pcm = np.concatenate([_speech_then_silence(), second])
    at = len(pcm) - len(second) + (len(second) // PACKET) * PACKET
    finals = _engine_finals(demo, pcm.astype(np.float32) / 32768.0, [at], caught_up=False)
    assert [f[3] for f in finals][:2] == ["silence", "force_final"] and finals[1][0], finals
    assert finals[1][2] <= at / RATE


def test_a_forced_end_before_anything_was_said_answers_with_an_empty_final(demo):
    """Leading silence, forced before the speech: the stream's first segment, nothing ever closed,
    so an empty final as /ws's force_final gives (unchanged), then the utterance."""
    speech, _ = soundfile.read(UTTERANCES[0], dtype="int16")
    pcm = np.concatenate([np.zeros(2 * RATE, "int16"), speech])
    finals = _engine_finals(demo, pcm.astype(np.float32) / 32768.0, [int(1.5 * RATE)], caught_up=False)
    assert finals[0][0] == [] and finals[0][3] == "force_final", finals
    assert any(f[0] for f in finals[1:]), finals


def _append(pcm: np.ndarray, force_eou: bool) -> str:
    ev = {"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm.tobytes()).decode()}
    if force_eou:
        ev["runtime_config"] = {"force_eou": "true"}  # as nvidia-riva-client sends it
    return json.dumps(ev)


async def _nim_session(wire: RealtimeFormat, engine, pcm: np.ndarray, forced_packet: int) -> tuple[list, list]:
    """A NIM client's flow with server VAD, the core stepped to its end before any result is read;
    (the completed events, the engine's finals), read until the last result."""
    session = {"input_audio_format": "pcm16", "input_audio_params": {"sample_rate_hz": RATE, "num_channels": 1},
               "turn_detection": {"type": "server_vad"}}  # fmt: skip
    wire.on_text(json.dumps({"type": "transcription_session.update", "session": session}))
    for n, i in enumerate(range(0, len(pcm), PACKET)):
        wire.on_text(_append(pcm[i : i + PACKET], force_eou=n == forced_packet))
        wire.on_text(json.dumps({"type": "input_audio_buffer.commit"}))  # NIM's flush
    wire.on_text(json.dumps({"type": "input_audio_buffer.done"}))
    _run_to_done(engine)
    completed, finals = [], []
    async with asyncio.timeout(30):
        while not completed or not completed[-1].get("is_last_result"):
            item = await wire.session.next_event()
            assert not isinstance(item, (Failure, NormalClose)), item
            if not isinstance(item, StreamResult):
                continue  # the session's own events (session.created, the speech detector's)
            finals += [item] if item.is_final else []
            completed += [e for e in map(json.loads, wire.render(item).frames) if e["type"] == f"{TRANSCRIPTION}.completed"]
    return completed, finals


def test_nim_session_forced_in_the_silence_after_the_endpoint_hides_no_item(demo):
    """The NIM session over the in-process core: the client's items are the utterance and the
    silence after it, numbered 0 and 1, the second starting where the speech ended; its last
    transcript repeats the utterance. Before: the engine's empty forced final was a hidden item
    (segments 0 and 2, the last starting at the forced point)."""
    pcm = _speech_then_silence()
    engine = helpers.new_engine(demo, num_slots=1)  # not started: stepped by hand

    async def run():
        wire = RealtimeFormat(_ctx(engine), "nim", {}, {})
        got = await _nim_session(wire, engine, pcm, _forced_sample(pcm) // PACKET - 1)
        wire.session.close()
        await _until_free(engine)
        return got

    completed, finals = asyncio.run(run())
    assert [r.end_reason for r in finals] == ["silence", "end_of_input"], _finals(finals)
    assert [e["nemo_serve"]["segment"] for e in completed] == [0, 1]
    first, last = completed
    assert first["transcript"] and last["transcript"] == first["transcript"] and last["is_last_result"] is True
    forced_s = _forced_sample(pcm) / RATE  # the second item starts where the speech ended, not there
    assert first["nemo_serve"]["audio_processed"] <= last["nemo_serve"]["start_time"] < forced_s - 1.0
    helpers.assert_engine_empty(engine)


def test_nvidia_client_forcing_in_the_silence_after_the_endpoint_keeps_the_utterance(tmp_path, demo_pair_server):
    """NVIDIA's realtime client unchanged against the real server (demo model, server VAD by
    default): the utterance, silence, force_eou 3.6 s into it (a client forcing at its file's end).
    Its final is the utterance (/ws's), its items the utterance and the silence after it (segments
    0, 1), no empty completed between. Before: segments 0 and 2 (an empty forced item the
    renderer hid); the client's final was right already, as NimRenderer drops empty non-last items."""
    pytest.importorskip("riva.client.realtime")
    pcm = _speech_then_silence()
    path = tmp_path / "speech_then_silence.wav"
    soundfile.write(path, pcm, RATE, subtype="PCM_16")
    srv = demo_pair_server  # the demo model's shared server (helpers_server.py: two slots, this test uses one)
    utterance = [t for t in asyncio.run(ws_finals(srv, path)) if t]
    events, client = asyncio.run(run_riva_client(riva_args(srv), path, force_eou_at=_forced_sample(pcm) // PACKET - 1))
    srv.assert_no_leak()
    completed = [e for e in events if e["type"] == f"{TRANSCRIPTION}.completed"]
    assert len(utterance) == 1 and client.final_transcript == utterance[0], (utterance, client.final_transcript)
    assert [(e["nemo_serve"]["segment"], e["transcript"]) for e in completed] == [(0, utterance[0]), (1, utterance[0])]
    assert completed[-1]["is_last_result"] is True
