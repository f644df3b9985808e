"""Speakers on the other protocols, through the real server (--diarizer builtin:tiny-sortformer)
and each protocol's own client library: Riva gRPC (riva.client), the file API and /v1/realtime
(openai SDK).

The reference is /ws on the same samples (tests/test_diarization_server.py checks /ws against
NeMo's own streaming loop): a diarized call's words and timings equal a plain call's, and its
speakers equal /ws's. Diarization asked of a server without a diarizer, or asked wrongly, is
refused before any audio.
"""

from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path

import grpc
import numpy as np
import pytest
import soundfile
import soxr

import nemo_serve

from .helpers_server import TOKEN, free_port, raw_session, start_server

riva = pytest.importorskip("riva.client")
openai = pytest.importorskip("openai")

UTTERANCES = sorted((Path(nemo_serve.__file__).parent / "assets" / "demo" / "utterances").glob("*.wav"))
MAX_SPEAKERS = 3
DIARIZE = "gpt-4o-transcribe-diarize"


@pytest.fixture(scope="module")
def server(diarizing_server):
    """The toy diarizer's server with a --grpc-port, shared with test_diarization_server.py
    (helpers_server.py; 4 slots, it had 3: no test here fills them)."""
    return diarizing_server


@pytest.fixture(scope="module")
def conversation(tmp_path_factory) -> Path:
    """Six demo utterances end to end, 16-bit PCM at 16 kHz: long enough for the toy diarizer to
    name more than one speaker (its speakers mean nothing, but they change)."""
    samples = np.concatenate([soundfile.read(w, dtype="int16")[0] for w in UTTERANCES[:6]])
    path = tmp_path_factory.mktemp("diar") / "conversation.wav"
    soundfile.write(path, samples, 16000, subtype="PCM_16")
    return path


def ws_diarized_finals(server, wav: Path, max_speakers: int, samples: np.ndarray | None = None, rate: int = 16000,
                       endpointing: dict | None = None, split: bool = False) -> list[dict]:  # fmt: skip
    """/ws's non-empty finals for the same samples (PCM16, 100 ms packets), speakers asked for;
    `samples` (PCM16 at `rate`) instead of the file's; `split`: split_on_speaker_change."""
    if samples is None:
        samples, rate = soundfile.read(wav, dtype="int16")
    diarization = {"max_speakers": max_speakers, **({"split_on_speaker_change": True} if split else {})}
    config = {"type": "config", "sample_rate": rate, "encoding": "pcm_s16le", "diarization": diarization,
              **({"endpointing": endpointing} if endpointing else {})}  # fmt: skip
    frames = [samples[i : i + rate // 10].tobytes() for i in range(0, len(samples), rate // 10)]
    messages, code = asyncio.run(raw_session(server.ws_url, [json.dumps(config), *frames, json.dumps({"type": "end"})]))
    assert code == 1000, messages[-3:]
    return [m for m in messages if m["type"] == "final" and m["text"]]


# ---------------------------------------------------------------------------------------------- Riva
def riva_service(server):
    return riva.ASRService(riva.Auth(uri=f"127.0.0.1:{server.grpc_port}", metadata_args=[["authorization", f"Bearer {TOKEN}"]]))


def riva_config(wav: Path, speakers: int | None, words: bool = True, custom: str = ""):
    """riva.client's own config helpers; `speakers`: max_speaker_count with diarization on, None: off;
    `custom`: custom_configuration as riva.client's scripts take it ("key:value,...")."""
    config = riva.RecognitionConfig(encoding=riva.AudioEncoding.LINEAR_PCM, language_code="en-US",
                                    enable_word_time_offsets=words)  # fmt: skip
    riva.add_audio_file_specs_to_config(config, wav)
    if speakers is not None:
        riva.add_speaker_diarization_to_config(config, True, speakers)
    riva.add_custom_configuration_to_config(config, custom)
    return config


def riva_stream(asr, wav: Path, speakers: int | None, words: bool = True, custom: str = "") -> list:
    config = riva.StreamingRecognitionConfig(config=riva_config(wav, speakers, words, custom), interim_results=False)
    with riva.AudioChunkFileIterator(str(wav), 1600) as chunks:
        return [r for response in asr.streaming_response_generator(chunks, config) for r in response.results]


def words_of(results) -> list[list[tuple[str, int, int]]]:
    return [[(w.word, w.start_time, w.end_time) for w in r.alternatives[0].words] for r in results]


def tags_of(results) -> list[list[int]]:
    return [[w.speaker_tag for w in r.alternatives[0].words] for r in results]


def test_riva_speaker_tags_equal_ws_speakers_and_words_equal_a_plain_call(server, conversation):
    asr = riva_service(server)
    try:
        diarized = [r for r in riva_stream(asr, conversation, MAX_SPEAKERS) if r.is_final]
        plain = [r for r in riva_stream(asr, conversation, None) if r.is_final]
        offline = asr.offline_recognize(conversation.read_bytes(), riva_config(conversation, MAX_SPEAKERS)).results
        no_word_times = [r for r in riva_stream(asr, conversation, MAX_SPEAKERS, words=False) if r.is_final]
    finally:
        asr.auth.channel.close()
    reference = ws_diarized_finals(server, conversation, MAX_SPEAKERS)
    server.assert_no_leak()
    expected = [[w["speaker"] + 1 for w in f["words"]] for f in reference]  # Riva's tags count from 1
    assert len({t for tags in expected for t in tags}) > 1, expected  # the audio has speaker changes
    assert [r.alternatives[0].transcript for r in diarized] == [r.alternatives[0].transcript for r in plain]
    assert words_of(diarized) == words_of(plain) == words_of(offline)
    assert tags_of(diarized) == tags_of(offline) == expected
    assert tags_of(no_word_times) == expected  # the speakers come on words even without time offsets
    assert all(w.speaker_tag == 0 for r in plain for w in r.alternatives[0].words)


@pytest.mark.parametrize("speakers, reason", [(5, "max_speaker_count 5: this diarizer tells at most 4"),
                                              (-1, "max_speaker_count -1")])  # fmt: skip
def test_riva_bad_max_speaker_count_is_invalid_argument(server, conversation, speakers, reason):
    asr = riva_service(server)
    try:
        with pytest.raises(grpc.RpcError) as e:
            riva_stream(asr, conversation, speakers)
        with pytest.raises(grpc.RpcError) as offline:
            asr.offline_recognize(conversation.read_bytes(), riva_config(conversation, speakers))
    finally:
        asr.auth.channel.close()
    for error in (e.value, offline.value):
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and reason in error.details(), error.details()
    server.assert_no_leak()


def test_riva_diarization_on_a_server_without_a_diarizer_is_refused(conversation):
    grpc_port = free_port()
    with start_server("--grpc-port", str(grpc_port), "--num-slots", "1") as s:
        s.grpc_port = grpc_port
        asr = riva_service(s)
        try:
            with pytest.raises(grpc.RpcError) as e:
                riva_stream(asr, conversation, 2)
            plain = [r for r in riva_stream(asr, conversation, None) if r.is_final]  # the server goes on
        finally:
            asr.auth.channel.close()
        s.assert_no_leak()
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "no diarizer loaded" in e.value.details()
    assert plain and all(w.speaker_tag == 0 for r in plain for w in r.alternatives[0].words)


def test_riva_split_on_speaker_change_in_custom_configuration(server, conversation):
    """custom_configuration split_on_speaker_change:true: every final one speaker's, the text that
    of the call without it, the finals /ws's with the option; a bad value, or the option without
    diarization, refused before any audio."""
    asr = riva_service(server)
    try:
        split = [r for r in riva_stream(asr, conversation, MAX_SPEAKERS, custom="split_on_speaker_change:true")
                 if r.is_final]  # fmt: skip
        whole = [r for r in riva_stream(asr, conversation, MAX_SPEAKERS) if r.is_final]
        refused = []
        for speakers, custom in [(MAX_SPEAKERS, "split_on_speaker_change:maybe"), (None, "split_on_speaker_change:true")]:
            with pytest.raises(grpc.RpcError) as e:
                riva_stream(asr, conversation, speakers, custom=custom)
            refused.append(e.value)
    finally:
        asr.auth.channel.close()
    reference = ws_diarized_finals(server, conversation, MAX_SPEAKERS, split=True)
    server.assert_no_leak()
    assert len(split) > len(whole) and all(len(set(tags)) == 1 for tags in tags_of(split)), tags_of(split)
    # the same text: a cut may fall inside a word (a speaker change between two of its tokens)
    assert "".join(r.alternatives[0].transcript for r in split).replace(" ", "") == \
        "".join(r.alternatives[0].transcript for r in whole).replace(" ", "")
    assert [r.alternatives[0].transcript.strip() for r in split] == [f["text"].strip() for f in reference]
    assert all(e.code() == grpc.StatusCode.INVALID_ARGUMENT for e in refused)
    assert "split_on_speaker_change='maybe': use true or false" in refused[0].details()
    assert "needs diarization_config.enable_speaker_diarization" in refused[1].details()


# ---------------------------------------------------------------------------------------- file API
def sdk(server):
    return openai.OpenAI(api_key=TOKEN, base_url=f"{server.http_url}/v1", max_retries=0)


def speaker_runs(ws_finals: list[dict]) -> list[tuple[str, str, float, float]]:
    """/ws's words cut where the speaker changes, within each final: (label, text, start, end),
    OpenAI's letters for the 0-based speakers."""
    runs = []
    for f in ws_finals:
        previous = None
        for w in f["words"]:
            if w["speaker"] == previous:
                label, text, start, _ = runs[-1]
                runs[-1] = (label, f"{text} {w['word']}", start, w["end"])
            else:
                runs.append(("ABCDEFGH"[w["speaker"]], w["word"], w["start"], w["end"]))
            previous = w["speaker"]
    return runs


def test_file_diarized_json_segments_are_ws_speaker_runs_and_text_a_plain_request(server, conversation):
    client = sdk(server)
    with open(conversation, "rb") as f:
        diarized = client.audio.transcriptions.create(file=f, model="gpt-4o-transcribe-diarize",
                                                      response_format="diarized_json", chunking_strategy="auto")  # fmt: skip
    with open(conversation, "rb") as f:
        plain = client.audio.transcriptions.create(file=f, model="any", response_format="verbose_json")
    reference = ws_diarized_finals(server, conversation, 4)  # all the diarizer's speakers, as the file API asks
    server.assert_no_leak()
    assert type(diarized).__name__ == "TranscriptionDiarized"  # the SDK parsed OpenAI's diarized shape
    expected = speaker_runs(reference)
    assert len({label for label, *_ in expected}) > 1 and len(expected) > 2, expected
    assert [(s.speaker, s.text, s.start, s.end) for s in diarized.segments] == expected
    assert all(s.type == "transcript.text.segment" for s in diarized.segments)
    assert len({s.id for s in diarized.segments}) == len(diarized.segments)
    assert diarized.text == plain.text and diarized.duration == plain.duration and diarized.task == "transcribe"
    assert " ".join(s.text for s in diarized.segments).split() == [w.word for w in plain.words]
    assert diarized.usage.type == "duration" and diarized.usage.seconds == plain.usage.seconds


def test_file_diarized_json_refused_without_a_diarizer_and_known_speakers_refused(server, shared_server, conversation):
    with open(conversation, "rb") as f, pytest.raises(openai.BadRequestError, match="no diarizer loaded") as e:
        sdk(shared_server).audio.transcriptions.create(file=f, model="any", response_format="diarized_json")
    assert e.value.body["param"] == "response_format"
    with open(conversation, "rb") as f, pytest.raises(openai.BadRequestError, match="known_speaker_names.* is not supported"):
        sdk(server).audio.transcriptions.create(file=f, model="any", response_format="diarized_json",
                                                known_speaker_names=["agent"],
                                                known_speaker_references=["data:audio/wav;base64,UklGRg=="])  # fmt: skip
    shared_server.assert_no_leak()
    server.assert_no_leak()


def test_deepgram_listen_diarize_gives_ws_speakers_per_word_and_utterance(server, conversation):
    """POST /v1/listen?diarize=true (deepgram-sdk, deepgram_prerecorded.py): each word's `speaker`
    is /ws's (0-based, as Deepgram numbers them), each utterance one speaker's run within an engine
    segment; the transcript is a plain request's."""
    from deepgram import DeepgramClient
    from deepgram.environment import DeepgramClientEnvironment

    base = server.http_url
    env = DeepgramClientEnvironment(base=base, production=base, agent=base, agent_rest=base)
    media = DeepgramClient(api_key=TOKEN, environment=env).listen.v1.media
    got = media.transcribe_file(request=conversation.read_bytes(), diarize=True, utterances=True)
    plain = media.transcribe_file(request=conversation.read_bytes())
    reference = ws_diarized_finals(server, conversation, 4)  # all the diarizer's speakers, as the route asks
    server.assert_no_leak()
    alt = got.results.channels[0].alternatives[0]
    assert [w.speaker for w in alt.words] == [w["speaker"] for f in reference for w in f["words"]]
    runs = [("ABCDEFGH"[u.speaker], u.transcript, u.start, u.end) for u in got.results.utterances]
    assert runs == speaker_runs(reference) and len({u.speaker for u in got.results.utterances}) > 1, runs
    assert alt.transcript == plain.results.channels[0].alternatives[0].transcript


def test_file_max_speakers_and_split_on_speaker_change_through_extra_body(server, conversation):
    """nemo-serve's two diarization fields, sent as OpenAI's SDK sends extra fields (extra_body):
    max_speakers 1 puts every word on speaker A; split_on_speaker_change cuts verbose_json segments
    where /ws's finals with the option end; bad values are refused (400) before any decoding."""
    client = sdk(server)
    with open(conversation, "rb") as f:
        one = client.audio.transcriptions.create(file=f, model="any", response_format="diarized_json",
                                                 extra_body={"max_speakers": 1})  # fmt: skip
    with open(conversation, "rb") as f:
        split = client.audio.transcriptions.create(file=f, model="any", response_format="verbose_json",
                                                   extra_body={"split_on_speaker_change": True, "max_speakers": 2})  # fmt: skip
    bad = [({"max_speakers": 5}, "diarized_json", "max_speakers '5': use a whole number from 1 to 4"),
           ({"max_speakers": 2}, "json", "max_speakers needs response_format diarized_json"),
           ({"split_on_speaker_change": "maybe"}, "json", "split_on_speaker_change 'maybe': use true or false")]
    for extra, response_format, said in bad:
        with open(conversation, "rb") as f, pytest.raises(openai.BadRequestError, match=said):
            client.audio.transcriptions.create(file=f, model="any", response_format=response_format, extra_body=extra)
    one_reference = ws_diarized_finals(server, conversation, 1)
    split_reference = ws_diarized_finals(server, conversation, 2, split=True)
    server.assert_no_leak()
    assert [(s.speaker, s.text, s.start, s.end) for s in one.segments] == speaker_runs(one_reference)
    assert {s.speaker for s in one.segments} == {"A"}
    assert len(split_reference) > len(ws_diarized_finals(server, conversation, 2))  # the option split finals
    assert [s.text.strip() for s in split.segments] == [f["text"].strip() for f in split_reference]


# ---------------------------------------------------------------------------------------- realtime
def realtime_events(server, wire: np.ndarray, model: str, until_close: bool = False, **speaker_fields) -> list:
    """The SDK's GA transcription flow at 24 kHz, no turn detection: append all, commit, until
    completed; `until_close`: then input_audio_buffer.done, every event until the server closes
    (1000, after the last item). `speaker_fields`: more transcription settings (max_speakers, ...)."""

    async def run() -> list:
        client = openai.AsyncOpenAI(api_key=TOKEN, base_url=f"{server.http_url}/v1")
        events = []
        async with client.realtime.connect(model="nemotron", extra_query={"intent": "transcription"}) as conn:
            await conn.session.update(session={"type": "transcription", "audio": {"input": {
                "format": {"type": "audio/pcm", "rate": 24000}, "transcription": {"model": model, **speaker_fields},
                "turn_detection": None}}})  # fmt: skip
            for i in range(0, len(wire), 2400):
                await conn.input_audio_buffer.append(audio=base64.b64encode(wire[i : i + 2400].tobytes()).decode())
            await conn.input_audio_buffer.commit()
            if until_close:
                await conn.send({"type": "input_audio_buffer.done"})
            async for ev in conn:  # the SDK's iteration ends at a normal close
                events.append(ev)
                if not until_close and ev.type in ("conversation.item.input_audio_transcription.completed", "error"):
                    break
        return events

    return asyncio.run(run())


def test_realtime_diarizing_model_gives_segment_events_of_ws_speakers(server, conversation):
    samples, rate = soundfile.read(conversation, dtype="float32")
    wire = np.clip(np.round(soxr.resample(samples, rate, 24000, quality="HQ") * 32768.0), -32768, 32767).astype("<i2")
    diarized = realtime_events(server, wire, "gpt-4o-transcribe-diarize")
    plain = realtime_events(server, wire, "gpt-4o-transcribe")
    reference = ws_diarized_finals(server, conversation, 4, wire, 24000, endpointing={"enabled": False})
    server.assert_no_leak()
    segments = [e for e in diarized if e.type == "conversation.item.input_audio_transcription.segment"]
    completed, plain_completed = diarized[-1], plain[-1]
    assert completed.type == plain_completed.type == "conversation.item.input_audio_transcription.completed"
    assert all(type(e).__name__ == "ConversationItemInputAudioTranscriptionSegment" for e in segments)
    expected = speaker_runs(reference)
    assert len({label for label, *_ in expected}) > 1, expected
    assert [(e.speaker, e.text, e.start, e.end) for e in segments] == expected
    assert all(e.item_id == completed.item_id and e.content_index == 0 for e in segments)
    assert completed.transcript == plain_completed.transcript
    assert not {"speaker", "speakers"} & set(completed.model_extra), completed.model_extra  # docs: completed gets none
    assert " ".join(e.text for e in segments) == " ".join(completed.transcript.split())  # words: runs of spaces collapsed
    assert completed.model_extra["nemo_serve"]["token_ids"] == plain_completed.model_extra["nemo_serve"]["token_ids"]
    assert not any(e.type.endswith(".segment") for e in plain)


def test_realtime_diarizing_model_refused_without_a_diarizer(shared_server):
    events = realtime_events(shared_server, np.zeros(2400, "<i2"), "gpt-4o-transcribe-diarize")
    errors = [e for e in events if e.type == "error"]
    assert errors and "no diarizer loaded" in errors[0].error.message and errors[0].error.param == "transcription.model"
    assert errors[0].error.code == "model_not_found", errors[0]  # docs/protocol.md names the code
    shared_server.assert_no_leak()


def wire_of(conversation: Path) -> np.ndarray:
    """The conversation as OpenAI's GA audio/pcm: PCM16 at 24 kHz."""
    samples, rate = soundfile.read(conversation, dtype="float32")
    return np.clip(np.round(soxr.resample(samples, rate, 24000, quality="HQ") * 32768.0), -32768, 32767).astype("<i2")


def segment_tuples(events: list) -> list[tuple[str, str, float, float]]:
    return [(e.speaker, e.text, e.start, e.end) for e in events if e.type == SEGMENT]


SEGMENT = "conversation.item.input_audio_transcription.segment"
COMPLETED = "conversation.item.input_audio_transcription.completed"


def test_realtime_max_speakers_one_puts_every_segment_on_speaker_a(server, conversation):
    """transcription.max_speakers, carried to the item's engine stream: /ws's speakers with the
    same max_speakers, so one speaker, "A", on every segment."""
    wire = wire_of(conversation)
    one = realtime_events(server, wire, "gpt-4o-transcribe-diarize", max_speakers=1)
    reference = ws_diarized_finals(server, conversation, 1, wire, 24000, endpointing={"enabled": False})
    server.assert_no_leak()
    assert not [e for e in one if e.type == "error"], one
    updated = next(e for e in one if e.type == "session.updated")
    assert updated.session.audio.input.transcription.model_extra["max_speakers"] == 1  # echoed
    assert segment_tuples(one) == speaker_runs(reference)
    assert {e.speaker for e in one if e.type == SEGMENT} == {"A"} and one[-1].type == COMPLETED


def test_realtime_split_on_speaker_change_gives_one_speaker_per_item(server, conversation):
    """transcription.split_on_speaker_change: a speaker change ends the engine segment, so the item:
    more items than the one commit makes without it, each holding the segment of one speaker, and
    those are /ws's finals with the option (text, speaker and times)."""
    wire = wire_of(conversation)
    split = realtime_events(server, wire, "gpt-4o-transcribe-diarize", until_close=True, max_speakers=2,
                            split_on_speaker_change=True)  # fmt: skip
    plain = realtime_events(server, wire, "gpt-4o-transcribe-diarize", until_close=True, max_speakers=2)
    reference = ws_diarized_finals(server, conversation, 2, wire, 24000, endpointing={"enabled": False}, split=True)
    server.assert_no_leak()
    assert not [e for e in split + plain if e.type == "error"]
    echoed = next(e for e in split if e.type == "session.updated").session.audio.input.transcription.model_extra
    assert echoed["split_on_speaker_change"] is True and echoed["max_speakers"] == 2, echoed  # docs: echoed
    completed = [e for e in split if e.type == COMPLETED and e.transcript.strip()]
    assert len(completed) == len(reference) > len([e for e in plain if e.type == COMPLETED and e.transcript.strip()])
    for item in completed:
        speakers = [e.speaker for e in split if e.type == SEGMENT and e.item_id == item.item_id]
        assert len(speakers) == 1, (item.transcript, speakers)
    assert [(s, t) for s, t, *_ in segment_tuples(split)] == [
        ("ABCD"[f["speaker"]], " ".join(w["word"] for w in f["words"])) for f in reference]
    def letters(events):  # a cut may fall inside a word (speakers are per token): compare without spaces
        return "".join("".join(e.transcript.split()) for e in events if e.type == COMPLETED)

    assert letters(split) == letters(plain)  # the same text, only cut


@pytest.mark.parametrize("fields, model, param, said", [
    ({"max_speakers": 5}, DIARIZE, "max_speakers", "max_speakers must be an integer from 1 to 4"),
    ({"max_speakers": 0}, DIARIZE, "max_speakers", "max_speakers must be an integer from 1 to 4"),
    ({"max_speakers": "2"}, DIARIZE, "max_speakers", "max_speakers must be an integer"),
    ({"max_speakers": True}, DIARIZE, "max_speakers", "max_speakers must be an integer"),
    ({"split_on_speaker_change": "maybe"}, DIARIZE, "split_on_speaker_change", "must be true or false"),
    ({"max_speakers": 2}, "gpt-4o-transcribe", "max_speakers", "needs transcription model gpt-4o-transcribe-diarize"),
    ({"split_on_speaker_change": True}, None, "split_on_speaker_change", "needs transcription model"),
])  # fmt: skip
def test_realtime_bad_speaker_fields_are_refused_and_change_nothing(server, fields, model, param, said):
    """A refused update is an `error` naming the field; the session goes on, unchanged (the
    update's other fields, here its rate and language, not applied), in both dialects."""
    errors, sessions = asyncio.run(refused_updates(server, {"model": model, "language": "en", **fields}))
    for error in errors:
        assert error.type == "error" and said in error.error.message and error.error.param == f"transcription.{param}"
    (created, ga), (beta_created, beta) = sessions
    assert created.type == "session.created" and ga.type == "session.updated"
    assert ga.session.audio.input == created.session.audio.input and ga.session.audio.input.format.rate == 24000
    assert beta_created["type"] == "session.created" and beta["type"] == "transcription_session.updated"
    assert beta["session"]["input_audio_transcription"] == beta_created["session"]["audio"]["input"]["transcription"]
    server.assert_no_leak()


def test_realtime_speaker_fields_refused_without_a_diarizer(shared_server):
    errors, _ = asyncio.run(refused_updates(shared_server, {"model": "gpt-4o-transcribe", "max_speakers": 1}))
    assert all("no diarizer loaded" in e.error.message and e.error.param == "transcription.max_speakers" for e in errors)
    shared_server.assert_no_leak()


async def refused_updates(server, transcription: dict) -> tuple[list, tuple]:
    """`transcription` in a GA session.update (with rate 16000) and a beta
    transcription_session.update, each on its own session, each followed by an empty update:
    the errors and each session's (created, updated) events (the beta ones as JSON: the SDK
    parses GA events)."""
    client = openai.AsyncOpenAI(api_key=TOKEN, base_url=f"{server.http_url}/v1")
    async with client.realtime.connect(model="nemotron", extra_query={"intent": "transcription"}) as conn:
        await conn.session.update(session={"type": "transcription", "audio": {"input": {
            "format": {"type": "audio/pcm", "rate": 16000}, "transcription": transcription}}})  # fmt: skip
        await conn.session.update(session={"type": "transcription"})
        ga_events = [ev async for ev in _until(conn, "session.updated")]
    beta_events = await beta_updates(server, [{"input_audio_transcription": transcription}, {}])
    errors = [e for e in ga_events if e.type == "error"]
    beta_errors = [e for e in beta_events if e["type"] == "error"]
    assert len(errors) == len(beta_errors) == 1, (ga_events, beta_events)
    assert beta_errors[0]["error"]["param"] == errors[0].error.param and beta_errors[0]["error"]["message"] == errors[0].error.message
    return errors, ((ga_events[0], ga_events[-1]), (beta_events[0], beta_events[-1]))


async def _until(conn, kind: str):
    async for ev in conn:
        yield ev
        if ev.type == kind:
            return


async def beta_updates(server, sessions: list[dict]) -> list[dict]:
    """A raw client's transcription_session.update for each of `sessions`: every event until the
    last one's transcription_session.updated."""
    from websockets.asyncio.client import connect

    url = f"ws://127.0.0.1:{server.port}/v1/realtime?intent=transcription"
    events = []
    async with connect(url, additional_headers={"Authorization": f"Bearer {TOKEN}"}) as ws, asyncio.timeout(30):
        for session in sessions:
            await ws.send(json.dumps({"type": "transcription_session.update", "session": session}))
        async for m in ws:
            events.append(json.loads(m))
            if events[-1]["type"] == "transcription_session.updated":
                return events
    return events
