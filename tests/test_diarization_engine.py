"""Streaming Sortformer in the engine core's loop (engine/runner.py, diarization/runner.py, engine/speakers.py).

In process (core/inproc.py, the production core): diarized and plain streams share the engine; a
diarized stream's ASR tokens equal a plain stream's on the same audio, its speaker probabilities
equal NeMo's own streaming loop on that stream alone (diarization/reference.py), every token
carries the speaker of its time, finals the speaker of most of their tokens; plain streams cost
the diarizer nothing; a bad or unserved `diarization` option is refused before any work.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from nemo_serve.builtin.sortformer import build_diarizer
from nemo_serve.diarization import runner as diar_runner
from nemo_serve.diarization.reference import nemo_chunks, nemo_reference_preds, stream_features
from nemo_serve.diarization.settings import MODEL_CARD_SETTINGS, apply_settings
from tests import helpers

PROB_ATOL = 2e-5  # as tests/test_diarization_step.py: padding changes matmul shapes


@functools.lru_cache(maxsize=None)
def diarizer():
    model = build_diarizer("tiny-sortformer", 0)
    apply_settings(model, MODEL_CARD_SETTINGS["ultra_low"])  # short chunks: many steps on short audio
    return model


def _oracle(audio: np.ndarray) -> np.ndarray:
    model = diarizer()
    return nemo_reference_preds(model, nemo_chunks(model, stream_features(model, torch.from_numpy(audio)))).numpy()


def _kept_probabilities(monkeypatch) -> dict:
    """stream_id -> its speaker probabilities as the runner had them when it let the stream go."""
    kept, close = {}, diar_runner.SortformerRunner.close

    def keeping(self, stream_id):
        if stream_id in self.streams:
            kept[stream_id] = self.streams[stream_id].preds.copy()
        close(self, stream_id)

    monkeypatch.setattr(diar_runner.SortformerRunner, "close", keeping)
    return kept


def _drive(engine, audios, diarization, packet=1600, start_tick=None):
    """helpers.drive with per-stream `diarization` options; returns (results per stream, stream ids)."""
    results, handles, pos, start_tick = [[] for _ in audios], {}, [0] * len(audios), start_tick or [0] * len(audios)
    for tick in range(100000):
        for i, audio in enumerate(audios):
            if tick == start_tick[i]:
                handles[i] = engine.open_stream(results[i].append, diarization=diarization[i])
            if i in handles and pos[i] < len(audio):
                engine.push(handles[i], audio[pos[i] : pos[i] + packet])
                pos[i] += packet
                if pos[i] >= len(audio):
                    engine.finish(handles[i])
        engine.iterate()
        if all(r and r[-1].done for r in results):
            engine.iterate()
            return results, [handles[i].stream_id for i in range(len(audios))]
    raise AssertionError("streams did not finish")


def _assert_empty(engine) -> None:
    helpers.assert_engine_empty(engine)
    d = engine.engine.diarizer
    assert not d.streams and d.pool.num_used == 0 and not engine.engine.speakers


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

    monkeypatch.setattr(diar_runner, "diarize_step", no_step)
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
