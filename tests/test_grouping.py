"""Which streams share an encoder call: first chunks apart (drop 0), equal non-final widths, oldest first.

Observed through `Engine.plan()`, the batches the next `iterate()` runs (iterate() runs exactly that plan)."""

import time

import numpy as np
import pytest

from . import helpers


@pytest.fixture(scope="module")
def m():
    return helpers.model("builtin:tiny-char", 3)


def open_with(engine, samples: int, finish: bool = False, on_result=lambda r: None):
    s = engine.open_stream(on_result)
    engine.push(s, np.zeros(samples, np.float32) + 0.01)
    if finish:
        engine.finish(s)
    return s


def ids(groups) -> list[list[str]]:
    return [[c.stream_id for c in grp] for grp in groups]


def test_first_chunks_never_share_a_call_with_later_chunks(m):
    g = m.geometry
    eng = helpers.new_engine(m, num_slots=4)
    a = open_with(eng, 16000 * 3)
    eng.iterate()  # a: first chunk done
    b = open_with(eng, 16000 * 3)
    groups = eng.plan()
    assert ids(groups) == [[b.stream_id], [a.stream_id]]
    first, later = groups
    assert first[0].is_first and first[0].num_frames == g.first_frames and first[0].t0 == 0
    assert not later[0].is_first and later[0].num_frames == g.chunk_frames and later[0].t0 == g.first_frames
    # iterate() runs that plan: two calls, one stream each
    steps = []
    eng.on_step = lambda batch, _s, _mode: steps.append(batch)
    assert eng.iterate().busy and steps == [1, 1]


def test_not_ready_until_next_chunk_features_exist(m):
    g = m.geometry
    eng = helpers.new_engine(m, num_slots=2)
    hop = g.hop_samples
    # First chunk needs frames [0, first_frames): samples up to (first_frames - 1) * hop + 2 hops.
    need = (g.first_frames - 1) * hop + 2 * hop
    s = open_with(eng, need - 1)
    assert eng.plan() == []
    assert not eng.iterate().busy and eng.stats.steps == 0
    eng.push(s, np.zeros(1, np.float32))
    assert ids(eng.plan()) == [[s.stream_id]]


def test_final_partial_chunk_shares_the_later_call(m):
    g = m.geometry
    eng = helpers.new_engine(m, num_slots=4)
    a = open_with(eng, 16000 * 4)
    b = open_with(eng, g.hop_samples * (g.first_frames + 12), finish=True)  # 13 frames after the first chunk
    eng.iterate()
    groups = eng.plan()
    assert len(groups) == 1
    widths = {c.stream_id: (c.num_frames, c.is_last) for c in groups[0]}
    assert widths == {a.stream_id: (g.chunk_frames, False), b.stream_id: (13, True)}  # only a last chunk may be shorter


def test_tail_shorter_than_sampling_frames_is_dropped_like_nemo(m):
    g = m.geometry
    eng = helpers.new_engine(m, num_slots=2)
    # first chunk + 5 frames in total (floor(L/hop) + 1 frames): NeMo's loop never encodes a 5-frame tail.
    results = []
    open_with(eng, g.hop_samples * (g.first_frames + 4), finish=True, on_result=results.append)
    eng.iterate()
    assert eng.plan() == []
    eng.iterate()
    assert results[-1].done and results[-1].is_final
    assert eng.stats.stream_steps == 1
    helpers.assert_engine_empty(eng)


def test_max_batch_caps_a_step_and_oldest_go_first(m):
    g = m.geometry
    eng = helpers.new_engine(m, num_slots=6, max_batch=4)
    need = g.first_frames * g.hop_samples + g.hop_samples  # a first chunk's audio
    streams = [open_with(eng, 0) for _ in range(6)]
    assert eng.plan() == []
    # Streams become ready in reverse order of opening: the later-opened ones have waited longer.
    for s in reversed(streams):
        eng.push(s, np.zeros(need, np.float32) + 0.01)
        eng.plan()
        time.sleep(0.002)
    groups = eng.plan()
    assert ids(groups) == [[s.stream_id for s in reversed(streams[2:])]]
    steps = []
    eng.on_step = lambda batch, _s, _mode: steps.append(batch)
    eng.iterate()
    assert steps == [4]
    assert ids(eng.plan()) == [[streams[1].stream_id, streams[0].stream_id]]  # the two left over, next
