"""A front end hands the heap glibc keeps free back to the OS, now and then (issue 48/45).

Under a churn of streams a front end's RSS grew 0.13-0.18 MiB/min for 15 minutes while glibc's
heap in use stayed flat and the free memory it kept grew (docs/performance.md "Memory over a
soak", soak_malloc_cpu.json): freed blocks between live ones stay resident, because free() only
gives back the top of the heap above M_TRIM_THRESHOLD. malloc_trim(0) also releases the whole free
pages inside the heap (madvise MADV_DONTNEED, glibc >= 2.8).

The call runs on the front end's event loop, every `period_s`, and only when the loop is not
backed up: a short sleep that wakes late means callbacks are queued, and the trim waits for a quiet
moment rather than adding its milliseconds to their latency. Its cost on a fragmented ~100 MiB heap
is measured by benchmarks/heap_trim_cost.py (heap_trim_cost_cpu.json).

Rejected: MALLOC_TRIM_THRESHOLD_ (it only trims the top of the heap, which a live block there
pins) and a thread that calls it off the loop (the trim holds the arena's lock, so the loop's own
mallocs would wait on it anyway, at a moment nobody chose).

Elsewhere (musl, macOS, Windows) there is no malloc_trim: detected once, logged at debug, and the
task is a no-op.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import time
from collections.abc import Callable

log = logging.getLogger("nemo_serve.server")

# A probe sleep that wakes this much later than asked means callbacks were queued ahead of it:
# the loop is busy, and the trim waits.
BUSY_LATENESS_S = 0.005
IDLE_PROBE_S = 0.05
# Quiet moments looked for after each period before giving up until the next one: a front end
# that is never quiet for 50 ms is loaded enough that a trim's milliseconds matter.
MAX_IDLE_TRIES = 20


def load_malloc_trim(loader: Callable[[str | None], object] = ctypes.CDLL) -> Callable[[], int] | None:
    """glibc's malloc_trim(0) as a callable, or None where the C library has none (said once, at debug).
    `loader` stands in for ctypes.CDLL in tests (a C library without the symbol)."""
    try:
        symbol = loader(None).malloc_trim  # the process's own symbols: the C library it runs on
    except (OSError, AttributeError) as e:
        log.debug("no malloc_trim in this C library (%s): freed heap is not handed back", e)
        return None
    symbol.argtypes = [ctypes.c_size_t]
    symbol.restype = ctypes.c_int
    return lambda: symbol(0)


async def wait_until_idle(probe_s: float = IDLE_PROBE_S, max_tries: int = MAX_IDLE_TRIES) -> bool:
    """True once a `probe_s` sleep wakes on time (nothing queued ahead of it), False after `max_tries`."""
    for _ in range(max_tries):
        asked = time.monotonic() + probe_s
        await asyncio.sleep(probe_s)
        if time.monotonic() - asked <= BUSY_LATENESS_S:
            return True
    return False


async def trim_periodically(period_s: float, loader: Callable[[str | None], object] = ctypes.CDLL) -> None:
    """Until cancelled: every `period_s`, at a quiet moment of the loop, malloc_trim(0). Returns at
    once where there is no malloc_trim (or `period_s` is 0: the setting's off)."""
    trim = load_malloc_trim(loader) if period_s > 0 else None
    if trim is None:
        return
    while True:
        await asyncio.sleep(period_s)
        if await wait_until_idle():
            started = time.perf_counter()
            trim()
            log.debug("malloc_trim took %.2f ms", (time.perf_counter() - started) * 1e3)
