"""/v1/realtime end to end: OpenAI's own SDK (GA dialect) and a NIM-style beta client against the
real `nemo-serve` process; their tokens must equal /ws's for the same audio. Every event received
is validated with the `openai` package's pydantic types of its dialect. Plus the parsing and
language mapping in process.
"""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from nemo_serve.server.realtime_protocol import (
    Append,
    BufferEvent,
    RealtimeError,
    SessionUpdate,
    model_language,
)
from nemo_serve.server.realtime_parse import parse_client_event

from .helpers_realtime import TRANSCRIPTION, b64, pcm16, tokens_and_text, ws_reference
from .helpers_server import TEST_MODEL, TOKEN
from .helpers_server import leak_checked_server  # noqa: F401 - this module's `server` fixture
from .helpers_ws import messages_until_close

openai = pytest.importorskip("openai")
from openai.types import realtime as ga  # noqa: E402
from openai.types.beta import realtime as beta  # noqa: E402


GA_TYPES = {
    "session.created": ga.SessionCreatedEvent,
    "session.updated": ga.SessionUpdatedEvent,
    "input_audio_buffer.committed": ga.InputAudioBufferCommittedEvent,
    "input_audio_buffer.cleared": ga.InputAudioBufferClearedEvent,
    "input_audio_buffer.speech_started": ga.InputAudioBufferSpeechStartedEvent,
    "input_audio_buffer.speech_stopped": ga.InputAudioBufferSpeechStoppedEvent,
    f"{TRANSCRIPTION}.delta": ga.ConversationItemInputAudioTranscriptionDeltaEvent,
    f"{TRANSCRIPTION}.completed": ga.ConversationItemInputAudioTranscriptionCompletedEvent,
    "error": ga.RealtimeErrorEvent,
}
BETA_TYPES = {
    # transcription_session.updated is not validated: its `client_secret` is required by the
    # beta type, and null in what NIM sends (there is no ephemeral key here either)
    "input_audio_buffer.committed": beta.InputAudioBufferCommittedEvent,
    "input_audio_buffer.speech_started": beta.InputAudioBufferSpeechStartedEvent,
    "input_audio_buffer.speech_stopped": beta.InputAudioBufferSpeechStoppedEvent,
    f"{TRANSCRIPTION}.delta": beta.ConversationItemInputAudioTranscriptionDeltaEvent,
    f"{TRANSCRIPTION}.completed": beta.ConversationItemInputAudioTranscriptionCompletedEvent,
    "error": beta.ErrorEvent,
}


def realtime_url(server, query: str = "") -> str:
    return f"ws://127.0.0.1:{server.port}/v1/realtime{query}"


def check_events(raw: list[dict], types: dict) -> None:
    """Each event parses as the SDK's type for it; item ids chain by previous_item_id."""
    for obj in raw:
        if obj["type"] in types:
            types[obj["type"]].model_validate(obj)
    committed = [e for e in raw if e["type"] == "input_audio_buffer.committed"]
    assert [e["previous_item_id"] for e in committed] == [None] + [e["item_id"] for e in committed[:-1]]
    completed = [e["item_id"] for e in raw if e["type"] == f"{TRANSCRIPTION}.completed"]
    assert completed == [e["item_id"] for e in committed]


# ----------------------------------------------------------------------------- real clients


def test_openai_sdk_ga_dialect_matches_ws(server):
    """The official SDK (client.realtime.connect, GA): session.update with a transcription
    session at 24 kHz and server VAD, the utterance appended as fast as it goes, commit: one item,
    completed with all of the audio; its tokens and text are /ws's for the same audio."""
    wire = pcm16(24000)

    async def run() -> list[dict]:
        client = openai.AsyncOpenAI(api_key=TOKEN, base_url=f"{server.http_url}/v1")
        raw: list[dict] = []
        async with client.realtime.connect(model="nemotron", extra_query={"intent": "transcription"}) as conn:
            created = await conn.recv()
            assert created.type == "session.created" and created.session.type == "transcription"
            await conn.session.update(session={
                "type": "transcription",
                "audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000},
                                    "transcription": {"model": "gpt-4o-transcribe", "language": "en"},
                                    "turn_detection": {"type": "server_vad", "silence_duration_ms": 1200}}},
            })  # fmt: skip
            for i in range(0, len(wire), 2400):
                await conn.input_audio_buffer.append(audio=b64(wire[i : i + 2400]))
            await conn.input_audio_buffer.commit()
            async for ev in conn:
                raw.append(json.loads(ev.to_json()))
                if ev.type == f"{TRANSCRIPTION}.completed":
                    break
        return [json.loads(created.to_json()), *raw]

    expected = asyncio.run(ws_reference(server, wire, 24000))
    raw = asyncio.run(run())
    check_events(raw, GA_TYPES)
    updated = next(e for e in raw if e["type"] == "session.updated")["session"]
    assert updated["audio"]["input"]["transcription"]["language"] == "en"
    assert updated["audio"]["input"]["turn_detection"]["silence_duration_ms"] == 1200
    assert any(e["type"] == f"{TRANSCRIPTION}.delta" for e in raw)
    completed = [e for e in raw if e["type"] == f"{TRANSCRIPTION}.completed"]
    assert len(completed) == 1 and completed[0]["nemo_serve"]["audio_processed"] >= len(wire) / 24000 - 0.08
    assert tokens_and_text(raw) == expected
    assert expected[0], "the model gave no tokens: the comparison would be empty"


def test_beta_dialect_nim_style_client_matches_ws(server):
    """A plain WebSocket client following NIM's documented messages: /v1/realtime?intent=
    transcription, transcription_session.update with NIM's whole session (pcm16,
    input_audio_params at 16 kHz, Riva options this server ignores), append + commit per chunk,
    input_audio_buffer.done, then items until `is_last_result`; tokens are /ws's."""
    from websockets.asyncio.client import connect

    wire = pcm16(16000)
    session = {
        "modalities": ["text"],
        "input_audio_format": "pcm16",
        "input_audio_transcription": {"language": "en-US", "model": TEST_MODEL, "prompt": ""},
        "input_audio_params": {"sample_rate_hz": 16000, "num_channels": 1},
        "recognition_config": {"max_alternatives": 1, "enable_automatic_punctuation": False},
        "endpointing_config": {"start_history": 0, "stop_history": 0},
        "turn_detection": None,
    }

    async def run() -> list[dict]:
        headers = {"Authorization": f"Bearer {TOKEN}"}
        raw: list[dict] = []
        async with connect(realtime_url(server, "?intent=transcription"), additional_headers=headers) as ws:
            first = json.loads(await ws.recv())
            assert first["type"] == "session.created"
            await ws.send(json.dumps({"type": "transcription_session.update", "session": session}))
            updated = json.loads(await ws.recv())
            assert updated["type"] == "transcription_session.updated", updated
            assert updated["session"]["input_audio_params"]["sample_rate_hz"] == 16000
            assert updated["session"]["turn_detection"] is None
            for i in range(0, len(wire), 1600):
                await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": b64(wire[i : i + 1600])}))
                await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            await ws.send(json.dumps({"type": "input_audio_buffer.done"}))
            async for message in ws:
                raw.append(json.loads(message))
            assert ws.close_code == 1000
        return raw

    expected = asyncio.run(ws_reference(server, wire, 16000))
    raw = asyncio.run(run())
    assert not [e for e in raw if e["type"] == "error"], raw
    check_events(raw, BETA_TYPES)
    assert not [e for e in raw if e["type"].startswith("input_audio_buffer.speech")]  # turn_detection off
    assert raw[-1]["type"] == f"{TRANSCRIPTION}.completed" and raw[-1]["is_last_result"] is True
    assert tokens_and_text(raw)[0] == expected[0]


def test_auth_bearer_and_query_token(server):
    """No token: HTTP 401 at the handshake; the SDK with a wrong key fails to connect;
    ?token= (browsers) is accepted."""
    from websockets.asyncio.client import connect
    from websockets.exceptions import InvalidStatus

    async def run() -> None:
        with pytest.raises(InvalidStatus) as e:
            async with connect(realtime_url(server)):
                pass
        assert e.value.response.status_code == 401
        client = openai.AsyncOpenAI(api_key="wrong", base_url=f"{server.http_url}/v1")
        with pytest.raises(InvalidStatus) as e:  # the SDK's handshake error, a 401 (not any failure: a 500 passed)
            async with client.realtime.connect(model="nemotron") as conn:
                await conn.recv()
        assert e.value.response.status_code == 401
        async with connect(realtime_url(server, f"?token={TOKEN}")) as ws:
            assert json.loads(await ws.recv())["type"] == "session.created"

    asyncio.run(run())


def test_unknown_fields_are_ignored(server):
    """Fields this server does not know, at every level, change nothing and draw no error."""
    from websockets.asyncio.client import connect

    async def run() -> list[dict]:
        headers = {"Authorization": f"Bearer {TOKEN}", "OpenAI-Beta": "realtime=v1"}
        async with connect(realtime_url(server), additional_headers=headers) as ws:
            assert json.loads(await ws.recv())["type"] == "transcription_session.created"
            await ws.send(json.dumps({"type": "session.update", "future_field": 1, "session": {
                "type": "transcription", "include": ["item.input_audio_transcription.logprobs"], "x": {"y": 2},
                "audio": {"input": {"noise_reduction": {"type": "near_field"}, "new": True,
                                    "format": {"type": "audio/pcm", "rate": 24000, "channels": 1},
                                    "transcription": {"language": "en", "delay": "low", "keywords": ["nemo"]}}}}}))  # fmt: skip
            updated = json.loads(await ws.recv())
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": b64(pcm16(24000)[:4800]),
                                      "extra": [1, 2]}))  # fmt: skip
            await ws.send(json.dumps({"type": "input_audio_buffer.done", "event_id": "e1", "why": "test"}))
            return [updated] + [json.loads(m) async for m in ws]

    raw = asyncio.run(run())
    assert raw[0]["type"] == "session.updated"  # the dialect follows the client's update
    assert not [e for e in raw if e["type"] == "error"], raw
    assert raw[-1]["type"] == f"{TRANSCRIPTION}.completed"


def test_session_fields_are_fixed_once_audio_was_appended(server):
    """docs/protocol.md: "The audio format, language, mode, phrases and turn detection are fixed
    once audio was appended; an update that names them then gets an `error`
    (`session_update_after_audio`)", and the session goes on with what it had: an update naming
    none of them is answered, and the item is /ws's on the audio at the rate first set."""
    from websockets.asyncio.client import connect

    wire = pcm16(24000)
    fmt = lambda rate: {"format": {"type": "audio/pcm", "rate": rate}}  # noqa: E731
    late = {  # each names one fixed field, after the first append
        "rate": fmt(16000),
        "same rate": fmt(24000),  # named, even unchanged
        "turn_detection": {"turn_detection": {"type": "server_vad"}},
        "language": {"transcription": {"language": "en"}},
        "phrases": {"transcription": {"phrases": ["nine"]}},
    }

    async def run() -> list[dict]:
        headers = {"Authorization": f"Bearer {TOKEN}"}
        async with connect(realtime_url(server), additional_headers=headers) as ws:
            update = lambda audio_input: json.dumps({"type": "session.update", "session": {  # noqa: E731
                "type": "transcription", "audio": {"input": audio_input}}})  # fmt: skip
            await ws.recv()  # session.created
            await ws.send(update({**fmt(24000), "turn_detection": None}))
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": b64(wire[:2400])}))
            for audio_input in late.values():
                await ws.send(update(audio_input))
            await ws.send(update({}))  # names no fixed field: answered
            for i in range(2400, len(wire), 2400):
                await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": b64(wire[i : i + 2400])}))
            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            await ws.send(json.dumps({"type": "input_audio_buffer.done"}))
            return await messages_until_close(ws)

    expected = asyncio.run(ws_reference(server, wire, 24000))
    raw = asyncio.run(run())
    kinds = [e["type"] for e in raw]
    assert kinds[:len(late) + 2] == ["session.updated"] + ["error"] * len(late) + ["session.updated"], kinds
    for e in raw[1 : len(late) + 1]:
        assert e["error"]["code"] == "session_update_after_audio", e
    assert tokens_and_text(raw) == expected and expected[0]


def test_malformed_events_get_openai_errors_and_other_streams_go_on(server):
    """Bad JSON, an unknown event type, bad base64, a binary frame, a bad field value: each gets
    an `error` event in OpenAI's shape and the session goes on. An append after
    input_audio_buffer.done is fatal: error, then close 1008 with the reason. A /ws stream
    running meanwhile gets its tokens."""
    from websockets.asyncio.client import connect

    wire = pcm16(24000)

    async def bad_client() -> tuple[list[dict], int, str]:
        headers = {"Authorization": f"Bearer {TOKEN}"}
        async with connect(realtime_url(server), additional_headers=headers) as ws:
            await ws.recv()
            for frame in ["{not json", json.dumps({"type": "response.create", "event_id": "ev_7"}),
                          json.dumps({"type": "input_audio_buffer.append", "audio": "@@@"}), b"\x00\x01",
                          json.dumps({"type": "session.update", "session": {"audio": {"input": {"format": {"rate": 5}}}}}),
                          json.dumps({"type": "input_audio_buffer.commit"})]:  # fmt: skip
                await ws.send(frame)
            errors = [json.loads(await ws.recv()) for _ in range(6)]
            await ws.send(json.dumps({"type": "session.update", "session": {"type": "transcription"}}))
            errors.append(json.loads(await ws.recv()))  # still served: session.updated
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": b64(wire[:2400])}))
            await ws.send(json.dumps({"type": "input_audio_buffer.done"}))
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": b64(wire[:2400])}))
            return errors + await messages_until_close(ws), ws.close_code, ws.close_reason

    async def both():
        return await asyncio.gather(bad_client(), ws_reference(server, wire, 24000))

    (raw, code, reason), (tokens, _) = asyncio.run(both())
    assert [e["type"] for e in raw[:6]] == ["error"] * 6 and raw[6]["type"] == "session.updated"
    for e in raw[:6]:
        ga.RealtimeErrorEvent.model_validate(e)
        assert e["error"]["type"] == "invalid_request_error"
    codes = [e["error"]["code"] for e in raw[:6]]
    assert codes[:4] == ["invalid_json", "unsupported_event", "invalid_base64", "invalid_value"]
    assert codes[5] == "input_audio_buffer_commit_empty"
    assert raw[1]["error"]["event_id"] == "ev_7" and raw[4]["error"]["param"].startswith("session.audio.input.format")
    fatal = [e for e in raw[7:] if e["type"] == "error"]
    # The append follows the done in the same burst: it is read before the item can finish, so it
    # is always the documented fatal error (a normal close here would be the old, weaker promise).
    assert code == 1008 and len(fatal) == 1, (code, reason, raw[7:])
    assert "after input_audio_buffer.done" in reason and "after input_audio_buffer.done" in fatal[0]["error"]["message"]
    assert tokens


# ----------------------------------------------------------------------------- in process


def test_parse_both_dialects():
    ga_update = parse_client_event(json.dumps({"type": "session.update", "session": {
        "type": "transcription", "audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000},
                                                     "turn_detection": None}}}}))  # fmt: skip
    assert isinstance(ga_update, SessionUpdate) and ga_update.dialect == "ga" and ga_update.rate == 24000
    assert ga_update.turn_detection_set and ga_update.turn_detection is None
    b = parse_client_event(json.dumps({"type": "transcription_session.update", "session": {
        "input_audio_format": "pcm16", "input_audio_transcription": {"language": "en"}}}))  # fmt: skip
    assert b.dialect == "beta" and b.rate is None and not b.turn_detection_set and b.transcription.language == "en"
    a = parse_client_event(json.dumps({"type": "input_audio_buffer.append", "audio": b64(np.arange(3, dtype="<i2"))}))
    assert isinstance(a, Append) and len(a.pcm) == 6
    assert parse_client_event('{"type": "input_audio_buffer.clear"}') == BufferEvent("clear", None)
    for bad in ['{"type": "session.update", "session": {"type": "realtime"}}',
                '{"type": "transcription_session.update", "session": {"input_audio_format": "g711_ulaw"}}',
                '{"type": "input_audio_buffer.append", "audio": "AA=="}', "[]", '{"type": 3}']:  # fmt: skip
        with pytest.raises(RealtimeError):
            parse_client_event(bad)


def test_language_codes_map_where_unambiguous():
    langs = ["de-DE", "en-US", "es-ES", "es-US"]
    assert model_language("en", langs) == "en-US"
    assert model_language("EN-us", langs) == "en-US"
    assert model_language("de", langs) == "de-DE"
    assert model_language("en", None) is None  # a model without prompts: a hint, ignored
    with pytest.raises(RealtimeError, match="ambiguous"):
        model_language("es", langs)
    with pytest.raises(RealtimeError, match="unknown"):
        model_language("fr", langs)
