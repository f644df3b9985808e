"""One batched streaming Sortformer step for all ready rows: pre-encode, [cache|fifo|chunk], encode, update.

What NeMo's `forward_streaming_step` does for a batch, with rows at different fill levels and at
different points of their streams (first chunk without left context, last one short) in one batch,
and the state updated in place in its slots. Each row's speaker probabilities match NeMo's
loop run on that stream alone, within float tolerance (padding changes the matmul shapes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .reference import FeatureChunk
from .slots import SpeakerCacheSlots
from .update import ChunkRows, model_input, update_slots


@dataclass
class DiarStepBatch:
    """The ready rows: their slots and this step's features (host-built staging, one row per stream)."""

    slots: torch.Tensor  # [B] long
    features: torch.Tensor  # [B, T_feat, F] zero past each row's length
    feature_lengths: list[int]  # per row
    left_offsets: torch.Tensor  # [B] long, feature frames of left context
    right_offsets: torch.Tensor  # [B] long, feature frames of right context


@dataclass
class DiarStepResult:
    slots: torch.Tensor  # [B] long, as in the batch
    chunk_preds: torch.Tensor  # [B, C, K] speaker probabilities of each row's new frames
    chunk_lengths: torch.Tensor  # [B] long, valid frames per row


def make_batch(slots: list[int], chunks: list[FeatureChunk], device=None) -> DiarStepBatch:
    lengths = [chunk.features.shape[0] for chunk in chunks]
    features = torch.zeros((len(chunks), max(lengths), chunks[0].features.shape[1]), device=device)
    for row, chunk in enumerate(chunks):
        features[row, : lengths[row]] = chunk.features
    return DiarStepBatch(
        slots=torch.tensor(slots, dtype=torch.long, device=device),
        features=features,
        feature_lengths=lengths,
        left_offsets=torch.tensor([c.left_offset for c in chunks], dtype=torch.long, device=device),
        right_offsets=torch.tensor([c.right_offset for c in chunks], dtype=torch.long, device=device),
    )


@torch.no_grad()
def diarize_step(model, pool: SpeakerCacheSlots, batch: DiarStepBatch) -> DiarStepResult:
    modules = model.sortformer_modules
    chunk = _pre_encode(model, batch)
    cache_lens = pool.tables.spkcache_lengths[batch.slots]
    fifo_lens = pool.tables.fifo_lengths[batch.slots]
    embs = model_input(pool, batch.slots, cache_lens, fifo_lens, chunk)
    lengths = cache_lens + fifo_lens + chunk.lengths
    encoded, encoded_lengths = model.frontend_encoder(processed_signal=embs, processed_signal_length=lengths,
                                                      bypass_pre_encode=True)  # fmt: skip
    preds = model.forward_infer(emb_seq=encoded, emb_seq_length=encoded_lengths)
    preds = modules.apply_mask_to_preds(preds, encoded_lengths)
    chunk_preds, chunk_lengths = update_slots(modules, pool, batch.slots, cache_lens, fifo_lens, chunk, preds)
    return DiarStepResult(batch.slots, chunk_preds, chunk_lengths)


def _pre_encode(model, batch: DiarStepBatch) -> ChunkRows:
    """Pre-encoder embeddings of all rows in one call, rows of different feature lengths padded.

    Safe to pad: NeMo's striding convolutions (MaskedConvSequential) zero each layer's input past a
    row's length, so a row's frames do not see its neighbours' padding (the step test holds rows at
    their first, steady and last, shorter chunks in one batch).
    """
    subsampling = model.encoder.subsampling_factor
    lengths = torch.tensor(batch.feature_lengths, device=batch.features.device)
    embs, emb_lengths = model.encoder.pre_encode(x=batch.features, lengths=lengths)
    emb_lengths = emb_lengths.to(torch.long)
    left = torch.round(batch.left_offsets / subsampling).long()  # as NeMo: round() left, ceil() right
    right = torch.div(batch.right_offsets + subsampling - 1, subsampling, rounding_mode="floor")
    return ChunkRows(embs[:, : int(emb_lengths.max())], emb_lengths, left, right)
