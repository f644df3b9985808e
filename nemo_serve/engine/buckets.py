"""Static batch buckets: the batch sizes a step runs at, and the cap on rows per step.

A step over n ready rows runs at the smallest bucket >= n; the rows past n point at the slot
pool's scratch row, whose results are discarded. Buckets are powers of two up to the cap, plus
the cap itself when it is not one (12 -> 1, 2, 4, 8, 12): at most log2(cap) + 2 shapes, so a
CUDA graph per (bucket, first/later chunk, full/short final chunk) is a bounded set captured once,
and a padded step costs at most twice the rows it serves.

The cap bounds what scales with the rows of one step rather than with the slots: the encoder's
gathered attention cache (rows x one slot's keys/values) and the activations. A ready set larger
than the cap is split into several steps of at most the cap. The ring layout (engine/ring_cache.py)
gathers one layer at a time and caps its steps at 2,048 rows (NEMO_SERVE_MAX_STEP_ROWS, for the
activations): its one-layer buffer at 2,048 Nemotron bf16 rows at 1120 ms is 0.55 GiB.
"""

from __future__ import annotations

import bisect
import os

# Bytes the gathered attention cache of one step may take: Nemotron at 1120 ms holds 6.9 MB of
# keys/values per stream in bf16, so 4 GiB caps a step at 512 rows (3.4 GiB). Override with
# NEMO_SERVE_STEP_CACHE_BYTES.
DEFAULT_STEP_CACHE_BYTES = 4 * 2**30


def step_cache_budget() -> int:
    return int(os.environ.get("NEMO_SERVE_STEP_CACHE_BYTES", DEFAULT_STEP_CACHE_BYTES))


def max_step_rows(num_slots: int, gather_bytes_per_row: int, budget_bytes: int | None = None) -> int:
    """Rows one step may run: the largest power of two whose gathered cache fits the budget (at
    least 1), and never more than the slots."""
    budget = step_cache_budget() if budget_bytes is None else budget_bytes
    rows = 1
    while rows * 2 * gather_bytes_per_row <= budget and rows * 2 <= num_slots:
        rows *= 2
    if rows < num_slots and num_slots * gather_bytes_per_row <= budget:
        rows = num_slots  # everything fits: one bucket of exactly the slot count on top
    return max(1, min(rows, num_slots))


def bucket_sizes(max_rows: int) -> list[int]:
    """Powers of two below `max_rows`, then `max_rows`."""
    if max_rows < 1:
        raise ValueError("max_rows must be >= 1")
    sizes, b = [], 1
    while b < max_rows:
        sizes.append(b)
        b *= 2
    sizes.append(max_rows)
    return sizes


def bucket_for(n: int, sizes: list[int]) -> int:
    """The smallest bucket that holds n rows (n <= sizes[-1])."""
    if n < 1 or n > sizes[-1]:
        raise ValueError(f"{n} rows: buckets hold 1 to {sizes[-1]}")
    return sizes[bisect.bisect_left(sizes, n)]


def split(n: int, max_rows: int) -> list[tuple[int, int]]:
    """[start, stop) ranges of at most `max_rows` covering n rows, in order."""
    return [(i, min(i + max_rows, n)) for i in range(0, n, max_rows)]
