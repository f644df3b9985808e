"""/v1/realtime as OpenAI's clients use it, on the demo model: a commit transcribes everything
before it, turn detection follows the session, the mode is the client's. Each committed item's
tokens must equal NeMo's loop on that item's audio alone (nemo_serve/oracle.py).

One server with a single slot: the audio after a commit has to wait for the committed item's
slot, the path a full server takes.
"""

from __future__ import annotations

import asyncio
import json
import time

import numpy as np
import pytest

from nemo_serve.model import DEMO_MODEL_PATH
from nemo_serve.oracle import oracle_transcribe

from . import helpers
from .helpers_server import TOKEN, as_model_input, start_server
from .helpers_ws import messages_until_close

openai = pytest.importorskip("openai")
from openai.types import realtime as ga  # noqa: E402

TRANSCRIPTION = "conversation.item.input_audio_transcription"
COMPLETED = f"{TRANSCRIPTION}.completed"
RATE = 24000
APPEND_SAMPLES = RATE // 50  # 20 ms, as OpenAI's guide appends


@pytest.fixture(scope="module")
def demo_server():
    args = ("--num-slots", "1", "--idle-timeout-s", "4", "--context-right", "all")
    with start_server(*args, model=str(DEMO_MODEL_PATH)) as s:
        yield s
        s.assert_no_leak()


@pytest.fixture(scope="module")
def demo_model():
    return helpers.model(str(DEMO_MODEL_PATH), "all")


def utterances(n: int, seed: int) -> list[np.ndarray]:
    """Bundled utterances as PCM16 at 24 kHz (what OpenAI's clients send)."""
    import soxr

    out = []
    for a in helpers.utterances(n, seed=seed):
        a = soxr.resample(a, 16000, RATE, quality="HQ")
        out.append(np.clip(np.round(a * 32768.0), -32768, 32767).astype("<i2"))
    return out


def energy_onset_s(wire: np.ndarray) -> float:
    """The first 10 ms within 20 dB of the loudest: where speech begins, by energy."""
    frame = RATE // 100
    x = wire[: len(wire) // frame * frame].astype(np.float64).reshape(-1, frame)
    rms = np.sqrt((x**2).mean(axis=1))
    return float(np.flatnonzero(rms >= 0.1 * rms.max())[0] * frame / RATE)


def oracle(model, wire: np.ndarray, mode: int) -> list[int]:
    return oracle_transcribe(model, as_model_input(wire, RATE), context_right=mode).token_ids


def b64(samples: np.ndarray) -> str:
    import base64

    return base64.b64encode(samples.tobytes()).decode()


async def sdk_session(server, session: dict, turns: list[np.ndarray], *, query: dict | None = None,
                      commit: bool = True, beta: bool = False, expect: int | None = None) -> list[dict]:  # fmt: skip
    """The SDK's guide flow: update, then per turn 20 ms appends (as fast as they go) and a
    commit; every event until `expect` items completed (default: one per turn)."""
    expect = len(turns) if expect is None else expect
    raw: list[dict] = []
    if beta:  # the beta interface dials wss:// from base_url: it needs websocket_base_url too
        client = openai.AsyncOpenAI(api_key=TOKEN, base_url=f"{server.http_url}/v1",
                                    websocket_base_url=f"ws://127.0.0.1:{server.port}/v1")  # fmt: skip
        connect = client.beta.realtime.connect(model="nemotron", extra_query=query or {})
    else:
        client = openai.AsyncOpenAI(api_key=TOKEN, base_url=f"{server.http_url}/v1")
        connect = client.realtime.connect(model="nemotron", extra_query={"intent": "transcription", **(query or {})})
    async with connect as conn:
        if beta:
            await conn.send({"type": "transcription_session.update", "session": session})
        else:
            await conn.session.update(session=session)
        for wire in turns:
            for i in range(0, len(wire), APPEND_SAMPLES):
                await conn.input_audio_buffer.append(audio=b64(wire[i : i + APPEND_SAMPLES]))
            if commit:
                await conn.input_audio_buffer.commit()
        async with asyncio.timeout(60):
            async for ev in conn:
                raw.append(json.loads(ev.to_json()))
                if len([e for e in raw if e["type"] == COMPLETED]) == expect:
                    break
    return raw


def completed_tokens(raw: list[dict]) -> list[list[int]]:
    return [e["nemo_serve"]["token_ids"] for e in raw if e["type"] == COMPLETED]


def guide_session(**extra) -> dict:
    return {"type": "transcription", **extra,
            "audio": {"input": {"format": {"type": "audio/pcm", "rate": RATE}, "turn_detection": None}}}  # fmt: skip


def test_each_commit_completes_its_item_whole_in_every_mode(demo_server, demo_model):
    """OpenAI's guide flow (turn_detection null, 20 ms appends, commit) with three turns in one
    session, sent back to back so the next turn's audio waits for the committed item's slot: each
    completed item's tokens equal NeMo's loop on that turn's audio alone. The mode is chosen by
    the session field in one session and by ?context_right= in another, and echoed."""
    modes = [m["context_right"] for m in demo_server.readyz()["modes"]]
    turns = utterances(3, seed=5)
    for mode, how in ((modes[0], None), (min(modes), "field"), (sorted(modes)[1], "query")):
        session = guide_session(context_right=mode) if how == "field" else guide_session()
        query = {"context_right": str(mode)} if how == "query" else None
        raw = asyncio.run(sdk_session(demo_server, session, turns, query=query))
        assert not [e for e in raw if e["type"] == "error"], raw
        for e in raw:
            if e["type"] in ("session.updated", COMPLETED, "input_audio_buffer.committed"):
                {"session.updated": ga.SessionUpdatedEvent, COMPLETED: ga.ConversationItemInputAudioTranscriptionCompletedEvent,
                 "input_audio_buffer.committed": ga.InputAudioBufferCommittedEvent}[e["type"]].model_validate(e)  # fmt: skip
        assert next(e for e in raw if e["type"] == "session.updated")["session"]["context_right"] == mode
        got = completed_tokens(raw)
        want = [oracle(demo_model, w, mode) for w in turns]
        assert got == want, (mode, how)
        assert all(want), "an utterance gave no tokens: the comparison would be weak"
        starts = [e["nemo_serve"]["item_start"] for e in raw if e["type"] == COMPLETED]
        assert starts == pytest.approx([0.0, len(turns[0]) / RATE, (len(turns[0]) + len(turns[1])) / RATE], abs=0.01)
    demo_server.assert_no_leak()


def test_turn_detection_null_means_one_item_per_commit(demo_server, demo_model):
    """Two utterances with 3 s of silence between them and one commit: with turn_detection null
    the endpointer does not split them (one completed, NeMo's loop on the whole); with server VAD
    the same audio gives two items, speech_started and speech_stopped for each."""
    a, b = utterances(2, seed=9)
    wire = np.concatenate([a, np.zeros(3 * RATE, dtype="<i2"), b])
    mode = demo_server.readyz()["modes"][0]["context_right"]
    raw = asyncio.run(sdk_session(demo_server, guide_session(), [wire]))
    assert completed_tokens(raw) == [oracle(demo_model, wire, mode)]
    assert not [e for e in raw if e["type"].startswith("input_audio_buffer.speech")]
    vad = {"type": "server_vad", "silence_duration_ms": 800, "prefix_padding_ms": 300, "threshold": 0.5}
    session = {"type": "transcription", "audio": {"input": {"turn_detection": vad}}}
    raw = asyncio.run(sdk_session(demo_server, session, [wire], expect=2))
    echoed = next(e for e in raw if e["type"] == "session.updated")["session"]["audio"]["input"]["turn_detection"]
    assert echoed["silence_duration_ms"] == 800 and echoed["prefix_padding_ms"] == 300 and echoed["threshold"] == 0.5
    types = [e["type"] for e in raw]
    assert types.count("input_audio_buffer.speech_started") == 2 and types.count("input_audio_buffer.speech_stopped") == 2, types
    # from the voice-activity detector, not the decoded text: at the onsets, less prefix_padding_ms
    starts_ms = [e["audio_start_ms"] for e in raw if e["type"] == "input_audio_buffer.speech_started"]
    onsets_ms = [energy_onset_s(a) * 1000, (len(a) / RATE + 3 + energy_onset_s(b)) * 1000]
    assert starts_ms == pytest.approx([o - 300 for o in onsets_ms], abs=150), (starts_ms, onsets_ms)
    assert types.index("input_audio_buffer.speech_started") < types.index(f"{TRANSCRIPTION}.delta")
    assert sum(completed_tokens(raw), []) == oracle(demo_model, wire, mode)


def test_server_vad_audio_that_stops_at_its_last_word_completes(demo_server, demo_model):
    """Server VAD, an utterance cut right after its last word and no commit: the item completes
    once the audio has stopped for silence_duration_ms, long before the idle close (4 s here)."""
    (wire,) = utterances(1, seed=2)
    loud = np.flatnonzero(np.abs(wire) > 0.05 * np.abs(wire).max())
    wire = wire[: loud[-1] + 1]
    mode = demo_server.readyz()["modes"][0]["context_right"]
    session = {"type": "transcription", "audio": {"input": {"turn_detection": {"type": "server_vad",
                                                                                "silence_duration_ms": 500}}}}  # fmt: skip
    loop_t0 = asyncio.new_event_loop()
    try:
        t0 = loop_t0.time()
        raw = loop_t0.run_until_complete(sdk_session(demo_server, session, [wire], commit=False))
        elapsed = loop_t0.time() - t0
    finally:
        loop_t0.close()
    assert [e for e in raw if e["type"] == COMPLETED], raw
    assert not [e for e in raw if e["type"] == "error"], raw
    assert sum(completed_tokens(raw), []) == oracle(demo_model, wire, mode)
    assert elapsed < 4.0


def test_beta_interface_needs_websocket_base_url(demo_server, demo_model):
    """client.beta.realtime.connect: with websocket_base_url it speaks the beta dialect end to
    end (transcription_session.*, a commit completes the item whole); the mode comes from the
    session's context_right."""
    (wire,) = utterances(1, seed=11)
    mode = min(m["context_right"] for m in demo_server.readyz()["modes"])
    session = {"input_audio_format": "pcm16", "turn_detection": None, "context_right": mode}
    raw = asyncio.run(sdk_session(demo_server, session, [wire], beta=True))
    updated = next(e for e in raw if e["type"] == "transcription_session.updated")
    assert updated["session"]["context_right"] == mode
    assert completed_tokens(raw) == [oracle(demo_model, wire, mode)]


def test_unserved_mode_is_refused_before_audio(demo_server):
    from websockets.asyncio.client import connect

    async def run():
        url = f"ws://127.0.0.1:{demo_server.port}/v1/realtime?context_right=7"
        async with connect(url, additional_headers={"Authorization": f"Bearer {TOKEN}"}) as ws:
            return await messages_until_close(ws), ws.close_code, ws.close_reason

    msgs, code, reason = asyncio.run(run())
    assert code == 1008 and "context_right" in reason
    assert msgs[-1]["type"] == "error"


def test_next_item_with_no_slot_and_nothing_to_wait_for_is_refused(demo_server):
    """The only slot: a realtime session commits an item and gets it completed (its slot comes
    back), a /ws stream takes the slot, then the session appends again: it has no item decoding
    whose slot it could wait for, so it gets an `error` and close 1013; the /ws stream goes on."""
    from websockets.asyncio.client import connect

    from nemo_serve.client import StreamingClient

    (wire,) = utterances(1, seed=4)
    demo_server.wait_open_streams(0)

    async def run():
        headers = {"Authorization": f"Bearer {TOKEN}"}
        async with connect(f"ws://127.0.0.1:{demo_server.port}/v1/realtime", additional_headers=headers) as rt:
            await rt.recv()
            await rt.send(json.dumps({"type": "session.update", "session": guide_session()}))
            await rt.send(json.dumps({"type": "input_audio_buffer.append", "audio": b64(wire)}))
            await rt.send(json.dumps({"type": "input_audio_buffer.commit"}))
            async for m in rt:
                if json.loads(m)["type"] == COMPLETED:
                    break
            await asyncio.to_thread(demo_server.wait_open_streams, 0)
            async with StreamingClient(demo_server.ws_url, sample_rate=RATE, token=TOKEN) as ws:
                await rt.send(json.dumps({"type": "input_audio_buffer.append", "audio": b64(wire[:4800])}))
                events = await messages_until_close(rt)
                await ws.send_audio(wire)
                await ws.end()
                finals = [m async for m in ws.messages() if m["type"] == "final"]
            return events, rt.close_code, finals

    events, code, finals = asyncio.run(run())
    assert code == 1013 and events[-1]["type"] == "error" and "no free slot" in events[-1]["error"]["message"]
    assert [t for f in finals for t in f["token_ids"]]
    demo_server.wait_open_streams(0)


def test_audio_left_uncommitted_is_completed_before_the_idle_close(demo_server, demo_model):
    """turn_detection null, an utterance appended and never committed, then nothing: at the idle
    timeout (4 s) the item is completed with all of its audio, and only after another idle period
    does the session close (1008)."""
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed

    (wire,) = utterances(1, seed=7)
    mode = demo_server.readyz()["modes"][0]["context_right"]

    async def run():
        headers = {"Authorization": f"Bearer {TOKEN}"}
        async with connect(f"ws://127.0.0.1:{demo_server.port}/v1/realtime", additional_headers=headers) as ws:
            await ws.recv()
            await ws.send(json.dumps({"type": "session.update", "session": guide_session()}))
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": b64(wire)}))
            t0, events = time.monotonic(), []
            try:
                async for m in ws:
                    events.append((time.monotonic() - t0, json.loads(m)))
            except ConnectionClosed:
                pass
            return events, time.monotonic() - t0, ws.close_code

    events, closed_after_s, code = asyncio.run(run())
    completed = [(t, e) for t, e in events if e["type"] == COMPLETED]
    assert len(completed) == 1 and completed[0][1]["nemo_serve"]["token_ids"] == oracle(demo_model, wire, mode)
    assert 3.5 < completed[0][0] < closed_after_s - 3.0
    assert code == 1008 and events[-1][1]["type"] == "error" and "idle" in events[-1][1]["error"]["message"]
