"""A stream's sample buffer (engine/frontend.py AudioBuffer) at real-time pace: a discard copies
nothing, a full buffer keeps only what is still needed, and a buffer sized by the engine for its
stream's chunk mode never reallocates (issue 46: at 1120 ms the old one grew from 16,000 samples
and copied each chunk's audio again when it compacted). The engine's buffers live on rows of its
AudioArena, given back at release and taken by the next streams."""

from __future__ import annotations

import numpy as np

from nemo_serve.engine.frontend import AudioArena, AudioBuffer

from . import helpers


def _segment(a: AudioBuffer, start: int, n: int) -> np.ndarray:
    out = np.full(n, np.nan, np.float32)
    a.copy_segment(start, out)
    return out


def test_a_discard_copies_nothing_and_a_full_buffer_keeps_only_what_is_needed():
    samples = np.arange(1, 6001, dtype=np.float32)
    a = AudioBuffer(4000)
    data = a._data
    for k in range(3):
        a.extend((samples[1000 * k : 1000 * (k + 1)],), arrived=float(k))
    a.discard_before(2500)
    assert a._data is data and a.offset == 0 and a._used == 3000  # marked only
    a.extend((samples[3000:3700], samples[3700:4500]), arrived=3.0)  # two pieces (a wrapped ring): full, so compacted
    assert a._data is data and a.offset == 2500 and a._used == 2000  # 500 kept + 1500 new, no new array
    assert np.array_equal(_segment(a, 2500, 2100), np.concatenate([samples[2500:4500], np.zeros(100, np.float32)]))
    assert a.arrival_time(4500) == 3.0 and a.arrival_time(3000) == 2.0
    a.extend((samples[4500:6000],), arrived=4.0)  # 3500 samples needed in 4000: fits after the compaction
    assert a._data is data
    a.extend((samples[:1000],), arrived=5.0)  # nothing discarded since: it grows, keeping everything
    assert len(a._data) == 8000 and np.array_equal(_segment(a, 2500, 3500), samples[2500:6000])
    assert np.array_equal(_segment(a, 6000, 1000), samples[:1000])


def test_an_engine_stream_at_real_time_pace_never_reallocates_its_buffer():
    m = helpers.model(context_right=13)  # 1120 ms chunks: 17,920 samples each, more than the old 16,000
    g = m.geometry
    engine = helpers.bare_engine(m, num_slots=1)
    stream = engine.admit(slot=0)
    audio = np.concatenate(helpers.utterances(3))  # about 9 s
    first = g.first_frames * g.hop_samples + 2 * g.hop_samples
    chunk = g.chunk_frames * g.hop_samples
    engine.take_audio(stream, (audio[:first],), 0.0)
    data = stream.audio._data
    steps = 0
    for start in range(first, len(audio) - chunk, chunk):
        engine.iterate()
        engine.take_audio(stream, (audio[start : start + chunk],), 0.0)
        assert stream.audio._data is data, f"reallocated after {steps} steps"
        steps += 1
    engine.iterate()
    assert steps >= 3 and engine.stats.stream_steps >= steps
    engine.abort(stream)
    engine.iterate()


def test_a_released_buffer_gives_its_row_back_and_reads_no_later_stream():
    arena = AudioArena()
    row = arena.take(4000)
    assert row.base.nbytes >= 4 << 20  # a block numpy maps on huge pages (AudioArena's docstring)
    a = AudioBuffer(4000, storage=row)
    a.extend((np.ones(3000, np.float32),), arrived=0.0)
    assert arena.num_in_use == 1 and a.release_storage() is row and a.release_storage() is None
    arena.give_back(row)
    b = AudioBuffer(4000, storage=arena.take(4000))
    assert np.shares_memory(b._data, row) and arena.num_in_use == 1  # the row, reused
    b.extend((np.full(3000, 2.0, np.float32),), arrived=0.0)
    assert np.array_equal(_segment(a, 0, 3000), np.zeros(3000, np.float32))  # forgotten, not b's samples
    assert np.array_equal(_segment(b, 0, 3000), np.full(3000, 2.0, np.float32))


def test_streams_on_reused_rows_decode_as_alone():
    """Two slots, three streams: the third opens once the first two are released, on a row one of
    them wrote; its tokens equal its own run on a fresh engine (helpers.drive checks the arena is
    empty at the end through assert_engine_empty)."""
    m = helpers.model()
    audios = helpers.utterances(3)
    alone = helpers.drive(helpers.new_engine(m, num_slots=1), [audios[2]]).tokens(0)
    engine = helpers.new_engine(m, num_slots=2)
    arena, taken = engine.engine.audio_arena, []
    take = arena.take
    arena.take = lambda capacity: taken.append(take(capacity)) or taken[-1]
    driven = helpers.drive(engine, audios, start_tick=[0, 0, 1 + max(len(a) for a in audios[:2]) // 1600])
    assert len(taken) == 3 and not np.shares_memory(taken[0], taken[1])
    assert np.shares_memory(taken[2], taken[0]) or np.shares_memory(taken[2], taken[1])  # a used row
    assert alone and driven.tokens(2) == alone
    helpers.assert_engine_empty(engine)
