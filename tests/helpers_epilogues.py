"""The fused layer epilogues' inputs and tolerances, shared by test_epilogues.py (torch twins
against NeMo's layer) and epilogue_triton_checks.py (the Triton kernels in the interpreter)."""

from __future__ import annotations

import torch


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _layer_inputs(model, b=3, t=4, seed=0):
    layer = model.nemo.encoder.layers[0]
    gen = torch.Generator().manual_seed(seed)
    d = layer.norm_out.normalized_shape[0]
    x = torch.randn(b, t, d, generator=gen).to(model.dtype)
    k = layer.conv.depthwise_conv.kernel_size[0] - 1
    cache = torch.randn(b, d, k, generator=gen).to(model.dtype)
    pad_mask = torch.zeros(b, t, dtype=torch.bool)
    pad_mask[1, t - 1:] = True  # a row with padded frames: the GLU mask zeroes them
    pad_mask[2, t - 2:] = True
    return layer, x, cache, pad_mask


def _attend(h):
    """A stand-in for attention (not what is tested here): deterministic, shape-keeping."""
    return torch.tanh(h) * 0.5


def _close(a, b, dtype):
    scale = max(b.float().abs().max().item(), 1.0)
    return (a.float() - b.float()).abs().max().item() <= TOL[dtype] * scale


TOL = {"fp32": 1e-4, "bf16": 2.0**-6}
