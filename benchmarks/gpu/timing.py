"""Step timing for the GPU profile (profile_step.py, index_bench.py): CUDA events on a GPU, the
wall clock on CPU, and the median the profile reports."""

from __future__ import annotations

import time

import numpy as np


class Timer:
    """CUDA events on a GPU (GPU time), the wall clock on CPU (synchronous there)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    def mark(self):
        import torch

        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def ms(self, a, b) -> float:
        return a.elapsed_time(b) if self.cuda else 1000 * (b - a)

    def done(self, marks: list) -> list[float]:
        """ms of each (start, end) pair, once the device has reached the last end."""
        if self.cuda:
            import torch

            torch.cuda.synchronize()
        return [self.ms(a, b) for a, b in marks]


def median_ms(xs) -> float | None:
    return round(float(np.median(xs)), 3) if len(xs) else None
