"""How far the step loop is behind real time: the engine's overload signal.

A stream's chunk is due when its last sample has arrived, but no earlier than one chunk of audio
after the stream's previous chunk was due: `due_k = max(arrival_k, due_{k-1} + duration_k)`, the
time an engine that serves the stream exactly at real-time pace would start it. The delay of a
step is the longest `step start - due` among its chunks. An engine that keeps up starts every chunk
within about one iteration of its due time, whatever the batch. One that does not falls further
behind with every chunk, and the delay grows without bound, even when each step takes in every
ready stream (their chunks are then already there when the step before ends: what grows is the time
since they arrived). A client that sends a minute of audio at once is not counted: its chunks are
due at real-time pace from its first one, and an engine that keeps up runs them ahead of that.

The reported figure is the longest delay of the steps in the last `window_s` seconds (a windowed
maximum over a monotonic queue: O(1) per step), and 0 once no step has run for that long (an idle
engine is not behind). While a step runs the figure stands however long it takes: a step longer
than the window must not read as an idle engine. The loop thread records; any thread (the
admission check) reads; `Engine.iterate()` returns the pair as it stood after its steps (the engine
core copies it into shared memory for the front ends).
"""

from __future__ import annotations

import math
from collections import deque


class QueueDelay:
    def __init__(self, window_s: float = 2.0) -> None:
        self.window_s = window_s
        self._steps: deque[tuple[float, float]] = deque()  # (time, delay), delays strictly decreasing
        # (value, valid until): replaced as one tuple, so a reader on another thread sees a pair
        # that belongs together (the engine core copies it into shared memory as is).
        self.published: tuple[float, float] = (0.0, 0.0)

    def begin_step(self, now: float) -> None:
        """Loop thread, before a step: what the window holds stands until the step ends."""
        self._expire(now)
        self.published = (self._steps[0][1] if self._steps else 0.0, math.inf)

    def record(self, delay_s: float, now: float) -> None:
        """Loop thread, after a step: the largest delay among its chunks."""
        steps = self._steps
        while steps and steps[-1][1] <= delay_s:
            steps.pop()  # never the maximum again: this step's delay is as long and outlives it
        steps.append((now, delay_s))
        self._expire(now)
        self.published = (steps[0][1], now + self.window_s)

    def _expire(self, now: float) -> None:
        horizon = now - self.window_s
        while self._steps and self._steps[0][0] < horizon:
            self._steps.popleft()

    def value(self, now: float) -> float:
        """The largest delay in the window (seconds); 0 when no step has run within it."""
        value, valid_until = self.published
        return value if now <= valid_until else 0.0
