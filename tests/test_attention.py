"""SDPA attention (engine/attention.py) against NeMo's matmul + softmax: outputs within a stated
tolerance step by step (fill levels from empty to full, masks of every kind), tokens identical to
NeMo's loop on the demo model, and the selftest naming what ran."""

import io

import pytest
import torch

from nemo_serve.engine.encoder import KVCacheEncoder
from nemo_serve.engine.slots import SlotPool
from nemo_serve.selftest import run_selftest

from . import helpers

# Largest |sdpa - matmul| of the encoder output over 12 steps, relative to the output's largest
# magnitude, measured on CPU (demo model, default mode): fp32 4.3e-7, bf16 1.2e-2 (bf16 rounding of
# each step's inputs); the bounds leave 8-20x.
TOLERANCE = {"fp32": 1e-5, "bf16": 1e-1}


def _encoder_outputs(m, attention: str, steps: int = 12, rows: int = 3):
    """Rows join at steps 0, 2, 5 (cache empty, partly filled, full), random features."""
    g = m.geometry
    enc = KVCacheEncoder(m, attention=attention)
    pool = SlotPool(m, rows, enc.channel_shape)
    gen = torch.Generator().manual_seed(0)
    history = torch.zeros(rows, m.num_mels, g.pre_cache_frames)
    start, outs = [0, 2, 5], []
    for s in range(steps):
        for is_first in (True, False):
            group = [r for r in range(rows) if (start[r] == s) == is_first and start[r] <= s]
            if not group:
                continue
            feats = torch.randn(len(group), m.num_mels, g.first_frames if is_first else g.chunk_frames, generator=gen)
            idx = torch.tensor(group)
            signal, drop, lengths = helpers.chunk_signal(g, history, idx, feats, is_first)
            with torch.inference_mode():
                e, _, cache = enc.step(signal.to(m.dtype), lengths, pool.gather_encoder(idx), drop, False)
            pool.scatter_encoder(idx, cache)
            outs.append(e.float())
    return outs


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_sdpa_matches_matmul_within_tolerance(dtype):
    m = helpers.model(None, None, dtype=dtype)
    ref, sdpa = _encoder_outputs(m, "matmul"), _encoder_outputs(m, "sdpa")
    worst = max(((a - b).abs().max() / a.abs().max()).item() for a, b in zip(ref, sdpa))
    assert worst <= TOLERANCE[dtype], worst
    assert any(not torch.equal(a, b) for a, b in zip(ref, sdpa))  # it did run another kernel


def test_sdpa_selftest_token_identical_and_named(monkeypatch):
    """Tokens equal NeMo's loop with SDPA on the demo model (fp32, its fastest mode: most steps),
    and the selftest's kernels line says which attention and layout ran."""
    monkeypatch.setenv("NEMO_SERVE_ATTENTION", "sdpa")
    monkeypatch.setenv("NEMO_SERVE_KV_LAYOUT", "ring")
    out = io.StringIO()
    mode = helpers.model(None, None).trained_context_right[-1]
    code = run_selftest(4, context_right=mode, num_slots=3, seed=1, out=out)
    assert code == 0, out.getvalue()
    kernels = [line for line in out.getvalue().splitlines() if line.startswith("kernels: ")]
    assert kernels == [kernels[0]] and "SDPA" in kernels[0] and "ring layout" in kernels[0], kernels


def test_selftest_names_the_reference_kernels(monkeypatch):
    monkeypatch.setenv("NEMO_SERVE_KV_LAYOUT", "window")
    out = io.StringIO()
    code = run_selftest(2, context_right=helpers.model(None, None).trained_context_right[0], num_slots=2, out=out)
    assert code == 0, out.getvalue()
    line = next(x for x in out.getvalue().splitlines() if x.startswith("kernels: "))
    assert "window layout" in line and "matmul + softmax (NeMo's arithmetic)" in line, line


def test_unknown_attention_is_refused():
    with pytest.raises(ValueError, match="matmul, sdpa"):
        KVCacheEncoder(helpers.model(None, None), attention="flash")
