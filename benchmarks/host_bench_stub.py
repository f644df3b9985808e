"""host_bench.py's stand-in model: a preprocessor of the right shape without arithmetic, and a step
that emits the trained demo model's decoder load through run_step's host-side result handling."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch


class _StubPreprocessor(torch.nn.Module):
    """Log-mel of the right shape, no arithmetic: a view of one zero tensor (on a GPU the output
    would be device memory, written by the device: no host cost)."""

    def __init__(self, num_mels: int, hop: int) -> None:
        super().__init__()
        self.num_mels, self.hop = num_mels, hop
        self.out = torch.zeros(0, num_mels, 0)

    def forward(self, input_signal: torch.Tensor, length: torch.Tensor):
        b, frames = input_signal.shape[0], input_signal.shape[1] // self.hop + 1
        if self.out.shape[0] < b or self.out.shape[2] < frames:
            self.out = torch.zeros(max(b, self.out.shape[0]), self.num_mels, max(frames, self.out.shape[2]))
        return self.out[:b, :, :frames], length


def _collect_stub(result):
    """The stub's launch returns its results already: collecting is taking them."""
    return result


EMISSION = Path(__file__).resolve().parent / "results" / "emission_demo_cpu_fp32.json"


def trained_emission(context_right: int) -> dict[int, float]:
    """The trained demo model's tokens per encoder frame at this chunk mode, as a distribution
    {tokens on one frame: share of frames} (benchmarks/gpu/emission.py measured it over the bundled
    utterances: 0.42 tokens per frame at every mode, 62-66% of frames without a token, up to 4)."""
    modes = {m["context_right"]: m for m in json.loads(EMISSION.read_text())["modes"]}
    counts = {int(k): v for k, v in modes[context_right]["frames_by_tokens"].items()}
    total = sum(counts.values())
    return {k: v / total for k, v in sorted(counts.items())}


def _emission_table(distribution: dict[int, float], length: int = 1 << 17) -> np.ndarray:
    """Cumulative tokens over `length` encoder frames drawn (seeded) from `distribution`: a row
    stepping frames [a, b) emits table[b] - table[a] tokens (each slot reads it at its own offset),
    so the stub costs O(rows) per step and carries the trained model's spread, not only its mean."""
    rng = np.random.default_rng(46)
    per_frame = rng.choice(list(distribution), size=length, p=list(distribution.values()))
    return np.concatenate([[0], np.cumsum(per_frame)])


def _stub_step(tokens_per_frame: float | dict[int, float], num_slots: int, emitted: dict):
    """The step's host side without the model: run_step's result handling (one packed [B, 2 + 2W]
    array turned into lists, sliced per row) over tokens made up at `tokens_per_frame` (a rate,
    spread evenly, or a distribution of tokens per frame: `trained_emission`). `emitted` counts
    the tokens and encoder frames it produced (the load it really carried)."""
    from nemo_serve.engine.step import StepResult

    decoded = np.zeros(num_slots, np.int64)  # encoder frames decoded per slot
    table = _emission_table(tokens_per_frame) if isinstance(tokens_per_frame, dict) else None
    offset = np.arange(num_slots, dtype=np.int64) * 7919 % (1 << 16)  # each slot its own stretch of the table

    def step(model, encoder, pool, batch) -> StepResult:
        rows = np.asarray(batch.rows)  # an array (a tensor in older versions)
        sub = model.geometry.subsampling
        start = decoded[rows]
        end = start + (np.asarray(batch.num_frames) + sub - 1) // sub
        decoded[rows] = end
        if table is None:
            lens = (end * tokens_per_frame).astype(np.int64) - (start * tokens_per_frame).astype(np.int64)
        else:
            lens = table[end + offset[rows]] - table[start + offset[rows]]
        emitted["tokens"] += int(lens.sum())
        emitted["frames"] += int((end - start).sum())
        width = max(int(lens.max()), 1)
        frames = start[:, None] + np.arange(width)[None, :]  # [B, W]
        packed = np.concatenate([lens[:, None], end[:, None], 1 + frames % 50, frames], axis=1)
        k, d = packed[:, 0].tolist(), packed[:, 1].tolist()
        ids, fr = packed[:, 2 : 2 + width].tolist(), packed[:, 2 + width :].tolist()
        return StepResult([r[:n] for r, n in zip(ids, k)], [r[:n] for r, n in zip(fr, k)], d)

    return step

