"""Per-stream incremental log-mel features, equal to NeMo's whole-file features up to float32 rounding.

Frame t of NeMo's (centred) STFT reads samples [t*hop - n_fft/2, t*hop + n_fft/2) and, through
pre-emphasis, one sample before that. So frames [t0, t1) can be computed from the segment
[t0*hop - M, (t1-1)*hop + M) with M = hop * ceil((n_fft/2 + 1) / hop) (two hops for 16 kHz,
n_fft 512): run the same preprocessor on the segment, keep local frames M/hop ... M/hop + n.
Samples before 0 are zeros, exactly what centre padding gives the whole file; at the end of a
stream, `length` = the real samples in the segment reproduces NeMo's end-of-file masking,
including the one extra all-zero frame (NeMo's buffer has floor(L/hop) + 1 frames; the last is
masked to 0.0 and its loop treats it as data).

What is guaranteed: every sample a frame reads, the framing, the FFT and the masking are the same
as in the whole-file computation, and the power spectrum is bit-identical (measured on Intel and
AMD). The mel filterbank product is one GEMM over all frames computed together, and BLAS picks its
blocking, hence its summation order, from the matrix size and the CPU: on the Intel CPUs measured
the features are bit-identical, on an AMD EPYC they differ by up to 9.5e-7 (one ulp of a log-mel
value). The bound any CPU obeys, 2 gamma_257 + 2u relative in the mel energy plus 2 ulp in the log
(3.5e-5 for log-mel values under 16 in magnitude), is derived and tested in tests/test_frontend.py.
Tokens are what must be identical, and are (parity tests, Intel and AMD).

Alternatives rejected: per-chunk preprocessing (centre padding inside every chunk, error up
to 2.9 log-mel) and NeMo 3.0's one-hop look-back bufferer (differs at chunk edges).
"""

from __future__ import annotations

import math
import time
from bisect import bisect_left

import numpy as np
import torch

from .geometry import frames_available  # noqa: F401 - the readiness rule, re-exported


class AudioBuffer:
    """One stream's raw samples, owned by the engine's loop thread (no lock: whoever takes audio
    from the network hands it to that thread first, core/engine_core.py)."""

    def __init__(self, capacity: int = 16000, storage: np.ndarray | None = None) -> None:
        """`capacity`: samples the buffer holds before it first compacts or grows (the engine sizes
        it for the stream's chunk mode, so a steady stream never reallocates). `storage`: a
        float32 row of that size to hold them (the engine's AudioArena; its old contents are never
        read), given back with `release_storage`; None: an array of its own."""
        # Samples [offset, offset + _used) are held in _data[:_used]; those before `kept_from` are
        # no longer needed (discard_before) and are dropped when the space is next wanted.
        self._data = np.zeros(capacity, dtype=np.float32) if storage is None else storage
        self._storage = storage  # the arena's row, kept even if the buffer outgrows it
        self._used = 0
        self.offset = 0  # global index of _data[0]
        self.kept_from = 0  # global index of the first sample still needed
        self.num_samples = 0  # samples taken in so far (global end)
        self.finished = False  # end of input
        self.finish_time: float | None = None  # server time of end of input
        # (global sample end, arrival time) per packet taken in, for latency accounting.
        self._arrival_ends: list[int] = []
        self._arrival_times: list[float] = []

    def release_storage(self) -> np.ndarray | None:
        """The stream is gone: hand back the arena's row (None if the buffer has none). The samples
        are forgotten (a later read gives zeros, a later extend an array of the buffer's own), so
        the row's next stream is never read through this buffer."""
        storage, self._storage = self._storage, None
        if storage is not None:
            self._data, self._used = np.zeros(0, dtype=np.float32), 0
            self.offset = self.kept_from = self.num_samples
        return storage

    def finish(self, at: float | None = None) -> None:
        """End of input; `at`: when it reached the server (default now). Idempotent."""
        if not self.finished:
            self.finished = True
            self.finish_time = time.time() if at is None else at

    def extend(self, parts: tuple[np.ndarray, ...], arrived: float, keep_from: int = 0) -> None:
        """Append samples (given as consecutive pieces, e.g. the two halves of a wrapped ring)
        straight into the buffer, one copy; `arrived`: when they reached the server. `keep_from`:
        as `discard_before(keep_from)` first (the engine's intake knows it as an array over the
        streams: no call per stepped chunk). Runs per stream per packet: kept lean."""
        if keep_from > self.kept_from:
            self.kept_from = min(keep_from, self.num_samples)
        used = self._used
        if len(parts) == 1:  # the usual case, without the loop
            samples = parts[0]
            n = len(samples)
            if n == 0:
                return
            if used + n > self._data.size:
                used = self._make_room(n)
            self._data[used : used + n] = samples
            self._used = used + n
        else:
            n = sum(map(len, parts))
            if n == 0:
                return
            if used + n > self._data.size:
                used = self._make_room(n)
            for p in parts:
                self._data[used : used + len(p)] = p
                used += len(p)
            self._used = used
        self.num_samples += n
        ends = self._arrival_ends
        ends.append(self.num_samples)
        self._arrival_times.append(arrived)
        if len(ends) > 32:  # trimmed now and then, not at every packet
            self._trim_arrivals()

    def _make_room(self, n: int) -> int:
        """Room for `n` more samples: the samples still needed moved to the front (the only copy of
        old audio, and only when the buffer is full: a discard copies nothing), the buffer doubled
        only if that is not enough. Returns the new end. The rejected alternative, compacting in
        discard_before, copied the kept tail at every other step and let the buffer grow first."""
        k = self.kept_from - self.offset
        if k > 0:
            kept = self._used - k
            self._data[:kept] = self._data[k : self._used]  # numpy buffers overlapping copies
            self._used, self.offset = kept, self.kept_from
        if self._used + n > len(self._data):
            new = np.zeros(max(2 * len(self._data), self._used + n), dtype=np.float32)
            new[: self._used] = self._data[: self._used]
            self._data = new
        return self._used

    def copy_segment(self, start: int, out: np.ndarray) -> None:
        """Write samples [start, start + len(out)) into `out`; zeros outside [0, num_samples)."""
        end = start + len(out)
        lo, hi = max(start, self.offset), min(end, self.num_samples)
        if hi <= lo:
            out[:] = 0.0
            return
        if lo > start:  # zeros only where there are samples to zero: an empty slice store costs as much
            out[: lo - start] = 0.0
        out[lo - start : hi - start] = self._data[lo - self.offset : hi - self.offset]
        if hi < end:
            out[hi - start :] = 0.0

    def arrival_time(self, sample_end: int) -> float:
        """Server time at which sample `sample_end - 1` arrived (the latest one if beyond)."""
        if not self._arrival_times:
            return time.time()
        i = min(bisect_left(self._arrival_ends, sample_end), len(self._arrival_ends) - 1)
        return self._arrival_times[i]

    def discard_before(self, start: int) -> None:
        """Forget samples before global index `start` (they will never be read again): marked
        only; their space is reused when the buffer is next full (_make_room)."""
        if start <= self.kept_from:
            return
        self.kept_from = min(start, self.num_samples)
        if len(self._arrival_ends) > 32:  # trimmed now and then, not at every step
            self._trim_arrivals()

    def _trim_arrivals(self) -> None:
        """Drop the packets that end before `kept_from`, but one, so arrival_time stays defined."""
        i = bisect_left(self._arrival_ends, self.kept_from)
        if i > 1:
            del self._arrival_ends[: i - 1], self._arrival_times[: i - 1]


class AudioArena:
    """Storage for the engine's stream buffers: rows of a few large arrays, a free list per row
    size, in place of an array per stream. Why: numpy asks the kernel for transparent huge pages
    for arrays of 4 MiB and more, so a chunk's copy into its stream's row and the copy of its
    segment into the feature input walk 2 MiB pages; a 64 kB array of a stream's own sits on 4 kB
    pages, and at thousands of streams each such copy misses the TLB (a micro-benchmark on a 2-core
    EPYC VM, not committed: 16,000 rows of 64 kB, an 80 ms chunk into each, about half the time per
    copy, the gain gone with numpy's huge pages off; the engine core: docs/performance.md, host work).
    Rows come in blocks of BLOCK_BYTES as streams open and are kept for the next streams: the arena
    holds the rows of its peak of open streams (the rejected alternative, a row per slot, would hold
    one per slot and chunk mode). Owned by the engine's loop thread, as the buffers."""

    BLOCK_BYTES = 32 << 20

    def __init__(self) -> None:
        self._free: dict[int, list[np.ndarray]] = {}  # row size (samples) -> rows not in use
        self.num_rows = 0  # rows made, in use or free

    def take(self, capacity: int) -> np.ndarray:
        """A float32 row of `capacity` samples (its contents are left over: AudioBuffer reads only
        what it wrote)."""
        free = self._free.setdefault(capacity, [])
        if not free:
            block = np.zeros((max(1, self.BLOCK_BYTES // (4 * capacity)), capacity), dtype=np.float32)
            free.extend(block[::-1])  # rows taken in address order
            self.num_rows += len(block)
        return free.pop()

    def give_back(self, row: np.ndarray) -> None:
        self._free[row.size].append(row)

    @property
    def num_in_use(self) -> int:
        """Rows held by streams' buffers (0 once every stream is released: tests' engine-empty check)."""
        return self.num_rows - sum(map(len, self._free.values()))


class FeatureExtractor:
    """Computes feature frames [t0, t0 + n) for many streams with one preprocessor call per shape."""

    def __init__(self, preprocessor: torch.nn.Module, hop: int, n_fft: int, device: torch.device) -> None:
        self.pre = preprocessor
        self.hop = hop
        self.margin = hop * math.ceil((n_fft // 2 + 1) / hop)
        self.margin_frames = self.margin // hop
        self.device = device
        self.pin = device.type == "cuda"
        # compute()'s inputs (samples; lengths and row indices), written on the host and copied to
        # the device without a wait: host staging kept between calls (a fresh array per step costs
        # page faults that grow with batch x chunk), pinned on CUDA.
        self._samples = _Staging(torch.float32, self.pin)
        self._ints = _Staging(torch.int64, self.pin)

    @classmethod
    def for_model(cls, model) -> "FeatureExtractor":
        fb = model.preprocessor.featurizer
        return cls(model.preprocessor, fb.hop_length, fb.n_fft, model.device)

    def frames_available(self, audio: AudioBuffer) -> int:
        """Frames whose every input sample has arrived (all of them once input has finished)."""
        return int(frames_available(audio.num_samples, audio.finished, self.hop, self.margin))

    def first_sample_needed(self, t0):
        """The first sample frame `t0` reads (an int, or an array for an array of frames)."""
        return t0 * self.hop - self.margin

    def last_sample_needed(self, t1):
        """Exclusive end of the samples that frames before t1 read (an int, or an array)."""
        return (t1 - 1) * self.hop + self.margin

    @property
    def host_buffers(self) -> list[torch.Tensor]:
        """The staging buffers now in use (tests/test_step_sync.py)."""
        return [b.buf for b in (self._samples, self._ints) if b.buf is not None]

    @torch.inference_mode()
    def compute(self, audios: list[AudioBuffer], t0s: list[int], n: int, *, more: bool = False) -> torch.Tensor:
        """Frames [t0, t0 + n) for each stream -> [B, F, n] fp32 on the device.

        Streams whose input has ended get their true sample count as `length`, so the
        frames past the end are NeMo's masked zeros. The input batch and its lengths are written
        into host staging and reach the device by non-blocking copies (none on CPU, where the
        staging is the input): nothing here waits for the device. `more`: another call of the
        same step (`compute_group`), staged after the previous ones instead of over them.
        """
        seg_len = (n - 1) * self.hop + 2 * self.margin
        b = len(audios)
        x = self._samples.take(b * seg_len, fresh=not more).view(b, seg_len)
        length = self._ints.take(b, fresh=not more)
        batch, lengths = x.numpy(), length.numpy()
        lengths[:] = seg_len
        starts = self.first_sample_needed(np.asarray(t0s, dtype=np.int64)).tolist()
        for a, start, row in zip(audios, starts, batch):
            i = start - a.offset
            if i >= 0 and start + seg_len <= a.num_samples:  # copy_segment's usual case, inlined (every row)
                row[:] = a._data[i : i + seg_len]
            else:
                a.copy_segment(start, row)
        for i in [i for i, a in enumerate(audios) if a.finished]:  # streams at their end: the real sample count
            lengths[i] = min(seg_len, audios[i].num_samples - starts[i])
        # Non-blocking from staging that no later step writes before the device has read it (_Staging).
        x = x.to(self.device, non_blocking=self.pin)
        feats, _ = self.pre(input_signal=x, length=length.to(self.device, non_blocking=self.pin))
        return feats[:, :, self.margin_frames : self.margin_frames + n]

    @torch.inference_mode()
    def compute_group(self, audios: list[AudioBuffer], t0s: list[int], widths: np.ndarray) -> torch.Tensor:
        """[B, F, max width] new frames of one step's rows, `widths[i]` frames for row i: final short
        chunks are computed apart (one call per width) and zero-padded. The rows of each width reach
        their place through a staged index (a list index would be a blocking copy on CUDA)."""
        if (widths == widths[0]).all():
            return self.compute(audios, t0s, int(widths[0]))
        pieces = []
        for k, n in enumerate(np.unique(widths).tolist()):
            idx = np.flatnonzero(widths == n)
            feats = self.compute([audios[i] for i in idx], [t0s[i] for i in idx], n, more=k > 0)
            rows = self._ints.take(len(idx), fresh=False)
            rows.numpy()[:] = idx  # staging too (_Staging)
            pieces.append((rows.to(self.device, non_blocking=self.pin), feats, n))
        out = torch.zeros(len(audios), pieces[0][1].shape[1], int(widths.max()), device=self.device)
        for rows, feats, n in pieces:
            out[:, :, :n].index_copy_(0, rows, feats)
        return out


class _Staging:
    """Host memory the device reads by non-blocking copies (pinned on CUDA): `take` hands out
    consecutive pieces, from the start again when `fresh` (the next step). On CPU the copies are
    done on return, so one buffer is reused. On CUDA the loop launches the next step before it
    waits for this one (engine/loop.py), so the device may not have read a piece yet when the
    next step is staged: a fresh step takes a new pinned buffer from torch's caching host
    allocator, which hands a block out again only after the copies recorded on it have run (the
    rejected alternative, reusing one buffer, was safe only while every step ended in a wait)."""

    def __init__(self, dtype: torch.dtype, pin: bool) -> None:
        self.dtype, self.pin = dtype, pin
        self.buf: torch.Tensor | None = None
        self.used = 0

    def take(self, n: int, fresh: bool) -> torch.Tensor:
        if fresh:
            self.used = 0
            if self.pin:
                self.buf = None  # the allocator keeps the old block until its copies are done
        size = 0 if self.buf is None else self.buf.numel()
        if self.used + n > size:
            # A new buffer. Pieces taken earlier this step stay valid in the old one: the caching
            # host allocator reuses pinned memory only after the copies recorded on it have run.
            self.buf = torch.empty(max(self.used + n, 2 * size), dtype=self.dtype, pin_memory=self.pin)
        piece = self.buf[self.used : self.used + n]
        self.used += n
        return piece
