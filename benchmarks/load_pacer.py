"""One pacer per event loop for the picows client's streams (load_picows.py): every packet of
every stream sent from one clock, with no task wake-up or timer per packet.

Why: with send_paced (load_level.py) each packet costs its stream's task a timer, a sleep and a
wake-up; at thousands of streams per process those, not the sends, were the generator's CPU
(py-spy on loadgen_capacity.py: most samples in the event loop itself). Here one task wakes every
TICK_S, pops from a heap (by due time) each stream whose next packet is due within EARLY_S, and
sends it with a synchronous frame write; between ticks it sleeps until the next packet is due.

The lateness is send_paced's definition, unchanged: per packet, how long after the later of its
due time and the previous send's return it went out; a stream held by TCP backpressure (its
transport paused) leaves the heap until it is writable again, and that wait is the server's, so
it is not counted. Ticks add at most TICK_S - EARLY_S of lateness to a packet (0.5 ms).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import time
from collections.abc import Callable, Sequence

from benchmarks.common import SAMPLE_RATE
from benchmarks.load_level import StreamRecord

TICK_S = 0.001  # uvloop's timers tick in whole milliseconds: a finer tick would not wake sooner
EARLY_S = 0.0005  # as send_paced: a packet may leave this much before its due time


class PacedStream:
    """One stream's packets, (samples sent after it, payload); `send(payload)` writes one frame
    synchronously; `writable()` says whether the transport takes more; `send_end()` writes the
    stream's last message. `sent` resolves once everything went out."""

    def __init__(self, packets: Sequence[tuple[int, bytes]], rec: StreamRecord, send: Callable[[bytes], None],
                 writable: Callable[[], bool], send_end: Callable[[], None]) -> None:  # fmt: skip
        self.packets, self.rec, self.send, self.writable, self.send_end = packets, rec, send, writable, send_end
        self.next = 0
        self.t0 = self.previous_sent = time.monotonic()
        self.sent = asyncio.get_running_loop().create_future()

    def due(self) -> float:
        return self.t0 + self.packets[self.next][0] / SAMPLE_RATE


class Pacer:
    """Owns the heap of (due time, order, stream); only its own task pops from it."""

    def __init__(self) -> None:
        self.heap: list[tuple[float, int, PacedStream]] = []
        self.order = itertools.count()  # ties broken by arrival, never by comparing streams
        self.parked: set[PacedStream] = set()  # held by backpressure, out of the heap
        loop = asyncio.get_running_loop()
        self.wakeup: asyncio.Future = loop.create_future()  # resolved by the timer, or by an earlier packet
        self.wake_at = math.inf  # monotonic time the pacer's task sleeps until
        self.task = loop.create_task(self._run())

    async def send_all(self, stream: PacedStream) -> None:
        """Schedule `stream`'s packets and wait until the last (and its end message) went out."""
        self._push(stream)
        try:
            await stream.sent
        finally:
            self.parked.discard(stream)  # a cancelled stream (timeout) leaves nothing behind

    def resume(self, stream: PacedStream) -> None:
        """Its transport is writable again: back in the heap; the wait is not the generator's."""
        if stream in self.parked:
            self.parked.discard(stream)
            stream.previous_sent = time.monotonic()
            self._push(stream)

    def _push(self, stream: PacedStream) -> None:
        due = stream.due()
        heapq.heappush(self.heap, (due, next(self.order), stream))
        if due < self.wake_at - TICK_S and not self.wakeup.done():  # due before the task wakes: wake it
            self.wakeup.set_result(None)

    async def _run(self) -> None:
        # It sleeps until the heap's first due time, at least TICK_S: with few streams it does not
        # spin every millisecond; with many, each wake-up sends the packets of a whole tick.
        loop = asyncio.get_running_loop()
        while True:
            self._send_due(time.monotonic())
            self.wakeup = loop.create_future()
            timer = None
            if self.heap:
                delay = max(TICK_S, self.heap[0][0] - EARLY_S - time.monotonic())
                self.wake_at = time.monotonic() + delay
                timer = loop.call_later(delay, _resolve, self.wakeup)
            else:
                self.wake_at = math.inf
            await self.wakeup
            if timer is not None:
                timer.cancel()

    def _send_due(self, now: float) -> None:
        heap = self.heap
        while heap and heap[0][0] - now <= EARLY_S:
            due, _, stream = heapq.heappop(heap)
            if stream.sent.done():  # cancelled while waiting
                continue
            if not stream.writable():
                self.parked.add(stream)
                continue
            self._send_one(stream, due)
            now = time.monotonic()

    def _send_one(self, stream: PacedStream, due: float) -> None:
        rec, now = stream.rec, time.monotonic()
        rec.send_lateness.append(max(0.0, now - max(due, stream.previous_sent)))
        end, payload = stream.packets[stream.next]
        try:
            stream.send(payload)
            stream.previous_sent = time.monotonic()
            rec.send_ends.append(end)
            rec.send_times.append(time.time())
            stream.next += 1
            if stream.next < len(stream.packets):
                heapq.heappush(self.heap, (stream.due(), next(self.order), stream))  # the task is awake
                return
            stream.send_end()
            rec.end_sent = time.time()
            stream.sent.set_result(None)
        except Exception as e:  # the stream's failure (a closed connection) is its own, not the pacer's
            stream.sent.set_exception(e)


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


_PACERS: dict[asyncio.AbstractEventLoop, Pacer] = {}


def pacer() -> Pacer:
    """This event loop's pacer (each load worker process runs one loop)."""
    loop = asyncio.get_running_loop()
    if loop not in _PACERS:
        for old in [lp for lp in _PACERS if lp.is_closed()]:
            del _PACERS[old]
        _PACERS[loop] = Pacer()
    return _PACERS[loop]
