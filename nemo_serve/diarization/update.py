"""NeMo's async speaker-cache update (`SortformerModules.streaming_update_async`), in place, as array operations.

NeMo's version walks the rows of a batch in Python, reading each row's fill levels with `.item()`,
and rebuilds every row's speaker cache and FIFO in fresh buffers each step (and sizes a row's
pop-out by the batch's widest chunk, which matters only where a chunk outgrows the update period
plus the FIFO's free room: at none of the model card's settings). Here the state stays in the slot
table and a step writes only what changes: the chunk's frames appended to each row's FIFO (one
index_copy_ at per-row offsets), and, on the rows whose FIFO overflows (once per update period),
the pop-out into the speaker cache, the silence statistics and the FIFO shift; of those, the rows
whose cache overflows are compressed together by NeMo's own (already batched) `_compress_spkcache`.
Flattened index_select / index_copy_ rather than torch.gather: on the CPU gather copies element by
element. The appends rely on what NeMo's state also keeps: zeros past each row's fill.

The integer decisions (the padded widths, which rows pop, which compress) are made on the host by
`plan_update`, from the slot table's host copy of the fill levels, before the step is enqueued: fill
levels follow from chunk lengths alone (never from the probabilities), so the host can keep them.
The step then has no device-to-host sync of its own and can be launched behind the ASR step and
collected after it (engine/loop.py). Rejected: reading the decisions back from the device (the
previous version: three syncs per step, each a wait for everything enqueued before it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .nemo_sortformer import compress_spkcache
from .slots import SpeakerCacheSlots


@dataclass
class ChunkRows:
    """One step's new frames, per row (pre-encoder embeddings, with left and right context)."""

    embs: torch.Tensor  # [B, T, D] zero past each row's length
    lengths: torch.Tensor  # [B] long: lc + chunk + rc frames (fewer at a stream's end)
    left: torch.Tensor  # [B] long: left-context frames at the start (lc)
    right: torch.Tensor  # [B] long: right-context frames at the end (rc)


@dataclass
class UpdatePlan:
    """One step's integer decisions, decided on the host (module docstring). Host lists, and device
    index tensors the step's indexing reads."""

    cache_lens: np.ndarray  # [B] each row's speaker-cache fill before the step
    fifo_lens: np.ndarray  # [B] each row's FIFO fill before the step
    chunk_lens: np.ndarray  # [B] the chunk frames each row reports (and appends to its FIFO)
    pop_rows: torch.Tensor  # [R] long: rows of the batch whose FIFO overflows (pop into the cache)
    compress_slots: torch.Tensor  # [C] long: slots whose cache overflows after the pop (compressed)


def plan_update(modules, pool: SpeakerCacheSlots, slots: np.ndarray, lengths: np.ndarray, left: np.ndarray,
                right: np.ndarray, device=None) -> UpdatePlan:  # fmt: skip
    """NeMo's async update rule on host integers (the device computes the same numbers for its
    indexing in `update_slots`): each row's chunk length, pop-out and compression, and the slots'
    host fill levels advanced to after the step. lengths/left/right: the rows' pre-encoded frames
    (with context) and their left and right context, as in ChunkRows."""
    cache, fifo = pool.host_cache_lengths[slots], pool.host_fifo_lengths[slots]
    width = lengths - left - right  # NeMo's max_chunk_len, row by row
    chunk_lens = np.minimum(np.maximum(lengths - left, 0), width)
    new_fifo = fifo + chunk_lens
    pop = np.minimum(np.maximum(modules.spkcache_update_period, width - pool.fifo_len + fifo), new_fifo)
    pop = np.where(new_fifo > pool.fifo_len, pop, 0)
    new_cache = cache + pop
    pool.host_fifo_lengths[slots] = new_fifo - pop
    pool.host_cache_lengths[slots] = np.minimum(new_cache, pool.spkcache_len)
    return UpdatePlan(cache, fifo, chunk_lens, device_index(np.flatnonzero(pop), device),
                      device_index(slots[new_cache > pool.spkcache_len], device))  # fmt: skip


def device_index(values, device) -> torch.Tensor:
    """A host index on the device without a sync: through pinned memory on CUDA (a copy from pageable
    memory waits for the stream); torch's pinned allocator keeps the buffer until the copy is done."""
    host = torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64))
    if torch.device(device or "cpu").type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def take(src: torch.Tensor, index: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """src[rows[b], index[b, j]]: [N_rows, N, X] and [B, W] -> [B, W, X]; index within [0, N); rows default 0..B-1."""
    n_rows, n, x = src.shape
    rows = torch.arange(index.shape[0], device=src.device) if rows is None else rows
    flat = (rows.unsqueeze(1) * n + index).reshape(-1)
    return src.reshape(n_rows * n, x).index_select(0, flat).view(index.shape[0], index.shape[1], x)


def put(table: torch.Tensor, rows: torch.Tensor, index: torch.Tensor, values: torch.Tensor, valid) -> None:
    """table[rows[b], index[b, j]] = values[b, j] where valid[b, j], in place. The table's last column
    takes the invalid writes, so that every row writes the same count (no per-row slice)."""
    n_rows, w, x = table.shape
    index = torch.where(valid, index, w - 1)
    flat = (rows.unsqueeze(1) * w + index).reshape(-1)
    table.view(n_rows * w, x).index_copy_(0, flat, values.reshape(-1, x))


def masked_take(src: torch.Tensor, start: torch.Tensor, count: torch.Tensor, width: int, rows=None) -> torch.Tensor:
    """Per row, src[row, start[b] : start[b] + count[b]] at the front of [B, width, X], zero after."""
    j = torch.arange(width, device=src.device).unsqueeze(0)
    index = (start.unsqueeze(1) + j).clamp(0, src.shape[1] - 1)
    return torch.where((j < count.unsqueeze(1)).unsqueeze(-1), take(src, index, rows), 0.0)


def model_input(pool: SpeakerCacheSlots, slots, cache_lens, fifo_lens, chunk: ChunkRows, width: int) -> torch.Tensor:
    """Per row [speaker cache | FIFO | chunk] back to back, zero after: [B, width, D], width the
    longest row (decided on the host: plan_update).

    What NeMo's `concat_and_pad` does with a Python loop over rows, read straight from the table.
    """
    starts = [torch.zeros_like(cache_lens), cache_lens, cache_lens + fifo_lens]
    j = torch.arange(width, device=cache_lens.device).unsqueeze(0)
    out = chunk.embs.new_zeros((len(cache_lens), width, chunk.embs.shape[2]))
    t = pool.tables
    sources = [(t.spkcache, slots, cache_lens), (t.fifo, slots, fifo_lens), (chunk.embs, None, chunk.lengths)]
    for (src, rows, lengths), start in zip(sources, starts):
        here = (j >= start.unsqueeze(1)) & (j < (start + lengths).unsqueeze(1))
        out = torch.where(here.unsqueeze(-1), take(src, (j - start.unsqueeze(1)).clamp(0, src.shape[1] - 1), rows), out)
    return out


def update_slots(modules, pool: SpeakerCacheSlots, slots, cache_lens, fifo_lens, chunk: ChunkRows, preds,
                 plan: UpdatePlan) -> torch.Tensor:  # fmt: skip
    """Apply one step to the rows' slots; returns chunk predictions [B, chunk_len, K] (plan.chunk_lens
    valid per row). No device sync: the plan says which rows pop and compress.

    preds [B, P, K]: the model's speaker probabilities over each row's [cache | fifo | chunk].
    """
    t = pool.tables
    row_chunk_width = chunk.lengths - chunk.left - chunk.right  # NeMo's max_chunk_len, row by row
    chunk_lens = (chunk.lengths - chunk.left).clamp(min=0).minimum(row_chunk_width)
    j = torch.arange(pool.chunk_room, device=preds.device).unsqueeze(0)
    chunk_preds = masked_take(preds, cache_lens + fifo_lens + chunk.left, chunk_lens, pool.chunk_room)
    chunk_embs = take(chunk.embs, (chunk.left.unsqueeze(1) + j).clamp(max=chunk.embs.shape[1] - 1))
    put(t.fifo, slots, fifo_lens.unsqueeze(1) + j, chunk_embs, j < chunk_lens.unsqueeze(1))
    new_fifo_lens = fifo_lens + chunk_lens

    period = torch.full_like(fifo_lens, modules.spkcache_update_period)
    pop = torch.maximum(period, row_chunk_width - pool.fifo_len + fifo_lens).minimum(new_fifo_lens)
    pop = torch.where(new_fifo_lens > pool.fifo_len, pop, 0)  # [B] frames into the cache this step
    t.fifo_lengths.index_copy_(0, slots, new_fifo_lens)
    rows = plan.pop_rows
    if len(rows):  # most steps pop no row
        _pop_into_cache(modules, pool, slots[rows], cache_lens[rows], fifo_lens[rows], chunk.left[rows],
                        pop[rows], preds[rows], plan.compress_slots)  # fmt: skip
    return chunk_preds


def _pop_into_cache(modules, pool, slots, cache_lens, fifo_lens, left, pop, preds, compress_slots) -> None:
    """Move each row's first pop[b] FIFO frames (and this step's predictions of them) into its cache."""
    t, width = pool.tables, pool.pop_room
    j = torch.arange(width, device=preds.device).unsqueeze(0)
    valid = j < pop.unsqueeze(1)
    popped = t.fifo[slots, :width]  # [R, P, D]
    # preds rows are [cache | fifo | lc | chunk | rc]: a popped chunk frame sits lc further on
    pred_index = cache_lens.unsqueeze(1) + j + torch.where(j >= fifo_lens.unsqueeze(1), left.unsqueeze(1), 0)
    popped_preds = torch.where(valid.unsqueeze(-1), take(preds, pred_index.clamp(max=preds.shape[1] - 1)), 0.0)
    _update_silence_profile(modules, pool, slots, popped, popped_preds, valid)
    put(t.spkcache, slots, cache_lens.unsqueeze(1) + j, popped, valid)
    put(t.spkcache_preds, slots, cache_lens.unsqueeze(1) + j, popped_preds, valid)
    remaining = t.fifo_lengths[slots] - pop
    fifo_width = t.fifo.shape[1] - 1
    t.fifo[slots, :fifo_width] = masked_take(t.fifo, pop, remaining, fifo_width, rows=slots)
    t.fifo_lengths.index_copy_(0, slots, remaining)
    new_cache_lens = cache_lens + pop
    t.spkcache_lengths.index_copy_(0, slots, new_cache_lens.clamp(max=pool.spkcache_len))
    if len(compress_slots):
        _compress(modules, pool, compress_slots)


def _update_silence_profile(modules, pool, slots, frames, frames_preds, valid) -> None:
    """NeMo's `_get_silence_profile` over the popped frames; rows without new silence keep theirs exactly."""
    t = pool.tables
    is_sil = (frames_preds.sum(dim=2) < modules.sil_threshold) & valid  # [R, P]
    sil_count = is_sil.sum(dim=1)
    sil_sum = torch.sum(frames * is_sil.unsqueeze(-1), dim=1)  # [R, D]
    old_mean, old_count = t.mean_sil_emb[slots], t.n_sil_frames[slots]
    count = old_count + sil_count
    mean = (old_mean * old_count.unsqueeze(1) + sil_sum) / count.clamp(min=1).unsqueeze(1)
    t.mean_sil_emb.index_copy_(0, slots, torch.where((sil_count > 0).unsqueeze(1), mean, old_mean))
    t.n_sil_frames.index_copy_(0, slots, count)


def _compress(modules, pool, slots) -> None:
    """NeMo's top-k per speaker keeps spkcache_len of the rows' frames; the room after them is zeroed."""
    t, limit, width = pool.tables, pool.spkcache_len, pool.spkcache_len + pool.pop_room
    packed, packed_preds = compress_spkcache(modules, t.spkcache[slots, :width], t.spkcache_preds[slots, :width],
                                             t.mean_sil_emb[slots])  # fmt: skip
    t.spkcache[slots, :limit], t.spkcache_preds[slots, :limit] = packed, packed_preds
    t.spkcache[slots, limit:], t.spkcache_preds[slots, limit:] = 0.0, 0.0
