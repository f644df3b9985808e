"""A diarized stream's feature frames, computed once each.

NeMo's loader cuts the diarizer's chunks from whole-file features: chunk k reads frames
[k*C - L, k*C + C + R), so consecutive chunks overlap by their left and right context (at the
model card's 1.04 s setting, 64 of a chunk's 112 frames). A feature frame depends only on its own
samples (engine/frontend.py: features computed piecewise equal the whole file's), so a frame
computed for one chunk serves the next: each step computes only the frames past the last it
computed. Rejected: computing every chunk's whole window (the previous version), 2.3x the
preprocessor work at 1.04 s and 1.7x at 0.32 s, for the same features.

A frame is computed only once final: before the input ends, a chunk is cut only when every frame to
its right context has all its samples (runner.py _next_cut); after it ends, the frames near the end
are computed with the true sample count. So a kept frame never changes.
"""

from __future__ import annotations

import torch


class KeptFeatures:
    """One stream's feature frames [first_frame, end_frame), consecutive, on the device: pieces
    [F, k] joined only when a chunk reads them (the ASR side adds one piece per ASR step, so joining
    at every add would copy the kept frames once per ASR step)."""

    def __init__(self) -> None:
        self.pieces: list[torch.Tensor] = []  # [F, k] each, consecutive from first_frame
        self.first_frame = 0
        self.num_kept = 0

    @property
    def end_frame(self) -> int:
        return self.first_frame + self.num_kept

    def missing_from(self, t0: int) -> int:
        """The first frame at or after t0 not computed yet."""
        return max(t0, self.end_frame) if self.num_kept else t0

    def add(self, t0: int, frames: torch.Tensor) -> bool:
        """Frames [t0, t0 + k) ([F, k], final: they never change) kept; those already kept are
        skipped. False, and nothing kept, where they would leave a gap after end_frame (the
        caller computes the gap's frames itself when a chunk needs them)."""
        if t0 > self.end_frame:
            return False
        fresh = frames[:, self.end_frame - t0 :]
        if fresh.shape[1]:
            self.pieces.append(fresh)
            self.num_kept += fresh.shape[1]
        return True

    def window(self, t0: int, n: int, new: torch.Tensor | None) -> torch.Tensor:
        """Frames [t0, t0 + n) as [n, F], `new` ([F, k], the frames from missing_from(t0) on)
        appended first; frames before t0 are forgotten (the next chunk starts after it)."""
        if not self.num_kept or t0 >= self.end_frame:
            self.pieces, self.first_frame, self.num_kept = [], t0, 0
        if new is not None:
            self.add(self.missing_from(t0), new)
        frames = self.pieces[0] if len(self.pieces) == 1 else torch.cat(self.pieces, dim=1)
        frames = frames[:, t0 - self.first_frame :]
        self.pieces, self.first_frame, self.num_kept = [frames], t0, frames.shape[1]
        assert self.end_frame >= t0 + n, (self.first_frame, self.end_frame, t0, n)
        return frames[:, :n].T
