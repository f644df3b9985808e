"""NeMo's async speaker-cache update (`SortformerModules.streaming_update_async`) as array operations.

NeMo's version walks the rows of a batch in Python, reading each row's fill levels with `.item()`
(and sizes a row's pop-out by the batch's widest chunk, which matters only where a chunk outgrows
the update period plus the FIFO's free room: at none of the model card's settings).
Here every per-row quantity is a [B] tensor: the FIFO append, the pop-out into the speaker cache,
the silence statistics and the FIFO shift are gathers with per-row offsets and masks, and the rows
whose cache overflows are compressed together by NeMo's own (already batched) `_compress_spkcache`.
Each row behaves as it does alone in NeMo's loop: its pop-out is sized by its own chunk width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .nemo_sortformer import compress_spkcache
from .slots import DiarState


@dataclass
class ChunkRows:
    """One step's new frames, per row (pre-encoder embeddings, with left and right context)."""

    embs: torch.Tensor  # [B, T, D] zero past each row's length
    lengths: torch.Tensor  # [B] long: lc + chunk + rc frames (fewer at a stream's end)
    left: torch.Tensor  # [B] long: left-context frames at the start (lc)
    right: torch.Tensor  # [B] long: right-context frames at the end (rc)


def place(out: torch.Tensor, src: torch.Tensor, src_start, dst_start, count) -> torch.Tensor:
    """out[b, dst_start[b] + j] = src[b, src_start[b] + j] for j < count[b]; other positions kept.

    out [B, W, X], src [B, N, X]; starts and counts [B] long. Positions are a mask over W, not a
    per-row slice, so rows of any fill level share one kernel.
    """
    positions = torch.arange(out.shape[1], device=out.device).unsqueeze(0)  # [1, W]
    j = positions - dst_start.unsqueeze(1)  # [B, W]
    valid = (j >= 0) & (j < count.unsqueeze(1))
    index = (src_start.unsqueeze(1) + j).clamp(0, src.shape[1] - 1)
    taken = torch.gather(src, 1, index.unsqueeze(-1).expand(-1, -1, src.shape[2]))
    return torch.where(valid.unsqueeze(-1), taken, out)


def concat_rows(parts: list[tuple[torch.Tensor, torch.Tensor]], width: int) -> torch.Tensor:
    """Per row, the first lengths[b] frames of each part back to back, zero after ([B, width, X]).

    What NeMo's `concat_and_pad` does with a Python loop over rows.
    """
    first = parts[0][0]
    out = first.new_zeros((first.shape[0], width, first.shape[2]))
    offset = torch.zeros_like(parts[0][1])
    for src, lengths in parts:
        out = place(out, src, torch.zeros_like(offset), offset, lengths)
        offset = offset + lengths
    return out


def update_rows(modules, state: DiarState, chunk: ChunkRows, preds: torch.Tensor):
    """New state, chunk predictions [B, C, K] and their lengths [B], from preds [B, P, K] of [cache|fifo|chunk]."""
    cache_lens, fifo_lens = state.spkcache_lengths, state.fifo_lengths
    max_fifo = state.fifo.shape[1]
    row_chunk_width = chunk.lengths - chunk.left - chunk.right  # NeMo's max_chunk_len, row by row
    chunk_lens = (chunk.lengths - chunk.left).clamp(min=0).minimum(row_chunk_width)
    width = int(row_chunk_width.max())
    zero = torch.zeros_like(cache_lens)

    fifo_preds = place(preds.new_zeros(state.fifo.shape[:2] + preds.shape[2:]), preds, cache_lens, zero, fifo_lens)
    chunk_preds = place(preds.new_zeros((preds.shape[0], width, preds.shape[2])), preds,
                        cache_lens + fifo_lens + chunk.left, zero, chunk_lens)  # fmt: skip
    new_fifo = concat_rows([(state.fifo, fifo_lens), (_from(chunk.embs, chunk.left), chunk_lens)], max_fifo + width)
    new_fifo_preds = concat_rows([(fifo_preds, fifo_lens), (chunk_preds, chunk_lens)], max_fifo + width)
    new_fifo_lens = fifo_lens + chunk_lens

    pop = torch.maximum(torch.full_like(fifo_lens, modules.spkcache_update_period), row_chunk_width - max_fifo + fifo_lens)
    pop = torch.where(new_fifo_lens > max_fifo, pop.minimum(new_fifo_lens), zero)  # [B] frames into the cache
    mean_sil_emb, n_sil_frames = _silence_profile(modules, state, new_fifo, new_fifo_preds, pop)

    max_pop = min(max(modules.spkcache_update_period, width), width + max_fifo)
    cache_width = state.spkcache.shape[1] + max_pop
    cache = concat_rows([(state.spkcache, cache_lens), (new_fifo, pop)], cache_width)
    cache_preds = concat_rows([(state.spkcache_preds, cache_lens), (new_fifo_preds, pop)], cache_width)
    cache_lens = cache_lens + pop
    remaining = new_fifo_lens - pop
    fifo = place(torch.zeros_like(state.fifo), new_fifo, pop, zero, remaining)

    spkcache, spkcache_preds, cache_lens = _compress_overflowing(modules, cache, cache_preds, cache_lens, mean_sil_emb)
    new_state = DiarState(spkcache, spkcache_preds, cache_lens, fifo, remaining, mean_sil_emb, n_sil_frames)
    return new_state, chunk_preds, chunk_lens


def _from(src: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """src shifted left by start[b] frames per row (zero-filled at the end)."""
    return place(torch.zeros_like(src), src, start, torch.zeros_like(start), src.shape[1] - start)


def _silence_profile(modules, state: DiarState, frames, frames_preds, pop):
    """NeMo's `_get_silence_profile` over each row's first pop[b] frames; rows without new silence keep theirs."""
    in_pop = torch.arange(frames.shape[1], device=frames.device).unsqueeze(0) < pop.unsqueeze(1)  # [B, W]
    is_sil = (frames_preds.sum(dim=2) < modules.sil_threshold) & in_pop
    sil_count = is_sil.sum(dim=1)
    sil_sum = torch.sum(frames * is_sil.unsqueeze(-1), dim=1)  # [B, D]
    n_sil = state.n_sil_frames + sil_count
    mean = (state.mean_sil_emb * state.n_sil_frames.unsqueeze(1) + sil_sum) / n_sil.clamp(min=1).unsqueeze(1)
    has_new = (sil_count > 0).unsqueeze(1)
    return torch.where(has_new, mean, state.mean_sil_emb), n_sil


def _compress_overflowing(modules, cache, cache_preds, cache_lens, mean_sil_emb):
    """Keep the first spkcache_len frames; rows over it are compressed by NeMo's top-k per speaker.

    Only the overflowing rows are compressed (a nonzero(): one host sync per step) rather than all
    rows under a mask: a stream overflows once per update period (24 steps at the 1.04 s setting).
    """
    limit = modules.spkcache_len
    spkcache, spkcache_preds = cache[:, :limit].clone(), cache_preds[:, :limit].clone()
    rows = torch.nonzero(cache_lens > limit).squeeze(1)
    if rows.numel():
        packed, packed_preds = compress_spkcache(modules, cache[rows], cache_preds[rows], mean_sil_emb[rows])
        spkcache[rows], spkcache_preds[rows] = packed, packed_preds
    return spkcache, spkcache_preds, cache_lens.clamp(max=limit)
