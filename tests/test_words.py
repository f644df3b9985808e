"""Word-level results: grouping, times and confidence (engine/words.py), the engine's token
confidences (engine/step.py: they change no token, the parity scenarios run with them on), and
words on /ws finals, /v1/realtime completed events and Riva final results of the real server."""

from __future__ import annotations

import asyncio
import json
import math

import pytest

from nemo_serve import selftest
from nemo_serve.engine.endpoint import EndpointConfig
from nemo_serve.engine.loop import Engine
from nemo_serve.engine.results import Detokenizer, ResultAssembler, StreamUpdate
from nemo_serve.engine.words import Word, words
from nemo_serve.oracle import oracle_transcribe

from . import helpers, test_buckets, test_parity
from .helpers_server import TEST_MODEL, TOKEN, as_model_input, free_port, start_server
from .helpers_words import nemo_max_prob

FRAME_S = 0.08


def _update(ids, frames, final, confs=None, segment=0):
    return StreamUpdate("s", segment, final, False, ids, frames, 0, 1.0, 0.0, new_token_confidences=confs)


def _joined(ws: list[Word]) -> str:
    return " ".join(w.word for w in ws)


# ----------------------------------------------------------------------------- grouping and times


def test_bpe_pieces_group_on_the_word_marker_with_times_and_min_confidence():
    vocab = ["<unk>", "▁the", "▁ca", "t", "▁", "'", "s", "▁sat"]
    det = Detokenizer(vocab, is_bpe=True)
    ids = [1, 2, 3, 4, 5, 6, 0, 7]  # the ca t ▁ ' s <unk> sat
    frames = [10, 12, 13, 15, 15, 16, 18, 20]
    confs = [0.9, 0.8, 0.5, 0.01, 0.7, 0.95, 0.02, 0.6]
    times = [round(f * FRAME_S, 3) for f in frames]
    got = words([det.piece(t) for t in ids], times, FRAME_S, confs)
    assert [w.word for w in got] == ["the", "cat", "'s", "sat"]
    assert _joined(got) == " ".join(det.text(ids).split())
    # start: first token's frame; end: the end of the last token's frame (the blank run after it)
    assert [(w.start, w.end) for w in got] == [(0.8, 0.88), (0.96, 1.12), (1.2, 1.36), (1.6, 1.68)]
    # min over the word's tokens; the lone "▁" (space only) and <unk> (no text) belong to no word
    assert [w.confidence for w in got] == [0.9, 0.5, 0.7, 0.6]


def test_word_end_stops_at_the_next_word_on_a_shared_frame():
    det = Detokenizer(["▁a", "n", "▁al", "▁b", "▁c"], is_bpe=True)
    ids, frames = [0, 1, 2, 3, 4], [5, 6, 6, 9, 9]
    got = words([det.piece(t) for t in ids], [f * FRAME_S for f in frames], FRAME_S)
    assert [w.word for w in got] == ["an", "al", "b", "c"]
    an, al, b, c = got
    assert (an.start, an.end) == (0.4, pytest.approx(0.48))  # "n" shares frame 6 with "al": ends where al starts
    assert al.end == pytest.approx(0.56)
    assert (b.start, b.end) == (c.start, pytest.approx(0.8))  # all on c's first frame: keeps its one frame
    assert all(w.end > w.start for w in got)
    assert all(w.confidence is None for w in got)  # no confidences given
    # the stream's last frame may reach past the audio the model consumed: no word ends after it
    clipped = words([det.piece(t) for t in ids], [f * FRAME_S for f in frames], FRAME_S, audio_end_s=0.76)
    assert [w.end for w in clipped] == [pytest.approx(x) for x in (0.48, 0.56, 0.76, 0.76)]
    # audio ending where a word starts: no room to clip it, it keeps its frame (never end <= start)
    at_start = words([det.piece(t) for t in ids], [f * FRAME_S for f in frames], FRAME_S, audio_end_s=0.72)
    assert all(w.end > w.start for w in at_start), at_start


def test_character_vocabulary_words_split_on_the_space_token():
    vocab = [" ", "a", "b", "c", "'"]
    det = Detokenizer(vocab, is_bpe=False)
    ids = [0, 1, 2, 0, 0, 3, 4, 1, 0]  # " ab  c'a "
    frames = [1, 2, 3, 4, 5, 7, 7, 8, 12]
    confs = [0.1, 0.9, 0.8, 0.1, 0.1, 0.99, 0.4, 0.97, 0.1]
    got = words([det.piece(t) for t in ids], [f * FRAME_S for f in frames], FRAME_S, confs)
    assert [w.word for w in got] == ["ab", "c'a"]
    assert _joined(got) == " ".join(det.text(ids).split())
    assert [(w.start, w.end) for w in got] == [(pytest.approx(0.16), pytest.approx(0.32)),
                                               (pytest.approx(0.56), pytest.approx(0.72))]  # fmt: skip
    assert [w.confidence for w in got] == [0.8, 0.4]  # the space tokens' 0.1 counts for no word


def test_assembler_gives_words_on_finals_only():
    det = Detokenizer(["▁he", "llo", "▁wor", "ld"], is_bpe=True)
    asm = ResultAssembler(det, FRAME_S)
    p = asm(_update([0, 1], [3, 4], False, [0.9, 0.8]))
    assert p.words is None and p.token_confidences is None
    f = asm(_update([2, 3], [8, 9], True, [0.7, 0.99]))
    assert f.text == "hello world" and _joined(f.words) == f.text
    assert f.token_confidences == [0.9, 0.8, 0.7, 0.99]
    assert [(w.word, w.start, w.end, w.confidence) for w in f.words] == [
        ("hello", 0.24, 0.4, 0.8), ("world", 0.64, 0.8, 0.7)]  # fmt: skip
    # next segment, confidences off: words without confidence
    f2 = asm(_update([0], [20], True, None, segment=1))
    assert [(w.word, w.confidence) for w in f2.words] == [("he", None)] and f2.token_confidences is None
    # an empty final: no words
    assert asm(_update([], [], True, None, segment=2)).words == []


# ----------------------------------------------------------------------------- engine


def _check_finals(results, with_confidence: bool) -> int:
    n = 0
    for r in results:
        if not r.is_final:
            assert r.words is None
            continue
        assert _joined(r.words) == " ".join(r.text.split())
        if with_confidence and r.token_ids:
            assert len(r.token_confidences) == len(r.token_ids)
            assert all(0.0 <= c <= 1.0 and math.isfinite(c) for c in r.token_confidences)
        for w in r.words:
            assert r.segment_start_s - 1e-9 <= w.start < w.end <= r.audio_processed_s + 1e-6
            assert (w.confidence is not None) == with_confidence
            if with_confidence:
                assert 0.0 <= w.confidence <= 1.0
        n += len(r.words)
    return n


def test_token_confidence_is_nemos_max_prob_of_the_emitted_label():
    """The docs define a token's confidence as NeMo's max_prob of the label it emitted: the engine's
    values equal an independent computation (nemo_max_prob) token for token, in two chunk modes."""
    m = helpers.model(None, "all")
    audios = helpers.utterances(2, seed=3)
    for mode in (min(m.modes), max(m.modes)):
        driven = helpers.drive(helpers.new_engine(m, 2, EndpointConfig.off(), token_confidence=True), audios,
                               packet=[1600, 333], modes=[mode, mode])  # fmt: skip
        for i, a in enumerate(audios):
            want_ids, want = nemo_max_prob(m, a, mode)
            got = [c for r in driven.finals(i) for c in r.token_confidences]  # endpointing off: one final
            assert driven.tokens(i) == want_ids and len(got) == len(want) > 5
            assert got == pytest.approx(want, abs=2e-4), (mode, i)


def test_engine_confidences_change_no_token_and_words_cover_the_text():
    """The demo model with endpointing (several finals per stream): tokens with confidence on equal
    NeMo's loop and the engine's own without it; every final's words join to its text."""
    m = helpers.model(None, 3)
    audios = helpers.utterances(4, seed=3)
    ep = EndpointConfig(enabled=True, rule2_min_trailing_silence_s=0.4).validated()
    on = helpers.drive(helpers.new_engine(m, 4, ep, token_confidence=True), audios, packet=[1600, 5000, 333])
    off = helpers.drive(helpers.new_engine(m, 4, ep), audios, packet=[1600, 5000, 333])
    n = 0
    for i, a in enumerate(audios):
        assert on.tokens(i) == off.tokens(i) == oracle_transcribe(m, a).token_ids
        n += _check_finals(on.results[i], True)
        _check_finals(off.results[i], False)
    assert n > 10
    confs = [c for i in range(4) for r in on.finals(i) for c in (r.token_confidences or [])]
    assert min(confs) < 0.99 < max(confs)  # a real spread, not a constant


def test_character_model_engine_words():
    m = helpers.model("builtin:tiny-char", 3)
    audios = helpers.utterances(2, seed=5)
    on = helpers.drive(helpers.new_engine(m, 2, token_confidence=True), audios, packet=4000)
    for i, a in enumerate(audios):
        assert on.tokens(i) == oracle_transcribe(m, a).token_ids
        _check_finals(on.results[i], True)


@pytest.fixture
def confidence_on(monkeypatch):
    """Every engine the parity tests make (helpers.new_engine, the self-test) has confidence on."""
    made: list[Engine] = []

    def engine(*args, **kw):
        kw.setdefault("token_confidence", True)
        e = Engine(*args, **kw)
        made.append(e)
        return e

    monkeypatch.setattr(helpers, "Engine", engine)
    monkeypatch.setattr(selftest, "Engine", engine)
    yield
    assert made and all(e.token_confidence for e in made)


@pytest.mark.parametrize("context_right", test_parity.DEFAULT_MODES)
def test_parity_scenarios_with_confidence_on(confidence_on, context_right):
    test_parity.test_selftest_every_trained_mode_fp32(context_right)
    test_buckets.test_buckets_padding_and_splits_match_oracle_every_mode_fp32(context_right)


def test_parity_scenarios_with_confidence_on_mixed(confidence_on):
    test_parity.test_selftest_bf16()
    test_parity.test_staggered_fill_levels_and_ragged_packets_match_oracle()
    test_parity.test_abort_mid_stream_leaves_neighbours_unchanged()
    test_parity.test_selftest_every_mode_in_one_engine()
    test_buckets.test_power_of_two_padding_matches_oracle_prompt_model()


# ----------------------------------------------------------------------------- the real server


async def _ws_finals(server, wire, rate: int) -> list[dict]:
    from .helpers_server import ws_pcm16_finals

    return await ws_pcm16_finals(server, wire, rate)


async def _realtime_completed(server, wire, rate: int) -> list[dict]:
    from websockets.asyncio.client import connect

    from .helpers_realtime import b64

    url = f"ws://127.0.0.1:{server.port}/v1/realtime?intent=transcription"
    session = {"input_audio_format": "pcm16", "input_audio_params": {"sample_rate_hz": rate}, "turn_detection": None}
    raw = []
    async with connect(url, additional_headers={"Authorization": f"Bearer {TOKEN}"}) as ws:
        await ws.send(json.dumps({"type": "transcription_session.update", "session": session}))
        for i in range(0, len(wire), rate // 10):
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": b64(wire[i : i + rate // 10])}))
        await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        await ws.send(json.dumps({"type": "input_audio_buffer.done"}))
        async for message in ws:
            raw.append(json.loads(message))
    assert not [e for e in raw if e["type"] == "error"], raw
    return [e for e in raw if e["type"] == "conversation.item.input_audio_transcription.completed"]


def _check_words(ws: list[dict], text: str, segment_start: float, audio_processed: float, confidence: bool) -> None:
    assert " ".join(w["word"] for w in ws) == " ".join(text.split())
    for w in ws:
        assert set(w) == {"word", "start", "end", "confidence"}
        assert segment_start - 1e-9 <= w["start"] < w["end"] <= audio_processed + 1e-6
        if confidence:
            assert 0.0 <= w["confidence"] <= 1.0
        else:
            assert w["confidence"] is None


def test_server_words_on_ws_and_realtime(shared_server):
    """A server with --word-confidence: /ws finals and /v1/realtime completed events carry words
    with confidences, and the tokens equal those of the shared server (confidence off, same model);
    Riva's finals carry /ws's word confidences and the lowest of them as their own."""
    from .helpers_realtime import pcm16

    rate = 16000
    wire = pcm16(rate)
    plain = asyncio.run(_ws_finals(shared_server, wire, rate))
    for f in plain:
        _check_words(f["words"], f["text"], f["start_time"], f["audio_processed"], confidence=False)
    plain_rt = asyncio.run(_realtime_completed(shared_server, wire, rate))
    for e in plain_rt:
        x = e["nemo_serve"]
        _check_words(x["words"], e["transcript"], x["start_time"], x["audio_processed"], confidence=False)
    shared_server.assert_no_leak()

    grpc_port = free_port()
    with start_server("--num-slots", "2", "--context-right", "all", "--word-confidence",
                      "--grpc-port", str(grpc_port)) as server:  # as shared, plus Riva # fmt: skip
        finals = asyncio.run(_ws_finals(server, wire, rate))
        completed = asyncio.run(_realtime_completed(server, wire, rate))
        riva_finals = _riva_finals(grpc_port, wire, rate)
        server.assert_no_leak()
    assert [t for f in finals for t in f["token_ids"]] == [t for f in plain for t in f["token_ids"]]
    assert sum(len(f["words"]) for f in finals) > 0, "no words: the comparison would be empty"
    for f in finals:
        _check_words(f["words"], f["text"], f["start_time"], f["audio_processed"], confidence=True)
    assert [t for e in completed for t in e["nemo_serve"]["token_ids"]] == [t for f in finals for t in f["token_ids"]]
    assert sum(len(e["nemo_serve"]["words"]) for e in completed) > 0
    for e in completed:
        x = e["nemo_serve"]
        _check_words(x["words"], e["transcript"], x["start_time"], x["audio_processed"], confidence=True)
    # Each word's confidence is the lowest of its tokens' max_prob, computed apart from the server.
    want = _independent_words(finals, as_model_input(wire, rate), shared_server.readyz()["context_right"])
    got = [w for f in finals for w in f["words"]]
    assert [w["word"] for w in got] == [w.word for w in want]
    assert [w["confidence"] for w in got] == pytest.approx([w.confidence for w in want], abs=3e-4)
    said = [w["confidence"] for e in completed for w in e["nemo_serve"]["words"]]
    assert said == pytest.approx([w.confidence for w in want], abs=3e-4)
    # Riva (protocol.md, Results): a final's confidence is its lowest word confidence, its words' are /ws's.
    if riva_finals is not None:
        alts = [r.alternatives[0] for r in riva_finals]
        assert [a.transcript for a in alts] == [f["text"] for f in finals if f["text"]]
        assert [w.confidence for a in alts for w in a.words] == pytest.approx([w["confidence"] for w in got], abs=1e-6)
        assert [a.confidence for a in alts] == pytest.approx([min(w.confidence for w in a.words) for a in alts], abs=1e-6)
        assert any(a.confidence < 0.99 for a in alts), "every word sure: 1.0 would pass unseen"


def _riva_finals(grpc_port: int, wire, rate: int) -> list | None:
    """riva.client's final results for the PCM16 `wire` in 100 ms messages; None where the client
    is not installed (CI installs it: env/nodeps.lock.txt)."""
    try:
        import riva.client as riva
    except ImportError:
        return None
    auth = riva.Auth(uri=f"127.0.0.1:{grpc_port}", metadata_args=[["authorization", f"Bearer {TOKEN}"]])
    config = riva.StreamingRecognitionConfig(config=riva.RecognitionConfig(
        encoding=riva.AudioEncoding.LINEAR_PCM, sample_rate_hertz=rate, language_code="en-US",
        max_alternatives=1, enable_word_time_offsets=True), interim_results=False)  # fmt: skip
    chunks = [wire[i : i + rate // 10].tobytes() for i in range(0, len(wire), rate // 10)]
    try:
        responses = riva.ASRService(auth).streaming_response_generator(chunks, config)
        return [r for response in responses for r in response.results if r.is_final]
    finally:
        auth.channel.close()


def _independent_words(finals: list[dict], audio, mode: int) -> list[Word]:
    """The finals' words with confidences from nemo_max_prob (grouping by engine/words.py, whose
    unit tests above check it on hand-made pieces)."""
    m = helpers.model(TEST_MODEL, "all")
    ids, confs = nemo_max_prob(m, audio, mode)
    assert [t for f in finals for t in f["token_ids"]] == ids
    det, out, k = Detokenizer(m.vocabulary, m.is_bpe), [], 0
    for f in finals:
        n = len(f["token_ids"])
        out += words([det.piece(t) for t in f["token_ids"]], f["timestamps"], FRAME_S, confs[k : k + n], f["audio_processed"])
        k += n
    return out
