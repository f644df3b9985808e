"""The scheduler's rules, without a model: readiness, first/later separation, widths, order, tails."""

import math

import numpy as np

from nemo_serve.model import ChunkGeometry

from .helpers_scheduler import SchedulerAlone

# R = 3 (320 ms): first chunk 1 + 8R = 25 frames, later chunks 8(R+1) = 32; NeMo encodes a final
# first chunk of at least 1 frame and a final later chunk of at least 8 (sampling_frames).
G = ChunkGeometry(context_left=56, context_right=3, first_frames=25, chunk_frames=32, pre_cache_frames=9,
                  drop_frames=2, min_first_frames=1, min_later_frames=8, hop_samples=160, sample_rate=16000,
                  subsampling=8)
MARGIN = 320  # two hops: frame t reads samples up to t * 160 + 320 (n_fft 512)


def samples_for(frames: int) -> int:
    """Fewest samples after which `frames` frames are complete while input continues."""
    return (frames - 1) * 160 + MARGIN


def sched(num_slots=8, max_batch=8) -> SchedulerAlone:
    return SchedulerAlone(G, num_slots, max_batch, MARGIN)


def ids(groups):
    return [(g.is_first, g.slots.tolist()) for g in groups]


def test_not_ready_until_the_first_chunk_is_complete():
    s = sched()
    s.admit(3)
    s.set_audio(3, samples_for(25) - 1, False)
    groups, done = s.plan(1.0)
    assert groups == [] and done.size == 0
    s.set_audio(3, samples_for(25), False)
    groups, done = s.plan(2.0)
    assert ids(groups) == [(True, [3])] and groups[0].widths.tolist() == [25] and groups[0].t0.tolist() == [0]
    assert not groups[0].is_last[0] and done.size == 0


def test_first_and_later_chunks_never_share_a_call_first_chunks_go_first():
    s = sched()
    for slot in (0, 1):
        s.admit(slot)
    s.set_audio(0, samples_for(25), False)
    (g,), _ = s.plan(1.0)
    s.advance(g)
    s.set_audio(0, samples_for(25 + 32), False)
    s.set_audio(1, samples_for(25), False)
    groups, _ = s.plan(2.0)
    assert ids(groups) == [(True, [1]), (False, [0])]
    assert groups[1].t0.tolist() == [25] and groups[1].widths.tolist() == [32]


def test_oldest_ready_first_ties_by_admission_and_max_batch_carries_over():
    s = sched(max_batch=2)
    for slot in (5, 2, 7):  # admitted in this order
        s.admit(slot)
    s.set_audio(7, samples_for(25), False)
    s.plan(1.0)  # 7 ready at t=1 (and planned, not stepped)
    s.set_audio(5, samples_for(25), False)
    s.set_audio(2, samples_for(25), False)
    groups, _ = s.plan(2.0)
    assert ids(groups) == [(True, [7, 5])]  # 7 oldest; 5 before 2 by admission
    s.advance(groups[0])
    groups, _ = s.plan(3.0)
    assert ids(groups) == [(True, [2])]  # left over, keeps its place
    assert s.ready_since[2] == 2.0


def test_end_of_input_final_short_chunk_and_too_short_tail():
    s = sched()
    for slot in (0, 1, 2):
        s.admit(slot)
        s.set_audio(slot, samples_for(25), False)
    (g,), _ = s.plan(1.0)
    s.advance(g)
    # slot 0: 40 frames after the first chunk -> a full chunk, then an 8-frame final chunk.
    # slot 1: exactly one more full chunk at end of input -> a full chunk that is also the last.
    # slot 2: a 7-frame tail: NeMo's loop does not encode it; the stream is done.
    for slot, extra in ((0, 40), (1, 32), (2, 7)):
        total = 25 + extra
        s.set_audio(slot, (total - 1) * 160, True)  # ended: floor(L/160) + 1 frames
    groups, done = s.plan(2.0)
    assert done.tolist() == [2]
    (later,) = groups
    assert later.slots.tolist() == [0, 1] and later.widths.tolist() == [32, 32]
    assert later.is_last.tolist() == [False, True]
    s.advance(later)
    s.release(1)
    s.release(2)
    (last,), done = s.plan(3.0)
    assert last.slots.tolist() == [0] and last.widths.tolist() == [8] and last.is_last.tolist() == [True]
    assert last.t0.tolist() == [57] and done.size == 0


def test_released_slots_are_not_planned_and_reuse_starts_fresh():
    s = sched()
    s.admit(4)
    s.set_audio(4, samples_for(25 + 32), False)
    (g,), _ = s.plan(1.0)
    s.advance(g)
    s.release(4)
    groups, done = s.plan(2.0)
    assert groups == [] and done.size == 0
    s.admit(4)
    assert s.next_frame[4] == 0 and not s.first_done[4] and s.num_samples[4] == 0 and math.isinf(s.ready_since[4])
    s.set_audio(4, samples_for(25), False)
    (g,), _ = s.plan(3.0)
    assert g.is_first and g.t0.tolist() == [0]
    assert g.slots.dtype == np.int64  # usable as an index tensor without a cast
