"""The in-place speaker-cache update (update.py) against NeMo's per-row `streaming_update_async`, at 256 rows.

Random states at every fill level (empty cache, part-filled, full; FIFO empty to full; rows whose
cache overflows this step and is compressed, rows that only append). All rows have the same chunk
width, where NeMo's batched update is row-by-row exact (it sizes pop-outs by the batch's widest chunk).
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.diar_update_bench import nemo, ours, random_rows, sortformer_modules
from nemo_serve.diarization.settings import MODEL_CARD_SETTINGS

NUM_ROWS = 256


@pytest.mark.parametrize("setting", list(MODEL_CARD_SETTINGS))
def test_in_place_update_equals_nemo_async_update(setting):
    modules = sortformer_modules(setting, emb_dim=32)
    state, chunk, preds = random_rows(modules, NUM_ROWS, torch.Generator().manual_seed(7))
    new, chunk_preds, chunk_lengths = ours(modules, state, chunk, preds)
    ref, ref_chunk_preds = nemo(modules, state, chunk, preds)
    assert torch.equal(chunk_preds, ref_chunk_preds)
    assert torch.equal(chunk_lengths, torch.full((NUM_ROWS,), modules.chunk_len))
    assert torch.equal(new.spkcache_lengths, ref.spkcache_lengths) and torch.equal(new.fifo_lengths, ref.fifo_lengths)
    assert torch.equal(new.n_sil_frames, ref.n_sil_frames)
    assert torch.equal(new.fifo, ref.fifo)
    # the silence mean sums over a wider zero-padded window than NeMo's (pop-out only): last bits only
    torch.testing.assert_close(new.mean_sil_emb, ref.mean_sil_emb, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(new.spkcache, ref.spkcache, rtol=1e-6, atol=1e-6)
    assert torch.equal(new.spkcache_preds, ref.spkcache_preds)  # same frames chosen by the top-k
    # the random state exercises what it claims: rows compressed this step, rows that only appended
    compressed = (state.spkcache_lengths + modules.spkcache_update_period > modules.spkcache_len) & (
        state.fifo_lengths + modules.chunk_len > modules.fifo_len)
    assert compressed.any() and (setting == "very_high" or not compressed.all())  # very_high: every row pops 300
    assert (new.n_sil_frames > state.n_sil_frames).any()
