"""Batched streaming Sortformer (nemo_serve.diarization) against NeMo's own loop, one stream at a time.

At each latency setting of the model card: streams of different lengths start at different steps,
share fewer slots than there are streams (a finished stream's slot is reused), and so sit in one
batch at different fill levels and at different points of their streams. Each stream's speaker
probabilities must equal NeMo's within PROB_ATOL and its decisions (p > 0.5, argmax) be identical.
"""

from __future__ import annotations

import functools

import pytest
import torch

from nemo_serve.builtin.sortformer import build_diarizer
from nemo_serve.diarization.reference import nemo_chunks, nemo_reference_preds, stream_features
from nemo_serve.diarization.settings import MODEL_CARD_SETTINGS, apply_settings
from nemo_serve.diarization.slots import NoFreeSlot, SpeakerCacheSlots
from nemo_serve.diarization.step import diarize_step, make_batch
from nemo_serve.synth import synth_audio

PROB_ATOL = 2e-5  # fp32: padding changes matmul shapes, so the last bits differ (max seen 2.9e-6)
# (stream seconds, first step it may start at): more streams than slots, so slots are reused.
# >= 30 s each: every setting compresses its speaker cache. The third waits for a slot, so it runs
# beside the others' late chunks (full cache) from its first chunk (empty cache, no left context).
STREAMS = [(31.5, 0), (30.5, 1), (32.0, 1)]
NUM_SLOTS = 2


@functools.lru_cache(maxsize=None)
def built():
    return build_diarizer("tiny-sortformer", 0)


def _run_batched(model, chunks_per_stream, starts):
    """Step all ready streams together until every stream is done; returns preds per stream and end states."""
    pool = SpeakerCacheSlots.for_model(model, NUM_SLOTS)
    outputs = {i: [] for i in range(len(chunks_per_stream))}
    next_chunk, end_states, step = {}, {}, 0
    waiting = list(range(len(chunks_per_stream)))
    while waiting or next_chunk:
        for i in [i for i in waiting if starts[i] <= step]:
            if not pool.num_free:
                break
            pool.acquire(f"s{i}")
            next_chunk[i] = 0
            waiting.remove(i)
        ready = sorted(next_chunk)
        if not ready:  # every started stream is done and the next may not start yet
            step += 1
            continue
        slots = [pool.stream_to_slot[f"s{i}"] for i in ready]
        batch = make_batch(slots, [chunks_per_stream[i][next_chunk[i]] for i in ready])
        result = diarize_step(model, pool, batch)
        assert not pool.problems()  # the host's fill levels (the step's widths and branches) = the device's
        for row, i in enumerate(ready):
            outputs[i].append(result.chunk_preds[row, : int(result.chunk_lengths[row])])
            next_chunk[i] += 1
            if next_chunk[i] == len(chunks_per_stream[i]):
                end_states[i] = pool.gather(torch.tensor([slots[row]]))
                pool.release(f"s{i}")
                del next_chunk[i]
        step += 1
    assert pool.num_used == 0 and pool.num_free == NUM_SLOTS
    return [torch.cat(outputs[i]) for i in range(len(chunks_per_stream))], end_states


@pytest.mark.parametrize("setting", list(MODEL_CARD_SETTINGS))
def test_batched_step_matches_nemo_loop_per_stream(setting):
    model = built()
    apply_settings(model, MODEL_CARD_SETTINGS[setting])
    chunks = [nemo_chunks(model, stream_features(model, synth_audio(seconds, 10 + i))) for i, (seconds, _) in enumerate(STREAMS)]
    ours, end_states = _run_batched(model, chunks, [start for _, start in STREAMS])
    for i, stream_chunks in enumerate(chunks):
        theirs = nemo_reference_preds(model, stream_chunks)
        assert ours[i].shape == theirs.shape, (i, ours[i].shape, theirs.shape)
        max_diff = (ours[i] - theirs).abs().max().item()
        print(f"{setting} stream {i}: max |p - p_nemo| = {max_diff:.2e}")
        assert max_diff <= PROB_ATOL, (setting, i, max_diff)
        assert torch.equal(ours[i] > 0.5, theirs > 0.5), (setting, i)
        assert torch.equal(ours[i].argmax(dim=1), theirs.argmax(dim=1)), (setting, i)
        # the test exercises what it claims: the cache filled and was compressed, silence was seen
        state = end_states[i]
        assert int(state.spkcache_lengths) == model.sortformer_modules.spkcache_len, (setting, i)
        assert int(state.n_sil_frames) > 0, (setting, i)


def test_slots_refuse_when_full_and_release_is_idempotent():
    pool = SpeakerCacheSlots(2, spkcache_len=8, fifo_len=4, emb_dim=3, num_speakers=2, chunk_room=2, pop_room=3)
    assert [pool.acquire("a"), pool.acquire("b")] == [0, 1]
    with pytest.raises(NoFreeSlot):
        pool.acquire("c")
    with pytest.raises(ValueError, match="already holds"):
        pool.acquire("a")
    pool.tables.fifo[0].fill_(1.0)
    pool.tables.fifo_lengths[0] = 4
    pool.release("a")
    pool.release("a")
    assert pool.num_free == 1 and pool.num_used == 1
    assert pool.acquire("c") == 0
    state = pool.gather(torch.tensor([0]))
    assert int(state.fifo_lengths) == 0 and not state.fifo.any()  # zeroed on reuse
