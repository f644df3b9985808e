"""How long ready audio waits for the step loop: the engine's overload signal.

A chunk is ready when its last sample has arrived and its stream's previous chunk has been stepped
(a stream's chunks are sequential). Its wait is the time from then to the start of the step that
runs it. An engine that keeps up runs every ready chunk within about one iteration, whatever the
batch; one that does not keeps falling further behind, and the waits grow without bound. The wait
is not the result latency: a client that sends a minute of audio at once makes its own later
chunks late, but each of them waits only for the step before it, so one fast client does not look
like overload.

The reported figure is the longest wait of the steps in the last `window_s` seconds (a windowed
maximum over a monotonic queue: O(1) per step), and 0 once no step has run for that long (an idle
engine is not behind). The loop thread records; any thread (the admission check) reads.
"""

from __future__ import annotations

from collections import deque


class QueueDelay:
    def __init__(self, window_s: float = 2.0) -> None:
        self.window_s = window_s
        self._steps: deque[tuple[float, float]] = deque()  # (time, wait), waits strictly decreasing
        # (value, valid until): replaced as one tuple, so a reader on another thread sees a pair
        # that belongs together (the engine core copies it into shared memory as is).
        self.published: tuple[float, float] = (0.0, 0.0)

    def record(self, wait_s: float, now: float) -> None:
        """Loop thread, after a step: the longest wait among its chunks."""
        steps = self._steps
        while steps and steps[-1][1] <= wait_s:
            steps.pop()  # never the maximum again: this step's wait is as long and outlives it
        steps.append((now, wait_s))
        horizon = now - self.window_s
        while steps[0][0] < horizon:
            steps.popleft()
        self.published = (steps[0][1], now + self.window_s)

    def value(self, now: float) -> float:
        """The longest wait in the window (seconds); 0 when no step has run within it."""
        value, valid_until = self.published
        return value if now <= valid_until else 0.0
