"""Deepgram's live clients, unchanged but for the base URL and key, against /v1/listen on both
WebSocket listeners (uvicorn --port, picows --fast-ws-port): deepgram-sdk's listen.v1 socket
client (what pipecat's DeepgramSTTService drives) and livekit-plugins-deepgram's SpeechStream.

What each checks against /ws on the same server and audio (two utterances, PCM16 at 16 kHz, the
server's endpoint rules): the finals' transcripts (the SDK, which sends no Finalize: the same
list, segment for segment; livekit, whose end of input sends Finalize first: the same characters,
since a Finalize adds a segment boundary), interim results arriving, a Finalize's final, and
CloseStream ending with Metadata and close 1000. The shared server: helpers_server.deepgram_server.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib.util
import json
import logging
import subprocess

import numpy as np
import pytest

from nemo_serve.client import StreamingClient

from . import helpers
from .helpers_server import LISTENERS, TOKEN



def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package is missing
        return False


# Both clients come with the `frameworks` extra (CI installs it); elsewhere the tests say why they skip.
needs_sdk = pytest.mark.skipif(not _installed("deepgram"), reason="deepgram-sdk not installed (frameworks extra)")
needs_livekit = pytest.mark.skipif(not _installed("livekit.plugins.deepgram"),
                                   reason="livekit-plugins-deepgram not installed (frameworks extra)")  # fmt: skip
RATE = 16000
PACKET = RATE // 10  # 100 ms
QUIET_S = 1.5  # livekit: no event for this long after its end of input ends the session


@pytest.fixture(scope="module")
def pcm() -> np.ndarray:
    """Two utterances, PCM16 at 16 kHz."""
    audio = np.concatenate(helpers.utterances(2, seed=3))
    return np.clip(np.round(audio * 32768.0), -32768, 32767).astype("<i2")


@pytest.fixture(scope="module")
def ws_finals(deepgram_server, pcm) -> list[str]:
    """/ws's final texts for `pcm` (the server's endpoint rules)."""

    async def run() -> list[str]:
        async with StreamingClient(deepgram_server.ws_base("uvicorn") + "/ws", sample_rate=RATE, encoding="pcm_s16le",
                                   token=TOKEN) as c:  # fmt: skip
            for i in range(0, len(pcm), PACKET):
                await c.send_audio(pcm[i : i + PACKET])
            await c.end()
            return [m["text"] for m in [m async for m in c.messages()] if m["type"] == "final"]

    finals = asyncio.run(run())
    assert "".join(finals).strip(), "the test model decoded nothing: nothing to compare"
    return finals


def _sdk_client(server, listener: str):
    from deepgram import AsyncDeepgramClient
    from deepgram.environment import DeepgramClientEnvironment

    base = server.ws_base(listener)
    http = base.replace("ws", "http", 1)
    return AsyncDeepgramClient(api_key=TOKEN, environment=DeepgramClientEnvironment(
        base=http, production=base, agent=base, agent_rest=http))  # fmt: skip


# What pipecat 1.x's DeepgramSTTService asks for by default (its settings, as the SDK sends them:
# Python booleans in the URL as True/False), plus SpeechStarted and UtteranceEnd.
SDK_OPTIONS = dict(model="nova-3-general", language="en", encoding="linear16", sample_rate=RATE, channels=1,
                   interim_results=True, smart_format=False, punctuate=True, profanity_filter=True,
                   vad_events=True, utterance_end_ms=1000)  # fmt: skip


async def _sdk_session(server, listener: str, pcm: np.ndarray, finalize_at: int | None = None, **options) -> list:
    """The SDK's async live client: `pcm` in 100 ms packets (a Finalize after `finalize_at`
    samples), CloseStream, every parsed message until the server closes. The SDK's iteration
    ends quietly only at a normal close (websockets' ConnectionClosedOK: 1000 or 1001); any
    other close raises here."""
    from deepgram.listen.v1.types import ListenV1Results

    async with _sdk_client(server, listener).listen.v1.connect(**{**SDK_OPTIONS, **options}) as conn:
        received: list = []

        async def read() -> None:
            async for message in conn:
                received.append(message)

        reader = asyncio.create_task(read())
        for i in range(0, len(pcm), PACKET):
            await conn.send_media(pcm[i : i + PACKET].tobytes())
            if finalize_at is not None and i + PACKET >= finalize_at > i:
                await conn.send_finalize()
                await asyncio.wait_for(_until(lambda: any(isinstance(m, ListenV1Results) and m.from_finalize
                                                          for m in received)), 10)  # fmt: skip
        await conn.send_close_stream()
        await asyncio.wait_for(reader, 60)
        return received


async def _until(condition) -> None:
    """As a voice agent waits for its turn's final after a Finalize."""
    while not condition():
        await asyncio.sleep(0.02)


@needs_sdk
@pytest.mark.parametrize("listener", LISTENERS)
def test_sdk_live_client_matches_ws(deepgram_server, pcm, ws_finals, listener):
    """deepgram-sdk 7.16's AsyncV1SocketClient: every message parses as its typed model, the
    finals equal /ws's segment for segment, interim results and SpeechStarted arrive, and
    CloseStream ends with Metadata (the audio's duration and sha256) and a normal close."""
    from deepgram.listen.v1.types import ListenV1Metadata, ListenV1Results, ListenV1SpeechStarted

    received = asyncio.run(_sdk_session(deepgram_server, listener, pcm))
    assert all(not isinstance(m, (dict, bytes)) for m in received), [m for m in received if isinstance(m, dict)]
    results = [m for m in received if isinstance(m, ListenV1Results)]
    finals = [m for m in results if m.is_final]
    assert [m.channel.alternatives[0].transcript for m in finals] == ws_finals
    assert any(not m.is_final and m.channel.alternatives[0].transcript for m in results), "no interim result"
    assert any(isinstance(m, ListenV1SpeechStarted) for m in received)
    assert finals[-1].speech_final and not any(m.from_finalize for m in results)
    # Results tile the audio: each final starts where the previous one ended
    assert finals[0].start == 0.0
    assert all(abs(b.start - (a.start + a.duration)) < 1e-6 for a, b in zip(finals, finals[1:]))
    assert all(w.start <= w.end for m in finals for w in m.channel.alternatives[0].words)
    metadata = received[-1]
    assert isinstance(metadata, ListenV1Metadata), received[-3:]
    assert metadata.duration == pytest.approx(len(pcm) / RATE, abs=1e-3)
    assert metadata.sha256 == hashlib.sha256(pcm.tobytes()).hexdigest()
    assert metadata.request_id == finals[0].metadata.request_id
    deepgram_server.assert_no_leak()


@needs_sdk
def test_sdk_keywords_boost_as_ws_phrases_do(deepgram_server, pcm, ws_finals):
    """keywords=TERM:INTENSIFIER and keyterm=PHRASE are /ws's `phrases` and `boost`
    (deepgram_keywords.py): the SDK's finals equal /ws's with the same phrases, which differ from
    the unboosted ones (so a route that ignored keywords fails here). The phrases are words of the
    test model's own transcripts ("gl do", "eemp proovee")."""
    from deepgram.listen.v1.types import ListenV1Results

    async def ws_boosted() -> list[str]:
        async with StreamingClient(deepgram_server.ws_base("uvicorn") + "/ws", sample_rate=RATE, encoding="pcm_s16le",
                                   token=TOKEN, phrases=["gl do", "eemp proovee"], boost=5.0) as c:  # fmt: skip
            for i in range(0, len(pcm), PACKET):
                await c.send_audio(pcm[i : i + PACKET])
            await c.end()
            return [m["text"] for m in [m async for m in c.messages()] if m["type"] == "final"]

    boosted = asyncio.run(ws_boosted())
    assert boosted != ws_finals, "boosting changed nothing here: pick other phrases"
    received = asyncio.run(_sdk_session(deepgram_server, "uvicorn", pcm, keyterm=["gl do"], keywords=["eemp proovee:5"]))
    finals = [m.channel.alternatives[0].transcript for m in received if isinstance(m, ListenV1Results) and m.is_final]
    assert finals == boosted
    deepgram_server.assert_no_leak()


@needs_sdk
@pytest.mark.parametrize("listener", LISTENERS)
def test_sdk_finalize_gives_a_final_from_finalize(deepgram_server, pcm, ws_finals, listener):
    """A Finalize mid-stream: a final with from_finalize true (is_final, not speech_final) for
    the audio sent before it; the transcripts stay /ws's characters."""
    from deepgram.listen.v1.types import ListenV1Results

    received = asyncio.run(_sdk_session(deepgram_server, listener, pcm, finalize_at=len(pcm) // 2))
    finals = [m for m in received if isinstance(m, ListenV1Results) and m.is_final]
    forced = [m for m in finals if m.from_finalize]
    assert len(forced) == 1 and not forced[0].speech_final and forced[0].channel.alternatives[0].transcript
    text = "".join(m.channel.alternatives[0].transcript for m in finals)
    assert text.replace(" ", "") == "".join(ws_finals).replace(" ", "")
    deepgram_server.assert_no_leak()


@pytest.mark.parametrize("listener", LISTENERS)
def test_every_finalize_is_answered(deepgram_server, pcm, listener):
    """As Deepgram answers each Finalize with a from_finalize final: after speech, the forced
    final (with text); after silence with nothing said since the last final, an empty one once
    the engine passed the point; right before CloseStream, one before Metadata. No speech_final
    on a final without text."""
    from .helpers_ws import messages_until_close, ws_connect

    finalize, silence = json.dumps({"type": "Finalize"}), np.zeros(2 * RATE, "<i2").tobytes()

    async def run() -> list[dict]:
        url = deepgram_server.ws_base(listener) + "/v1/listen?encoding=linear16&sample_rate=16000"
        async with ws_connect(url, additional_headers={"Authorization": f"Token {TOKEN}"}) as ws:
            for frames in ([pcm.tobytes(), finalize, silence, silence], [finalize, silence], [finalize]):
                for f in frames:
                    await ws.send(f)
                await asyncio.sleep(0.5)
            await ws.send(json.dumps({"type": "CloseStream"}))
            return await messages_until_close(ws, 30)

    messages = asyncio.run(run())
    forced = [m for m in messages if m["type"] == "Results" and m["from_finalize"]]
    assert len(forced) == 3 and all(m["is_final"] and not m["speech_final"] for m in forced), forced
    assert forced[0]["channel"]["alternatives"][0]["transcript"], forced[0]
    assert [m["channel"]["alternatives"][0]["transcript"] for m in forced[1:]] == ["", ""], forced
    assert not any(m["speech_final"] for m in messages if m["type"] == "Results"
                   and not m["channel"]["alternatives"][0]["transcript"].strip())  # fmt: skip
    assert messages[-1]["type"] == "Metadata"
    deepgram_server.assert_no_leak()


async def _livekit_session(base_url: str, pcm: np.ndarray) -> list:
    """livekit-plugins-deepgram 1.8.9's STT().stream() outside a worker: 10 ms frames as a room
    track delivers them, then end_input (its Finalize, then CloseStream); every event."""
    from livekit import rtc
    from livekit.agents.utils import http_context
    from livekit.plugins import deepgram

    frame = RATE // 100
    async with http_context.open():
        stt = deepgram.STT(base_url=base_url, api_key=TOKEN, sample_rate=RATE)
        stream = stt.stream()
        for i in range(0, len(pcm), frame):
            chunk = pcm[i : i + frame].tobytes()
            stream.push_frame(rtc.AudioFrame(data=chunk, sample_rate=RATE, num_channels=1,
                                             samples_per_channel=len(chunk) // 2))  # fmt: skip
            if i % (frame * 10) == 0:
                await asyncio.sleep(0)
        stream.end_input()
        events = []
        # Until the events stop for QUIET_S: the stream's own end waits on livekit's 5 s
        # KeepAlive sleep (its keepalive task returns only when it next wakes), so it is closed
        # here instead; the server's close came right after the last final.
        with contextlib.suppress(asyncio.TimeoutError, StopAsyncIteration):
            while True:
                events.append(await asyncio.wait_for(stream.__anext__(), QUIET_S))
        await stream.aclose()
        await stt.aclose()
    return events


@needs_livekit
@pytest.mark.parametrize("listener", LISTENERS)
def test_livekit_speech_stream_matches_ws(deepgram_server, pcm, ws_finals, listener, caplog):
    """livekit's SpeechStream (its defaults: interim results, vad_events, endpointing 25 ms):
    interim and final transcripts, start and end of speech, /ws's characters in the finals, and
    the stream ends without livekit seeing an unexpected close (no reconnect, nothing logged)."""
    from livekit.agents import stt as agents_stt

    http = deepgram_server.ws_base(listener).replace("ws", "http", 1)
    with caplog.at_level(logging.WARNING, logger="livekit.plugins.deepgram"):
        events = asyncio.run(asyncio.wait_for(_livekit_session(http + "/v1/listen", pcm), 120))
    kinds = [ev.type for ev in events]
    finals = [ev.alternatives[0].text for ev in events if ev.type == agents_stt.SpeechEventType.FINAL_TRANSCRIPT]
    assert "".join(finals).replace(" ", "") == "".join(ws_finals).replace(" ", "")
    assert agents_stt.SpeechEventType.INTERIM_TRANSCRIPT in kinds
    assert agents_stt.SpeechEventType.START_OF_SPEECH in kinds and agents_stt.SpeechEventType.END_OF_SPEECH in kinds
    assert not [r for r in caplog.records if r.name.startswith("livekit.plugins.deepgram")], caplog.text
    deepgram_server.assert_no_leak()


def test_endpointing_only_lengthens_the_servers_pause():
    """endpointing=N ms: rule 2 (and rule 1) become N where longer than the server's, else the
    server's rules stand (Deepgram's few-ms default would split at nearly every word);
    endpointing=false: rules 1 and 2 and EOU endings off, rule 3 kept. The SDK's True/False parse."""
    from nemo_serve.engine.endpoint import EndpointConfig
    from nemo_serve.server.deepgram_live import endpoint_config, parse_options

    base = EndpointConfig()
    query = {"encoding": "linear16", "sample_rate": "16000"}
    assert endpoint_config(base, parse_options(query)) == base
    assert endpoint_config(base, parse_options({**query, "endpointing": "25"})) == base
    longer = endpoint_config(base, parse_options({**query, "endpointing": "3000"}))
    assert (longer.rule1_min_trailing_silence_s, longer.rule2_min_trailing_silence_s) == (3.0, 3.0)
    off = endpoint_config(base, parse_options({**query, "endpointing": "false", "interim_results": "True"}))
    assert off.rule2_min_trailing_silence_s == off.rule1_min_trailing_silence_s == 3600.0 and not off.eou
    assert off.rule3_min_utterance_length_s == base.rule3_min_utterance_length_s and off.enabled
    assert parse_options({**query, "interim_results": "True"}).interim_results
    assert endpoint_config(EndpointConfig.off(), parse_options({**query, "endpointing": "3000"})) == EndpointConfig.off()


@pytest.mark.parametrize("listener", LISTENERS)
def test_pipecat_deepgram_service_matches_ws(deepgram_server, pcm, listener, tmp_path):
    """pipecat 1.14's DeepgramSTTService, unchanged but for base_url, in the interpreter that has
    pipecat (tests/framework_clients/pipecat_deepgram_stt.py; skipped without one): two turns,
    each followed by the VAD stop its VADProcessor would send and 1 s of silence. Its
    transcripts hold /ws's characters for the same session audio up to the end pipecat reads,
    the Finalize after a turn marks a transcript finalized, interim transcripts arrive, no error."""
    from .test_framework_clients import DRIVERS, framework_python

    python = framework_python("pipecat.services.deepgram")
    turns = [pcm[: len(pcm) // 2], pcm[len(pcm) // 2 :]]
    paths = []
    for k, turn in enumerate(turns):
        paths.append(tmp_path / f"turn{k}.pcm")
        paths[-1].write_bytes(turn.tobytes())
    gap = np.zeros(RATE, "<i2")
    session = np.concatenate([np.concatenate([t, gap]) for t in turns])

    async def ws_text() -> str:
        async with StreamingClient(deepgram_server.ws_base(listener) + "/ws", sample_rate=RATE, encoding="pcm_s16le",
                                   token=TOKEN) as c:  # fmt: skip
            await c.send_audio(session)
            await c.end()
            return "".join(m["text"] for m in [m async for m in c.messages()] if m["type"] == "final")

    run = subprocess.run([python, str(DRIVERS / "pipecat_deepgram_stt.py"), deepgram_server.ws_base(listener), TOKEN,
                          *map(str, paths)], capture_output=True, text=True, timeout=120)  # fmt: skip
    lines = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert run.returncode == 0 and lines, run.stderr[-3000:]
    assert not [x for x in lines if x.get("type") == "error"], lines
    finals = [x for x in lines if "text" in x]
    # A prefix of /ws's: pipecat cancels its connection task right after sending CloseStream (its
    # _disconnect at EndFrame), so the finals of the tail decoded after it never reach the
    # pipeline (Deepgram sends them too). At least the first turn's half of the text came.
    text, ws = "".join(x["text"] for x in finals).replace(" ", ""), asyncio.run(ws_text()).replace(" ", "")
    assert ws.startswith(text) and len(text) >= len(ws) // 2, (text, ws)
    assert any(x["finalized"] for x in finals), finals
    assert lines[-1]["interim"] > 0
    deepgram_server.assert_no_leak()
