"""Admission under overload: refuse while the model is behind real time, then re-admit gradually.

The queue delay (engine/queue_delay.py) says the engine is behind, but late: a stream adds its
share of work at once and the delay then grows only as fast as the streams drift (a server twice
over capacity falls behind by about a second per second). Refusing while it is over the limit and
admitting everyone once it is back under makes waves: the streams admitted before the delay
reached the limit keep it up until they end, then every client that was refused comes back within
a second (measured: benchmarks/results/overload_demo_r13_nocap_cpu.json, docs/server.md "Overload").

So, as TCP does with its window: when the delay crosses the limit, the open streams at that moment
were already too many, and new streams are admitted again only up to half of them (multiplicative
decrease); while the delay stays under half the limit that cap grows by 5% a second, at least one
stream a second (increase), until it reaches the slots and is dropped. Each front end keeps its own
guard over the same shared numbers (the delay and the open streams are the engine's), so they
agree.
"""

from __future__ import annotations

GROWTH_PER_S = 0.05  # the cap's growth while healthy, as a fraction of itself per second
MIN_GROWTH_PER_S = 1.0  # streams per second, so that a small cap recovers too


class OverloadGuard:
    def __init__(self, limit_s: float, num_slots: int) -> None:
        self.limit_s = limit_s  # 0: off
        self.num_slots = num_slots
        self.cap: float | None = None  # most open streams while recovering; None: the slots alone
        self._over = False
        self._last: float | None = None  # when the cap was last brought up to date

    def refusal(self, delay_s: float, open_streams: int, now: float) -> str | None:
        """Why a new stream would be refused now, or None."""
        if not self.limit_s:
            return None
        if delay_s > self.limit_s:
            if not self._over:  # just crossed: what is open now is too many
                self._over = True
                self.cap = max(1.0, open_streams / 2)
            self._last = now
            return (f"server overloaded: the model is {delay_s:.2f} s behind real time (limit {self.limit_s:g} s); "
                    "retry later or another instance")  # fmt: skip
        self._over = False
        if self.cap is None:
            return None
        if self._last is not None and delay_s < self.limit_s / 2:
            self.cap += max(MIN_GROWTH_PER_S, GROWTH_PER_S * self.cap) * max(0.0, now - self._last)
        self._last = now
        if self.cap >= self.num_slots:
            self.cap = None
            return None
        if open_streams >= int(self.cap):
            return (f"server overloaded: recovering, admitting up to {int(self.cap)} open streams for now "
                    f"({open_streams} open); retry later or another instance")  # fmt: skip
        return None
