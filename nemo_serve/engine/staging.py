"""What a launched step owns until it is collected (engine/step.py: launch, then collect).

A step part's host staging (rows, lengths, languages, features in; packed results out) belongs to
that part from `Stepper.launch` to `Stepper.collect`, as vLLM v1's batch queue keeps a running
batch's inputs with its future: the host can stage and launch the next step while this one runs,
without waiting for the device to reuse a buffer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Staging:
    """Host staging for one device step part (pinned on CUDA: non-blocking copies from and to it).
    Owned by that part from `Stepper.launch` until `Stepper.collect` has read its results: only
    then may another part write it (the alternative, one set per stepper, needs a wait for the
    device before every reuse: the synchronous step)."""

    rows: torch.Tensor  # [R] long
    lens: torch.Tensor  # [R] long
    langs: torch.Tensor  # [R] long
    feat: torch.Tensor | None  # [R, F, W] fp32; None on CPU (features are already host tensors there)
    out: torch.Tensor  # [R, 2 + 3 * out_width] int32, the packed results

    @classmethod
    def make(cls, rows: int, mels: int, width: int, packed: int, cuda: bool) -> "Staging":
        return cls(torch.empty(rows, dtype=torch.long, pin_memory=cuda), torch.empty(rows, dtype=torch.long, pin_memory=cuda),
                   torch.zeros(rows, dtype=torch.long, pin_memory=cuda),
                   torch.zeros(rows, mels, width, dtype=torch.float32, pin_memory=cuda) if cuda else None,
                   torch.empty(rows, packed, dtype=torch.int32, pin_memory=cuda))  # fmt: skip

    def buffers(self) -> list[torch.Tensor]:
        return [x for x in (self.rows, self.lens, self.langs, self.feat, self.out) if x is not None]


@dataclass
class LaunchedPart:
    staging: Staging
    num_rows: int
    confidence: bool  # its rows' token confidences are packed after the frames
    done: object | None  # CUDA: an event recorded after its results copy; None: already complete


@dataclass
class LaunchedStep:
    """A step whose device work is enqueued: `Stepper.collect` turns it into a StepResult."""

    stepper: object  # the Stepper that launched it
    parts: list[LaunchedPart]
    confidence: bool
