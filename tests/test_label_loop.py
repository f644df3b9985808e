"""Our label loop (engine/label_loop.py) against NeMo's label-looping computer, call by call.

Both decode the same encoder output from the same carried state, chunk after chunk, with rows of
different lengths in one batch (rows at different label-loop depths, padded rows of length 0):
labels, timestamps, lengths, confidence and the carried state (predictor h/c and output, last
label, decoded frames, boosting-tree state) must be equal (torch.equal: bitwise). fp32 and bf16,
the trained demo model at scale 1 (few emissions) and at larger scales (frames that emit many
labels), random-weight builtins (a frame that emits tends to emit max_symbols), boosted rows beside
unboosted ones. The engine-level parity (tokens against NeMo's streaming loop) is in
tests/test_parity.py, tests/test_phrase_boost.py and tests/test_words.py, which run this loop by
default on the CPU (engine/step.py `decoder_kind`).
"""

from __future__ import annotations

import copy

import pytest
import torch

from nemo_serve.engine.biasing import BiasingRegistry, biasing_computer
from nemo_serve.engine.label_loop import label_loop
from nemo_serve.engine.nemo_decoder import confidence_computer
from nemo_serve.nemo_private import decoder_state_after_sos

from . import helpers
from .helpers_label_loop import SPECS, _chunks, _compare


@pytest.mark.parametrize("rows_mode", ["all", "active"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("spec", SPECS)
def test_same_labels_state_and_confidence_as_nemo(spec, dtype, rows_mode):
    model = helpers.model(spec, None, dtype)
    base = model.decoding_computer
    total = 0
    for scale, seed in ((1.0, 0), (0.7, 1), (4.0, 2)):
        chunks = _chunks(model, b=7, t=5, n=4, scale=scale, seed=seed, spec=spec, dtype=dtype)
        total += _compare(base, model, chunks, rows_mode=rows_mode)
        total += _compare(confidence_computer(base), model, chunks, confidence=True, rows_mode=rows_mode)
    assert total > 20, "too few labels to exercise the loop"


@pytest.mark.parametrize("spec, max_symbols, scale", [(None, None, 4.0), ("builtin:tiny-hybrid", 2, 1.0),
                                                      ("builtin:tiny-prompt", 1, 0.7)])
def test_frames_at_max_symbols_match(spec, max_symbols, scale):
    """Frames that emit max_symbols labels (the forced move to the next frame): the demo model's
    encoder output scaled up emits 10 at a frame; random-weight builtins with max_symbols cut to
    1-2 (a copy of the computer) hit it on most emitting frames."""
    model = helpers.model(spec)
    base = copy.copy(model.decoding_computer)
    base.max_symbols = max_symbols or base.max_symbols
    chunks = _chunks(model, b=8, t=4, n=3, scale=scale, seed=3, spec=spec)
    x, lens = chunks[0]
    with torch.inference_mode():
        ours, _ = label_loop(base, x, lens, decoder_state_after_sos(base, model.device, 8))
    per_frame = [torch.bincount(ours.timestamps[i, :m]).max().item() for i, m in enumerate(ours.current_lengths.tolist()) if m]
    assert max(per_frame) == base.max_symbols, per_frame
    for rows_mode in ("all", "active"):
        _compare(base, model, chunks, rows_mode=rows_mode)


@pytest.mark.parametrize("rows_mode", ["all", "active"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_boosted_rows_beside_plain_rows_match_nemo(dtype, rows_mode):
    """Boosted rows (two trees, a strong boost) beside unboosted ones; the boost is seen to change
    labels (NeMo's own computer with and without it), so a loop that ignored it would fail."""
    model = helpers.model(None, None, dtype)
    registry = BiasingRegistry(model.nemo.tokenizer, int(model.decoding_computer._blank_index), model.device)
    from nemo_serve.engine.phrases import PhraseRequest

    a, sa = registry.acquire(PhraseRequest(("nine fifty",), 20.0))
    c, sc = registry.acquire(PhraseRequest(("each game", "girl test snow"), 20.0))
    ids = torch.tensor([a, -1, c, a, -1, c])
    init = torch.tensor([sa, 0, sc, sa, 0, sc])
    computer = biasing_computer(model.decoding_computer, registry.multi_model)
    changed = 0
    for scale, seed in ((1.0, 5), (3.0, 6)):
        chunks = _chunks(model, b=6, t=5, n=4, scale=scale, seed=seed, dtype=dtype)
        _compare(computer, model, chunks, ids, fusion_init=init, rows_mode=rows_mode)
        _compare(confidence_computer(computer), model, chunks, ids, confidence=True, fusion_init=init,
                 rows_mode=rows_mode)
        changed += _labels(computer, model, chunks, ids, init) != _labels(model.decoding_computer, model, chunks)
    assert changed, "the boost changed no label: the test would not see a loop that ignores it"


def _labels(computer, model, chunks, bias_ids=None, fusion_init=None) -> list:
    state = decoder_state_after_sos(computer, model.device, chunks[0][0].shape[0])
    if fusion_init is not None:
        state.fusion_states_list = [fusion_init.clone()]
    extra = {"multi_biasing_ids": bias_ids} if bias_ids is not None else {}
    out = []
    with torch.inference_mode():
        for x, lens in chunks:
            hyps, state = computer(x=x, out_len=lens, prev_batched_state=state, **extra)
            out.append([hyps.transcript[i, :m].tolist() for i, m in enumerate(hyps.current_lengths.tolist())])
    return out
