"""Greedy RNN-T decoding of calibration frames for many candidate blank biases at once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


def calibrate_blank(model, projected: list[torch.Tensor], target: float, lo: float, hi: float, rounds: int) -> float:
    """Blank bias giving `target` emitting frames on the calibration frames: grid bisection.

    Each round decodes all frames for 8 candidate biases at once (one batch) and keeps the
    bracket around the target (moving it if the target lies outside); a round narrows it 7 times.
    """
    for _ in range(rounds):
        candidates = torch.linspace(lo, hi, 8, dtype=torch.float64)
        fractions = simulate_greedy(model, projected, candidates.float()).emitting_fraction
        above = (fractions >= target).nonzero()  # the fraction falls as the blank bias rises
        if len(above) == 0:
            lo, hi = lo - (hi - lo), lo
        elif int(above[-1]) == len(candidates) - 1:
            lo, hi = hi, hi + (hi - lo)
        else:
            i = int(above[-1])
            lo, hi = float(candidates[i]), float(candidates[i + 1])
    return round((lo + hi) / 2, 3)


@dataclass
class GreedyStats:
    """Per-candidate statistics of a greedy RNN-T decode: all tensors [C]."""

    emitting_fraction: torch.Tensor  # frames with >= 1 token / frames
    tokens_per_frame: torch.Tensor
    max_symbols_fraction: torch.Tensor  # frames cut off at max_symbols / frames
    distinct_tokens: torch.Tensor


@torch.no_grad()
def simulate_greedy(model, projected: Sequence[torch.Tensor], blank_offsets: torch.Tensor) -> GreedyStats:
    """Greedy RNN-T decoding (NeMo's rule: emit while non-blank, at most max_symbols per frame)
    of every sequence of joint-projected frames [T, H] for every blank offset [C] at once.

    A stand-in for NeMo's label-looping decoder in calibration, where it runs for many
    candidate blank biases in one batch; the tests check the result with NeMo's own decoder.
    A row that emits over 1.5 tokens per frame is cut short and counted as all-emitting:
    it only tells the bisection that its bias is far too low.
    """
    joint, decoder = model.joint, model.decoder
    max_symbols = int(model.cfg.decoding.greedy.get("max_symbols", 10))
    out = joint.joint_net[-1]
    blank = joint.num_classes_with_blank - 1
    num_cands = len(blank_offsets)
    rows = len(projected) * num_cands
    seq_of_row = torch.arange(rows) // num_cands
    cand_of_row = torch.arange(rows) % num_cands
    lengths = torch.tensor([f.shape[0] for f in projected])[seq_of_row]
    frames = torch.nn.utils.rnn.pad_sequence(list(projected), batch_first=True)[seq_of_row]  # [R, T, H]
    offsets = blank_offsets[cand_of_row]

    g, (h, c) = decoder.predict(None, None, add_sos=False, batch_size=rows)  # h, c: [L, R, Hp]
    pred = joint.project_prednet(g)[:, 0]  # [R, H]
    t = torch.zeros(rows, dtype=torch.long)
    symbols = torch.zeros(rows, dtype=torch.long)
    emitted_here = torch.zeros(rows, dtype=torch.bool)
    num_emitting, num_tokens, num_cut = torch.zeros(rows), torch.zeros(rows), torch.zeros(rows)
    seen = torch.zeros(num_cands, blank + 1, dtype=torch.bool)
    live = torch.arange(rows)  # rows with frames left
    while len(live):
        logits = out(torch.relu(frames[live, t[live]] + pred[live]))
        logits[:, blank] += offsets[live]
        label = logits.argmax(-1)
        emit = label != blank
        rows_emit = live[emit]
        if len(rows_emit):
            num_tokens[rows_emit] += 1
            emitted_here[rows_emit] = True
            seen[cand_of_row[rows_emit], label[emit]] = True
            g, (h_new, c_new) = decoder.predict(label[emit, None], (h[:, rows_emit], c[:, rows_emit]), add_sos=False)
            pred[rows_emit] = joint.project_prednet(g)[:, 0]
            h[:, rows_emit], c[:, rows_emit] = h_new, c_new
            symbols[rows_emit] += 1
        advance = ~emit | (symbols[live] >= max_symbols)
        num_cut[live[advance & emit]] += 1
        rows_adv = live[advance]
        num_emitting[rows_adv] += emitted_here[rows_adv].float()
        emitted_here[rows_adv], symbols[rows_adv] = False, 0
        t[rows_adv] += 1
        runaway = live[num_tokens[live] > 1.5 * t[live] + 5]
        num_emitting[runaway] += (lengths[runaway] - t[runaway]).float()
        t[runaway] = lengths[runaway]
        live = live[t[live] < lengths[live]]

    def per_cand(x):
        return torch.zeros(num_cands).index_add_(0, cand_of_row, x)

    total_frames = per_cand(lengths.float())
    return GreedyStats(
        emitting_fraction=per_cand(num_emitting) / total_frames,
        tokens_per_frame=per_cand(num_tokens) / total_frames,
        max_symbols_fraction=per_cand(num_cut) / total_frames,
        distinct_tokens=seen.sum(1),
    )
