"""Several chunk modes in one engine: each stream picks its own, every stream equals NeMo's loop at it."""

import numpy as np
import pytest

from nemo_serve.config import Settings, SettingsError
from nemo_serve.model import UnsupportedModeError, load_model
from nemo_serve.oracle import oracle_transcribe

from . import helpers
from .helpers_scheduler import SchedulerAlone


@pytest.fixture(scope="module")
def all_modes():
    return helpers.model(None, "all")


# ----------------------------------------------------------------------------- choosing modes


def test_context_right_takes_one_mode_a_list_or_all(all_modes):
    trained = all_modes.trained_context_right
    assert all_modes.modes == trained and all_modes.geometry.context_right == trained[0]
    two = load_model(None, context_right=f"{trained[-1]},{trained[0]}")
    assert two.modes == (trained[-1], trained[0])
    assert two.geometry.context_right == trained[-1]  # the first listed is the default
    assert two.nemo.encoder.att_context_size[1] == trained[-1]  # and NeMo's encoder is left at it
    assert [two.geometry_for(r).chunk_ms for r in two.modes] == [80 * (r + 1) for r in two.modes]
    assert load_model(None, context_right=3).modes == (3,)
    bad = next(r for r in range(1, 30) if r not in trained)
    with pytest.raises(UnsupportedModeError) as e:
        load_model(None, context_right=f"0,{bad}")
    assert all(str(v) in str(e.value) for v in trained)
    with pytest.raises(UnsupportedModeError, match="not served here; valid values: 13, 0"):
        load_model(None, context_right="13,0").geometry_for(3)


def test_settings_check_the_list_syntax_before_any_model_loads():
    assert Settings(context_right="0, 3,13").context_right == "0,3,13"
    assert Settings(context_right="ALL").context_right == "all"
    assert Settings(context_right=6).context_right == "6"
    for bad in ("fast", "3,3", "-1", ""):
        with pytest.raises((SettingsError, ValueError)):
            Settings(context_right=bad)


# ----------------------------------------------------------------------------- scheduling


class _G:
    """A chunk geometry as the scheduler reads it (demo-model numbers)."""

    def __init__(self, r: int) -> None:
        self.context_right = r
        self.first_frames, self.chunk_frames = 1 + 8 * r, 8 * (r + 1)
        self.min_first_frames, self.min_later_frames = 1, 1
        self.hop_samples = 160
        self.chunk_ms = 80.0 * (r + 1)


def _ready_first_chunk(s: SchedulerAlone, slot: int, g: _G) -> None:
    s.set_audio(slot, (g.first_frames - 1) * 160 + 400, False)  # just enough for the first chunk


def test_modes_never_share_a_call_and_the_short_chunks_go_first():
    s = SchedulerAlone(_G(13), num_slots=6, max_batch=6, margin_samples=400)
    modes = [13, 0, 13, 3, 0, 13]
    for slot, r in enumerate(modes):
        s.admit(slot, _G(r))
        _ready_first_chunk(s, slot, _G(r))
    groups, _ = s.plan(now=10.0)  # all ready at once: deadlines now + 80, 320, 1120 ms
    assert [(g.context_right, g.slots.tolist()) for g in groups] == [(0, [1, 4]), (3, [3]), (13, [0, 2, 5])]
    assert all(g.is_first for g in groups)
    assert all((g.widths == 1 + 8 * g.context_right).all() for g in groups)


def test_a_burst_of_long_chunks_does_not_starve_the_short_ones():
    """40 streams at 1120 ms became ready a second before 4 streams at 80 ms; 8 rows per plan.
    Earliest deadline first: the 80 ms chunks (due 80 ms after ready) go in the first plan, ahead of
    the 1120 ms chunks that have waited longer but are due later."""
    s = SchedulerAlone(_G(13), num_slots=44, max_batch=8, margin_samples=400)
    for slot in range(40):
        s.admit(slot, _G(13))
        _ready_first_chunk(s, slot, _G(13))
    s.plan(now=0.0)  # the long chunks are seen ready at t = 0 (and not stepped)
    for slot in range(40, 44):
        s.admit(slot, _G(0))
        _ready_first_chunk(s, slot, _G(0))
    groups, _ = s.plan(now=1.0)
    assert groups[0].context_right == 0 and groups[0].slots.tolist() == [40, 41, 42, 43]
    assert [len(g) for g in groups] == [4, 4]  # and the remaining rows to the oldest long chunks
    assert groups[1].slots.tolist() == [0, 1, 2, 3]
    # A long chunk past its deadline goes before a short one that is not.
    s2 = SchedulerAlone(_G(13), num_slots=2, max_batch=1, margin_samples=400)
    s2.admit(0, _G(13))
    _ready_first_chunk(s2, 0, _G(13))
    s2.plan(now=0.0)
    s2.admit(1, _G(0))
    _ready_first_chunk(s2, 1, _G(0))
    (g,), _ = s2.plan(now=1.2)
    assert g.slots.tolist() == [0]


# ----------------------------------------------------------------------------- parity


def _drive_mixed(m, n, seed, kv_cache=True, languages=None):
    audios = helpers.utterances(n, seed=seed)
    modes = [m.modes[(i // 2) % len(m.modes)] for i in range(n)]  # pairs: one mode, same start
    steps = []
    eng = helpers.new_engine(m, n, kv_cache=kv_cache)
    eng.on_step = lambda b, _s, mode: steps.append((mode, b))
    # Uneven packets (equal every third tick, so pairs often step together), staggered starts.
    driven = helpers.drive(eng, audios, packet=[3200, 700, 5700], start_tick=[i // 2 for i in range(n)],
                           languages=languages, modes=modes)
    for i, (a, r) in enumerate(zip(audios, modes)):
        lang = languages[i] if languages else None
        assert driven.tokens(i) == oracle_transcribe(m, a, lang, context_right=r).token_ids, (i, r, lang)
    helpers.assert_engine_empty(eng)
    assert set(eng.stats.by_mode) == set(m.modes)
    assert any(b > 1 for _, b in steps)  # streams of one mode shared calls
    return steps


def test_every_mode_in_one_engine_matches_nemo_at_its_own_mode_fp32(all_modes):
    """Eight streams, two per trained mode, staggered and with ragged packets, in one engine (one slot
    pool, the key/value encoder told each call's mode): each equals NeMo's loop at its own mode."""
    _drive_mixed(all_modes, 8, seed=3)


def test_nemo_layer_code_switches_modes_per_call(all_modes):
    """--no-kv-cache runs NeMo's own cache_aware_stream_step, which reads the mode from module state:
    the step switches it per call, and NeMo's loop run in between (the oracle) does not disturb it."""
    steps = _drive_mixed(all_modes, 8, seed=5, kv_cache=False)
    switches = sum(a[0] != b[0] for a, b in zip(steps, steps[1:]))
    assert switches >= 4  # modes interleaved call by call


def test_prompt_model_mixed_languages_and_modes_match_oracle():
    m = helpers.model("builtin:tiny-prompt", "all")
    codes = sorted(m.prompt_dictionary)[:3]
    _drive_mixed(m, 8, seed=7, languages=[codes[i % 3] for i in range(8)])  # each pair: one mode, two languages


def test_bf16_two_modes_match_oracle():
    m = helpers.model(None, "0,13", dtype="bf16")
    _drive_mixed(m, 4, seed=9)


def test_a_mode_not_served_is_refused_at_open_with_the_valid_list():
    m = helpers.model(None, "13,0")
    eng = helpers.new_engine(m, 2)
    with pytest.raises(ValueError, match="context_right 3 is not served here; valid values: 13, 0"):
        eng.open_stream(lambda r: None, context_right=3)
    assert eng.num_free_slots == 2
    s = eng.open_stream(lambda r: None, context_right=0)
    assert s.context_right == 0 and eng.open_by_mode() == {0: 1}
    eng.abort(s)
    eng.iterate()
    assert eng.num_free_slots == 2 and eng.open_by_mode() == {}


def test_one_pool_for_every_mode_is_sized_for_the_largest(all_modes):
    one = helpers.bare_engine(helpers.model(None, 0), 2)
    mixed = helpers.bare_engine(all_modes, 2)
    alone = mixed.encoder.cache_bytes_for(0, mixed.pool.cache_bytes_per_stream)
    assert alone == one.pool.cache_bytes_per_stream  # what an 80 ms-only pool holds, computed right
    assert mixed.pool.cache_bytes_per_stream > alone
    assert "a mode alone would need per stream" in mixed.summary()
    for r, g in all_modes.geometries.items():
        assert f"{g.chunk_ms:.0f} ms" in mixed.summary()
    assert np.isclose(
        mixed.pool.cache_bytes_per_stream, helpers.bare_engine(helpers.model(None, 13), 2).pool.cache_bytes_per_stream
    )


@pytest.mark.parametrize("overlap", [False, True])
def test_the_engine_steps_one_mode_per_iteration_earliest_due_first(overlap):
    """Both streams ready at once with a backlog: the 80 ms stream's chunks go first, one iteration each
    (planning again after each, so a 1120 ms step never sits between two 80 ms chunks that are due
    sooner), and the 1120 ms chunk goes once no earlier-due chunk is ready. Overlapped (launch, then
    collect: engine/loop.py) too, where the 80 ms stream is in flight every other iteration."""
    m = helpers.model(None, "0,13")
    eng = helpers.new_engine(m, 2, overlap=overlap)
    order = []
    short = eng.open_stream(lambda r: order.append("80"), context_right=0)
    long_ = eng.open_stream(lambda r: order.append("1120"), context_right=13)
    audio = helpers.utterances(1, seed=2)[0][: 24000]  # 1.5 s: many 80 ms chunks, one 1120 ms chunk
    for s in (short, long_):
        eng.push(s, audio)
    calls = eng.plan()
    assert [{c.stream_id for c in call} for call in calls] == [{short.stream_id}]
    while eng.iterate().busy:
        pass
    first_long = order.index("1120")
    assert first_long > 10 and set(order[:first_long]) == {"80"}  # the short backlog first
    for s in (short, long_):
        eng.finish(s)
    while eng.num_open_streams:
        eng.iterate()
