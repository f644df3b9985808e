"""The recipe's RNN-T loss: NeMo's value, vectorised for the CPU."""

from __future__ import annotations

import torch


def rnnt_loss(logits: torch.Tensor, targets: torch.Tensor, logit_lens: torch.Tensor, target_lens: torch.Tensor,
              blank: int) -> torch.Tensor:
    """Vectorised RNN-T negative log-likelihood, summed per utterance and averaged over the batch.

    Same value as NeMo's ``RNNTLoss`` (warprnnt_numba, reduction ``mean_batch``) but ~10x faster on CPU:
    the forward variable is computed one time step at a time, and the recursion along the label axis
    (alpha[t,u] = logaddexp(alpha[t-1,u] + blank[t-1,u], alpha[t,u-1] + emit[t,u-1])) is solved in closed form
    with a cumulative sum and ``logcumsumexp``.  Gradients come from autograd.
    logits: [B, T, U+1, V] joint output (pre-softmax); targets: [B, U].
    """
    lp = logits.float().log_softmax(-1)
    B, T, U1, _ = lp.shape
    blank_lp = lp[..., blank]                                                    # [B, T, U+1]
    tg = targets[:, : U1 - 1].long().clamp(min=0)
    emit_lp = lp[:, :, : U1 - 1, :].gather(-1, tg[:, None, :, None].expand(B, T, U1 - 1, 1)).squeeze(-1)  # [B,T,U]
    zeros = lp.new_zeros(B, T, 1)
    csum = torch.cat([zeros, emit_lp.cumsum(-1)], dim=-1)                        # [B, T, U+1]
    neg_inf = torch.finfo(lp.dtype).min / 4
    a = torch.full((B, U1), neg_inf, dtype=lp.dtype, device=lp.device)
    a[:, 0] = 0.0
    alphas = []
    for t in range(T):
        if t > 0:
            a = alphas[-1] + blank_lp[:, t - 1]
            a = torch.cat([a[:, :1], a[:, 1:]], dim=-1)
        c = csum[:, t]
        alpha_t = c + torch.logcumsumexp(a - c, dim=-1)
        alphas.append(alpha_t)
    alpha = torch.stack(alphas, dim=1)                                           # [B, T, U+1]
    bi = torch.arange(B, device=lp.device)
    tl, ul = logit_lens.long() - 1, target_lens.long()
    ll = alpha[bi, tl, ul] + blank_lp[bi, tl, ul]
    return -ll.mean()
