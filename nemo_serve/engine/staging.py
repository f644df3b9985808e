"""What a launched step owns until it is collected (engine/step.py: launch, then collect).

A step part's host staging (rows, lengths, languages, features in; packed results out) belongs to
that part from `Stepper.launch` to `Stepper.collect`, as vLLM v1's batch queue keeps a running
batch's inputs with its future: the host can stage and launch the next step while this one runs,
without waiting for the device to reuse a buffer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
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


class StagingSets:
    """A stepper's staging sets, owned or free. Two are made up front, so one step can be staged
    while another runs; `take` makes one more (kept) when more parts are in flight than that."""

    def __init__(self, rows: int, mels: int, width: int, packed: int, cuda: bool, num_sets: int = 2) -> None:
        self._shape, self._cuda = (rows, mels, width, packed), cuda
        self._all = [Staging.make(*self._shape, cuda) for _ in range(num_sets)]
        self._free = list(self._all)

    def take(self) -> Staging:
        if not self._free:
            st = Staging.make(*self._shape, self._cuda)
            self._all.append(st)
            return st
        return self._free.pop()

    def give_back(self, st: Staging) -> None:
        self._free.append(st)

    def buffers(self) -> list[torch.Tensor]:
        return [x for st in self._all for x in st.buffers()]


# Staging one part's inputs: rows [lo, hi) of the batch into the device buffers' first `bucket`
# rows. An input already on the device is copied device to device; a host one goes through the
# part's staging set and a non-blocking copy (`cuda`: the set is pinned).


def _host_long(values, lo: int, hi: int) -> torch.Tensor:
    return values[lo:hi] if isinstance(values, torch.Tensor) else torch.from_numpy(np.asarray(values[lo:hi], dtype=np.int64))


def stage_rows(st: Staging, d_rows: torch.Tensor, rows, lo: int, hi: int, bucket: int, scratch: int,
               device: torch.device, cuda: bool) -> None:  # fmt: skip
    """Slot rows; the padded rows past hi - lo point at the scratch slot."""
    n = hi - lo
    if isinstance(rows, torch.Tensor) and rows.device == device:
        d_rows[:n].copy_(rows[lo:hi])  # already there: device to device
        d_rows[n:bucket].fill_(scratch)
        return
    st.rows[:n] = _host_long(rows, lo, hi)
    st.rows[n:bucket] = scratch
    d_rows[:bucket].copy_(st.rows[:bucket], non_blocking=cuda)


def stage_languages(st: Staging, d_langs: torch.Tensor, languages, lo: int, hi: int, bucket: int,
                    d_rows: torch.Tensor, slot_languages: torch.Tensor, device: torch.device, cuda: bool) -> None:  # fmt: skip
    """Prompt language per row; None: the slots' own (`slot_languages`), gathered on the device
    by the rows already staged in `d_rows`. Padded rows get language 0."""
    n = hi - lo
    if languages is None:
        torch.index_select(slot_languages, 0, d_rows[:n], out=d_langs[:n])
    elif isinstance(languages, torch.Tensor) and languages.device == device:
        d_langs[:n].copy_(languages[lo:hi])
    else:
        st.langs[:n] = _host_long(languages, lo, hi)
        d_langs[:n].copy_(st.langs[:n], non_blocking=cuda)
    d_langs[n:bucket].fill_(0)


def stage_features(st: Staging, d_feat: torch.Tensor, features: torch.Tensor, lo: int, hi: int, width: int,
                   device: torch.device) -> None:  # fmt: skip
    """Feature chunks, zero-padded to the mode's `width` (a short final chunk, masked by its length)."""
    n, w = hi - lo, features.shape[-1]
    if features.device == device:
        d_feat[:n, :, :w].copy_(features[lo:hi])
    else:
        st.feat[:n, :, :w].copy_(features[lo:hi])
        d_feat[:n, :, :w].copy_(st.feat[:n, :, :w], non_blocking=True)
    if w < width:
        d_feat[:n, :, w:width].zero_()
    # Rows past n keep earlier features (finite): they feed only the scratch slot.


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
