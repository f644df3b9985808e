"""The relative-position attention's last part, two ways: NeMo's matmul + softmax, or PyTorch SDPA.

Both take the rows' queries with the content bias added (q_u [B, h, T, d_k]), the window's keys and
values ([B, h, C+T, d_k], read where engine/encoder.py put them) and the positional term
(bd [B, h, T, >= C+T], already relative-shifted).

- `matmul` (the default, NeMo's arithmetic: RelPositionMultiHeadAttention.forward with
  use_pytorch_sdpa False): q_u K^T, + bd, / sqrt(d_k), masked_fill, softmax, masked_fill, @ V.
  About 8 kernels after the position product, and the [B, h, T, C+T] scores go through memory
  four times. Token-identical to NeMo's loop (the parity tests).
- `sdpa`: the positional term scaled and masked becomes SDPA's additive float mask, and one
  `scaled_dot_product_attention` call does the rest (on CUDA the memory-efficient kernel, which
  takes a float bias; flash takes none). Same mathematics, other accumulation order: outputs agree to
  float rounding (tests/test_attention.py states the tolerance), tokens are checked against
  NeMo's loop by the selftest, which names the attention that ran. Rows whose positions are all
  masked get 0, as NeMo's second masked_fill gives them.

NEMO_SERVE_ATTENTION=sdpa picks it; NeMo's own `use_pytorch_sdpa` models take it always (their
oracle does too).
"""

from __future__ import annotations

import os

import torch

INF_VAL = 10000.0  # NeMo's mask fill (multi_head_attention.INF_VAL)
KINDS = ("matmul", "sdpa")


def attention_kind(kind: str | None = None) -> str:
    """`kind`, else NEMO_SERVE_ATTENTION, else `matmul` (NeMo's arithmetic)."""
    kind = kind or os.environ.get("NEMO_SERVE_ATTENTION", "matmul")
    if kind not in KINDS:
        raise ValueError(f"attention {kind!r}: one of {', '.join(KINDS)}")
    return kind


def matmul_attention(a, q_u, k, v, bd, mask):
    """NeMo's: returns linear_out(attention) [B, T, D]. `mask` [B, T, C+T] (True: masked)."""
    n = k.shape[-2]
    ac = torch.matmul(q_u, k.transpose(-2, -1))
    scores = (ac + bd[:, :, :, :n]) / a.s_d_k
    return a.forward_attention(v, scores, mask)


def sdpa_attention(a, q_u, k, v, bd, mask_heads, all_masked):
    """SDPA with the positional term as an additive bias. `mask_heads` [B, 1, T, C+T], `all_masked`
    [B, 1, T, 1]. SDPA's default scale is 1/sqrt(d_k), NeMo's s_d_k."""
    b, _, t, _ = q_u.shape
    n = k.shape[-2]
    bias = bd[:, :, :, :n] * (1 / a.s_d_k)
    bias.masked_fill_(mask_heads, -INF_VAL)
    out = torch.nn.functional.scaled_dot_product_attention(q_u, k, v, attn_mask=bias)
    out = out.masked_fill(all_masked, 0.0)
    return a.linear_out(out.transpose(1, 2).reshape(b, t, -1))
