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
guard over the same shared numbers (the delay and the open streams are the engine's).

The guard's state moves only in `decide`, which admission calls for a stream it is admitting or
refusing. `verdict` computes the same answer without storing it, for /readyz: a load balancer's
health check, polled during an overload, must neither set the cap (which would then refuse a burst
on an idle server whose /readyz had said ready) nor move the clock the cap grows on. Growth is
integrated over the time since the last decision, so a verdict and the decision after it agree.
"""

from __future__ import annotations

from dataclasses import dataclass

GROWTH_PER_S = 0.05  # the cap's growth while healthy, as a fraction of itself per second
MIN_GROWTH_PER_S = 1.0  # streams per second, so that a small cap recovers too


@dataclass(frozen=True)
class Verdict:
    refusal: str | None  # why a new stream would be refused now; None: admitted
    behind: bool  # the delay is over the limit
    cap: int | None  # most open streams admitted while recovering; None: the slots alone

    @property
    def overloaded(self) -> bool:
        """Behind real time, or recovering from it (a cap in force)."""
        return self.behind or self.cap is not None


@dataclass(frozen=True)
class _State:
    cap: float | None = None  # most open streams while recovering; None: the slots alone
    over: bool = False  # the last decision saw the delay over the limit
    last: float | None = None  # when the last decision was taken (the cap grows from there)


class OverloadGuard:
    def __init__(self, limit_s: float, num_slots: int) -> None:
        self.limit_s = limit_s  # 0: off
        self.num_slots = num_slots
        self._state = _State()  # owner: decide(); nothing else writes it

    @property
    def cap(self) -> float | None:
        return self._state.cap

    def verdict(self, delay_s: float, open_streams: int, now: float) -> Verdict:
        """What a stream arriving now would be told; reads only (/readyz)."""
        state = self._next(delay_s, open_streams, now)
        return Verdict(self._refusal(state, delay_s, open_streams), state.over, _whole(state.cap))

    def decide(self, delay_s: float, open_streams: int, now: float) -> str | None:
        """For a stream being admitted or refused now: why it is refused, or None. The only call
        that moves the guard's state."""
        state = self._next(delay_s, open_streams, now)
        self._state = state
        return self._refusal(state, delay_s, open_streams)

    def _next(self, delay_s: float, open_streams: int, now: float) -> _State:
        """The state a decision taken now would leave; computed, not stored."""
        old = self._state
        if not self.limit_s:
            return old
        if delay_s > self.limit_s:
            # Just crossed: what is open now is too many. Still over: the cap stays.
            cap = old.cap if old.over else max(1.0, open_streams / 2)
            return _State(cap, True, now)
        cap = old.cap
        if cap is not None and old.last is not None and delay_s < self.limit_s / 2:
            cap += max(MIN_GROWTH_PER_S, GROWTH_PER_S * cap) * max(0.0, now - old.last)
        if cap is not None and cap >= self.num_slots:
            cap = None
        return _State(cap, False, now)

    def _refusal(self, state: _State, delay_s: float, open_streams: int) -> str | None:
        if state.over:
            return (f"server overloaded: the model is {delay_s:.2f} s behind real time (limit {self.limit_s:g} s); "
                    "retry later or another instance")  # fmt: skip
        if state.cap is not None and open_streams >= int(state.cap):
            return (f"server overloaded: recovering, admitting up to {int(state.cap)} open streams for now "
                    f"({open_streams} open); retry later or another instance")  # fmt: skip
        return None


def _whole(cap: float | None) -> int | None:
    return None if cap is None else int(cap)
