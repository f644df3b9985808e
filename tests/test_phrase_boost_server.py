"""Phrase boosting over the wire: `phrases` and `boost` in the /ws config message, against the
real server (the shared one: several front-end processes around one engine core) with the
project's own WebSocket client. A boosted and a plain stream at the same time are each
token-identical to NeMo's loop (the boosted one with NeMo's decoder boosting the same phrases);
bad phrases are refused with an error before any audio while another stream streams on."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from nemo_serve.oracle import oracle_transcribe

from . import helpers
from .helpers_server import TEST_MODEL, as_model_input, encode, raw_session
from .helpers_e2e import check_well_formed, stream


@pytest.fixture(scope="module")
def model():
    return helpers.model(TEST_MODEL, "all")


def _phrase_from(model, audio) -> str:
    """Words the model can spell by construction: the first two of its own transcript of `audio`."""
    words = oracle_transcribe(model, audio).text.split()
    assert words, "the test model transcribed nothing"
    return " ".join(words[:2])


@pytest.mark.parametrize("mode", [0, 13])
def test_boosted_and_plain_streams_match_nemo(shared_server, model, mode):
    a, b, c = helpers.utterances(3, seed=41)
    phrases, boost = [_phrase_from(model, b), _phrase_from(model, c)], 3.0

    async def both():
        return await asyncio.gather(
            stream(shared_server.ws_url, encode(a, "pcm_f32le"), 16000, "pcm_f32le", packet=1280,
                   context_right=mode, phrases=phrases, boost=boost),
            stream(shared_server.ws_url, encode(b, "pcm_f32le"), 16000, "pcm_f32le", packet=1280, context_right=mode),
        )  # fmt: skip

    boosted, plain = asyncio.run(both())
    for t in (boosted, plain):
        check_well_formed(t)
    assert boosted.token_ids == oracle_transcribe(model, a, context_right=mode, phrases=phrases, boost=boost).token_ids
    assert plain.token_ids == oracle_transcribe(model, b, context_right=mode).token_ids
    shared_server.assert_no_leak()


def test_bad_phrases_are_refused_before_audio_and_others_stream_on(shared_server, model):
    audio = helpers.utterances(1, seed=43)[0]
    cases = {
        "phrase 0 is empty": {"phrases": [""]},
        "cannot spell": {"phrases": ["\u4e2d\u6587"]},
        "at most 100 per stream": {"phrases": [f"w{i}" for i in range(101)]},
        "at most 64": {"phrases": ["a" * 65]},
        "boost must be": {"phrases": ["a"], "boost": -1},
        "phrases: Input should be a valid list": {"phrases": "a"},
    }

    async def scenario():
        plain = asyncio.create_task(stream(shared_server.ws_url, encode(audio, "pcm_f32le"), 16000, "pcm_f32le",
                                           packet=1280, speed=4.0))  # fmt: skip
        refused = []
        for fields in cases.values():
            config = json.dumps({"type": "config", **fields})
            refused.append(await raw_session(shared_server.ws_url, [config, b"\x00" * 3200]))
        return await plain, refused

    plain, refused = asyncio.run(scenario())
    for (needle, fields), (messages, code) in zip(cases.items(), refused):
        assert code == 1008 and [m["type"] for m in messages] == ["error"], (fields, messages)
        assert needle in messages[0]["reason"], (needle, messages[0]["reason"])
    check_well_formed(plain)
    assert plain.token_ids == oracle_transcribe(model, audio).token_ids
    shared_server.assert_no_leak()


def test_realtime_session_phrases_match_ws_and_nemo(shared_server, model):
    """/v1/realtime (NIM's beta dialect, a plain WebSocket client): `phrases` and `boost` in
    input_audio_transcription boost the session's stream as /ws's config does; a bad list is
    answered with an `error` event naming the `phrases` param, and the session goes on."""
    import base64

    from websockets.asyncio.client import connect

    from .helpers_server import TOKEN

    audio, other = helpers.utterances(2, seed=47)
    phrases, boost = [_phrase_from(model, other)], 3.0
    wire = np.clip(np.round(audio * 32768.0), -32768, 32767).astype("<i2")

    def update(transcription: dict) -> str:
        return json.dumps({"type": "transcription_session.update",
                           "session": {"input_audio_format": "pcm16", "input_audio_params": {"sample_rate_hz": 16000},
                                       "input_audio_transcription": transcription, "turn_detection": None}})  # fmt: skip

    async def run() -> tuple[dict, list[dict]]:
        raw: list[dict] = []
        url = f"ws://127.0.0.1:{shared_server.port}/v1/realtime?intent=transcription"
        async with connect(url, additional_headers={"Authorization": f"Bearer {TOKEN}"}) as ws:
            assert json.loads(await ws.recv())["type"] == "session.created"
            await ws.send(update({"phrases": ["ok", ""]}))
            bad = json.loads(await ws.recv())
            await ws.send(update({"phrases": phrases, "boost": boost}))
            assert json.loads(await ws.recv())["type"] == "transcription_session.updated"
            for i in range(0, len(wire), 1600):
                await ws.send(json.dumps({"type": "input_audio_buffer.append",
                                          "audio": base64.b64encode(wire[i : i + 1600].tobytes()).decode()}))  # fmt: skip
            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            await ws.send(json.dumps({"type": "input_audio_buffer.done"}))
            async for message in ws:
                raw.append(json.loads(message))
        return bad, raw

    bad, raw = asyncio.run(run())
    assert bad["type"] == "error" and bad["error"]["param"] == "phrases", bad
    assert "phrase 1 is empty" in bad["error"]["message"]
    assert not [e for e in raw if e["type"] == "error"], raw
    tokens = [t for e in raw if e["type"].endswith("input_audio_transcription.completed") for t in e["nemo_serve"]["token_ids"]]
    assert tokens == oracle_transcribe(model, as_model_input(wire, 16000), phrases=phrases, boost=boost).token_ids
    shared_server.assert_no_leak()


def test_server_phrase_total_refuses_before_audio_and_frees_with_the_stream():
    """--max-phrases-total 2: a stream holding two phrases leaves room for none; the next boosted
    stream is refused (error, 1008, before any audio) while a plain one is served; once the first
    ends, a boosted stream is served again."""
    from websockets.asyncio.client import connect

    from .helpers_server import TOKEN, start_server

    with start_server("--num-slots", "3", "--max-phrases-total", "2") as server:
        async def scenario():
            headers = {"Authorization": f"Bearer {TOKEN}"}
            async with connect(server.ws_url, additional_headers=headers) as first:
                await first.send(json.dumps({"type": "config", "phrases": ["ab", "cd"]}))
                assert json.loads(await first.recv())["type"] == "ready"
                refused = await raw_session(server.ws_url, [json.dumps({"type": "config", "phrases": ["ef"]})])
                plain = await raw_session(server.ws_url, [json.dumps({"type": "config"}), json.dumps({"type": "end"})])
                await first.send(json.dumps({"type": "end"}))
                async for _ in first:
                    pass
            await asyncio.to_thread(server.wait_open_streams, 0)
            again = await raw_session(server.ws_url, [json.dumps({"type": "config", "phrases": ["ef"]}),
                                                      json.dumps({"type": "end"})])  # fmt: skip
            return refused, plain, again

        refused, plain, again = asyncio.run(scenario())
        assert refused[1] == 1008 and [m["type"] for m in refused[0]] == ["error"], refused
        assert "at most 2 in all" in refused[0][0]["reason"]
        assert plain[1] == 1000 and plain[0][0]["type"] == "ready", plain
        assert again[1] == 1000 and again[0][0]["type"] == "ready", again
        server.assert_no_leak()
