"""Positional forced finals (engine/forced_ends.py): `force_final(stream, at_sample=N)` ends the
segment right after the whole chunks before sample N, however far past N the engine has audio and
decodes before anyone looks (the race NIM's force_eou lost: issue 45 follow-up). The reference is
a plain force_final called once the engine had decoded exactly the audio before N and no more,
which is what /ws's force_final gives a client that waits for the model there."""

from __future__ import annotations

import numpy as np
import pytest

from nemo_serve.engine.geometry import whole_chunk_frames

from . import helpers
from .helpers_server import TEST_MODEL


@pytest.fixture(scope="module")
def tiny():
    return helpers.model(TEST_MODEL)


@pytest.fixture(scope="module")
def audio():
    return np.concatenate(helpers.utterances(2, seed=3))  # two utterances back to back, a few seconds


def _run_to_done(eng, max_iterations: int = 2000) -> None:
    for _ in range(max_iterations):
        if not eng.iterate().steps and eng.num_open_streams == 0:
            return
    raise AssertionError("the stream did not finish")


def _idle(eng) -> None:
    """Iterate until the engine has nothing left to step with the audio it has."""
    while eng.iterate().steps:
        pass


def _segments(results) -> list[tuple[list[int], float, str]]:
    """Each final's (segment tokens, audio processed, end reason)."""
    return [(r.token_ids, r.audio_processed_s, r.end_reason) for r in results if r.is_final]


def _caught_up_reference(m, audio, points: list[int]) -> list:
    """force_final (no position) at each point, called only once the engine decoded the audio
    before it and had nothing more: the ends where the client asked."""
    eng = helpers.new_engine(m, 1)
    got = []
    s = eng.open_stream(got.append)
    start = 0
    for at in points:
        eng.push(s, audio[start:at])
        _idle(eng)
        eng.force_final(s)
        start = at
    eng.push(s, audio[start:])
    eng.finish(s)
    _run_to_done(eng)
    helpers.assert_engine_empty(eng)
    return _segments(got)


def test_a_positional_forced_final_lands_where_asked_when_the_engine_runs_past_it(tiny, audio):
    """All the audio, two forced points and the end of input are in before the engine steps once:
    each forced segment still ends at its whole chunks, with the reference's tokens."""
    rate = tiny.geometry.sample_rate
    points = [int(1.3 * rate) + 37, int(2.6 * rate) + 5]
    expected = _caught_up_reference(tiny, audio, points)
    assert len(expected) == 3 and expected[0][0] and expected[1][0], expected  # two forced ends, each with tokens
    eng = helpers.new_engine(tiny, 1)
    got = []
    s = eng.open_stream(got.append)
    eng.push(s, audio[: points[0]])
    eng.force_final(s, at_sample=points[0])  # sent before the audio past it, as a front end does
    eng.push(s, audio[points[0] : points[1]])
    eng.force_final(s, at_sample=points[1])
    eng.push(s, audio[points[1] :])
    eng.finish(s)
    _run_to_done(eng)
    assert _segments(got) == expected
    g = tiny.geometry
    margin = eng.engine.model_info.feature_margin
    assert [e[1] for e in expected[:2]] == [round(whole_chunk_frames(g, p, margin) * g.hop_samples / rate, 3) for p in points]
    helpers.assert_engine_empty(eng)


def test_a_positional_forced_final_for_audio_already_decoded_ends_now(tiny, audio):
    """The engine decoded every whole chunk before the point already: the segment ends at once,
    where the reference's does (a front end that asks late loses nothing)."""
    at = int(1.3 * tiny.geometry.sample_rate) + 37
    expected = _caught_up_reference(tiny, audio, [at])
    eng = helpers.new_engine(tiny, 1)
    got = []
    s = eng.open_stream(got.append)
    eng.push(s, audio[:at])
    _idle(eng)
    eng.force_final(s, at_sample=at)
    eng.push(s, audio[at:])
    eng.finish(s)
    _run_to_done(eng)
    assert _segments(got) == expected
    helpers.assert_engine_empty(eng)


def test_forced_ends_pending_on_a_stream_go_with_it(tiny, audio):
    """An abort, or an end of input before the point is reached, leaves no target on the slot
    (the books check it): the next stream on the slot is not cut."""
    eng = helpers.new_engine(tiny, 1)
    got = []
    s = eng.open_stream(got.append)
    eng.push(s, audio[:8000])
    eng.force_final(s, at_sample=len(audio))  # never reached by this stream
    eng.abort(s)
    _run_to_done(eng)
    eng.engine.check_accounting()
    again = []
    s2 = eng.open_stream(again.append)
    eng.push(s2, audio)
    eng.finish(s2)
    _run_to_done(eng)
    assert [r[2] for r in _segments(again)] == ["end_of_input"]
    helpers.assert_engine_empty(eng)


def test_forced_end_targets_are_kept_in_order_whatever_order_they_come_in():
    """engine.force_final(at_sample) is the engine's API: each point ends a segment, in the
    order of the audio, whatever order the calls came in (our NIM front end sends them in order;
    another caller need not). Before: a target before a later pending one was queued after it
    and merged into it at take(), and one before the nearest was dropped."""
    from nemo_serve.engine.forced_ends import NONE, ForcedEnds

    ends = ForcedEnds(num_slots=2)
    for frame in (10, 30, 20, 5, 20):  # 20 twice: one point, one end
        ends.add(0, frame)
    ends.add(1, 7)
    met = []
    while ends.next_frame[0] != NONE:
        met.append(int(ends.next_frame[0]))
        ends.take(0, met[-1])
    assert met == [5, 10, 20, 30]
    assert ends.pending() == [1] and int(ends.next_frame[1]) == 7
