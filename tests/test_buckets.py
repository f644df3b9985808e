"""Static batch buckets: sizes, the row cap, and that bucketing, padding and splitting change no token."""

import numpy as np
import pytest
import torch

from nemo_serve.engine.buckets import bucket_for, bucket_sizes, max_step_rows, split
from nemo_serve.engine.slots import SlotPool
from nemo_serve.engine.step import StepBatch, run_step, stepper_for
from nemo_serve.oracle import oracle_transcribe

from . import helpers

DEFAULT_MODES = helpers.model(None, None).trained_context_right


def test_bucket_sizes_and_choice():
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(8) == [1, 2, 4, 8]
    assert bucket_sizes(12) == [1, 2, 4, 8, 12]
    sizes = bucket_sizes(8192)
    assert len(sizes) == 14 and sizes[-1] == 8192
    assert [bucket_for(n, [1, 2, 4, 8, 12]) for n in (1, 2, 3, 5, 8, 9, 12)] == [1, 2, 4, 8, 8, 12, 12]
    with pytest.raises(ValueError):
        bucket_for(13, [1, 2, 4, 8, 12])
    assert split(7, 3) == [(0, 3), (3, 6), (6, 7)]
    assert split(3, 3) == [(0, 3)]


def test_max_step_rows_caps_the_gather_buffer():
    mib = 2**20
    assert max_step_rows(8000, 7 * mib, 4 * 2**30) == 512  # Nemotron-like: 512 x 7 MiB = 3.5 GiB
    assert max_step_rows(8000, 7 * mib, 1) == 1  # at least one row
    assert max_step_rows(12, 1, 2**30) == 12  # everything fits: the slot count itself
    assert max_step_rows(100, mib, 64 * mib) == 64


def test_gather_buffer_is_sized_once_and_not_grown():
    m = helpers.model("builtin:tiny-char", 3)
    pool = SlotPool(m, 16, max_rows=4)
    buf = pool._channel_buf
    assert buf.numel() == 4 * pool.cache_last_channel[:, 0].numel()
    pool.gather_encoder(torch.arange(4))
    assert pool._channel_buf is buf
    with pytest.raises(ValueError):
        pool.gather_encoder(torch.arange(5))
    assert pool.fixed_bytes == pool.bytes_per_slot + buf.numel() * buf.element_size()


def _bucketed_engine(m, num_slots, max_rows):
    eng = helpers.new_engine(m, num_slots)
    eng.engine.pool = SlotPool(m, num_slots, eng.engine.encoder.channel_shape, max_rows=max_rows)
    return eng


@pytest.mark.parametrize("context_right", DEFAULT_MODES)
def test_buckets_padding_and_splits_match_oracle_every_mode_fp32(context_right):
    """Seven streams, steps of at most 5 rows (buckets 1, 2, 4, 5). Aligned (2 s packets, same
    start): 7 ready rows are split 5 + 2. Ragged (staggered starts, uneven packets): odd group sizes run
    padded, short final chunks beside full ones. Three then four (2 s packets, three streams open
    first): 3 rows run padded to 4 whatever the utterances. Every stream's tokens equal NeMo's loop."""
    m = helpers.model(None, context_right)
    audios = helpers.utterances(7, seed=context_right)
    refs = [oracle_transcribe(m, a).token_ids for a in audios]
    three_then_four = [0, 0, 0, 60, 60, 60, 60]
    for packet, start in [(32000, [0] * 7), ([3200, 700, 16000, 1], [0, 0, 0, 1, 1, 2, 5]), (32000, three_then_four)]:
        eng = _bucketed_engine(m, 8, 5)
        driven = helpers.drive(eng, audios, packet=packet, start_tick=start)
        for i in range(len(audios)):
            assert driven.tokens(i) == refs[i], (packet, i)
        st = stepper_for(m, eng.engine.encoder, eng.engine.pool)
        assert st.sizes == [1, 2, 4, 5]
        if start == [0] * 7:
            assert st.parts > eng.stats.steps  # steps were split
        if start == three_then_four:
            assert st.padded_rows > 0  # the three first chunks ran as a bucket of 4
        helpers.assert_engine_empty(eng)


def test_power_of_two_padding_matches_oracle_prompt_model():
    """Buckets 1, 2, 4, 8 with mixed languages: 5 or 6 ready rows run at 8, 3 at 4."""
    m = helpers.model("builtin:tiny-prompt", 3)
    codes = sorted(m.prompt_dictionary)[:3]
    audios = helpers.utterances(6, seed=11)
    languages = [codes[i % 3] for i in range(6)]
    eng = _bucketed_engine(m, 8, 8)
    driven = helpers.drive(eng, audios, packet=[4000, 1280], start_tick=[0, 0, 0, 1, 2, 2], languages=languages)
    for i, (a, lang) in enumerate(zip(audios, languages)):
        assert driven.tokens(i) == oracle_transcribe(m, a, language=lang).token_ids, (i, lang)
    assert stepper_for(m, eng.engine.encoder, eng.engine.pool).padded_rows > 0
    helpers.assert_engine_empty(eng)


def test_padded_rows_touch_only_the_scratch_slot():
    m = helpers.model(None, 3)
    eng = _bucketed_engine(m, 6, 4)
    pool, g = eng.engine.pool, m.geometry
    for i in range(3):
        pool.open_row(i)
    before = [t.clone() for t in pool._slot_tensors()]
    scratch_len = int(pool.cache_last_channel_len[pool.scratch])
    feats = torch.randn(3, m.num_mels, g.first_frames)
    with torch.inference_mode():
        r = run_step(m, eng.engine.encoder, pool, StepBatch(np.array([0, 1, 2]), feats, [g.first_frames] * 3, True, None))
    assert len(r.token_ids) == 3  # the padded fourth row's results are not returned
    for i, t in enumerate(pool._slot_tensors()):
        axis = 1 if t.dim() >= 2 and t.shape[0] != pool.num_slots + 1 else 0
        unused = torch.tensor([3, 4, 5])  # free slots: untouched by the padded row
        assert torch.equal(t.index_select(axis, unused), before[i].index_select(axis, unused)), i
    assert int(pool.cache_last_channel_len[pool.scratch]) > scratch_len  # the scratch slot was run
    assert int(pool.decoded_lengths[pool.scratch]) == 0  # ... with decode length 0


def test_freed_slots_are_reset_in_one_batch_before_the_next_step():
    m = helpers.model(None, 3)
    eng = helpers.new_engine(m, 4)
    pool, g = eng.engine.pool, m.geometry
    for i in range(3):
        pool.open_row(i)
    feats = torch.randn(3, m.num_mels, g.first_frames)
    with torch.inference_mode():
        run_step(m, eng.engine.encoder, pool, StepBatch(np.array([0, 1, 2]), feats, [g.first_frames] * 3, True, None))
    assert (pool.cache_last_channel_len[:3] > 0).all()
    pool.close_row(0)
    pool.close_row(2)
    assert pool._to_reset == [0, 2] and pool.cache_last_channel_len[0] > 0
    with torch.inference_mode():
        run_step(m, eng.engine.encoder, pool, StepBatch(np.array([1]), feats[:1, :, :], [g.first_frames], True, None))
    assert pool._to_reset == []
    assert pool.cache_last_channel_len[0] == 0 and pool.cache_last_channel_len[2] == 0
    assert pool.decoded_lengths[0] == 0 and pool.labels[2] == m.blank_id


def test_reallocated_slot_keeps_its_new_language_across_the_deferred_reset():
    m = helpers.model("builtin:tiny-prompt", 3)
    pool = SlotPool(m, 2)
    a = 0
    pool.open_row(a, language_index=5)
    pool.close_row(a)
    pool.open_row(a, language_index=7)  # taken again before the deferred reset
    pool.flush()
    assert int(pool.languages[a]) == 7


def test_start_up_memory_line():
    m = helpers.model("builtin:tiny-char", 3)
    pool = SlotPool(m, 16, max_rows=4)
    line = m.summary(16, pool.cache_bytes_per_stream, "kv", pool.memory_summary())
    per = pool.bytes_per_slot
    assert f"state {per / 2**20:.2f} MiB/stream x 16 slots = {per * 16 / 2**20:.1f} MiB" in line
    assert "gather buffer for 4 rows per step" in line
