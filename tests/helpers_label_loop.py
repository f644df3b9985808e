"""Our label loop against NeMo's label-looping computer chunk by chunk: encoder-output chunks of
real utterances and the call-by-call comparison (test_label_loop.py, test_greedy_joint.py)."""

from __future__ import annotations

import functools

import numpy as np
import torch

from nemo_serve.engine.label_loop import label_loop
from nemo_serve.engine.nemo_decoder import aten_rnn
from nemo_serve.engine.step import apply_prompt
from nemo_serve.nemo_private import decoder_state_after_sos

from . import helpers


SPECS = [None, "builtin:tiny-hybrid", "builtin:tiny-char", "builtin:tiny-prompt"]


@functools.lru_cache(maxsize=8)
def _encoded(spec, dtype: str) -> torch.Tensor:
    """The model's encoder output [N, T, D] for bundled (or synthetic) utterances, offline (a real
    encoder's output emits like speech; random vectors mostly give blanks); prompt models with
    language 0, as the engine applies it (engine/step.py `apply_prompt`)."""
    model = helpers.model(spec, None, dtype)
    audio = helpers.utterances(4, 16000, seed=1)
    n = min(len(a) for a in audio)
    signal = torch.from_numpy(np.stack([a[:n] for a in audio]))
    with torch.inference_mode():
        feats, feat_len = model.preprocessor(input_signal=signal, length=torch.full((4,), n))
        enc, _ = model.nemo.encoder(audio_signal=feats.to(model.dtype), length=feat_len)
        if model.prompt_dictionary is not None:
            enc = apply_prompt(model, enc, torch.zeros(4, dtype=torch.long))
    return enc.transpose(1, 2).contiguous()  # [N, T, D]


def _chunks(model, b: int, t: int, n: int, scale: float, seed: int, spec=None, dtype="fp32"):
    """n chunks [B, T, D] of real encoder output times `scale` (a larger scale emits more labels per
    frame), each row reading another utterance at another offset; lengths per row in [0, T]."""
    g = torch.Generator().manual_seed(seed)
    enc = _encoded(spec, dtype)
    starts = torch.randint(0, enc.shape[1] - t * n, (b,), generator=g)
    out = []
    for k in range(n):
        x = torch.stack([enc[i % enc.shape[0], s + k * t : s + (k + 1) * t] for i, s in enumerate(starts.tolist())])
        lens = torch.randint(0, t + 1, (b,), generator=g)
        lens[0] = t  # one full row always
        out.append(((x.float() * scale).to(model.dtype), lens))
    return out


def _same(x, y, exact: bool) -> bool:
    """Bitwise, or (rows_mode "active": matrix products of other shapes) within float rounding."""
    return torch.equal(x, y) if exact else torch.allclose(x.float(), y.float(), rtol=0.02, atol=1e-5)


def _equal_states(a, b, exact: bool):
    for x, y in zip(a.predictor_states, b.predictor_states):
        assert _same(x, y, exact)
    assert _same(a.predictor_outputs, b.predictor_outputs, exact)
    assert torch.equal(a.labels, b.labels)
    assert torch.equal(a.decoded_lengths, b.decoded_lengths)
    assert len(a.fusion_states_list) == len(b.fusion_states_list)
    for x, y in zip(a.fusion_states_list, b.fusion_states_list):
        assert torch.equal(x, y)


def _compare(computer, model, chunks, bias_ids=None, confidence=False, fusion_init=None, rows_mode="all") -> int:
    """Decode chunk after chunk with both, carrying each one's own state; returns labels emitted."""
    b, exact = chunks[0][0].shape[0], rows_mode == "all"
    ref_state = decoder_state_after_sos(computer, model.device, b)
    if fusion_init is not None:
        ref_state.fusion_states_list = [fusion_init.clone()]
    ours_state = ref_state
    ref_state = _clone_state(ref_state)
    emitted = 0
    extra = {"multi_biasing_ids": bias_ids} if bias_ids is not None else {}
    for x, lens in chunks:
        with torch.inference_mode(), aten_rnn(x.device, x.dtype):
            ref, ref_state = computer(x=x, out_len=lens, prev_batched_state=ref_state, **extra)
            ours, ours_state = label_loop(computer, x, lens, ours_state, bias_ids, confidence, rows_mode)
        assert torch.equal(ours.current_lengths, ref.current_lengths)
        for i, m in enumerate(ref.current_lengths.tolist()):
            assert ours.transcript[i, :m].tolist() == ref.transcript[i, :m].tolist(), f"row {i}"
            assert ours.timestamps[i, :m].tolist() == ref.timestamps[i, :m].tolist(), f"row {i}"
            if confidence:
                assert _same(ours.step_confidence[i, :m], ref.step_confidence[i, :m], exact), f"row {i}"
        _equal_states(ours_state, ref_state, exact)
        emitted += int(ref.current_lengths.sum())
    return emitted


def _clone_state(s):
    return type(s)(
        predictor_states=[x.clone() for x in s.predictor_states], predictor_outputs=s.predictor_outputs.clone(),
        labels=s.labels.clone(), decoded_lengths=s.decoded_lengths.clone(),
        fusion_states_list=[x.clone() for x in s.fusion_states_list], time_jumps=None,
    )
