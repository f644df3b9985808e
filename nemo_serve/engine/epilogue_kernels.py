"""Triton kernels for engine/epilogues.py: each epilogue one kernel, fp32 inside, one rounding out.

The kernels are built on first use (`_kernels`), not at import: Triton reads TRITON_INTERPRET
when a kernel is decorated, and the CPU tests set it before that (tests/test_epilogues.py), so
the same code runs as a CUDA kernel on the GPU and in Triton's interpreter on the CPU.

Rounding, against NeMo's ops: `residual_norm` rounds r = residual + alpha * y to the tensor's
dtype (as torch.add does) before normalising it, so the residual stream carried on is NeMo's bit
for bit in fp32 up to the add's own rounding; the LayerNorm's mean and variance are summed in
another order than ATen's (a tree over the row), so the normed output differs in the last bits.
"""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=1)
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def residual_norm_kernel(res_ptr, y_ptr, w_ptr, b_ptr, r_ptr, out_ptr, d, alpha, eps,
                             KEEP_R: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        inside = cols < d
        at = row * d + cols
        res = tl.load(res_ptr + at, mask=inside, other=0.0).to(tl.float32)
        y = tl.load(y_ptr + at, mask=inside, other=0.0).to(tl.float32)
        r = (res + alpha * y).to(out_ptr.dtype.element_ty)  # rounded as torch.add rounds
        if KEEP_R:
            tl.store(r_ptr + at, r, mask=inside)
        r = r.to(tl.float32)
        mean = tl.sum(r, axis=0) / d
        diff = tl.where(inside, r - mean, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(diff * diff, axis=0) / d + eps)
        w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + cols, mask=inside, other=0.0).to(tl.float32)
        tl.store(out_ptr + at, (diff * rstd * w + b).to(out_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def glu_mask_kernel(x_ptr, mask_ptr, out_ptr, n, c, t, HAS_MASK: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = i < n
        per_row = c * t
        b = i // per_row
        at = b * 2 * per_row + i % per_row  # x [B, 2C, T]: the first half, then the gate half
        a = tl.load(x_ptr + at, mask=inside, other=0.0).to(tl.float32)
        g = tl.load(x_ptr + at + per_row, mask=inside, other=0.0).to(tl.float32)
        out = a * tl.sigmoid(g)
        if HAS_MASK:
            padded = tl.load(mask_ptr + b * t + i % t, mask=inside, other=0)
            out = tl.where(padded != 0, 0.0, out)
        tl.store(out_ptr + i, out.to(out_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def bn_silu_kernel(x_ptr, scale_ptr, shift_ptr, out_ptr, n, c, t, BLOCK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = i < n
        ch = (i // t) % c  # x [B, C, T]
        x = tl.load(x_ptr + i, mask=inside, other=0.0).to(tl.float32)
        z = x * tl.load(scale_ptr + ch, mask=inside, other=0.0) + tl.load(shift_ptr + ch, mask=inside, other=0.0)
        tl.store(out_ptr + i, (z * tl.sigmoid(z)).to(out_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def channel_norm_silu_kernel(x_ptr, w_ptr, b_ptr, out_ptr, c, t, eps, BLOCK: tl.constexpr):
        frame = tl.program_id(0).to(tl.int64)  # one (row, frame) of x [B, C, T]: its C values, stride T
        ch = tl.arange(0, BLOCK)
        inside = ch < c
        at = (frame // t) * c * t + ch * t + frame % t
        x = tl.load(x_ptr + at, mask=inside, other=0.0).to(tl.float32)
        mean = tl.sum(x, axis=0) / c
        diff = tl.where(inside, x - mean, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(diff * diff, axis=0) / c + eps)
        w = tl.load(w_ptr + ch, mask=inside, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + ch, mask=inside, other=0.0).to(tl.float32)
        z = (diff * rstd * w + b).to(out_ptr.dtype.element_ty).to(tl.float32)  # rounded as NeMo's norm output
        tl.store(out_ptr + at, (z * tl.sigmoid(z)).to(out_ptr.dtype.element_ty), mask=inside)

    return triton, residual_norm_kernel, glu_mask_kernel, bn_silu_kernel, channel_norm_silu_kernel


ELEMENTWISE_BLOCK = 1024


def residual_norm(residual, y, alpha: float, weight, bias, eps: float, keep_residual: bool = True):
    """(residual + alpha * y, LayerNorm of it) over the last axis; residual, y [..., D]."""
    triton, kernel, *_ = _kernels()
    d = residual.shape[-1]
    residual, y = residual.contiguous(), y.contiguous()
    out = torch.empty_like(residual)
    r = torch.empty_like(residual) if keep_residual else out  # unused when not kept
    rows = residual.numel() // d
    kernel[(rows,)](residual, y, weight, bias, r, out, d, float(alpha), float(eps),
                    KEEP_R=keep_residual, BLOCK=triton.next_power_of_2(d))  # fmt: skip
    return (r if keep_residual else None), out


def glu_mask(x, pad_mask):
    """GLU over axis 1 of x [B, 2C, T], then frames where pad_mask [B, T] holds set to 0."""
    triton, _, kernel, *_ = _kernels()
    x = x.contiguous()
    b, c2, t = x.shape
    out = torch.empty(b, c2 // 2, t, dtype=x.dtype, device=x.device)
    mask = pad_mask.contiguous() if pad_mask is not None else out  # unused without a mask
    n = out.numel()
    kernel[(triton.cdiv(n, ELEMENTWISE_BLOCK),)](x, mask, out, n, c2 // 2, t, HAS_MASK=pad_mask is not None,
                                                 BLOCK=ELEMENTWISE_BLOCK)  # fmt: skip
    return out


def bn_silu(x, scale, shift):
    """SiLU(x * scale + shift) per channel of x [B, C, T]: eval BatchNorm folded, then SiLU."""
    triton, _, _, kernel, _ = _kernels()
    x = x.contiguous()
    out = torch.empty_like(x)
    n = x.numel()
    kernel[(triton.cdiv(n, ELEMENTWISE_BLOCK),)](x, scale, shift, out, n, x.shape[1], x.shape[2],
                                                 BLOCK=ELEMENTWISE_BLOCK)  # fmt: skip
    return out


def channel_norm_silu(x, weight, bias, eps: float):
    """SiLU(LayerNorm over axis 1) of x [B, C, T], without NeMo's transposes."""
    triton, *_, kernel = _kernels()
    x = x.contiguous()
    out = torch.empty_like(x)
    b, c, t = x.shape
    kernel[(b * t,)](x, weight, bias, out, c, t, float(eps), BLOCK=triton.next_power_of_2(c))
    return out
