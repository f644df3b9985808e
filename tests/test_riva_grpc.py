"""Riva ASR over gRPC (--grpc-port) with NVIDIA's own client library, `riva.client`, unchanged.

The real server is started with --grpc-port; each test speaks to it with riva.client's Auth,
ASRService.streaming_response_generator over AudioChunkFileIterator (which sends the WAV file as
it is, header included) and offline_recognize, and compares the transcripts with /ws's for the
same samples.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
import soundfile

from nemo_serve.client import StreamingClient

from .helpers_server import TOKEN, free_port, start_server
from .helpers_riva import RIVA_NUM_SLOTS, UTTERANCES, ws_finals, ws_finals_of, ws_text

riva = pytest.importorskip("riva.client")
from riva.client.proto import riva_asr_pb2 as rasr  # noqa: E402

CHUNK_FRAMES = 1600  # transcribe_file.py's default --file-streaming-chunk
NUM_SLOTS = RIVA_NUM_SLOTS


@pytest.fixture(scope="module")
def server(riva_server):
    """The Riva files' shared server (helpers_riva.py): with --fast-grpc-port too where hpack is
    installed (the fast door's tests at the end), --idle-timeout-s 3, every trained mode."""
    return riva_server


@pytest.fixture
def asr(server):
    service = riva.ASRService(riva.Auth(uri=f"127.0.0.1:{server.grpc_port}", metadata_args=[["authorization", f"Bearer {TOKEN}"]]))
    yield service
    service.auth.channel.close()
    server.assert_no_leak()


def streaming_config(wav: Path, interim: bool = True, words: bool = True, model: str = "", stop_history_ms: int = 0,
                     contexts: tuple[tuple[list[str], float], ...] = ()):  # fmt: skip
    """`contexts`: (phrases, boost) pairs, each added as riva.client's word boosting adds one."""
    config = riva.StreamingRecognitionConfig(
        config=riva.RecognitionConfig(
            encoding=riva.AudioEncoding.LINEAR_PCM, language_code="en-US", max_alternatives=1,
            enable_word_time_offsets=words, model=model,
        ),
        interim_results=interim,
    )  # fmt: skip
    riva.add_audio_file_specs_to_config(config, wav)
    riva.add_endpoint_parameters_to_config(config, 0, 0, stop_history_ms, 0, 0, 0)
    for phrases, boost in contexts:
        riva.add_word_boosting_to_config(config, phrases, boost)
    return config


def stream(asr, wav: Path, **options) -> list:
    with riva.AudioChunkFileIterator(str(wav), CHUNK_FRAMES) as chunks:
        return [r for response in asr.streaming_response_generator(chunks, streaming_config(wav, **options))
                for r in response.results]  # fmt: skip


def words_ms(ws_final: dict) -> list[tuple[str, int, int]]:
    return [(w["word"], round(w["start"] * 1000), round(w["end"] * 1000)) for w in ws_final["words"]]


def test_streaming_recognize_matches_ws_on_every_utterance(server, asr):
    for wav in UTTERANCES:
        results = stream(asr, wav)
        finals = [r for r in results if r.is_final]
        reference = ws_finals(server, wav)
        assert [r.alternatives[0].transcript for r in finals] == [f["text"] for f in reference], wav.name
        assert [[(w.word, w.start_time, w.end_time) for w in r.alternatives[0].words] for r in finals] == [
            words_ms(f) for f in reference
        ], wav.name
        assert all(r.channel_tag == 1 and len(r.alternatives) == 1 for r in results)
        # Without --word-confidence a final's confidence, and each word's, is 1.0 (protocol.md, Results)
        assert all(r.alternatives[0].confidence == 1.0 for r in finals), wav.name
        assert all(w.confidence == 1.0 for r in finals for w in r.alternatives[0].words), wav.name
        processed = [r.audio_processed for r in results]
        assert processed == sorted(processed) and processed[-1] == pytest.approx(reference[-1]["audio_processed"], abs=1e-3)


def test_calls_are_counted_in_the_metrics(server, asr):
    wav = UTTERANCES[6]
    series = ("nemo_serve_streams_total", 'nemo_serve_final_latency_seconds_count{context_right="13"}',
              "nemo_serve_audio_seconds_total")  # fmt: skip
    before = [server.metric(m) for m in series]
    finals = [r for r in stream(asr, wav) if r.is_final]
    after = [server.metric(m) for m in series]
    assert after[0] == before[0] + 1
    assert after[1] == before[1] + len(finals)
    assert after[2] - before[2] == pytest.approx(finals[-1].audio_processed, abs=0.01)


def test_interim_results_grow_into_the_final_and_are_off_when_not_asked(server, asr):
    wav = UTTERANCES[3]
    results = stream(asr, wav)
    first_final = next(i for i, r in enumerate(results) if r.is_final)
    interim = results[:first_final]
    assert interim, "a 4 s utterance at 1120 ms chunks has partials before its first final"
    assert all(r.stability == 1.0 and not r.alternatives[0].words for r in interim)
    final = results[first_final].alternatives[0].transcript
    assert all(final.startswith(r.alternatives[0].transcript) for r in interim)  # partials only grow
    quiet = stream(asr, wav, interim=False, words=False)
    assert quiet and all(r.is_final and not r.alternatives[0].words for r in quiet)
    assert [r.alternatives[0].transcript for r in quiet] == [r.alternatives[0].transcript for r in results if r.is_final]


def test_offline_recognize_matches_ws(server, asr):
    for wav in UTTERANCES[:8]:
        config = riva.RecognitionConfig(encoding=riva.AudioEncoding.LINEAR_PCM, language_code="en-US",
                                        enable_word_time_offsets=True)  # fmt: skip
        riva.add_audio_file_specs_to_config(config, wav)
        response = asr.offline_recognize(wav.read_bytes(), config)  # the whole file, header included
        reference = ws_finals(server, wav)
        assert [r.alternatives[0].transcript for r in response.results] == [f["text"] for f in reference], wav.name
        assert [[(w.word, w.start_time, w.end_time) for w in r.alternatives[0].words] for r in response.results] == [
            words_ms(f) for f in reference
        ]


def test_headerless_pcm_at_another_rate_is_resampled_as_ws_does(server, asr):
    """Raw PCM16 at 8 kHz (no WAV header) as audio_content: /ws's resampler, /ws's text."""
    wav = UTTERANCES[5]
    audio, rate = soundfile.read(wav, dtype="float32")
    import soxr

    pcm8k = np.clip(np.round(soxr.resample(audio, rate, 8000, quality="HQ") * 32768), -32768, 32767).astype("<i2")
    config = riva.StreamingRecognitionConfig(
        config=riva.RecognitionConfig(encoding=riva.AudioEncoding.LINEAR_PCM, sample_rate_hertz=8000, language_code="en-US"),
        interim_results=False,
    )
    chunks = [pcm8k[i : i + 800].tobytes() for i in range(0, len(pcm8k), 800)]
    finals = [r.alternatives[0].transcript for resp in asr.streaming_response_generator(chunks, config) for r in resp.results]

    async def reference() -> list[str]:
        async with StreamingClient(server.ws_url, sample_rate=8000, encoding="pcm_s16le", token=TOKEN) as c:
            for chunk in chunks:
                await c.send_audio(np.frombuffer(chunk, dtype="<i2"))
            await c.end()
            return [m["text"] async for m in c.messages() if m["type"] == "final" and m["text"]]

    assert finals == asyncio.run(reference())


def test_config_lists_modes_and_a_mode_is_chosen_by_model_name(server, asr):
    response = asr.stub.GetRivaSpeechRecognitionConfig(rasr.RivaSpeechRecognitionConfigRequest(),
                                                       metadata=asr.auth.get_auth_metadata())  # fmt: skip
    modes = {c.parameters["mode_model_name"]: int(c.parameters["context_right"]) for c in response.model_config}
    readyz = server.readyz()
    assert sorted(modes.values()) == sorted(m["context_right"] for m in readyz["modes"])
    assert response.model_config[0].model_name == readyz["model"]
    assert all(c.parameters["sample_rate"] == "16000" for c in response.model_config)
    name_80ms = next(name for name, r in modes.items() if r == 0)
    wav = UTTERANCES[7]
    results = stream(asr, wav, model=name_80ms)
    assert [r.alternatives[0].transcript for r in results if r.is_final] == [f["text"] for f in ws_finals(server, wav, 0)]
    with pytest.raises(grpc.RpcError) as e:
        stream(asr, wav, model="no-such-model")
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and name_80ms in e.value.details()


def test_endpointing_stop_history_is_rule2(server, asr):
    """stop_history (ms of trailing silence after speech) closes segments as /ws's rule 2 does."""
    for wav in UTTERANCES[:6]:
        finals = [r.alternatives[0].transcript for r in stream(asr, wav, stop_history_ms=160) if r.is_final]
        reference = ws_finals(server, wav, endpointing={"rule2_min_trailing_silence_s": 0.16})
        assert finals == [f["text"] for f in reference], wav.name
    many = sum(len([r for r in stream(asr, w, stop_history_ms=160) if r.is_final]) for w in UTTERANCES[:6])
    few = sum(len([r for r in stream(asr, w) if r.is_final]) for w in UTTERANCES[:6])
    assert many > few, "a 160 ms stop_history splits where the default 1.2 s does not"


def finals_text(results) -> list[str]:
    return [r.alternatives[0].transcript for r in results if r.is_final]


def test_speech_contexts_boost_as_ws_phrases(server, asr):
    """riva.client's word boosting (SpeechContext phrases + boost) is /ws's `phrases` / `boost`:
    the same transcript as /ws with the same list, and not the unboosted one (the test model is
    random, so two words of its own output, boosted, change what it writes)."""
    phrases = [" ".join(ws_text(server, w)[0].split()[:2]) for w in UTTERANCES[10:12]]
    changed = 0
    for wav in UTTERANCES[:3]:
        boosted = finals_text(stream(asr, wav, contexts=((phrases, 3.0),)))
        assert boosted == ws_text(server, wav, phrases=phrases, boost=3.0), wav.name
        changed += boosted != ws_text(server, wav)
    assert changed, "the boost reached the decoder"
    wav = UTTERANCES[0]  # two contexts of one boost merge; boost 0 (proto3's unset) is the default, 1
    split = finals_text(stream(asr, wav, contexts=(([phrases[0]], 3.0), ([phrases[1]], 3.0))))
    assert split == ws_text(server, wav, phrases=phrases, boost=3.0)
    assert finals_text(stream(asr, wav, contexts=((phrases, 0.0),))) == ws_text(server, wav, phrases=phrases)


def test_bad_speech_contexts_end_only_their_call(server, asr):
    """Refused before any audio with INVALID_ARGUMENT and /ws's reason, in StreamingRecognize and
    Recognize, while another call streams on to its /ws transcript."""
    wav = UTTERANCES[2]
    good = {}
    slow = threading.Thread(target=lambda: good.setdefault("finals", finals_text(
        r for resp in asr.streaming_response_generator(
            riva.AudioChunkFileIterator(str(wav), 1600, riva.sleep_audio_length), streaming_config(wav))
        for r in resp.results)))  # fmt: skip
    slow.start()
    cases = {
        "phrase 0 is empty": (([" "], 2.0),),
        "cannot spell": ((["\u4e2d\u6587"], 2.0),),
        "at most 100 per stream": (([f"w{i}" for i in range(101)], 2.0),),
        "at most 64": ((["a" * 65], 2.0),),
        "boost must be a number in (0, 10]": ((["a"], 20.0),),  # Riva's samples use 4 to 20
        "boost must be": ((["a"], -5.0),),  # Riva's negative boost (suppress a word): not served
        "different boosts (2, 4)": ((["a"], 2.0), (["b"], 4.0)),
    }
    for needle, contexts in cases.items():
        with pytest.raises(grpc.RpcError) as e:
            list(asr.streaming_response_generator([b"\0\0" * 160], streaming_config(wav, contexts=contexts)))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, needle
        assert needle in e.value.details() and "speech_contexts" in e.value.details(), e.value.details()
    config = riva.RecognitionConfig(encoding=riva.AudioEncoding.LINEAR_PCM, language_code="en-US")
    riva.add_word_boosting_to_config(config, [""], 2.0)
    with pytest.raises(grpc.RpcError) as e:
        asr.offline_recognize(wav.read_bytes(), config)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "phrase 0 is empty" in e.value.details()
    slow.join(30)
    assert good["finals"] == ws_text(server, wav)


def test_token_is_required(server):
    wav = UTTERANCES[0]
    for metadata in (None, [["authorization", "Bearer wrong"]]):
        service = riva.ASRService(riva.Auth(uri=f"127.0.0.1:{server.grpc_port}", metadata_args=metadata))
        with pytest.raises(grpc.RpcError) as e:
            stream(service, wav)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        service.auth.channel.close()


def test_malformed_requests_end_only_their_call(server, asr):
    wav = UTTERANCES[2]
    good = {}
    slow = threading.Thread(target=lambda: good.setdefault("finals", [
        r.alternatives[0].transcript for resp in asr.streaming_response_generator(
            riva.AudioChunkFileIterator(str(wav), 1600, riva.sleep_audio_length), streaming_config(wav))
        for r in resp.results if r.is_final]))  # fmt: skip
    slow.start()
    bad_configs = {
        "encoding": riva.RecognitionConfig(encoding=riva.AudioEncoding.FLAC),
        "sample_rate_hertz": riva.RecognitionConfig(encoding=riva.AudioEncoding.LINEAR_PCM, sample_rate_hertz=1000),
        "audio_channel_count": riva.RecognitionConfig(encoding=riva.AudioEncoding.LINEAR_PCM, audio_channel_count=2),
    }
    for field, config in bad_configs.items():
        with pytest.raises(grpc.RpcError) as e:
            list(asr.streaming_response_generator([b"\0\0" * 160], riva.StreamingRecognitionConfig(config=config)))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.details()
    requests = [rasr.StreamingRecognizeRequest(audio_content=b"\0\0" * 160)]  # audio before any config
    with pytest.raises(grpc.RpcError) as e:
        list(asr.stub.StreamingRecognize(iter(requests), metadata=asr.auth.get_auth_metadata()))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "streaming_config" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:  # odd byte count: not whole 16-bit samples
        list(asr.streaming_response_generator([b"\0" * 321], streaming_config(wav, interim=False)))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "2-byte samples" in e.value.details()
    slow.join(30)
    assert good["finals"] == [f["text"] for f in ws_finals(server, wav)]


def test_no_free_slot_is_resource_exhausted(server, asr):
    """NUM_SLOTS streams hold every slot; the next call is refused with /ws's reason, and counted."""
    release = threading.Event()
    wav = UTTERANCES[1]

    def held_audio():
        yield b"\0\0" * 1600
        release.wait(20)

    def hold(out: list) -> None:
        config = streaming_config(wav, interim=False)
        out.extend(asr.streaming_response_generator(held_audio(), config))

    holders = [threading.Thread(target=hold, args=([],)) for _ in range(NUM_SLOTS)]
    before = server.metric('nemo_serve_refusals_total{reason="no_free_slot"}')
    for t in holders:
        t.start()
    deadline = time.monotonic() + 10
    while server.readyz()["free_slots"] and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        with pytest.raises(grpc.RpcError) as e:
            stream(asr, wav)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "no free slot" in e.value.details()
        assert server.metric('nemo_serve_refusals_total{reason="no_free_slot"}') == before + 1
    finally:
        release.set()
        for t in holders:
            t.join(20)


def test_a_silent_call_ends_at_the_idle_timeout_and_gives_its_slot_back(server, asr):
    """--idle-timeout-s 3 (the fixture): config and one packet, then nothing; the call's input
    clock (riva_grpc.InputClock) ends it with /ws's reason, and its slot comes back."""
    release = threading.Event()
    wav = UTTERANCES[1]

    def silent_audio():
        yield b"\0\0" * 1600
        release.wait(20)

    t0 = time.monotonic()
    try:
        with pytest.raises(grpc.RpcError) as e:
            list(asr.streaming_response_generator(silent_audio(), streaming_config(wav, interim=False)))
    finally:
        release.set()
    assert "idle timeout" in e.value.details(), e.value.details()
    assert 2.5 < time.monotonic() - t0 < 15


def check_calls_per_address_limit(service, wav: Path, limit: int) -> None:
    """`limit` calls from this address are open (slots to spare): the next is refused."""
    release = threading.Event()

    def held_audio():
        yield b"\0\0" * 1600
        release.wait(20)

    holders = [threading.Thread(target=lambda: list(service.streaming_response_generator(
        held_audio(), streaming_config(wav, interim=False)))) for _ in range(limit)]  # fmt: skip
    for t in holders:
        t.start()
    time.sleep(1.0)
    try:
        with pytest.raises(grpc.RpcError) as e:
            stream(service, wav)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "from your address" in e.value.details()
    finally:
        release.set()
        for t in holders:
            t.join(20)


@pytest.mark.parametrize("door", ["--grpc-port", "--fast-grpc-port"])
def test_tls_calls_per_address_and_drain(door):
    """A server of its own (SIGTERM ends it), over TLS with the server's certificate;
    --max-connections-per-ip bounds calls (one front end: its share is the whole limit); SIGTERM
    mid-stream: the call still gets the finals of all the audio it sent, equal to /ws's, and ends
    with OK; a call that starts during the drain is refused with UNAVAILABLE; the server exits 0.
    On each door: grpc.aio's, and our own HTTP/2's (server/fast_grpc.py)."""
    if door == "--fast-grpc-port":
        pytest.importorskip("hpack")
    grpc_port = free_port()
    with start_server(door, str(grpc_port), "--num-slots", "3", "--drain-timeout-s", "20", "--frontends", "1",
                      "--max-connections-per-ip", "2", tls=True) as s:  # fmt: skip
        if s.cafile is None:
            pytest.skip("no openssl to make a certificate")
        service = riva.ASRService(riva.Auth(ssl_root_cert=str(s.cafile), uri=f"127.0.0.1:{grpc_port}",
                                            metadata_args=[["authorization", f"Bearer {TOKEN}"]]))  # fmt: skip
        wav = UTTERANCES[4]
        assert [r.alternatives[0].transcript for r in stream(service, wav) if r.is_final] == [
            f["text"] for f in ws_finals(s, wav)
        ]
        check_calls_per_address_limit(service, wav, limit=2)
        started, release = threading.Event(), threading.Event()
        audio = wav.read_bytes()
        header, pcm = audio[:44], audio[44:44 + 32000]  # 1 s: the drain ends the input here
        samples, rate = soundfile.read(wav, dtype="int16", frames=len(pcm) // 2)
        expected = [f["text"] for f in ws_finals_of(s, samples, rate)]
        assert expected, "1 s of the utterance has text: the drain's final is not empty"

        def paced():
            yield header
            for i in range(0, len(pcm), 3200):
                yield pcm[i : i + 3200]
                time.sleep(0.1)
            started.set()
            release.wait(30)  # input stays open: only the drain can end it

        out: list = []
        errors: list = []

        def run() -> None:
            try:
                out.extend(r for resp in service.streaming_response_generator(paced(), streaming_config(wav))
                           for r in resp.results)  # fmt: skip
            except Exception as e:  # noqa: BLE001 - asserted below: the call must end with OK
                errors.append(e)

        t = threading.Thread(target=run)
        t.start()
        assert started.wait(10)
        time.sleep(0.5)
        s.proc.send_signal(signal.SIGTERM)  # the supervisor, as systemd sends it: it drains each front end
        time.sleep(0.5)
        with pytest.raises(grpc.RpcError) as e:
            stream(service, wav)
        # "server is draining", or, once the drain is over, no listener at all: UNAVAILABLE either way
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        t.join(30)
        release.set()
        assert not t.is_alive() and not errors, errors
        assert [r.alternatives[0].transcript for r in out if r.is_final] == expected  # whole, not cut
        assert s.proc.wait(30) == 0
        service.auth.channel.close()


# ----------------------------------------------------------------------------- --fast-grpc-port


def door_service(server, door: str, token: str | None = TOKEN):
    if server.fast_grpc_port is None:
        pytest.skip("--fast-grpc-port needs hpack")
    metadata = [["authorization", f"Bearer {token}"]] if token else None
    port = server.fast_grpc_port if door == "fast_grpc" else server.grpc_port
    return riva.ASRService(riva.Auth(uri=f"127.0.0.1:{port}", metadata_args=metadata))


def all_results(response_list) -> list[tuple]:
    """Streaming results, or Recognize's (no is_final nor stability: None)."""
    return [(getattr(r, "is_final", None), getattr(r, "stability", None), r.channel_tag, round(r.audio_processed, 4),
             a.transcript, a.confidence, [(w.word, w.start_time, w.end_time) for w in a.words])
            for r in response_list for a in r.alternatives]  # fmt: skip


def test_fast_door_results_equal_grpc_aio(server):
    """--fast-grpc-port (server/fast_grpc.py, our own HTTP/2) through riva.client, unchanged:
    every final equal to grpc.aio's in the same server (text, confidence, word times,
    audio_processed), and every partial the same text as grpc.aio's at the same audio_processed
    (which partials a client gets depends on timing: a partial still queued when the next one
    comes is replaced by it); Recognize and GetRivaSpeechRecognitionConfig too. Seen failing with
    every message cut to its first 60 bytes (grpc_h2.H2Connection.flush): a final went missing."""
    slow, fast = door_service(server, "grpc_aio"), door_service(server, "fast_grpc")
    try:
        for wav in UTTERANCES[:6]:
            expected, got = all_results(stream(slow, wav)), all_results(stream(fast, wav))
            assert expected and any(r[0] for r in expected), wav.name
            assert [r for r in got if r[0]] == [r for r in expected if r[0]], wav.name
            partials = [{r[3]: r for r in results if not r[0]} for results in (expected, got)]
            assert partials[1] and all(partials[0][k] == r for k, r in partials[1].items() if k in partials[0]), wav.name
        for wav in UTTERANCES[6:9]:
            config = riva.RecognitionConfig(encoding=riva.AudioEncoding.LINEAR_PCM, language_code="en-US",
                                            enable_word_time_offsets=True)  # fmt: skip
            riva.add_audio_file_specs_to_config(config, wav)
            expected = all_results(slow.offline_recognize(wav.read_bytes(), config).results)
            assert all_results(fast.offline_recognize(wav.read_bytes(), config).results) == expected, wav.name
        request = rasr.RivaSpeechRecognitionConfigRequest()
        configs = [s.stub.GetRivaSpeechRecognitionConfig(request, metadata=s.auth.get_auth_metadata()) for s in (slow, fast)]
        assert configs[0] == configs[1] and len(configs[0].model_config) >= 2
    finally:
        slow.auth.channel.close()
        fast.auth.channel.close()
    server.assert_no_leak()


def test_fast_door_requires_the_token(server):
    for token in (None, "wrong"):
        s = door_service(server, "fast_grpc", token)
        with pytest.raises(grpc.RpcError) as e:
            stream(s, UTTERANCES[0])
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and "bearer token" in e.value.details()
        s.auth.channel.close()
    server.assert_no_leak()


# ----------------------------------------------------------------------------- units (no server)


def test_wav_header_is_stripped_however_the_messages_split_it():
    from nemo_serve.server.riva_mapping import LeadingWav, RivaRequestError

    wav = UTTERANCES[0].read_bytes()
    samples, rate = soundfile.read(UTTERANCES[0], dtype="int16")
    for size in (1, 7, 44, 45, 3200):
        strip = LeadingWav()
        pcm = b"".join(strip.feed(wav[i : i + size]) for i in range(0, len(wav), size)) + strip.flush()
        assert pcm == samples.tobytes() and strip.sample_rate == rate, size
    raw = samples.tobytes()
    strip = LeadingWav()
    assert strip.feed(raw[:3]) + strip.feed(raw[3:]) + strip.flush() == raw  # no header: untouched
    float_wav = bytearray(wav)
    float_wav[20:22] = (3).to_bytes(2, "little")  # WAVE_FORMAT_IEEE_FLOAT
    with pytest.raises(RivaRequestError, match="16-bit"):
        LeadingWav().feed(bytes(float_wav))
    with pytest.raises(RivaRequestError, match="WAV header"):
        strip = LeadingWav()
        strip.feed(wav[:30])
        strip.flush()


def test_grpc_port_needs_a_port_of_its_own():
    from nemo_serve.config import Settings, SettingsError

    with pytest.raises(SettingsError, match="--grpc-port"):
        Settings.from_sources({"port": 9000, "grpc_port": 9000}, {})
    assert Settings.from_sources({"port": 0, "grpc_port": 0}, {}).grpc_port == 0
    assert Settings.from_sources({}, {}).grpc_port is None  # off unless given
    for taken in ({"port": 9000}, {"grpc_port": 9000}, {"fast_ws_port": 9000}):  # --fast-grpc-port likewise
        with pytest.raises(SettingsError, match="--fast-grpc-port"):
            Settings.from_sources({"port": 8000, **taken, "fast_grpc_port": 9000}, {})
    assert Settings.from_sources({}, {}).fast_grpc_port is None
