"""Which streams share an encoder call: first chunks apart (drop 0), equal non-final widths, oldest first."""

import numpy as np
import pytest

from . import helpers


@pytest.fixture(scope="module")
def m():
    return helpers.model("builtin:tiny-char", 3)


def open_with(engine, samples: int, finish: bool = False):
    s = engine.open_stream(lambda r: None)
    engine.push(s, np.zeros(samples, np.float32) + 0.01)
    if finish:
        engine.finish(s)
    return s


def plan(engine):
    engine._drain_inbox()
    return engine._group(engine._ready_chunks())


def test_first_chunks_never_share_a_call_with_later_chunks(m):
    g = m.geometry
    eng = helpers.new_engine(m, num_slots=4)
    a = open_with(eng, 16000 * 3)
    eng.iterate()  # a: first chunk done
    b = open_with(eng, 16000 * 3)
    groups = plan(eng)
    assert [[c.stream.stream_id for c in grp] for grp in groups] == [[b.stream_id], [a.stream_id]]
    first, later = groups
    assert first[0].is_first and first[0].num_frames == g.first_frames
    assert not later[0].is_first and later[0].num_frames == g.chunk_frames


def test_not_ready_until_next_chunk_features_exist(m):
    g = m.geometry
    eng = helpers.new_engine(m, num_slots=2)
    hop = g.hop_samples
    # First chunk needs frames [0, first_frames): samples up to (first_frames - 1) * hop + 2 hops.
    need = (g.first_frames - 1) * hop + 2 * hop
    s = open_with(eng, need - 1)
    assert plan(eng) == []
    eng.push(s, np.zeros(1, np.float32))
    assert len(plan(eng)) == 1


def test_final_partial_chunk_shares_the_later_call(m):
    g = m.geometry
    eng = helpers.new_engine(m, num_slots=4)
    a = open_with(eng, 16000 * 4)
    b = open_with(eng, g.hop_samples * (g.first_frames + 12), finish=True)  # 13 frames after the first chunk
    eng.iterate()
    groups = plan(eng)
    assert len(groups) == 1
    widths = {c.stream.stream_id: (c.num_frames, c.is_last) for c in groups[0]}
    assert widths[a.stream_id] == (g.chunk_frames, False)
    assert widths[b.stream_id] == (13, True)  # shorter: only a stream's last chunk may be


def test_tail_shorter_than_sampling_frames_is_dropped_like_nemo(m):
    g = m.geometry
    eng = helpers.new_engine(m, num_slots=2)
    # first chunk + 5 frames in total (floor(L/hop) + 1 frames): NeMo's loop never encodes a 5-frame tail.
    s = open_with(eng, g.hop_samples * (g.first_frames + 4), finish=True)
    results = []
    s.on_result = results.append
    eng.iterate()
    eng.iterate()
    assert results[-1].done and results[-1].is_final
    assert eng.stats.stream_steps == 1
    helpers.assert_engine_empty(eng)


def test_max_batch_caps_a_step_and_oldest_go_first(m):
    eng = helpers.new_engine(m, num_slots=6, max_batch=4)
    streams = [open_with(eng, 16000) for _ in range(6)]
    eng._drain_inbox()
    chunks = eng._ready_chunks()
    for k, c in enumerate(chunks):
        c.stream.ready_since = 100.0 - k  # later-opened streams have waited longer
    groups = eng._group(chunks)
    picked = [c.stream.stream_id for grp in groups for c in grp]
    assert len(picked) == 4
    assert set(picked) == {s.stream_id for s in streams[2:]}
