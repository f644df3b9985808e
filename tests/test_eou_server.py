"""An EOU model (builtin:tiny-eou, engine/eou.py) served end to end, each protocol with its real
client: /ws (websockets, the bundled StreamingClient), /v1/realtime (openai SDK, server VAD),
Riva gRPC (riva.client) and the file API (openai SDK). The segments are NeMo's loop split at its
<EOU>/<EOB> tokens; the probability is the softmax computed apart from the engine."""

from __future__ import annotations

import asyncio
import base64
import json
import re
from pathlib import Path

import grpc
import numpy as np
import pytest
import soundfile

import nemo_serve
from nemo_serve.engine.eou import EouTokens
from nemo_serve.oracle import oracle_transcribe

from . import helpers
from .helpers_server import TOKEN, as_model_input, free_port, pcm16_file, start_server, ws_pcm16_finals

openai = pytest.importorskip("openai")
riva = pytest.importorskip("riva.client")

EOU_MODEL = "builtin:tiny-eou"
UTTERANCE = sorted((Path(nemo_serve.__file__).parent / "assets" / "demo" / "utterances").glob("*.wav"))[3]
TRANSCRIPTION = "conversation.item.input_audio_transcription"
RULES_OFF = {"rule1_min_trailing_silence_s": 3000, "rule2_min_trailing_silence_s": 3000,
             "rule3_min_utterance_length_s": 3000}  # only EOU tokens and the end of input end segments


@pytest.fixture(scope="module")
def server():
    grpc_port = free_port()
    with start_server("--grpc-port", str(grpc_port), "--num-slots", "3", model=EOU_MODEL) as s:
        s.grpc_port = grpc_port
        yield s


def pcm16(rate: int) -> np.ndarray:
    return pcm16_file(UTTERANCE, rate)


def ws_finals(server, wire: np.ndarray, rate: int, endpointing: dict | None = None) -> list[dict]:
    return asyncio.run(ws_pcm16_finals(server, wire, rate, endpointing=endpointing))


def test_ws_finals_end_at_eou_with_reason_and_probability(server):
    from .helpers_words import nemo_max_prob

    m = helpers.model(EOU_MODEL, None)
    eou = EouTokens.from_vocabulary(m.vocabulary)
    wire = pcm16(16000)
    finals = ws_finals(server, wire, 16000, RULES_OFF)
    audio = as_model_input(wire, 16000)
    ref = oracle_transcribe(m, audio).token_ids
    expected, current = [], []
    for t in ref:  # NeMo's loop split at its EOU tokens, as NeMo's voice agent draws turns
        if t in eou.id_to_reason:
            expected.append((current, eou.id_to_reason[t]))
            current = []
        else:
            current.append(t)
    expected.append((current, "end_of_input"))
    assert [(f["token_ids"], f["end_reason"]) for f in finals] == expected
    assert sum(r == "eou" for _, r in expected) >= 1, "no EOU in this utterance: the test would prove little"
    assert all("<EOU>" not in f["text"] and "<EOU>" not in f["tokens"] for f in finals)
    assert [f["backchannel"] for f in finals] == [r == "eob" for _, r in expected]
    # the probability: the joint's softmax at the EOU token, computed apart from the engine
    ids, confs = nemo_max_prob(m, audio, server.readyz()["context_right"])
    assert ids == ref
    n = len(m.vocabulary) + 1
    want = [c * (1 - 1 / n) + 1 / n for t, c in zip(ids, confs) if t in eou.id_to_reason]
    assert [f["eou_probability"] for f in finals[:-1]] == pytest.approx(want, abs=3e-4)
    assert finals[-1]["eou_probability"] is None and finals[-1]["eou_time"] is None
    for f in finals[:-1]:
        assert f["start_time"] <= f["eou_time"] and all(t <= f["eou_time"] for t in f["timestamps"])
    # a stream that turns EOU endings off: one segment, the same tokens without EOU ones
    off = ws_finals(server, wire, 16000, {**RULES_OFF, "eou": False})
    assert [(f["token_ids"], f["end_reason"]) for f in off] == [([t for t in ref if t not in eou.id_to_reason], "end_of_input")]
    server.assert_no_leak()


def test_realtime_server_vad_commits_and_completes_at_each_eou(server):
    """The openai SDK in server-VAD mode: each EOU item with text is speech_stopped at the EOU's
    audio time, then committed, then completed; the client never commits."""
    rate = 24000
    wire = pcm16(rate)
    reference = [f for f in ws_finals(server, wire, rate, {"rule2_min_trailing_silence_s": 1.2}) if f["text"]]
    assert any(f["end_reason"] in ("eou", "eob") for f in reference)

    async def run() -> list[dict]:
        client = openai.AsyncOpenAI(api_key=TOKEN, base_url=f"{server.http_url}/v1")
        raw: list[dict] = []
        async with client.realtime.connect(model="nemotron", extra_query={"intent": "transcription"}) as conn:
            await conn.recv()
            await conn.session.update(session={
                "type": "transcription",
                "audio": {"input": {"format": {"type": "audio/pcm", "rate": rate},
                                    "turn_detection": {"type": "server_vad", "silence_duration_ms": 1200}}},
            })  # fmt: skip
            for i in range(0, len(wire), 2400):
                await conn.input_audio_buffer.append(audio=base64.b64encode(wire[i : i + 2400].tobytes()).decode())
            # no commit: the items end at the EOUs, the last one when the audio stops (server VAD)
            async for ev in conn:
                raw.append(json.loads(ev.to_json()))
                if ev.type == f"{TRANSCRIPTION}.completed" and raw[-1]["nemo_serve"]["end_reason"] == "end_of_input":
                    break
                if ev.type == f"{TRANSCRIPTION}.completed" and len([e for e in raw if e["type"].endswith(".completed")]) > 50:
                    break
        return raw

    raw = asyncio.run(asyncio.wait_for(run(), 120))
    completed = [e for e in raw if e["type"] == f"{TRANSCRIPTION}.completed"]
    got = [(e["transcript"], e["nemo_serve"]["token_ids"], e["nemo_serve"]["end_reason"]) for e in completed]
    assert got == [(f["text"], f["token_ids"], f["end_reason"]) for f in reference]
    for e, f in zip(completed, reference):
        if f["end_reason"] not in ("eou", "eob"):
            continue
        item = e["item_id"]
        kinds = [x["type"] for x in raw if x.get("item_id") == item]
        assert kinds.index("input_audio_buffer.speech_stopped") < kinds.index("input_audio_buffer.committed") < kinds.index(e["type"])
        stopped = next(x for x in raw if x.get("item_id") == item and x["type"] == "input_audio_buffer.speech_stopped")
        assert stopped["audio_end_ms"] == round(f["eou_time"] * 1000)
        assert e["nemo_serve"]["eou_probability"] == f["eou_probability"]
    server.assert_no_leak()


def _riva_finals(server, custom: dict | None = None) -> list[str]:
    service = riva.ASRService(riva.Auth(uri=f"127.0.0.1:{server.grpc_port}", metadata_args=[["authorization", f"Bearer {TOKEN}"]]))
    try:
        config = riva.StreamingRecognitionConfig(
            config=riva.RecognitionConfig(encoding=riva.AudioEncoding.LINEAR_PCM, language_code="en-US", max_alternatives=1),
            interim_results=False,
        )  # fmt: skip
        riva.add_audio_file_specs_to_config(config, UTTERANCE)
        for k, v in (custom or {}).items():
            config.config.custom_configuration[k] = v
        with riva.AudioChunkFileIterator(str(UTTERANCE), 1600) as chunks:
            results = [r for resp in service.streaming_response_generator(chunks, config) for r in resp.results]
    finally:
        service.auth.channel.close()
    assert all(r.is_final and r.stability == 1.0 for r in results)
    return [r.alternatives[0].transcript for r in results if r.alternatives[0].transcript]


def test_riva_final_result_at_each_eou_and_custom_configuration_turns_it_off(server):
    """docs/protocol.md's custom_configuration row: "eou": "false" turns the EOU endings off, another
    value of it is INVALID_ARGUMENT, a key the server does not know changes nothing."""
    samples, rate = soundfile.read(UTTERANCE, dtype="int16")
    reference = [f for f in ws_finals(server, samples, rate) if f["text"]]
    assert any(f["end_reason"] in ("eou", "eob") for f in reference) and len(reference) > 1
    assert _riva_finals(server) == [f["text"] for f in reference]
    assert _riva_finals(server, {"not_an_option_here": "1"}) == [f["text"] for f in reference]
    whole = [f["text"] for f in ws_finals(server, samples, rate, {"eou": False}) if f["text"]]
    assert _riva_finals(server, {"eou": "false"}) == whole and len(whole) < len(reference)
    with pytest.raises(grpc.RpcError) as refused:
        _riva_finals(server, {"eou": "maybe"})
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value
    assert "custom_configuration eou='maybe': use true or false" in refused.value.details()
    server.assert_no_leak()


def test_file_api_segments_split_at_eou(server):
    samples, rate = soundfile.read(UTTERANCE, dtype="int16")
    reference = [f for f in ws_finals(server, samples, rate) if f["text"]]
    client = openai.OpenAI(api_key=TOKEN, base_url=f"{server.http_url}/v1", max_retries=0)
    with open(UTTERANCE, "rb") as f:
        got = client.audio.transcriptions.create(file=f, model="nemotron-streaming", response_format="verbose_json",
                                                 timestamp_granularities=["segment"])  # fmt: skip
    segments = [s.model_dump() for s in got.segments]
    assert [(s["text"], s["tokens"], s["end_reason"], s["backchannel"]) for s in segments] == [
        (f["text"], f["token_ids"], f["end_reason"], f["backchannel"]) for f in reference
    ]
    assert any(s["end_reason"] == "eou" and 0 < s["eou_probability"] <= 1 for s in segments)
    server.assert_no_leak()


def test_nvidia_nim_client_shows_each_eou_item_and_the_last_as_its_final(server, tmp_path):
    """NIM's dialect (a session from NIM's bootstrap: commits are flushes) on an EOU model, with
    NVIDIA's client unchanged (tests/nim_client/, as tests/test_nim_sessions.py runs it): items end
    at the model's EOU tokens, so what it prints, `Interim Transcript` per item and `Final
    Transcript` for the last, is /ws's non-empty finals in order, the EOU token never in the text,
    and it saves the last; the events it read carry each item's end_reason."""
    pytest.importorskip("riva.client.realtime")
    from .helpers_nim import nvidia_client_runs, riva_args, run_riva_client

    samples, rate = soundfile.read(UTTERANCE, dtype="int16")
    reference = [f for f in ws_finals(server, samples, rate) if f["text"]]
    assert sum(f["end_reason"] in ("eou", "eob") for f in reference) >= 2, reference  # the test needs EOU items
    (rc, shown, saved), = asyncio.run(nvidia_client_runs(server, [UTTERANCE], tmp_path, concurrency=1)).values()
    printed = re.findall(r" - INFO - (Interim|Final) Transcript: (.*)$", shown, re.MULTILINE)
    expected = [("Interim", f["text"]) for f in reference[:-1]] + [("Final", reference[-1]["text"])]
    assert rc == 0 and printed == expected and saved == reference[-1]["text"], (shown[-1500:], expected)
    assert "<EOU>" not in shown and "<EOB>" not in shown
    events, _ = asyncio.run(run_riva_client(riva_args(server, sample_rate_hz=rate), UTTERANCE))
    completed = [e for e in events if e["type"] == f"{TRANSCRIPTION}.completed"]
    assert [(e["transcript"], e["nemo_serve"]["end_reason"]) for e in completed] == [
        (f["text"], f["end_reason"]) for f in reference]  # fmt: skip
    server.assert_no_leak()
