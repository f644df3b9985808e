"""POST /v1/audio/transcriptions end to end: OpenAI's own SDK (`client.audio.transcriptions.create`)
against the real `nemo-serve` process. A file's tokens must equal /ws's for the same samples,
whatever the response format, rate or latency mode; refusals (token, size, duration, format,
admission) come back as OpenAI errors the SDK raises, and leave no slot behind.
"""

from __future__ import annotations

import asyncio
import io
import signal
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile

import nemo_serve
from nemo_serve.oracle import oracle_transcribe

from . import helpers
from .helpers_server import PROMPT_TEST_MODEL, SHARED_NUM_SLOTS, TOKEN, finals_tokens_and_text, start_server, ws_pcm16_finals
from .helpers_server import post_with_every_slot_held
from .helpers_server import leak_checked_server  # noqa: F401 - this module's `server` fixture

openai = pytest.importorskip("openai")

UTTERANCES = sorted((Path(nemo_serve.__file__).parent / "assets" / "demo" / "utterances").glob("*.wav"))


def sdk(server) -> "openai.OpenAI":
    return openai.OpenAI(api_key=TOKEN, base_url=f"{server.http_url}/v1", max_retries=0)


async def ws_tokens(server, pcm: np.ndarray, rate: int, context_right: int | None = None,
                    language: str | None = None) -> tuple[list[int], str]:  # fmt: skip
    """/ws's tokens and text for these PCM16 samples (packets of 100 ms, then end)."""
    return finals_tokens_and_text(await ws_pcm16_finals(server, pcm, rate, context_right=context_right, language=language))


def pcm16(path: Path) -> tuple[np.ndarray, int]:
    data, rate = soundfile.read(path, dtype="int16")
    return data, rate


def test_sdk_verbose_json_tokens_equal_ws_on_every_bundled_utterance(server):
    """All 24 utterances: verbose_json's segment tokens, concatenated, are /ws's; its text is
    /ws's; words have times inside the audio, in order."""
    client = sdk(server)
    mismatches = []
    for path in UTTERANCES:
        expected_tokens, expected_text = asyncio.run(ws_tokens(server, *pcm16(path)))
        with open(path, "rb") as f:
            got = client.audio.transcriptions.create(
                file=f, model="nemotron-streaming", response_format="verbose_json", language="en",
                timestamp_granularities=["word", "segment"], prompt="ignored", temperature=0.4,
            )  # fmt: skip
        tokens = [t for s in got.segments for t in s.tokens]
        if (tokens, got.text) != (expected_tokens, expected_text):
            mismatches.append((path.name, tokens, expected_tokens, got.text, expected_text))
        duration = soundfile.info(path).duration
        assert got.duration == pytest.approx(duration, abs=1e-3) and got.usage.seconds == int(np.ceil(duration))
        assert " ".join(w.word for w in got.words) == " ".join(got.text.split())
        assert all(0 <= w.start <= w.end <= duration + 0.2 for w in got.words)
        assert [w.start for w in got.words] == sorted(w.start for w in got.words)
        # protocol.md's verbose_json: task, the request's language (a model without prompts keeps it),
        # Whisper's statistics at their fixed values, a segment from its first word's start to its
        # last word's end
        assert (got.task, got.language) == ("transcribe", "en")
        k = 0
        for seg in got.segments:
            stats = (seg.temperature, seg.avg_logprob, seg.compression_ratio, seg.no_speech_prob, seg.seek)
            assert stats == (0.0, 0.0, 1.0, 0.0, 0), (path.name, seg)
            n = len(seg.text.split())
            assert (seg.start, seg.end) == (got.words[k].start, got.words[k + n - 1].end), (path.name, seg)
            k += n
        assert [s.id for s in got.segments] == list(range(len(got.segments))) and k == len(got.words)
    assert not mismatches, mismatches
    assert any(s.text for s in got.segments), "the model gave no text: the comparison would be empty"


def test_sdk_json_text_srt_and_vtt_carry_the_same_transcript(server):
    path = UTTERANCES[3]
    client = sdk(server)
    _, expected = asyncio.run(ws_tokens(server, *pcm16(path)))
    assert expected
    with open(path, "rb") as f:
        as_json = client.audio.transcriptions.create(file=f, model="any")
    assert as_json.text == expected
    with open(path, "rb") as f:
        as_text = client.audio.transcriptions.create(file=f, model="any", response_format="text")
    assert as_text.strip() == expected
    for kind, first_line in (("srt", "1"), ("vtt", "WEBVTT")):
        with open(path, "rb") as f:
            body = client.audio.transcriptions.create(file=f, model="any", response_format=kind)
        lines = body.strip().splitlines()
        assert lines[0] == first_line and expected in lines
        sep = "," if kind == "srt" else "."
        assert any(line.startswith("00:00:0") and f" --> 00:00:0" in line and sep in line for line in lines)


def test_a_44khz_stereo_flac_is_the_same_stream_as_its_samples_sent_to_ws(server):
    """Any rate and container: the file is decoded, its channels averaged and resampled as /ws
    resamples, so its tokens equal /ws's for the same mono 44.1 kHz samples."""
    audio, rate = soundfile.read(UTTERANCES[5], dtype="float32")
    import soxr

    mono = np.clip(np.round(soxr.resample(audio, rate, 44100, quality="HQ") * 32767), -32768, 32767).astype("<i2")
    stereo = np.stack([mono, mono], axis=1)
    buf = io.BytesIO()
    soundfile.write(buf, stereo, 44100, format="FLAC", subtype="PCM_16")
    expected_tokens, expected_text = asyncio.run(ws_tokens(server, mono, 44100))
    got = sdk(server).audio.transcriptions.create(file=("a.flac", buf.getvalue()), model="x", response_format="verbose_json")
    assert [t for s in got.segments for t in s.tokens] == expected_tokens and got.text == expected_text
    assert got.language == "unknown"  # no `language` asked, a model without prompts (protocol.md's verbose_json)
    assert expected_tokens


def test_context_right_chooses_the_latency_mode(server):
    """The shared server serves every mode: a file at 80 ms (form field or URL) gets /ws's tokens
    at 80 ms, which differ from the default mode's on this utterance."""
    path = UTTERANCES[1]
    fast = asyncio.run(ws_tokens(server, *pcm16(path), context_right=0))[0]
    default = asyncio.run(ws_tokens(server, *pcm16(path)))[0]
    assert fast != default, "this utterance decodes alike in both modes: pick another"
    client = sdk(server)
    with open(path, "rb") as f:
        form = client.audio.transcriptions.create(file=f, model="x", response_format="verbose_json",
                                                  extra_body={"context_right": "0"})  # fmt: skip
    with open(path, "rb") as f:
        query = client.audio.transcriptions.create(file=f, model="x", response_format="verbose_json",
                                                   extra_query={"context_right": 0})  # fmt: skip
    assert [t for s in form.segments for t in s.tokens] == fast
    assert [t for s in query.segments for t in s.tokens] == fast
    with open(path, "rb") as f, pytest.raises(openai.BadRequestError, match="context_right '5' is not a latency mode served here; valid values"):
        client.audio.transcriptions.create(file=f, model="x", extra_body={"context_right": "5"})


def test_refusals_are_openai_errors_the_sdk_raises(server):
    client = sdk(server)
    with pytest.raises(openai.AuthenticationError, match="bearer token"):
        openai.OpenAI(api_key="wrong", base_url=f"{server.http_url}/v1", max_retries=0).audio.transcriptions.create(
            file=("a.wav", UTTERANCES[0].read_bytes()), model="x")  # fmt: skip
    with pytest.raises(openai.BadRequestError, match="cannot decode the file as audio.*readable formats: WAV"):
        client.audio.transcriptions.create(file=("notes.txt", b"not audio at all " * 100), model="x")
    with pytest.raises(openai.BadRequestError, match="response_format 'xml'"):
        client.audio.transcriptions.create(file=("a.wav", UTTERANCES[0].read_bytes()), model="x", response_format="xml")
    long_wav = io.BytesIO()
    soundfile.write(long_wav, np.zeros(16000 * 11, dtype="int16"), 16000, format="WAV")  # --max-stream-s 10
    with pytest.raises(openai.APIStatusError, match="11.0 s long; this server takes at most 10 s") as e:
        client.audio.transcriptions.create(file=("long.wav", long_wav.getvalue()), model="x")
    assert e.value.status_code == 413
    # no file field: a plain form
    r = httpx.post(f"{server.http_url}/v1/audio/transcriptions", headers=server.auth_headers,
                   files={"model": (None, "x")}, timeout=10, trust_env=False)  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "file"


def test_body_over_max_file_bytes_is_413_before_it_is_read(server):
    """--max-file-bytes (default 25 MiB): refused from Content-Length."""
    big = b"\0" * (26 << 20)
    r = httpx.post(f"{server.http_url}/v1/audio/transcriptions", headers=server.auth_headers,
                   files={"file": ("big.wav", big)}, timeout=30, trust_env=False)  # fmt: skip
    assert r.status_code == 413 and "--max-file-bytes" in r.json()["error"]["message"]


def test_full_server_answers_503_with_the_ws_reason_and_counts_it(server):
    """Same admission as /ws: with every slot held by /ws streams, a file is refused at once
    with /ws's reason; once they end it is served. Metrics count both."""
    refused_before = server.metric('nemo_serve_refusals_total{reason="no_free_slot"}')
    ok_before = server.metric('nemo_serve_file_transcriptions_total{status="200"}')

    r = post_with_every_slot_held(server, SHARED_NUM_SLOTS, "/v1/audio/transcriptions", headers=server.auth_headers,
                                  files={"file": ("a.wav", UTTERANCES[0].read_bytes())})  # fmt: skip
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["message"].startswith("no free slot (all 3 in use)")
    assert server.metric('nemo_serve_refusals_total{reason="no_free_slot"}') == refused_before + 1
    server.wait_open_streams(0)
    with open(UTTERANCES[0], "rb") as f:
        assert sdk(server).audio.transcriptions.create(file=f, model="x").text
    assert server.metric('nemo_serve_file_transcriptions_total{status="200"}') == ok_before + 1


def test_prompt_language_and_a_drain_that_lets_a_file_finish():
    """A server of its own (SIGTERM ends it) on a multilingual prompt model. `language` chooses the prompt: a file's tokens are /ws's in
    that language (`de` maps to the model's one German code). A SIGTERM while a long file decodes
    lets it finish, as a drain lets a stream finish: 200 with its whole transcript, then exit 0;
    before that, a client that gives up on a long file stops its decoding."""
    path = UTTERANCES[2]
    pcm, rate = pcm16(path)
    # The long file must still be decoding when the client gives up and when the drain is seen,
    # on any machine: 25 s of audio is 311 steps at 80 ms, and the test hook's 10 ms a step makes
    # that 3 s at least (150 s of audio did it by length alone, and NeMo's loop on all of it, the
    # oracle below, cost CI 10 s or more).
    long_pcm = np.concatenate([pcm16(p)[0] for p in UTTERANCES[:8]])  # about 25 s
    long_wav = io.BytesIO()
    soundfile.write(long_wav, long_pcm, 16000, format="WAV", subtype="PCM_16")
    with start_server("--num-slots", "2", "--context-right", "13,0", "--drain-timeout-s", "120",
                      model=PROMPT_TEST_MODEL, env={"NEMO_SERVE_TEST_STEP_SLEEP_S": "0.01"}) as srv:  # fmt: skip
        german = asyncio.run(ws_tokens(srv, pcm, rate, language="de-DE"))[0]
        french = asyncio.run(ws_tokens(srv, pcm, rate, language="fr-FR"))[0]
        assert german != french, "the prompt changes nothing on this utterance: pick another"
        client = sdk(srv)
        for language, expected in (("de", german), ("fr-FR", french)):
            with open(path, "rb") as f:
                got = client.audio.transcriptions.create(file=f, model="x", language=language, response_format="verbose_json")
            assert [t for s in got.segments for t in s.tokens] == expected
            assert got.language == {"de": "de-DE", "fr-FR": "fr-FR"}[language]

        # A client that gives up (read timeout) stops the decoding at once: its slot comes back and
        # it is counted as gone, long before the file would have finished.
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{srv.http_url}/v1/audio/transcriptions?context_right=0", headers=srv.auth_headers,
                       files={"file": ("long.wav", long_wav.getvalue())}, timeout=httpx.Timeout(30, read=0.5),
                       trust_env=False)  # fmt: skip
        srv.wait_open_streams(0, timeout_s=2.0)
        assert srv.metric('nemo_serve_stream_errors_total{reason="client_gone"}') == 1

        answer: list = []
        post = threading.Thread(target=lambda: answer.append(httpx.post(
            f"{srv.http_url}/v1/audio/transcriptions?context_right=0", headers=srv.auth_headers,
            files={"file": ("long.wav", long_wav.getvalue())}, data={"response_format": "verbose_json"},
            timeout=180, trust_env=False)))  # fmt: skip
        post.start()
        deadline = time.monotonic() + 60
        while srv.readyz()["open_streams"] < 1:  # the file holds its slot: decoding has begun
            assert time.monotonic() < deadline and post.is_alive(), "the file never took a slot"
            time.sleep(0.01)
        srv.proc.send_signal(signal.SIGTERM)  # to the supervisor, which passes it on to the front ends
        deadline = time.monotonic() + 10
        while not srv.readyz()["draining"]:
            assert time.monotonic() < deadline, "the front end never started draining"
            time.sleep(0.05)
        refused = httpx.post(f"{srv.http_url}/v1/audio/transcriptions", headers=srv.auth_headers,
                             files={"file": ("a.wav", path.read_bytes())}, timeout=30, trust_env=False)  # fmt: skip
        assert post.is_alive(), "the long file finished before the drain could be seen: make it longer"
        assert refused.status_code == 503 and "draining" in refused.json()["error"]["message"]
        post.join(180)
        assert srv.proc.wait(timeout=60) == 0
    r = answer[0]
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["duration"] == pytest.approx(len(long_pcm) / 16000, abs=1e-3)
    # Decoded to the end, not cut at the drain: the whole file's tokens are NeMo's loop on all of it.
    model = helpers.model(PROMPT_TEST_MODEL, "all")
    whole = oracle_transcribe(model, long_pcm.astype(np.float32) / 32768.0, context_right=0).token_ids
    assert [t for s in body["segments"] for t in s["tokens"]] == whole
