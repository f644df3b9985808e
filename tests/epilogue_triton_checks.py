"""The Triton epilogue kernels (engine/epilogue_kernels.py) in Triton's interpreter on the CPU,
against NeMo's layer and the torch twins; run by tests/test_epilogues.py in a child process with
TRITON_INTERPRET=1 (python -m tests.epilogue_triton_checks fp32 bf16). Prints one line per check
that passed; an AssertionError otherwise."""

from __future__ import annotations

import os
import sys

import torch

from nemo_serve.engine.encoder import KVCacheEncoder
from nemo_serve.engine.epilogues import TorchEpilogues, TritonEpilogues, fused_layer

from . import helpers
from .helpers_epilogues import DTYPES, _attend, _close, _layer_inputs


def check_layer(dtype):
    model = helpers.model(None, None, dtype)
    layer, x, cache, pad_mask = _layer_inputs(model)
    with torch.inference_mode():
        ref, ref_cache = KVCacheEncoder._nemo_layer(layer, x, _attend, pad_mask, cache)
        out, out_cache = fused_layer(TritonEpilogues(), layer, x, _attend, pad_mask, cache)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert _close(out_cache, ref_cache, dtype)  # the next conv cache: the GLU output's last frames
    assert _close(out, ref, dtype), (out.float() - ref.float()).abs().max()


def check_epilogues(dtype):
    """Odd sizes (a row not a power of two, elements not a multiple of the block)."""
    dt = DTYPES[dtype]
    gen = torch.Generator().manual_seed(2)
    twin, kern = TorchEpilogues(), TritonEpilogues()
    norm = torch.nn.LayerNorm(37)
    bn = torch.nn.BatchNorm1d(5).eval()
    with torch.no_grad():
        for p in (norm.weight, norm.bias, bn.weight, bn.bias, bn.running_mean):
            p.copy_(torch.randn(p.shape, generator=gen))
        bn.running_var.copy_(torch.rand(5, generator=gen) + 0.5)
    norm, bn = norm.to(dt), bn.to(dt)
    res, y = torch.randn(2, 3, 37, generator=gen).to(dt), torch.randn(2, 3, 37, generator=gen).to(dt)
    with torch.inference_mode():
        for alpha in (0.5, 1.0):
            (r0, n0), (r1, n1) = twin.residual_norm(res, y, alpha, norm), kern.residual_norm(res, y, alpha, norm)
            assert _close(r1, r0, dtype) and _close(n1, n0, dtype), alpha
            assert kern.residual_norm(res, y, alpha, norm, keep_residual=False)[0] is None
        x = torch.randn(3, 10, 7, generator=gen).to(dt)
        mask = torch.rand(3, 7, generator=gen) > 0.6
        for m in (mask, None):
            assert _close(kern.glu_mask(x, m), twin.glu_mask(x, m), dtype)
        assert torch.equal(kern.glu_mask(x, mask)[mask.unsqueeze(1).expand(3, 5, 7)].float(), torch.zeros(int(mask.sum()) * 5))
        z = torch.randn(2, 5, 9, generator=gen).to(dt) * 3
        assert _close(kern.norm_silu(z, bn), twin.norm_silu(z, bn), dtype)
        channel_norm = torch.nn.LayerNorm(5)
        with torch.no_grad():
            channel_norm.weight.copy_(torch.randn(5, generator=gen))
            channel_norm.bias.copy_(torch.randn(5, generator=gen))
        channel_norm = channel_norm.to(dt)
        assert _close(kern.norm_silu(z, channel_norm), twin.norm_silu(z, channel_norm), dtype)




if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1 (Triton's interpreter on the CPU)"
    torch.set_num_threads(1)
    for dtype in sys.argv[1:]:  # several dtypes in one process: Triton and NeMo are imported once
        check_layer(dtype)
        print(f"{dtype}-layer-ok", flush=True)
        check_epilogues(dtype)
        print(f"{dtype}-epilogues-ok", flush=True)
