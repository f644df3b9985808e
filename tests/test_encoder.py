"""The KV-cache encoder step against NeMo's cache_aware_stream_step, step by step.

Same features, same fill levels (rows started at different steps), same drop counts: the
outputs must agree to float rounding and the cached keys/values must be the projections of
NeMo's cached layer inputs. Token identity end to end is in test_parity.py.
"""

import pytest
import torch

from nemo.collections.asr.parts.submodules.causal_convs import CausalConv2D

from nemo_serve.engine.encoder import (
    KVCacheEncoder,
    NemoEncoder,
    causal_conv2d,
    kv_cache_unsupported,
    make_encoder,
)
from nemo_serve.engine.nemo_decoder import aten_rnn
from nemo_serve.engine.slots import SlotPool

from . import helpers


def _run_both(m, steps: int, rows: int, start: list[int], final_width: int | None = None, full: bool = True):
    """Drive both encoders over random features; row r joins at step start[r]. Yields per-step outputs.
    Every row of a call has the full width, so `full` may be passed as True (masks skipped) or False."""
    g = m.geometry
    kv, ref = KVCacheEncoder(m), NemoEncoder(m)
    pools = {"kv": SlotPool(m, rows, kv.channel_shape), "ref": SlotPool(m, rows)}
    gen = torch.Generator().manual_seed(0)
    history = torch.zeros(rows, m.num_mels, g.pre_cache_frames)
    for s in range(steps):
        active = [r for r in range(rows) if start[r] <= s]
        first = [r for r in active if start[r] == s]
        later = [r for r in active if start[r] < s]
        for group, is_first in ((first, True), (later, False)):
            if not group:
                continue
            width = g.first_frames if is_first else g.chunk_frames
            if final_width and s == steps - 1 and not is_first:
                width = final_width
            feats = torch.randn(len(group), m.num_mels, width, generator=gen)
            idx = torch.tensor(group)
            signal, drop, lengths = helpers.chunk_signal(g, history, idx, feats, is_first)
            out = {}
            for name, enc in (("kv", kv), ("ref", ref)):
                with torch.inference_mode():
                    e, n, cache = enc.step(signal.to(m.dtype), lengths, pools[name].gather_encoder(idx), drop, full)
                pools[name].scatter_encoder(idx, cache)
                out[name] = (e, n, cache)
            yield m, out


@pytest.mark.parametrize("spec,full", [(None, True), (None, False), ("builtin:tiny-hybrid", True)])
def test_kv_encoder_matches_nemo_step_by_step(spec, full):
    m = helpers.model(spec, None)
    assert kv_cache_unsupported(m.nemo.encoder) is None
    worst = 0.0
    for m, out in _run_both(m, steps=12, rows=3, start=[0, 2, 5], full=full):
        (e_kv, n_kv, c_kv), (e_ref, n_ref, c_ref) = out["kv"], out["ref"]
        assert torch.equal(n_kv, n_ref)
        assert torch.equal(c_kv.cache_last_channel_len, c_ref.cache_last_channel_len)
        assert e_kv.shape == e_ref.shape
        worst = max(worst, (e_kv - e_ref).abs().max().item())
        torch.testing.assert_close(c_kv.cache_last_time, c_ref.cache_last_time, rtol=1e-4, atol=1e-4)
        # Cached K|V are the projections of NeMo's cached layer inputs (valid, right-aligned rows).
        d = m.nemo.encoder.d_model
        for i, layer in enumerate(m.nemo.encoder.layers):
            a = layer.self_attn
            for b, fill in enumerate(c_ref.cache_last_channel_len.tolist()):
                if fill == 0:
                    continue
                x = c_ref.cache_last_channel[i, b, -fill:]
                with torch.inference_mode():
                    k, v = a.linear_k(x), a.linear_v(x)
                got = c_kv.cache_last_channel[i, b, :, -fill:]  # [h, fill, 2 d_k]
                assert got.shape[0] * got.shape[-1] == 2 * d
                torch.testing.assert_close(got[..., : a.d_k].transpose(0, 1).reshape(fill, d), k, rtol=1e-4, atol=1e-4)
                torch.testing.assert_close(got[..., a.d_k :].transpose(0, 1).reshape(fill, d), v, rtol=1e-4, atol=1e-4)
    assert worst < 1e-4, worst


def test_kv_encoder_final_partial_chunk_outputs_match():
    m = helpers.model(None, None)
    g = m.geometry
    for m, out in _run_both(m, steps=4, rows=2, start=[0, 0], final_width=g.chunk_frames // 2 + 1):
        (e_kv, n_kv, _), (e_ref, n_ref, _) = out["kv"], out["ref"]
        assert torch.equal(n_kv, n_ref)
        valid = int(n_ref.min())
        torch.testing.assert_close(e_kv[:, :, :valid], e_ref[:, :, :valid], rtol=1e-4, atol=1e-4)


def test_kv_cache_layout_and_size():
    """Sizes derived by hand for the shipped demo model at its default mode [56, 13]: configs/demo_model.yaml
    (d_model 128, 4 heads (d_k 32), conv kernel 9 (causal: 8 cached columns)) with its encoder stacked to 6
    layers, 56 cached left frames, 13 + 1 scratch positions.
      NeMo's layout:  channel 6 x 56 x 128 = 43,008 + time 6 x 128 x 8 = 6,144 -> 49,152 floats = 196,608 B
      key/value:      channel 6 x 4 heads x (56 + 14) x (2 x 32) = 107,520 + time 6,144 -> 113,664 floats = 454,656 B
    """
    m = helpers.model(None, None)
    assert m.name == "demo" and m.geometry.context_right == 13
    enc = make_encoder(m)
    kv, ref = SlotPool(m, 2, enc.channel_shape), SlotPool(m, 2)
    # two slots + the scratch row padded steps point at
    assert ref.cache_last_channel.shape == (6, 3, 56, 128) and ref.cache_last_time.shape == (6, 3, 128, 8)
    assert kv.cache_last_channel.shape == (6, 3, 4, 56 + 14, 64) and kv.cache_last_time.shape == (6, 3, 128, 8)
    assert m.cache_bytes_per_stream == ref.cache_bytes_per_stream == 196_608
    assert kv.cache_bytes_per_stream == 454_656
    # what the tensors really hold, for the two slots and the scratch row
    assert ref.cache_last_channel.nbytes + ref.cache_last_time.nbytes == 3 * 196_608
    assert kv.cache_last_channel.nbytes + kv.cache_last_time.nbytes == 3 * 454_656


def test_engine_without_kv_cache_runs_nemo_layers_and_agrees():
    m = helpers.model(None, None)
    audios = helpers.utterances(3, seed=4)
    runs = {}
    for kv in (True, False):
        engine = helpers.new_engine(m, 3, kv_cache=kv)
        assert engine.engine.encoder.kind == ("kv" if kv else "nemo")
        driven = helpers.drive(engine, audios, packet=2400, start_tick=[0, 1, 4])
        runs[kv] = [driven.tokens(i) for i in range(3)]
    assert runs[True] == runs[False]
    assert all(runs[True])


def test_unmasked_subsampling_equals_nemos_when_no_row_is_padded():
    m = helpers.model(None, None)
    enc = KVCacheEncoder(m)
    g = m.geometry
    w = g.pre_cache_frames + g.chunk_frames
    x = torch.randn(3, w, m.num_mels, generator=torch.Generator().manual_seed(1))
    lengths = torch.full((3,), w)
    with torch.inference_mode():
        ref, ref_len = m.nemo.encoder.pre_encode(x=x, lengths=lengths)
        got, got_len = enc._pre_encode(x, lengths, full=True)
    assert torch.equal(got_len, ref_len)
    assert torch.equal(got, ref)  # the skipped masks are all ones: bit-identical


@pytest.mark.parametrize("size", [(13, 80), (14, 41), (7, 20)])
def test_causal_conv2d_without_pad_copy_is_bit_identical(size):
    m = helpers.model(None, None)
    convs = [c for c in m.nemo.encoder.pre_encode.conv if isinstance(c, CausalConv2D)]
    assert len(convs) == 3  # dw_striding x8: one full conv, two depthwise
    gen = torch.Generator().manual_seed(2)
    with torch.inference_mode():
        for conv in convs:
            x = torch.randn(2, conv.in_channels, *size, generator=gen)
            ref = conv(x)
            got = causal_conv2d(conv, x)
            assert got.shape == ref.shape
            assert torch.equal(got, ref)


def test_aten_rnn_restores_the_onednn_flag():
    assert torch.backends.mkldnn.enabled
    with pytest.raises(RuntimeError):
        with aten_rnn(torch.device("cpu"), torch.float32):
            assert not torch.backends.mkldnn.enabled
            raise RuntimeError("boom")
    assert torch.backends.mkldnn.enabled


def test_aten_rnn_leaves_bf16_on_onednn():
    """bf16 decoding must round where NeMo's loop does: oneDNN stays on (the flip changed tokens)."""
    with aten_rnn(torch.device("cpu"), torch.bfloat16):
        assert torch.backends.mkldnn.enabled
