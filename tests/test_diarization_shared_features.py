"""A diarizer whose preprocessor is the ASR model's takes its feature frames from the ASR side
(diarization/shared_features.py, diarization/runner.py): no second preprocessor run, the speakers
still NeMo's loop's and the same as with the diarizer's own frames; where the configs differ the
diarizer computes its own (test_diarization_engine.py runs that path: tiny-sortformer's 128 mels
beside the demo ASR model's 80)."""

from __future__ import annotations

import copy
import functools

import numpy as np
import pytest
import torch

from nemo_serve.builtin.sortformer import DEMO_DIARIZER_PATH, build_diarizer
from nemo_serve.diarization.reference import nemo_chunks, nemo_reference_preds, stream_features
from nemo_serve.diarization.runner import SortformerRunner
from nemo_serve.diarization.settings import MODEL_CARD_SETTINGS, apply_settings
from nemo_serve.diarization.shared_features import feature_differences
from nemo_serve.engine.frontend import AudioBuffer
from tests import helpers

from .helpers_diarization import _assert_empty, _drive, _kept_probabilities
from .test_diarization_overlap import ThreadDiarDevice

pytestmark = pytest.mark.skipif(not DEMO_DIARIZER_PATH.exists(), reason="no demo_sortformer.nemo shipped")
PROB_ATOL = 2e-5  # as tests/test_diarization_step.py


@functools.lru_cache(maxsize=None)
def demo_diarizer(setting: str):
    model = build_diarizer("demo-sortformer")  # 80 mels, as the demo ASR model
    model.streaming_mode = model.async_streaming = True
    apply_settings(model, MODEL_CARD_SETTINGS[setting])
    return model


def _oracle(model, audio: np.ndarray) -> np.ndarray:
    return nemo_reference_preds(model, nemo_chunks(model, stream_features(model, torch.from_numpy(audio)))).numpy()


def _run(monkeypatch, setting: str, share: bool, audios, overlap: bool = False):
    """Two diarized streams and a plain one, opened at different ticks; (results, probabilities
    per diarized stream, frames the diarizer's own preprocessor computed, engine). `overlap`: the
    overlapped loop, the diarizer's steps on a stand-in device thread (test_diarization_overlap.py)."""
    kept = _kept_probabilities(monkeypatch)
    engine = helpers.new_engine(helpers.model(None), 3, diarizer=demo_diarizer(setting), overlap=overlap)
    runner, computed = engine.engine.diarizer, []
    if overlap:
        runner.device = ThreadDiarDevice(0.004)
    assert runner.shares_asr_features, "the demo ASR model's and demo-sortformer's preprocessors differ"
    runner.shares_asr_features = share
    compute = runner.features.compute

    def counting(audios, t0s, n, **kw):
        computed.append(n * len(audios))
        return compute(audios, t0s, n, **kw)

    monkeypatch.setattr(runner.features, "compute", counting)
    options = [{"max_speakers": 4}, {"max_speakers": 2}, None]
    results, ids = _drive(engine, audios, options, packet=1234, start_tick=[0, 3, 1])
    _assert_empty(engine)
    return results, [kept[ids[0]], kept[ids[1]]], sum(computed), engine


@pytest.mark.parametrize("setting", ["ultra_low", "low"])
def test_shared_features_give_nemo_speakers_and_the_own_features_speakers(monkeypatch, setting):
    audios = helpers.utterances(3, seed=7)
    shared, shared_probs, shared_computed, engine = _run(monkeypatch, setting, True, audios)
    own, own_probs, own_computed, _ = _run(monkeypatch, setting, False, audios)
    num_frames = sum(engine.engine.diarizer._final_frames(_ended(a)) for a in audios[:2])
    print(f"{setting}: frames computed by the diarizer: shared {shared_computed}, own {own_computed} of {num_frames}")
    assert own_computed == num_frames  # the own path: every frame once, by the diarizer
    # none: the ASR side encodes every frame of these streams (docs/diarization.md: "the diarizer's
    # preprocessor computing no frame"); a tail it skips is the withholding test's case below
    assert shared_computed == 0, (shared_computed, num_frames)
    for i in (0, 1):
        theirs = _oracle(demo_diarizer(setting), audios[i])
        assert shared_probs[i].shape == theirs.shape
        diff = np.abs(shared_probs[i] - theirs).max()
        print(f"{setting} stream {i}: shared max |p - p_nemo| = {diff:.2e}, own {np.abs(own_probs[i] - theirs).max():.2e}")
        assert diff <= PROB_ATOL, (i, diff)
        assert np.array_equal(shared_probs[i] > 0.5, theirs > 0.5) and np.array_equal(shared_probs[i].argmax(1), theirs.argmax(1))
        assert np.abs(shared_probs[i] - own_probs[i]).max() <= PROB_ATOL
    speakers = [[(r.token_speakers, r.speaker) for r in rs if r.is_final] for rs in shared]
    assert speakers == [[(r.token_speakers, r.speaker) for r in rs if r.is_final] for rs in own]
    assert any(s for s, _ in speakers[0]), "no token got a speaker"
    assert all(r.token_speakers is None for r in shared[2])  # the plain stream


def test_shared_features_with_the_overlapped_loop_give_nemo_speakers(monkeypatch):
    """Overlap on (NEMO_SERVE_OVERLAP=1): the ASR step's frames are handed over at its launch and
    the diarizer's steps run on another thread; its probabilities are still NeMo's loop's."""
    audios = helpers.utterances(3, seed=7)
    results, probs, computed, engine = _run(monkeypatch, "ultra_low", True, audios, overlap=True)
    num_frames = sum(engine.engine.diarizer._final_frames(_ended(a)) for a in audios[:2])
    assert computed == 0, (computed, num_frames)  # as without the overlap
    for i in (0, 1):
        theirs = _oracle(demo_diarizer("ultra_low"), audios[i])
        assert probs[i].shape == theirs.shape and np.abs(probs[i] - theirs).max() <= PROB_ATOL, i
    assert all(r.token_speakers is not None for rs in results[:2] for r in rs if r.is_final)


def _ended(audio: np.ndarray) -> AudioBuffer:
    buffer = AudioBuffer()
    buffer.extend((audio,), 0.0)
    buffer.finish()
    return buffer


def test_the_configs_that_share_and_those_that_do_not():
    asr = helpers.model(None).preprocessor
    assert feature_differences(asr, demo_diarizer("low").preprocessor) == []  # pad_to 0 / 16: ignored
    tiny = build_diarizer("tiny-sortformer").preprocessor
    assert any(d.startswith("nfilt") for d in feature_differences(asr, tiny))
    changed = copy.deepcopy(demo_diarizer("low").preprocessor)
    changed.featurizer.preemph = 0.96
    changed.featurizer.fb[0, 0, 1] += 1e-7  # one filterbank weight
    found = feature_differences(asr, changed)
    assert any(d.startswith("preemph") for d in found) and "buffer fb differs" in found, found
    changed.train()
    assert any("training" in d for d in feature_differences(asr, changed))


def test_frames_the_asr_side_never_computes_are_computed_by_the_diarizer(monkeypatch):
    """The ASR side's last chunk withheld from the diarizer, as a tail the ASR does not encode: the
    stream's release tells the diarizer, which computes those frames itself; speakers still NeMo's."""
    take = SortformerRunner.take_asr_features

    def withholding_last(self, stream_ids, t0s, widths, last, feats):
        take(self, [None if is_last else i for i, is_last in zip(stream_ids, last)], t0s, widths, np.zeros_like(last), feats)

    monkeypatch.setattr(SortformerRunner, "take_asr_features", withholding_last)
    audios = helpers.utterances(3, seed=7)
    _, probs, computed, engine = _run(monkeypatch, "ultra_low", True, audios)
    num_frames = sum(engine.engine.diarizer._final_frames(_ended(a)) for a in audios[:2])
    assert 0 < computed < num_frames / 2, (computed, num_frames)
    for i in (0, 1):
        theirs = _oracle(demo_diarizer("ultra_low"), audios[i])
        assert probs[i].shape == theirs.shape and np.abs(probs[i] - theirs).max() <= PROB_ATOL


PACKET = 1234  # samples: packets that fall across chunk and frame edges


def _feed(engine, h, audio: np.ndarray, upto: int, pos: list[int], i: int) -> None:
    """One packet of stream i's audio, while it has not reached `upto`."""
    if pos[i] < upto:
        engine.push(h, audio[pos[i] : min(pos[i] + PACKET, upto)])
        pos[i] = min(pos[i] + PACKET, upto)


@pytest.mark.parametrize("overlap", [False, True])
def test_every_way_the_asr_side_stops_the_diarizer_ends_or_releases(monkeypatch, overlap):
    """On the shared path a diarizer chunk waits for the ASR side's frames; wherever the ASR side
    stops for a stream, the stream still gets its diarizer tail (its `done` final, every token
    with a speaker) or its release: its last chunk at the end of input (0); an input that ends 4
    frames past a chunk, a tail the ASR side does not encode, so the core releases the stream on it
    (1); an abort mid-stream while its diarizer waits for frames (2); a forced final, then the end
    (3); an input that ends at once, with no audio (4); one shorter than the first chunk (5). Bounded: a stream that waited forever would fail the tick limit, a leaked slot the last check."""
    engine = helpers.new_engine(helpers.model(None), 6, diarizer=demo_diarizer("ultra_low"), overlap=overlap)
    runner = engine.engine.diarizer
    assert runner.shares_asr_features
    handed_last, stopped, waited = set(), set(), set()
    take, stop = runner.take_asr_features, runner.asr_stopped

    def taking(stream_ids, t0s, widths, last, feats):
        handed_last.update(i for i, is_last in zip(stream_ids, last) if i is not None and is_last)
        return take(stream_ids, t0s, widths, last, feats)

    def stopping(stream_id):
        stopped.add(stream_id)
        return stop(stream_id)

    monkeypatch.setattr(runner, "take_asr_features", taking)
    monkeypatch.setattr(runner, "asr_stopped", stopping)
    audios = helpers.utterances(4, seed=3) + [np.zeros(0, np.float32), helpers.utterances(1, seed=4)[0][:4800]]
    g = engine.engine.geometry  # frames at the end of input: samples // hop + 1 (engine/geometry.py)
    later_chunks = (len(audios[1]) // g.hop_samples - g.first_frames) // g.chunk_frames - 1  # all within its audio
    tail_frames = g.first_frames + later_chunks * g.chunk_frames + 4
    audios[1] = audios[1][: (tail_frames - 1) * g.hop_samples + 50]
    assert 0 < 4 < g.min_later_frames
    results = [[] for _ in audios]
    hs = [engine.open_stream(results[i].append, diarization={"max_speakers": 4}) for i in range(len(audios))]
    ids = [h.stream_id for h in hs]
    pos, half = [0] * len(audios), [len(a) // 2 for a in audios]
    engine.finish(hs[4])
    aborted = forced = False
    for tick in range(3000):
        for i in (0, 1, 3, 5):
            _feed(engine, hs[i], audios[i], len(audios[i]) if i != 3 or forced else half[i], pos, i)
        _feed(engine, hs[2], audios[2], half[2], pos, 2)
        for i in (0, 1, 5):
            if pos[i] == len(audios[i]) and not hs[i].finished:
                engine.finish(hs[i])  # with its last packet
        s2 = runner.streams.get(ids[2])
        if pos[2] == half[2] and not aborted and s2 and s2.next_start and runner._next_cut(s2) is None:
            waited.add(ids[2])
            engine.abort(hs[2])  # its diarizer waits (for audio or the ASR side's frames)
            aborted = True
        if pos[3] == half[3] and not forced:
            engine.force_final(hs[3])
            forced = True
        if pos[3] == len(audios[3]) and not hs[3].finished:
            engine.finish(hs[3])
        engine.iterate()
        if aborted and all(results[i] and results[i][-1].done for i in (0, 1, 3, 4, 5)) and not runner.streams:
            break
    else:
        raise AssertionError(f"streams waited: {sorted(runner.streams)}, results {[len(r) for r in results]}")
    engine.iterate()
    _assert_empty(engine)
    assert ids[0] in handed_last and ids[1] not in handed_last and ids[1] in stopped, (handed_last, stopped)
    assert ids[2] in waited and not any(r.done for r in results[2])
    assert [r.end_reason for r in results[3] if r.is_final][0] == "force_final"
    assert ids[5] in handed_last and [r.token_ids for r in results[4]] == [[]], (handed_last, results[4])
    for i in (0, 1, 3, 4, 5):
        finals = [r for r in results[i] if r.is_final]
        assert finals[-1].done and (i >= 4 or any(r.token_ids for r in finals)), i  # 0.3 s: no word yet
        assert all(r.token_speakers is not None and len(r.token_speakers) == len(r.token_ids) for r in finals), i
