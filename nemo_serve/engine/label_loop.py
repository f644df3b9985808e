"""RNN-T greedy decoding of one step's rows as one label loop of our own (`label_loop`).

NeMo's label-looping computer (`rnnt_label_looping.py`, `torch_impl`) nests two loops: an outer
one that emits one label per row and runs the prediction network, and an inner one that skips
blank frames. Each trip evaluates the joint over the whole vocabulary for every row of the batch,
finished rows included, and keeps about 47 operators of per-row bookkeeping (where / minimum /
less / any on [B], hypothesis writes, the max-symbols check) per outer trip.

Per row, both loops are the same walk: evaluate the joint at (frame t, predictor output g); a
blank moves to frame t + 1; a label is emitted at t, the prediction network advances on it, and
after `max_symbols` labels at one frame the row is forced to t + 1. So one flat loop does it:

    each trip: the rows that emitted last trip run the prediction network (only those rows);
               the rows still inside their chunk run the joint (only those rows);
               one fused update of every row's frame, count, labels and results.

Every row takes exactly the joint evaluations and prediction-network steps NeMo's loop takes, with
NeMo's own modules (`joint.joint_after_projection`, `decoder.predict`, `joint.project_prednet`,
the encoder projected once per frame by `joint.project_encoder` before the loop), so the arithmetic
per row is NeMo's; only the number of rows in each matrix product differs (as it already does
between our buckets and NeMo's one-utterance loop). Phrase boosting adds the row's boosting-tree
scores to the non-blank logits exactly as NeMo's loop does (`advance_fusion_models`), and token
confidence is NeMo's own `_get_step_confidence` on the unboosted logits of the emitting trip.

Host synchronisation: one per trip, reading two counts (rows to predict, rows to evaluate), which
size the compacted row sets. NeMo's `torch_impl` also syncs once per trip (`active_mask.any()`);
its CUDA-graph mode has none but evaluates every row every trip. The body has no other sync and no
per-row Python; results are written through a spare column (rows that emitted nothing write to
column K) rather than by masking on the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nemo.collections.asr.parts.submodules.transducer_decoding.label_looping_base import BatchedLabelLoopingState

from ..nemo_private import blank_index, step_confidence
from .greedy_joint import greedy_labels


@dataclass
class LoopHyps:
    """What the step reads from NeMo's BatchedHyps, same names and layout (`Stepper.decode`)."""

    transcript: torch.Tensor  # [B, K] label ids, K = T x max_symbols
    timestamps: torch.Tensor  # [B, K] global encoder frame of each label
    current_lengths: torch.Tensor  # [B] labels emitted per row
    step_confidence: torch.Tensor | None  # [B, K] (with confidence)
    trips: int = 0  # iterations of the loop (each: at most one joint and one predictor call)


class _Rows:
    """Per-row loop state [B], allocated once per call. `take` and `put` read and write a field for
    the rows a trip evaluates: every row (idx None: the tensor itself, rebound, no gather or
    scatter) or the compacted rows (index_select / index_copy_)."""

    def __init__(self, out_len: torch.Tensor, state: BatchedLabelLoopingState, width: int, float_dtype, confidence,
                 boosted: bool):  # fmt: skip
        b, dev = out_len.shape[0], out_len.device
        self.t = torch.zeros(b, dtype=torch.long, device=dev)  # frame each row is at
        self.count = torch.zeros(b, dtype=torch.long, device=dev)  # labels emitted at that frame
        self.out_len = out_len
        self.active = self.t < out_len  # still inside its chunk
        self.pending = torch.zeros(b, dtype=torch.bool, device=dev)  # emitted last trip: predictor due
        self.last_label = state.labels.clone()  # the label the predictor advances on
        self.lengths = torch.zeros(b, dtype=torch.long, device=dev)
        # One spare column (K) takes the writes of rows that emitted nothing this trip.
        self.transcript = torch.zeros(b, width + 1, dtype=torch.long, device=dev)
        self.timestamps = torch.zeros(b, width + 1, dtype=torch.long, device=dev)
        self.confidence = torch.zeros(b, width + 1, dtype=float_dtype, device=dev) if confidence else None
        self.width = width
        self.frame_offset = state.decoded_lengths  # global frame of this chunk's frame 0
        self.g = state.predictor_outputs.clone()  # [B, 1, H] the predictor's (projected) output
        self.h = [s.clone() for s in state.predictor_states]  # [layers, B, H] each
        self.fusion = state.fusion_states_list[0].clone() if boosted else None  # [B] boosting-tree state
        self.every_row = torch.arange(b, device=dev)

    def take(self, name: str, idx: torch.Tensor | None) -> torch.Tensor:
        x = getattr(self, name)
        return x if idx is None else x.index_select(0, idx)

    def put(self, name: str, idx: torch.Tensor | None, value: torch.Tensor) -> None:
        if idx is None:
            setattr(self, name, value)
        else:
            getattr(self, name).index_copy_(0, idx, value)


ROW_MODES = ("all", "active")


def label_loop(computer, encoded: torch.Tensor, out_len: torch.Tensor, state: BatchedLabelLoopingState,
               multi_biasing_ids: torch.Tensor | None = None, confidence: bool = False,
               rows_mode: str = "all"):  # fmt: skip
    """Greedy RNN-T decoding of `encoded` [B, T, D] from the rows' carried `state`, as NeMo's
    label-looping `computer` (its joint, decoder, blank id, max_symbols, biasing multi-model and
    confidence method) would decode it. Returns (LoopHyps, the new BatchedLabelLoopingState).

    `rows_mode`: "all" runs the joint and the prediction network over every row of the batch, as
    NeMo's computer does, so each matrix product has NeMo's shape and the results are bitwise
    NeMo's at the same batch size. "active" runs the joint only on the rows still inside their
    chunk and the prediction network only on the rows that emitted: less work, but a matrix
    product of fewer rows may sum in another order (on the CPU a 1-row product is a GEMV), so the
    floats can differ from NeMo's in the last bits (tokens identical in every test here)."""
    if rows_mode not in ROW_MODES:
        raise ValueError(f"rows_mode {rows_mode!r}: one of {ROW_MODES}")
    t_max = encoded.shape[1]
    blank = blank_index(computer)
    max_symbols = int(computer.max_symbols)  # the engine sizes its results by it (Stepper.out_width)
    f_proj = computer.joint.project_encoder(encoded)  # [B, T, H]: once per frame, not per trip
    rows = _Rows(out_len, state, t_max * max_symbols, f_proj.dtype, confidence, multi_biasing_ids is not None)
    trips = 0
    while True:
        n_pending, n_active = torch.stack([rows.pending, rows.active]).sum(1).tolist()  # the trip's one sync
        if n_pending:
            _predict(computer, rows, None if rows_mode == "all" else _indices(rows.pending, n_pending))
        if not n_active:
            break
        trips += 1
        idx = None if rows_mode == "all" else _indices(rows.active, n_active)
        labels, unbiased, fusion_next = _joint(computer, rows, f_proj, idx, blank, multi_biasing_ids, confidence)
        _advance(computer, rows, idx, labels, unbiased, blank, max_symbols, confidence, fusion_next)
    hyps = LoopHyps(
        transcript=rows.transcript[:, : rows.width],
        timestamps=rows.timestamps[:, : rows.width],
        current_lengths=rows.lengths,
        step_confidence=rows.confidence[:, : rows.width] if confidence else None,
        trips=trips,
    )
    new_state = BatchedLabelLoopingState(
        predictor_states=rows.h,
        predictor_outputs=rows.g,
        labels=rows.last_label,
        decoded_lengths=out_len + state.decoded_lengths,
        fusion_states_list=[rows.fusion] if rows.fusion is not None else [],
        time_jumps=None,
    )
    return hyps, new_state


def _indices(mask: torch.Tensor, n: int) -> torch.Tensor:
    """The rows where `mask` holds, in order, given their number (known from the trip's sync):
    a stable sort instead of `nonzero`, which would sync again to learn its size."""
    return torch.argsort((~mask).to(torch.int8), stable=True)[:n]


def _joint(computer, rows: _Rows, f_proj, idx, blank, multi_biasing_ids, need_logits: bool):
    """Greedy labels of the rows `idx` (None: all) at their frames (a finished row reads its
    chunk's last frame, as NeMo's `safe_time_indices`); with boosting, NeMo's rule: the boosted
    argmax over non-blank labels unless the unboosted argmax is blank. Returns (labels, the
    unboosted logits, each row's tree state after its label, or None without boosting). Without
    boosting or confidence only the labels are needed: engine/greedy_joint.py (NeMo's joint, or
    with NEMO_SERVE_JOINT=argmax its labels without the log-softmax's full pass; logits None)."""
    frames = rows.take("t", idx).clamp(max=f_proj.shape[1] - 1)
    f = f_proj[rows.every_row if idx is None else idx, frames].unsqueeze(1)  # [n, 1, H]
    if rows.fusion is None and not need_logits:
        return greedy_labels(computer.joint, f, rows.take("g", idx)), None, None
    logits = computer.joint.joint_after_projection(f, rows.take("g", idx)).squeeze(1).squeeze(1)  # [n, V+1]
    labels = logits.max(-1)[1]  # NeMo's op (first maximum on ties)
    if rows.fusion is None:
        return labels, logits, None
    unbiased = logits.clone()
    ids = multi_biasing_ids if idx is None else multi_biasing_ids.index_select(0, idx)
    scores, candidates = computer.advance_fusion_models([rows.take("fusion", idx)], ids, logits.dtype)
    logits[:, :-1] += scores[0]
    labels = torch.where(labels == blank, labels, logits[:, :-1].max(-1)[1])
    fusion_next = candidates[0].gather(1, torch.where(labels == blank, 0, labels).unsqueeze(1)).squeeze(1)
    return labels, unbiased, fusion_next


def _advance(computer, rows: _Rows, idx, labels, unbiased, blank, max_symbols, confidence, fusion_next) -> None:
    """One fused update of the evaluated rows that are still live: emit labels, move frames, force
    the next frame after max_symbols labels at one frame."""
    live = rows.take("active", idx)
    emit = (labels != blank) & live
    t = rows.take("t", idx)
    count = torch.where(emit, rows.take("count", idx) + 1, 0)
    step = live & (~emit | (count >= max_symbols))
    # results: a row that emitted writes at its length, the others into the spare column
    length = rows.take("lengths", idx)
    at = (rows.every_row if idx is None else idx).unsqueeze(1), torch.where(emit, length, rows.width).unsqueeze(1)
    rows.transcript[at] = labels.unsqueeze(1)
    rows.timestamps[at] = (t + rows.take("frame_offset", idx)).unsqueeze(1)
    if confidence:
        rows.confidence[at] = step_confidence(computer, unbiased).unsqueeze(1)
    rows.put("lengths", idx, length + emit)
    rows.put("last_label", idx, torch.where(emit, labels, rows.take("last_label", idx)))
    if fusion_next is not None:
        rows.put("fusion", idx, torch.where(emit, fusion_next, rows.take("fusion", idx)))
    t = t + step
    rows.put("t", idx, t)
    rows.put("count", idx, torch.where(step, 0, count))
    rows.put("active", idx, t < rows.take("out_len", idx))
    rows.put("pending", idx, emit)


def _predict(computer, rows: _Rows, idx) -> None:
    """The prediction network on the rows `idx` (None: every row) on each row's last label; only
    the rows that emitted last trip take the new state."""
    due = rows.take("pending", idx)
    labels = rows.take("last_label", idx).unsqueeze(1)  # [n, 1]
    state = [s if idx is None else s.index_select(1, idx) for s in rows.h]
    n = labels.shape[0]
    out, new_state, *_ = computer.decoder.predict(labels, state, add_sos=False, batch_size=n)
    out = computer.joint.project_prednet(out).to(rows.g.dtype)
    rows.put("g", idx, torch.where(due.view(-1, 1, 1), out, rows.take("g", idx)))
    for k, (old, new) in enumerate(zip(state, new_state)):
        kept = torch.where(due.view(1, -1, 1), new.to(old.dtype), old)
        if idx is None:
            rows.h[k] = kept
        else:
            rows.h[k].index_copy_(1, idx, kept)
    rows.pending = torch.zeros_like(rows.pending)
