"""One batched model step over a group of slots: encoder chunk + prompt + RNN-T greedy decoding.

All rows of one call share the chunk mode (one per server), the drop count (first chunks drop
0, later chunks drop 2) and the chunk width (only a stream's final chunk may be shorter: its
cache is discarded afterwards, and the encoder masks its padding). Mixing first and later chunks,
or unequal widths, would change the drop or pad a row that the cache keeps: not NeMo's arithmetic.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from .slots import SlotPool


@dataclass
class StepBatch:
    rows: torch.Tensor  # [B] slot indices, long, on the device
    features: torch.Tensor  # [B, F, W] fp32, new frames only (right-padded)
    num_frames: list[int]  # new frames per row (<= W)
    is_first: bool  # first chunks: no pre-encode history, drop 0
    languages: torch.Tensor | None  # [B] prompt index per row (prompt models)


@dataclass
class StepResult:
    token_ids: list[list[int]]  # new tokens per row
    token_frames: list[list[int]]  # global encoder frame of each new token
    decoded_frames: list[int]  # encoder frames decoded per row after this step


def apply_prompt(model, encoded: torch.Tensor, languages: torch.Tensor) -> torch.Tensor:
    """Per-row language prompt: what PromptStreamingMixin._apply_prompt_to_encoded does for one
    global language, with a one-hot per row so one batch can mix languages."""
    x = encoded.transpose(1, 2)  # [B, T, D]
    b, t, _ = x.shape
    prompt = torch.zeros(b, t, model.num_prompts, dtype=x.dtype, device=x.device)
    prompt.scatter_(2, languages.view(b, 1, 1).expand(-1, t, -1), 1.0)
    out = model.nemo.prompt_kernel(torch.cat([x, prompt], dim=-1)).to(x.dtype)
    return out.transpose(1, 2)  # [B, D, T]


@contextlib.contextmanager
def aten_rnn(device: torch.device, dtype: torch.dtype):
    """On CPU in fp32, run the prediction network's LSTM on ATen's GEMM cell instead of oneDNN's.

    oneDNN's LSTM reorders its weights on every call. The label-looping decoder calls it once per
    emitted label with a single time step, so the reorder costs more than the arithmetic. In fp32
    the two differ only in the order of float operations, as the key/value-cached encoder does,
    and tokens stay identical to NeMo's loop (parity tests). Not in bf16: without oneDNN every
    GEMM of the decoder (LSTM and joint) rounds to bf16 in other places than NeMo's loop does,
    which changes tokens (test_prompt_model_bf16_mixed_languages_match_oracle fails with it). The
    flag is process-wide; only the step loop thread runs the model, and it is restored at once.
    """
    if device.type != "cpu" or dtype != torch.float32 or not torch._C._get_mkldnn_enabled():
        yield
        return
    torch._C._set_mkldnn_enabled(False)
    try:
        yield
    finally:
        torch._C._set_mkldnn_enabled(True)


@torch.inference_mode()
def run_step(model, encoder, pool: SlotPool, batch: StepBatch) -> StepResult:
    """`encoder`: a NemoEncoder or KVCacheEncoder whose cache layout matches `pool`."""
    g = model.geometry
    rows = batch.rows
    # 1. input: [history | new frames] for later chunks, new frames alone for first chunks.
    history = pool.gather_history(rows)  # [B, F, 9]
    with_history = torch.cat([history, batch.features], dim=-1)
    pool.scatter_history(rows, with_history[:, :, -g.pre_cache_frames :])  # only used if the chunk was full
    lengths = torch.tensor(batch.num_frames, dtype=torch.long)
    if batch.is_first:
        signal, drop = batch.features, 0
    else:
        signal, drop = with_history, g.drop_frames
        lengths = lengths + g.pre_cache_frames
    signal = signal.to(model.dtype)
    lengths = lengths.to(signal.device)
    # 2. encoder, caches gathered from and written back to the slot rows.
    full = min(batch.num_frames) == batch.features.shape[-1]  # no row padded (known here, no sync)
    encoded, encoded_len, cache = encoder.step(signal, lengths, pool.gather_encoder(rows), drop, full)
    pool.scatter_encoder(rows, cache)
    if batch.languages is not None:
        encoded = apply_prompt(model, encoded, batch.languages)
    # 3. RNN-T greedy label-looping decoding from the rows' carried state.
    state = pool.gather_decoder(rows)
    with aten_rnn(encoded.device, encoded.dtype):
        hyps, new_state = model.decoding_computer(
            x=encoded.transpose(1, 2), out_len=encoded_len, prev_batched_state=state
        )
    pool.scatter_decoder(rows, new_state)
    # 4. one device->host copy for everything the results need.
    n = len(batch.num_frames)
    packed = torch.cat(
        [
            hyps.current_lengths[:n, None],
            new_state.decoded_lengths[:n, None],
            hyps.transcript[:n].to(torch.long),
            hyps.timestamps[:n].to(torch.long),
        ],
        dim=1,
    ).cpu()  # [B, 2 + 2W]: one sync per step, not four
    width = hyps.transcript.shape[1]
    lens = packed[:, 0].tolist()
    decoded = packed[:, 1].tolist()
    used = max(lens, default=0)
    ids = packed[:, 2 : 2 + used].tolist()
    frames = packed[:, 2 + width : 2 + width + used].tolist()
    return StepResult(
        token_ids=[r[:k] for r, k in zip(ids, lens)],
        token_frames=[r[:k] for r, k in zip(frames, lens)],
        decoded_frames=decoded,
    )
