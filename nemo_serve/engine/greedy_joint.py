"""The joint's greedy label without its log-softmax, and still NeMo's label bit for bit.

On the CPU NeMo's joint (`RNNTJoint.joint_after_projection`, `log_softmax` None) ends with a
log-softmax over the V+1 outputs, and greedy decoding takes its argmax (first maximum). Per row the
log-softmax is x - M - L (M the row's maximum, L = log sum exp(x - M), 0 <= L <= log(V+1)): a
monotone map, so its argmax is the logits' argmax, except where rounding makes a value at a lower
index equal to the maximum. That needs a logit within a few units in the last place of L of the
maximum (|x_i - M| <= ulp(L) <= eps * L; see `tie_margin`). `greedy_labels` takes the logits'
argmax and gives NeMo's log-softmax and argmax to the rows that hold such a near tie, only those:
the labels are NeMo's bitwise and the [n, V+1] exp / log / subtract passes are skipped for all
other rows. Rows that need the logits themselves (token confidence, phrase boosting) take the
full joint (engine/label_loop.py).

On CUDA NeMo's joint applies no log-softmax (its argmax is the logits'): there the full joint is
already this, and the near-tie check would cost a host sync, so CUDA always takes the full joint.

Off by default (NEMO_SERVE_JOINT=argmax turns it on): measured on the CPU it does not pay
(benchmarks/results/joint_argmax_cpu.json, benchmarks/joint_argmax_bench.py). The log-softmax is
V exponentials per row against the joint's V x H multiply-adds, under 1% of a Nemotron-shaped
joint, and the near-tie check (compare, sum, any) costs about what it saves; on the demo model's
129 outputs the check costs more than the log-softmax. Kept, tested, as the measured answer to
"compute only what greedy argmax needs".
"""

from __future__ import annotations

import math
import os

import torch

JOINT_MODES = ("argmax", "full")


def joint_mode(mode: str | None = None) -> str:
    """`mode`, else NEMO_SERVE_JOINT, else `full` (NeMo's joint; `argmax` is exact too but does not pay)."""
    mode = mode or os.environ.get("NEMO_SERVE_JOINT", "full")
    if mode not in JOINT_MODES:
        raise ValueError(f"NEMO_SERVE_JOINT={mode!r}: one of {', '.join(JOINT_MODES)}")
    return mode


def greedy_labels(joint, f: torch.Tensor, g: torch.Tensor, mode: str | None = None) -> torch.Tensor:
    """NeMo's greedy labels `joint.joint_after_projection(f, g).max(-1)[1]` for f, g [n, 1, H]: [n]."""
    if joint_mode(mode) == "full" or not _log_softmax_skippable(joint, f):
        return joint.joint_after_projection(f, g).squeeze(1).squeeze(1).max(-1)[1]
    raw = joint.joint_net(f.unsqueeze(2) + g.unsqueeze(1)).squeeze(1).squeeze(1)  # NeMo's ops up to log_softmax
    top, labels = raw.max(-1)
    # In float: the margin is below a bf16 unit at the logits' magnitude; rounding is monotone, so
    # every logit within the margin of the maximum passes the comparison.
    near = (raw.float() >= (top.float() - tie_margin(raw)).unsqueeze(1)).sum(-1) > 1
    if bool(near.any()):  # a sync, free on the CPU (the only device this path runs on)
        rows = near.nonzero().squeeze(1)
        labels[rows] = raw[rows].log_softmax(dim=-1).max(-1)[1]  # NeMo's op, row by row the same arithmetic
    return labels


def tie_margin(raw: torch.Tensor) -> float:
    """How close to its row's maximum a logit must be for the log-softmax's rounding to tie them:
    a tie needs |x_i - M| within about one unit in the last place of the results (magnitude <= L +
    |x_i - M|), and ulp(L) <= eps * L with L <= log(V+1); 8x that covers an evaluation as
    (x - M) - L or as x - (M + L), and bf16 evaluated in float then rounded."""
    return 8 * torch.finfo(raw.dtype).eps * max(math.log(raw.shape[-1]), 1.0)


def _log_softmax_skippable(joint, f: torch.Tensor) -> bool:
    """Where NeMo's joint ends in a log-softmax of the joint net's output and nothing else differs."""
    if f.is_cuda or getattr(joint, "log_softmax", False) is False or getattr(joint, "temperature", None) != 1.0:
        return False  # (a joint class without these attributes: the full joint, NeMo's call)
    return not joint.training and not joint.is_adapter_available()
