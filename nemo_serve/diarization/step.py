"""One batched streaming Sortformer step for all ready rows: pre-encode, [cache|fifo|chunk], encode, update.

What NeMo's `forward_streaming_step` does for a batch, with rows at different fill levels and at
different points of their streams (first chunk without left context, last one short) in one batch,
and the state updated in place in its slots. Each row's speaker probabilities match NeMo's
loop run on that stream alone, within float tolerance (padding changes the matmul shapes).

`diarize_step` enqueues the step and returns: its padded widths and branches are decided on the host
(update.py plan_update, nemo_sortformer.py pre_encode_lengths), so nothing in it reads the device.
Reading the result (`DiarStepResult.chunk_preds`) is the one wait, at collect
(diarization/runner.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .nemo_sortformer import pre_encode_lengths
from .pre_encode import pre_encode
from .reference import FeatureChunk
from .slots import SpeakerCacheSlots
from .update import ChunkRows, UpdatePlan, device_index, model_input, plan_update, update_slots


@dataclass
class DiarStepBatch:
    """The ready rows: their slots and this step's features (host-built staging, one row per stream)."""

    slots: torch.Tensor  # [B] long
    features: torch.Tensor  # [B, T_feat, F] zero past each row's length
    feature_lengths: list[int]  # per row
    left_offsets: torch.Tensor  # [B] long, feature frames of left context
    right_offsets: torch.Tensor  # [B] long, feature frames of right context
    host_slots: np.ndarray  # [B] the slots again, on the host (the plan's)
    host_left: np.ndarray  # [B] left_offsets on the host
    host_right: np.ndarray  # [B] right_offsets on the host


@dataclass
class DiarStepResult:
    slots: torch.Tensor  # [B] long, as in the batch
    chunk_preds: torch.Tensor  # [B, C, K] speaker probabilities of each row's new frames (on the device)
    chunk_lengths: torch.Tensor  # [B] long, valid frames per row (host: known at launch)


def make_batch(slots: list[int], chunks: list[FeatureChunk], device=None) -> DiarStepBatch:
    lengths = [chunk.features.shape[0] for chunk in chunks]
    features = torch.zeros((len(chunks), max(lengths), chunks[0].features.shape[1]), device=device)
    for row, chunk in enumerate(chunks):
        features[row, : lengths[row]] = chunk.features
    left = np.array([c.left_offset for c in chunks], np.int64)
    right = np.array([c.right_offset for c in chunks], np.int64)
    host_slots = np.array(slots, np.int64)
    return DiarStepBatch(device_index(host_slots, device), features, lengths, device_index(left, device),
                         device_index(right, device), host_slots, left, right)  # fmt: skip


def diarize_step(model, pool: SpeakerCacheSlots, batch: DiarStepBatch) -> DiarStepResult:
    """Plan and run one step (the two halves in one call: tests, benchmarks)."""
    return run_step(model, pool, batch, plan_step(model, pool, batch))


def plan_step(model, pool: SpeakerCacheSlots, batch: DiarStepBatch) -> "StepPlan":
    """The host half: the step's widths and branches, the slots' host fill levels advanced. Steps
    must be run in the order they are planned (a device stream's order)."""
    sub = model.encoder.subsampling_factor
    emb_lengths = np.array(pre_encode_lengths(model.encoder.pre_encode, batch.feature_lengths), np.int64)
    left = np.round(batch.host_left / sub).astype(np.int64)  # as _pre_encode (NeMo's round and ceil)
    right = -(-batch.host_right // sub)
    update = plan_update(model.sortformer_modules, pool, batch.host_slots, emb_lengths, left, right,
                         batch.features.device)  # fmt: skip
    return StepPlan(update, int(emb_lengths.max()), int((update.cache_lens + update.fifo_lens + emb_lengths).max()))


@dataclass
class StepPlan:
    update: UpdatePlan
    emb_width: int  # the longest row's pre-encoded frames
    model_width: int  # the longest row's [cache | FIFO | chunk]


@torch.no_grad()
def run_step(model, pool: SpeakerCacheSlots, batch: DiarStepBatch, plan: StepPlan) -> DiarStepResult:
    """The device half, enqueued without a sync: pre-encode, [cache | FIFO | chunk], encoder, the
    speaker sigmoids, the update in place."""
    modules = model.sortformer_modules
    chunk = _pre_encode(model, batch, plan.emb_width)
    cache_lens = pool.tables.spkcache_lengths[batch.slots]
    fifo_lens = pool.tables.fifo_lengths[batch.slots]
    embs = model_input(pool, batch.slots, cache_lens, fifo_lens, chunk, plan.model_width)
    lengths = cache_lens + fifo_lens + chunk.lengths
    encoded, encoded_lengths = model.frontend_encoder(processed_signal=embs, processed_signal_length=lengths,
                                                      bypass_pre_encode=True)  # fmt: skip
    preds = model.forward_infer(emb_seq=encoded, emb_seq_length=encoded_lengths)
    preds = modules.apply_mask_to_preds(preds, encoded_lengths)
    chunk_preds = update_slots(modules, pool, batch.slots, cache_lens, fifo_lens, chunk, preds, plan.update)
    return DiarStepResult(batch.slots, chunk_preds, torch.from_numpy(plan.update.chunk_lens))


def _pre_encode(model, batch: DiarStepBatch, width: int) -> ChunkRows:
    """Pre-encoder embeddings of all rows in one call, rows of different feature lengths padded, cut
    to `width` frames (the longest row's, from the host's plan).

    Safe to pad: NeMo's striding convolutions (MaskedConvSequential) zero each layer's input past a
    row's length, so a row's frames do not see its neighbours' padding (the step test holds rows at
    their first, steady and last, shorter chunks in one batch); diarization/pre_encode.py does that
    on the padded rows only.
    """
    subsampling = model.encoder.subsampling_factor
    embs, emb_lengths = pre_encode(model.encoder.pre_encode, batch.features, np.array(batch.feature_lengths, np.int64))
    left = torch.round(batch.left_offsets / subsampling).long()  # as NeMo: round() left, ceil() right
    right = torch.div(batch.right_offsets + subsampling - 1, subsampling, rounding_mode="floor")
    return ChunkRows(embs[:, :width], emb_lengths, left, right)
