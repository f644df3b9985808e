"""POST /v1/listen end to end: Deepgram's own clients, unchanged but for the base URL and key
(deepgram-sdk's `listen.v1.media.transcribe_file`, livekit-plugins-deepgram's `STT.recognize()`),
against the real `nemo-serve` process (the shared server). A file's tokens, text and words must
equal /v1/audio/transcriptions' and /ws's for the same WAV; refusals come back in Deepgram's
error shape, which the SDK raises, and leave no slot behind. The hostile uploads (bombs, stalls,
a body over the cap, 401 before the body) are in test_hostile_files.py, beside its neighbour.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile

import nemo_serve

from .helpers_server import SHARED_NUM_SLOTS, TOKEN, finals_tokens_and_text, post_with_every_slot_held, ws_pcm16_finals
from .helpers_server import leak_checked_server  # noqa: F401 - this module's `server` fixture

deepgram = pytest.importorskip("deepgram")

UTTERANCES = sorted((Path(nemo_serve.__file__).parent / "assets" / "demo" / "utterances").glob("*.wav"))
NUM_FILES = 4  # a few of the 24: test_transcriptions.py holds the file route to /ws on all of them


def sdk(server, key: str = TOKEN):
    from deepgram import DeepgramClient
    from deepgram.environment import DeepgramClientEnvironment

    base = server.http_url
    env = DeepgramClientEnvironment(base=base, production=base.replace("http", "ws", 1), agent=base, agent_rest=base)
    return DeepgramClient(api_key=key, environment=env)


def openai_verbose(server, data: bytes, **fields) -> dict:
    """/v1/audio/transcriptions' verbose_json for the same bytes."""
    r = httpx.post(f"{server.http_url}/v1/audio/transcriptions", headers=server.auth_headers, trust_env=False,
                   files={"file": ("a.wav", data)}, data={"response_format": "verbose_json", **fields}, timeout=30)  # fmt: skip
    assert r.status_code == 200, r.text
    return r.json()


def ws_tokens(server, path: Path, **options) -> tuple[list[int], str]:
    pcm, rate = soundfile.read(path, dtype="int16")
    return finals_tokens_and_text(asyncio.run(ws_pcm16_finals(server, pcm, rate, **options)))


def test_sdk_transcribe_file_gives_the_tokens_text_and_words_of_the_other_routes(server):
    """Per file: the utterances' token ids (nemo-serve's extension) are /ws's and verbose_json's;
    the transcript is their text; the words are verbose_json's, `punctuated_word` as written and
    `word` lowercased; metadata describes this body (its sha256, duration) and this request."""
    dg = sdk(server)
    for path in UTTERANCES[:NUM_FILES]:
        data = path.read_bytes()
        raw = dg.listen.v1.media.with_raw_response.transcribe_file(
            request=data, model="nova-3", language="en", punctuate=True, smart_format=True, utterances=True,
            numerals=True, filler_words=True, tag=["t1", "t2"],
            profanity_filter=False, sentiment=False, summarize=False, redact="false",
        )  # fmt: skip
        got = raw.data
        assert type(got).__name__ == "ListenV1Response", got  # not the callback's "accepted" shape
        ws = ws_tokens(server, path)
        verbose = openai_verbose(server, data, language="en")
        alt = got.results.channels[0].alternatives[0]
        tokens = [t for u in got.results.utterances for t in u.token_ids]
        assert (tokens, alt.transcript) == ws, path.name
        assert tokens == [t for s in verbose["segments"] for t in s["tokens"]] and alt.transcript == verbose["text"]
        assert [(w.punctuated_word, w.start, w.end) for w in alt.words] == [(w["word"], w["start"], w["end"])
                                                                           for w in verbose["words"]]  # fmt: skip
        assert all(w.word == w.punctuated_word.lower() and w.confidence == 1.0 for w in alt.words)
        assert alt.confidence == 1.0  # no --word-confidence: 1.0, as Riva's mapping says
        assert " ".join(u.transcript for u in got.results.utterances) == alt.transcript
        m = got.metadata
        assert m.sha256 == hashlib.sha256(data).hexdigest() and m.channels == 1 and m.tags == ["t1", "t2"]
        assert m.duration == pytest.approx(soundfile.info(path).duration, abs=1e-6)
        assert m.request_id == raw.headers["dg-request-id"] and m.models[0] in m.model_info
        assert m.model_info[m.models[0]]["name"] == server.readyz()["model"]
        assert tokens


def test_context_right_chooses_the_latency_mode(server):
    """nemo-serve's extension, as /ws takes it: 80 ms gives /ws's 80 ms tokens, not the default's."""
    path = UTTERANCES[1]
    fast, default = ws_tokens(server, path, context_right=0)[0], ws_tokens(server, path)[0]
    assert fast != default, "this utterance decodes alike in both modes: pick another"
    r = httpx.post(f"{server.http_url}/v1/listen?utterances=true&context_right=0", content=path.read_bytes(),
                   headers={"Authorization": f"Token {TOKEN}", "Content-Type": "audio/wav"}, trust_env=False, timeout=30)  # fmt: skip
    assert [t for u in r.json()["results"]["utterances"] for t in u["token_ids"]] == fast


def test_livekit_recognize_gets_the_file_routes_transcript(server):
    """livekit-plugins-deepgram's non-streaming STT.recognize(): the WAV it builds from its frames
    (Content-Type audio/wav, its default options: model nova-3, language en-US, punctuate...)."""
    pytest.importorskip("livekit.plugins.deepgram")
    import aiohttp
    from livekit import rtc
    from livekit.plugins import deepgram as lk_deepgram

    async def recognize(pcm: np.ndarray, rate: int):
        async with aiohttp.ClientSession() as session:
            stt = lk_deepgram.STT(api_key=TOKEN, base_url=f"{server.http_url}/v1/listen", http_session=session)
            return await stt.recognize(rtc.AudioFrame(pcm.tobytes(), rate, 1, len(pcm)))

    for path in UTTERANCES[:2]:
        pcm, rate = soundfile.read(path, dtype="int16")
        event = asyncio.run(recognize(pcm, rate))
        verbose = openai_verbose(server, path.read_bytes())
        [alt] = event.alternatives
        assert alt.text == verbose["text"] and alt.text, path.name
        assert [str(w) for w in alt.words] == [w["word"] for w in verbose["words"]]
        assert (alt.start_time, alt.end_time) == (verbose["words"][0]["start"], verbose["words"][-1]["end"])
        assert alt.language == "en-US" and alt.confidence == 1.0 and event.request_id


REFUSED_QUERIES = [
    ("callback=https://example.com/hook", "callbacks are not supported"),
    ("summarize=v2", "summaries"), ("sentiment=true", "sentiment"), ("topics=true", "topic"),
    ("redact=pci", "redaction is not supported"), ("replace=a:b", "replacement"), ("search=hello", "search"),
    ("multichannel=true", "channels are averaged"), ("profanity_filter=true", "profanity"),
    ("detect_entities=true", "entity"), ("paragraphs=true", "paragraphs"), ("intents=true", "intent"),
    ("diarize=true", "no diarizer loaded"), ("utterances=maybe", "utterances 'maybe': use true or false"),
    ("context_right=5", "context_right '5' is not a latency mode served here"),
    ("keywords=alarm:0", "(suppression) is not supported"), ("keywords=alarm:-3", "(suppression) is not supported"),
    ("keywords=alarm:x", "must be a number"), ("keywords=alarm:2&keywords=nine:3", "one intensifier for all"),
    ("keywords=alarm&keywords=nine:3", "got 1, 3"), ("keywords=alarm:11", "boost must be a number in (0, 10]"),
    ("keyterm=%E4%B8%AD%E6%96%87", "cannot spell"),
]  # fmt: skip


def test_keywords_and_keyterms_boost_as_ws_phrases_do(server):
    """Deepgram's `keywords=TERM:INTENSIFIER` and `keyterm=PHRASE`, through the SDK, are /ws's
    `phrases` and `boost`: the same tokens. The phrases are words of the test model's own
    transcripts of other files ("gl do": 006.wav's); boosted by 5 they enter this file's
    transcript, which they are not in unboosted, so a route that ignored keywords fails here."""
    path = UTTERANCES[0]
    data, dg = path.read_bytes(), sdk(server)

    def listen(**options) -> tuple[list[int], str]:
        got = dg.listen.v1.media.transcribe_file(request=data, utterances=True, **options).results
        return [t for u in got.utterances for t in u.token_ids], got.channels[0].alternatives[0].transcript

    plain = listen()
    assert plain == ws_tokens(server, path) and "gl do" not in plain[1], plain
    boosted = listen(keywords=["gl do:5"])
    assert boosted == ws_tokens(server, path, phrases=["gl do"], boost=5.0), boosted
    assert "gl do" in boosted[1], boosted
    both = listen(keyterm=["gl do"], keywords=["eemp proovee:5"])  # a keyterm takes the keywords' weight
    assert both == ws_tokens(server, path, phrases=["gl do", "eemp proovee"], boost=5.0), both
    assert both[0] not in (plain[0], boosted[0])


def test_refusals_are_deepgram_errors_the_sdk_raises(server):
    """401 wrong key, 400 remote audio (the SDK's transcribe_url), bad audio, refused features and
    bad values, 413 over --max-stream-s or --max-file-bytes: {"err_code", "err_msg", "request_id"}."""
    from deepgram.core.api_error import ApiError
    from deepgram.errors import BadRequestError

    wav = UTTERANCES[0].read_bytes()
    with pytest.raises(ApiError) as e:
        sdk(server, key="wrong").listen.v1.media.transcribe_file(request=wav)
    assert e.value.status_code == 401 and e.value.body["err_code"] == "INVALID_AUTH", e.value
    with pytest.raises(BadRequestError) as e:
        sdk(server).listen.v1.media.transcribe_url(url="https://dpgr.am/spacewalk.wav")
    assert "this server fetches nothing" in e.value.body["err_msg"], e.value
    with pytest.raises(BadRequestError) as e:
        sdk(server).listen.v1.media.transcribe_file(request=b"not audio at all " * 100)
    assert "cannot decode the file as audio" in e.value.body["err_msg"]
    long_wav = io.BytesIO()
    soundfile.write(long_wav, np.zeros(16000 * 11, dtype="int16"), 16000, format="WAV")  # --max-stream-s 10
    with pytest.raises(ApiError) as e:
        sdk(server).listen.v1.media.transcribe_file(request=long_wav.getvalue(), request_options={"max_retries": 0})
    assert e.value.status_code == 413 and "at most 10 s" in e.value.body["err_msg"], e.value
    head = {"Authorization": f"Token {TOKEN}", "Content-Type": "audio/wav"}
    problems = []
    for query, words in REFUSED_QUERIES:
        r = httpx.post(f"{server.http_url}/v1/listen?{query}", content=wav, headers=head, trust_env=False, timeout=30)
        body = r.json()
        if r.status_code != 400 or words not in body.get("err_msg", "") or body.get("request_id") != r.headers["dg-request-id"]:
            problems.append((query, r.status_code, r.text[:200]))
    assert not problems, problems
    r = httpx.post(f"{server.http_url}/v1/listen", content=b"\0" * (26 << 20), headers=head, trust_env=False, timeout=30)
    assert r.status_code == 413 and "--max-file-bytes" in r.json()["err_msg"], r.text
    r = httpx.post(f"{server.http_url}/v1/listen", content=wav, headers={**head, "Origin": "https://elsewhere.example"},
                   trust_env=False, timeout=30)  # fmt: skip
    assert r.status_code == 403 and "--allowed-origins" in r.json()["err_msg"], r.text  # a page elsewhere: /ws's rule


def test_full_server_answers_503_with_the_ws_reason(server):
    """Same admission as /ws and the other file route: every slot held by /ws streams, a file is
    refused at once (Retry-After, /ws's reason); once they end it is served."""

    r = post_with_every_slot_held(server, SHARED_NUM_SLOTS, "/v1/listen", content=UTTERANCES[0].read_bytes(),
                                  headers={"Authorization": f"Token {TOKEN}"})  # fmt: skip
    assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
    assert r.json()["err_msg"].startswith("no free slot (all 3 in use)") and r.json()["err_code"] == "Service Unavailable"
    server.wait_open_streams(0)
    assert sdk(server).listen.v1.media.transcribe_file(request=UTTERANCES[0].read_bytes()).results.channels[0]
