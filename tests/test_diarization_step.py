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
from nemo_serve.diarization.reference import nemo_chunks, stream_features
from nemo_serve.diarization.settings import MODEL_CARD_SETTINGS, apply_settings
from nemo_serve.diarization.slots import NoFreeSlot, SpeakerCacheSlots
from nemo_serve.synth import synth_audio

from .helpers_diarization import assert_matches_nemo_loop, run_batched

# (stream seconds, first step it may start at): more streams than slots, so slots are reused.
# >= 30 s each: every setting compresses its speaker cache. The third waits for a slot, so it runs
# beside the others' late chunks (full cache) from its first chunk (empty cache, no left context).
STREAMS = [(31.5, 0), (30.5, 1), (32.0, 1)]


@functools.lru_cache(maxsize=None)
def built():
    return build_diarizer("tiny-sortformer", 0)


@pytest.mark.parametrize("setting", list(MODEL_CARD_SETTINGS))
def test_batched_step_matches_nemo_loop_per_stream(setting):
    model = built()
    apply_settings(model, MODEL_CARD_SETTINGS[setting])
    chunks = [nemo_chunks(model, stream_features(model, synth_audio(seconds, 10 + i))) for i, (seconds, _) in enumerate(STREAMS)]
    ours, end_states = run_batched(model, chunks, [start for _, start in STREAMS])
    assert_matches_nemo_loop(model, chunks, ours, end_states, setting)


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
