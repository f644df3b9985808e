"""Per-stream phrase boosting (engine/biasing.py): exact where it should be.

A stream without phrases is token-identical to NeMo's loop, also beside boosted streams in the
same steps; a boosted stream is token-identical to NeMo's loop with the decoder's boosting tree
set from the same phrases and weight (oracle.py). At two chunk modes. The phrases chosen change
the demo model's transcript (asserted), so a boost that did nothing would fail too.
"""

from __future__ import annotations

import numpy as np
import pytest

from nemo_serve.engine.phrases import PhraseLimits
from nemo_serve.oracle import oracle_transcribe
from nemo_serve.selftest import BUNDLED_MANIFEST, load_utterances

from . import helpers

# (bundled utterance, phrases, boost): each boost changes that utterance's transcript in NeMo's loop.
BOOSTED = [(0, ["nine fifty"], 3.0), (12, ["each game"], 1.0), (14, ["girl test snow"], 3.0)]
PLAIN = [2, 9, 19]  # utterances streamed without phrases beside them


@pytest.fixture(scope="module")
def model():
    return helpers.model(None, "all")


@pytest.fixture(scope="module")
def audios():
    return [u.audio for u in load_utterances(BUNDLED_MANIFEST, 16000)]


def _oracle(model, audio, mode, phrases=(), boost=1.0):
    return oracle_transcribe(model, audio, context_right=mode, phrases=phrases, boost=boost).token_ids


@pytest.mark.parametrize("mode", [0, 13])
def test_boosted_and_plain_streams_in_one_batch_match_nemo(model, audios, mode):
    boosted = [audios[i] for i, _, _ in BOOSTED]
    plain = [audios[i] for i in PLAIN]
    engine = helpers.new_engine(model, num_slots=8)
    # Interleaved and staggered: boosted and plain rows share steps, at different fill levels.
    order = [boosted[0], plain[0], boosted[1], plain[1], boosted[2], plain[2]]
    phrases = [(p, b) for _, p, b in BOOSTED]
    opts = [phrases[0], None, phrases[1], None, phrases[2], None]
    out = helpers.drive(engine, order, packet=[1600, 3200, 800], start_tick=[0, 0, 1, 2, 3, 3],
                        modes=[mode] * 6, phrases=opts)  # fmt: skip
    changed = 0
    for k, (audio, opt) in enumerate(zip(order, opts)):
        want = _oracle(model, audio, mode, *(opt or ()))
        assert out.tokens(k) == want, f"stream {k} ({'boosted' if opt else 'plain'}) at mode {mode}"
        if opt:
            changed += want != _oracle(model, audio, mode)
    assert changed >= 2, "the phrases should change most boosted transcripts"
    helpers.assert_engine_empty(engine)
    assert engine.engine.pool.biasing.num_active == 0  # every tree left the decoder with its streams


def test_plain_streams_unchanged_while_others_are_boosted(model, audios):
    """The plain streams' tokens with boosted neighbours equal their tokens in an engine that never
    saw a phrase (no biasing decoder at all)."""
    plain = [audios[i] for i in PLAIN]
    alone = helpers.drive(helpers.new_engine(model), plain, modes=[13] * 3)
    engine = helpers.new_engine(model)
    mixed = plain + [audios[i] for i, _, _ in BOOSTED]
    out = helpers.drive(engine, mixed, modes=[13] * 6, phrases=[None] * 3 + [(p, b) for _, p, b in BOOSTED])
    assert engine.engine.pool.biasing is not None and engine.engine.pool.biasing.trees_built == 3
    for k in range(3):
        assert out.tokens(k) == alone.tokens(k)


def test_one_tree_per_list_shared_and_removed_with_its_last_stream(model, audios):
    engine = helpers.new_engine(model, num_slots=4)
    same = (["nine fifty"], 3.0)
    out = helpers.drive(engine, [audios[0]] * 3, start_tick=[0, 2, 4], modes=[13] * 3,
                        phrases=[same, same, (["nine fifty"], 2.0)])  # fmt: skip
    reg = engine.engine.pool.biasing
    assert reg.trees_built == 2  # (phrases, boost) is the key: two lists, three streams
    assert out.tokens(0) == out.tokens(1) == _oracle(model, audios[0], 13, ["nine fifty"], 3.0)
    # NeMo keeps the id range (has_models stays true); no tree is active and no state is held
    assert reg.num_active == 0 and not reg.multi_model.model2active.any() and reg.multi_model.num_states_total == 0
    helpers.assert_engine_empty(engine)


@pytest.mark.parametrize(
    "phrases, boost, needle",
    [
        ([""], None, "phrase 0 is empty"),
        (["ok", "   "], None, "phrase 1 is empty"),
        (["caf\u00e9 \u4e2d"], None, "cannot spell"),
        (["Hello"], None, "cannot spell"),  # the demo vocabulary is lower case
        (["<unk>"], None, "cannot spell"),  # a special entry spells nothing
        (["a"] * 5, None, "at most 4 per stream"),
        (["x" * 11], None, "at most 10"),
        (["ok"], 0, "boost must be"),
        (["ok"], "2", "boost must be"),
        ("ok", None, "list of strings"),
    ],
)
def test_bad_phrases_are_refused_at_open(model, phrases, boost, needle):
    engine = helpers.new_engine(model, phrase_limits=PhraseLimits(max_phrases_per_stream=4, max_phrase_chars=10))
    with pytest.raises(ValueError, match=needle):
        engine.open_stream(lambda r: None, phrases=phrases, boost=boost)
    helpers.assert_engine_empty(engine)


def test_total_phrase_limit_counts_open_streams_and_frees_with_them(model, audios):
    engine = helpers.new_engine(model, phrase_limits=PhraseLimits(max_phrases_total=3))
    a = engine.open_stream(lambda r: None, phrases=["one", "two"])
    with pytest.raises(ValueError, match="at most 3 in all"):
        engine.open_stream(lambda r: None, phrases=["three", "four"])
    engine.open_stream(lambda r: None)  # no phrases: not limited
    engine.abort(a)
    engine.iterate()
    engine.iterate()
    b = engine.open_stream(lambda r: None, phrases=["three", "four"])
    engine.abort(b)


def test_a_character_model_refuses_phrases():
    """NeMo builds boosting trees through a tokenizer; a character model has none."""
    engine = helpers.new_engine(helpers.model("builtin:tiny-char"))
    with pytest.raises(ValueError, match="needs a model with a tokenizer"):
        engine.open_stream(lambda r: None, phrases=["a"])
    engine.open_stream(lambda r: None)  # without phrases: served as ever


def test_a_reused_slot_and_the_scratch_row_carry_no_tree(model):
    """A row freed and taken again before the next flush gets the new stream's id (-1 without
    phrases), never its previous stream's; the scratch row (padded rows) never has one."""
    from nemo_serve.engine.slots import SlotPool

    pool = SlotPool(model, 2)
    a = 0
    pool.open_row(a, 0, biasing_id=3, biasing_state=7)
    assert pool.boosted[a] and pool.biasing_ids[a] == 3 and pool.biasing_states[a] == 7
    pool.close_row(a)
    pool.open_row(a)  # before any flush
    pool.flush()
    assert not pool.boosted[a] and pool.biasing_ids[a] == -1
    assert pool.biasing_ids[pool.scratch] == -1 and not pool.any_boosted(np.arange(pool.num_slots + 1))
