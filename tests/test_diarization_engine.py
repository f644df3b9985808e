"""Streaming Sortformer in the engine core's loop (engine/runner.py, diarization/runner.py, engine/speakers.py).

In process (core/inproc.py, the production core): diarized and plain streams share the engine; a
diarized stream's ASR tokens equal a plain stream's on the same audio, its speaker probabilities
equal NeMo's own streaming loop on that stream alone (diarization/reference.py), every token
carries the speaker of its time, finals the speaker of most of their tokens; plain streams cost
the diarizer nothing; a bad or unserved `diarization` option is refused before any work.
"""

from __future__ import annotations

import functools
import time

import numpy as np
import pytest
import torch

from nemo_serve.builtin.sortformer import build_diarizer
from nemo_serve.diarization import runner as diar_runner
from nemo_serve.diarization.reference import nemo_chunks, nemo_reference_preds, stream_features
from nemo_serve.diarization.settings import MODEL_CARD_SETTINGS, apply_settings
from nemo_serve.engine.frontend import AudioBuffer
from nemo_serve.engine.invariants import ENV, AccountingError
from tests import helpers

from .helpers_diarization import _kept_probabilities, _drive, _assert_empty

PROB_ATOL = 2e-5  # as tests/test_diarization_step.py: padding changes matmul shapes


@functools.lru_cache(maxsize=None)
def diarizer():
    model = build_diarizer("tiny-sortformer", 0)
    apply_settings(model, MODEL_CARD_SETTINGS["ultra_low"])  # short chunks: many steps on short audio
    return model


def _oracle(audio: np.ndarray) -> np.ndarray:
    model = diarizer()
    return nemo_reference_preds(model, nemo_chunks(model, stream_features(model, torch.from_numpy(audio)))).numpy()


def test_diarized_streams_match_plain_tokens_and_nemo_speaker_probabilities(monkeypatch):
    kept = _kept_probabilities(monkeypatch)
    audios = helpers.utterances(3, seed=5)
    audios = audios + [audios[0]]  # stream 3: stream 0's audio, plain
    engine = helpers.new_engine(helpers.model(None), 4, diarizer=diarizer())
    options = [{"max_speakers": 4}, {"max_speakers": 2}, None, None]
    results, ids = _drive(engine, audios, options, packet=1234, start_tick=[0, 3, 1, 2])
    tokens = [[t for r in rs for t in r.new_token_ids] for rs in results]
    assert tokens[0] == tokens[3] and tokens[0], "a diarized stream's tokens differ from a plain one's"
    plain = helpers.new_engine(helpers.model(None), 2)
    alone, _ = _drive(plain, audios[1:3], [None, None])
    assert tokens[1:3] == [[t for r in rs for t in r.new_token_ids] for rs in alone]
    for i in (0, 1):
        ours, theirs = kept[ids[i]], _oracle(audios[i])
        assert ours.shape == theirs.shape, (i, ours.shape, theirs.shape)
        assert np.abs(ours - theirs).max() <= PROB_ATOL, i
        _check_speakers(results[i], theirs, options[i]["max_speakers"], engine.engine)
    for i in (2, 3):
        assert all(r.token_speakers is None and r.speaker is None for r in results[i])
    _assert_empty(engine)


def _check_speakers(results, probs, max_speakers, engine) -> None:
    """Each token: the oracle's most probable speaker (of the first max_speakers) at its time;
    each final: the speaker of most of its tokens; each word: its first token's."""
    frame_s = engine.diarizer.frame_s
    finals = [r for r in results if r.is_final]
    assert finals and any(r.token_ids for r in finals)
    for r in finals:
        frames = [min(int(t / frame_s + 1e-6), len(probs) - 1) for t in r.token_times_s]
        want = [int(np.argmax(probs[f, :max_speakers])) for f in frames]
        assert r.token_speakers == want
        counts = np.bincount(want, minlength=max_speakers) if want else None
        assert r.speaker == (int(np.argmax(counts)) if want else None)
        assert len(r.word_speakers or []) == len(r.words or [])
    assert max(s for r in finals for s in r.token_speakers) < max_speakers


def test_split_on_speaker_change_ends_a_segment_at_each_change():
    """Each final's tokens have one speaker; consecutive segments of a split differ in speaker; the
    tokens, in order, are the plain stream's; segments are numbered 0, 1, 2, ... and each starts
    at its first token."""
    audios = helpers.utterances(2, seed=5)[:1] * 2
    engine = helpers.new_engine(helpers.model(None), 2, diarizer=diarizer())
    split = {"max_speakers": 4, "split_on_speaker_change": True}
    results, _ = _drive(engine, audios, [split, None], packet=1234)
    finals = [r for r in results[0] if r.is_final]
    assert [t for r in finals for t in r.token_ids] == [t for r in results[1] for t in r.new_token_ids]
    assert [r.segment for r in finals] == list(range(len(finals)))
    changes = [r for r in finals if r.end_reason == "speaker_change"]
    assert changes, "the audio should hold a speaker change (the test would show nothing)"
    for r in finals:
        assert len(set(r.token_speakers)) <= 1 and r.speaker == (r.token_speakers[0] if r.token_ids else None)
        if r.token_ids:
            assert r.segment_start_s <= r.token_times_s[0]
    for before, after in zip(finals, finals[1:]):
        if before.end_reason == "speaker_change" and before.token_ids and after.token_ids:
            assert before.speaker != after.token_speakers[0]
            assert after.segment_start_s == after.token_times_s[0]
    partials = [r for r in results[0] if not r.is_final]
    assert all(len(set(r.token_speakers)) <= 1 for r in partials)
    _assert_empty(engine)


def test_plain_streams_cost_the_diarizer_nothing(monkeypatch):
    def no_step(*args, **kw):
        raise AssertionError("the diarizer stepped for a plain stream")

    monkeypatch.setattr(diar_runner, "plan_step", no_step)
    monkeypatch.setattr(diar_runner, "run_step", no_step)
    engine = helpers.new_engine(helpers.model(None), 2, diarizer=diarizer())
    results, _ = _drive(engine, helpers.utterances(2, seed=1), [None, None])
    assert all(r[-1].done for r in results) and engine.engine.diarizer.num_steps == 0
    _assert_empty(engine)


def test_diarization_option_refused_before_any_work():
    served = helpers.new_engine(helpers.model(None), 2, diarizer=diarizer())
    for bad, said in [({"max_speakers": 5}, "from 1 to 4"), ({"max_speakers": 0}, "from 1 to 4"),
                      ({"max_speakers": True}, "integer"), ({"speakers": 2}, "unknown option"),
                      ([2], "must be an object"), ({"max_speakers": 2, "split_on_speaker_change": "yes"}, "true or false")]:  # fmt: skip
        with pytest.raises(ValueError, match=said):
            served.open_stream(lambda r: None, diarization=bad)
    unserved = helpers.new_engine(helpers.model(None), 2)
    with pytest.raises(ValueError, match="no diarizer loaded"):
        unserved.open_stream(lambda r: None, diarization={"max_speakers": 2})
    _assert_empty(served)
    helpers.assert_engine_empty(unserved)


def test_speaker_window_keeps_what_is_asked_and_stays_small():
    """SpeakerWindow against a whole-history array: every kept frame equal, forgotten ones gone,
    and its rows under four times the most frames it had to keep."""
    rng = np.random.default_rng(0)
    window, whole, most_kept = diar_runner.SpeakerWindow(4, capacity=8), np.zeros((0, 4), np.float32), 0
    for _ in range(2000):
        new = rng.random((int(rng.integers(1, 14)), 4), dtype=np.float32)
        window.append(new)
        whole = np.concatenate([whole, new])
        window.forget_before(len(whole) - int(rng.integers(0, 40)))
        most_kept = max(most_kept, len(whole) - window.first_frame + 14)
        assert window.num_frames == len(whole)
        assert np.array_equal(window.kept(), whole[window.first_frame :])
        assert window.row(len(whole) - 1).tolist() == whole[-1].tolist()
        assert window.capacity < 4 * most_kept
    window.forget_before(10**9)
    assert len(window.kept()) == 1, "the last frame is always kept"


def test_a_forgotten_frame_asked_for_gets_the_oldest_kept_one_and_a_warning(caplog):
    window = diar_runner.SpeakerWindow(2, capacity=4)
    window.append(np.array([[0.9, 0.1], [0.2, 0.8], [0.3, 0.7]], np.float32))
    window.forget_before(2)
    with caplog.at_level("WARNING", logger="nemo_serve.diarization"):
        assert window.row(0).tolist() == window.row(2).tolist() == pytest.approx([0.3, 0.7])
    assert "forgotten frame 0" in caplog.text


def test_a_long_diarized_stream_keeps_a_bounded_window_and_exact_speakers(monkeypatch):
    """Two minutes of speech on one diarized stream: the runner keeps only the frames between the
    attacher's oldest need and its own position (a few seconds, not the stream's length), its
    buffer stops growing early, and every token still gets the speaker of its time (the whole
    history the runner reported)."""
    kept = _kept_probabilities(monkeypatch)
    audio = np.concatenate(helpers.utterances(40, seed=3))[: 16000 * 120]
    engine = helpers.new_engine(helpers.model(None), 1, diarizer=diarizer())
    runner, seen = engine.engine.diarizer, []  # (frames reported, frames kept, buffer rows) per step
    collect = diar_runner.SortformerRunner.collect

    def measuring(self, launched):
        stream_ids = collect(self, launched)
        window = self.streams[stream_ids[0]].preds
        seen.append((window.num_frames, len(window.kept()), window.capacity))
        return stream_ids

    monkeypatch.setattr(diar_runner.SortformerRunner, "collect", measuring)
    results, ids = _drive(engine, [audio], [{"max_speakers": 4}], packet=4000)
    frames_total = seen[-1][0]
    assert frames_total * runner.frame_s > 100
    most_kept = max(k for _, k, _ in seen)
    assert most_kept * runner.frame_s < 10, f"kept {most_kept} frames of {frames_total}"
    early = [c for n, _, c in seen if n * runner.frame_s < 30]
    assert max(c for _, _, c in seen) == max(early), "the buffer grew after the first 30 s"
    _check_speakers(results[0], kept[ids[0]], 4, engine.engine)
    _assert_empty(engine)


def _forgetting_pool_release(self, stream_id):
    """SortformerRunner.close with its slot release lost (the leak the books must catch)."""
    self.streams.pop(stream_id, None)


def test_the_diarizer_books_are_checked_and_a_leaked_slot_is_caught(monkeypatch):
    engine = helpers.new_engine(helpers.model(None), 2, diarizer=diarizer())
    audio = helpers.utterances(1, seed=2)[0]
    a = engine.open_stream(lambda r: None, diarization={"max_speakers": 2})
    b = engine.open_stream(lambda r: None)
    for h in (a, b):
        engine.push(h, audio[:16000])
    for _ in range(3):
        engine.iterate()
    assert engine.check_accounting(exact=True) == 2
    speakers = engine.engine.speakers
    # An aborted stream whose speaker books are not dropped: the diarizer slot would stay held forever.
    monkeypatch.setattr(type(speakers), "drop", lambda self, stream_id: None)
    engine.abort(a)
    engine.iterate()
    with pytest.raises(AccountingError, match="no release waiting"):
        engine.check_accounting()
    monkeypatch.undo()
    speakers.drop(a.stream_id)
    engine.check_accounting()
    # A diarized stream's end whose diarizer slot is never given back.
    monkeypatch.setattr(diar_runner.SortformerRunner, "close", _forgetting_pool_release)
    c = engine.open_stream(lambda r: None, diarization={"max_speakers": 2})
    engine.push(c, audio)
    engine.finish(c)
    with pytest.raises(AccountingError, match="diarizer slots held by"):
        for _ in range(200):
            engine.iterate()
            engine.check_accounting()
    monkeypatch.undo()
    engine.engine.diarizer.pool.release(c.stream_id)
    engine.abort(b)
    _assert_empty(engine)


def test_check_invariants_fails_the_loop_on_a_leaked_diarizer_slot(monkeypatch, tmp_path):
    """NEMO_SERVE_CHECK_INVARIANTS on: the in-process loop checks the diarizer's books after each
    iteration, so a release that loses its diarizer slot fails the engine loudly."""
    monkeypatch.setenv(ENV, str(tmp_path))
    monkeypatch.setattr(diar_runner.SortformerRunner, "close", _forgetting_pool_release)
    engine = helpers.new_engine(helpers.model(None), 2, diarizer=diarizer()).start()
    try:
        done = []
        h = engine.open_stream(lambda r: done.append(r.done), diarization={"max_speakers": 2})
        engine.push(h, helpers.utterances(1, seed=2)[0])
        engine.finish(h)
        deadline = time.monotonic() + 60
        while engine.error is None and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        engine.stop()
    assert isinstance(engine.error, AccountingError) and "diarizer slots held by" in str(engine.error)


@functools.lru_cache(maxsize=None)
def slow_diarizer():
    """The model card's "high" setting: a 10 s chunk, so the diarizer is far behind the ASR's tokens."""
    model = build_diarizer("tiny-sortformer", 0)
    apply_settings(model, MODEL_CARD_SETTINGS["high"])
    return model


def test_a_forced_final_on_a_diarized_stream_comes_out_at_once(monkeypatch):
    """force_final with no more audio coming yet: the final (and any before it) is in the very next
    iteration's output, each token the diarizer has reached with its speaker and each later one
    with the speaker of the diarizer's latest frame; the stream then goes on, exact, to its end."""
    kept = _kept_probabilities(monkeypatch)
    audio = np.concatenate(helpers.utterances(5, seed=4))
    assert len(audio) > 16000 * 14
    engine = helpers.new_engine(helpers.model(None), 1, diarizer=slow_diarizer())
    results = []
    h = engine.open_stream(results.append, diarization={"max_speakers": 4})
    pos = 0
    while pos < 16000 * 12:
        engine.push(h, audio[pos : pos + 1600])
        pos += 1600
        engine.iterate()
    for _ in range(5):
        engine.iterate()  # nothing more arrives: the diarizer stays behind the last tokens
    assert not any(r.is_final for r in results)
    engine.force_final(h)
    engine.iterate()
    finals = [r for r in results if r.is_final]
    assert finals and finals[-1].end_reason == "force_final"
    frame_s, probs = engine.engine.diarizer.frame_s, kept[h.stream_id]
    latest = int(np.argmax(probs[-1, :4]))
    times = [t for r in finals for t in r.token_times_s]
    reached = [int(t / frame_s + 1e-6) < len(probs) for t in times]
    assert any(reached) and not all(reached), (len(probs), times)
    want = [int(np.argmax(probs[int(t / frame_s + 1e-6), :4])) if r else latest for t, r in zip(times, reached)]
    assert [s for r in finals for s in r.token_speakers] == want
    for at in range(pos, len(audio), 1600):
        engine.push(h, audio[at : at + 1600])
        engine.iterate()
    engine.finish(h)
    for _ in range(400):
        engine.iterate()
        if results[-1].done:
            break
    later = [r for r in results if r.is_final][len(finals) :]
    assert results[-1].done and later
    _check_speakers(later, kept[h.stream_id], 4, engine.engine)
    _assert_empty(engine)


def test_a_forced_final_before_the_diarizer_has_any_frame_says_speaker_zero():
    """3 s into a stream at the 10 s setting the diarizer has reported nothing: the forced final
    is out at once, its tokens and itself speaker 0 (Sortformer's first voice), never None."""
    audio = np.concatenate(helpers.utterances(2, seed=4))
    engine = helpers.new_engine(helpers.model(None), 1, diarizer=slow_diarizer())
    results = []
    h = engine.open_stream(results.append, diarization={"max_speakers": 4})
    for at in range(0, 3 * 16000, 1600):
        engine.push(h, audio[at : at + 1600])
        engine.iterate()
    assert engine.engine.diarizer.streams[h.stream_id].num_frames == 0
    engine.force_final(h)
    engine.iterate()
    forced = [r for r in results if r.is_final]
    assert len(forced) == 1 and forced[0].token_ids, forced
    assert forced[0].token_speakers == [0] * len(forced[0].token_ids) and forced[0].speaker == 0
    engine.abort(h)
    _assert_empty(engine)


def test_the_diarizer_slot_table_reports_a_slot_both_held_and_free():
    engine = helpers.new_engine(helpers.model(None), 2, diarizer=diarizer())
    h = engine.open_stream(lambda r: None, diarization={"max_speakers": 2})
    engine.iterate()
    pool = engine.engine.diarizer.pool
    pool._free_slots.append(pool.stream_to_slot[h.stream_id])  # a release run twice by hand
    with pytest.raises(AccountingError, match="one is both or twice"):
        engine.check_accounting()
    pool._free_slots.pop()
    engine.abort(h)
    _assert_empty(engine)


def test_each_diarizer_feature_frame_is_computed_once(monkeypatch):
    """Consecutive chunks overlap by their left and right context; a frame computed for one chunk
    serves the next (diarization/features.py): the preprocessor computes each of the stream's
    feature frames once, the speakers staying NeMo's (the other tests here run with the reuse)."""
    engine = helpers.new_engine(helpers.model(None), 1, diarizer=diarizer())
    runner, computed = engine.engine.diarizer, []
    compute = runner.features.compute

    def counting(audios, t0s, n, **kw):
        computed.append(n * len(audios))
        return compute(audios, t0s, n, **kw)

    monkeypatch.setattr(runner.features, "compute", counting)
    audio = helpers.utterances(1, seed=2)[0]
    results, _ = _drive(engine, [audio], [{"max_speakers": 4}], packet=1234)
    num_frames = runner._final_frames(_ended_buffer(audio))
    assert results[0][-1].done and runner.num_steps > 10
    assert sum(computed) == num_frames, (sum(computed), num_frames)
    _assert_empty(engine)


def _ended_buffer(audio: np.ndarray) -> AudioBuffer:
    buffer = AudioBuffer()
    buffer.extend((audio,), time.time())
    buffer.finish()
    return buffer


def test_an_id_the_diarizer_still_holds_is_refused_before_any_slot_is_taken():
    """A stream whose ASR side has ended keeps its diarizer slot until its speakers are out; a
    second stream opened meanwhile with its id (the bare engine's API allows it) is refused before
    the engine takes its slot, so the refusal loses nothing: the slot stays free, the books agree,
    and the id opens again once the first stream's release is out."""
    engine = helpers.bare_engine(helpers.model(None), 2, diarizer=diarizer())
    first = engine.admit(slot=0, stream_id="x", diarization={"max_speakers": 2})
    engine.take_audio(first, (helpers.utterances(1, seed=2)[0][:40000],), time.time())
    engine.finish(first)
    released = []
    for _ in range(200):
        released += [r.stream_id for r in engine.iterate().released]
        if not engine.slots.holds(first):
            break
    assert "x" in engine.diarizer.streams and not released, "the ASR side ended with the diarizer done: no window"
    with pytest.raises(ValueError, match="'x'"):
        engine.admit(slot=1, stream_id="x", diarization={"max_speakers": 2})
    assert not engine.slots.held[1]
    assert engine.check_accounting() == 0
    for _ in range(200):
        released += [r.stream_id for r in engine.iterate().released]
        if released:
            break
    assert released == ["x"]
    again = engine.admit(slot=1, stream_id="x", diarization={"max_speakers": 2})
    engine.abort(again)
    engine.iterate()
    assert engine.check_accounting() == 0
    assert not engine.diarizer.streams and not engine.slots.held.any()
