"""Admission under overload: refuse while the model is behind real time, then re-admit gradually.

The queue delay (engine/queue_delay.py) says the engine is behind, but late: a stream adds its
share of work at once and the delay then grows only as fast as the streams drift (a server twice
over capacity falls behind by about a second per second). Refusing while it is over the limit and
admitting everyone once it is back under makes waves: the streams admitted before the delay
reached the limit keep it up until they end, then every client that was refused comes back within
a second (measured: benchmarks/results/overload_demo_r13_nocap_cpu.json, docs/performance.md "Overload").

So, as TCP does with its window: when the delay crosses the limit, the open streams at that moment
were already too many, and new streams are admitted again only up to half of them (multiplicative
decrease); while the delay stays under half the limit that cap grows by 5% a second, at least one
stream a second (increase), until it reaches the slots and is dropped.

The guard belongs to one engine core: it judges that core's own numbers (its delay, and the streams
open on it from every front end), and its state lives where every front end of the core sees it,
the core's shared block (core/shared.py; in memory for the in-process engine). So all front ends,
and /readyz on any of them, agree on whether a new stream is admitted; a guard per front end would
cross at its own time with its own cap, and K of them would admit up to K times the cap. This
module is the policy: `_next` takes a state and returns one. `OverloadGuard` binds it to the store
that keeps a core's state and to the lock its decisions are taken under.

The state moves only in `decide`, which admission calls for a stream it is admitting or refusing.
`verdict` computes the same answer without storing it, for /readyz: a load balancer's health check,
polled during an overload, must neither set the cap (which would then refuse a burst on an idle
server whose /readyz had said ready) nor move the clock the cap grows on. Growth is integrated over
the time since the last decision, so a verdict and the decision after it agree.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Protocol

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
class GuardState:
    cap: float | None = None  # most open streams while recovering; None: the slots alone
    over: bool = False  # the last decision saw the delay over the limit
    last: float | None = None  # when the last decision was taken (the cap grows from there)


class GuardStore(Protocol):
    """Where one core's guard state is kept: core/shared.py SharedSlots, or InMemory."""

    def load_guard(self) -> GuardState: ...

    def save_guard(self, state: GuardState) -> None: ...


class InMemory:
    """The state of a guard only one process judges by (the in-process engine, tests)."""

    def __init__(self) -> None:
        self._state = GuardState()

    def load_guard(self) -> GuardState:
        return self._state

    def save_guard(self, state: GuardState) -> None:
        self._state = state


class OverloadGuard:
    """One engine core's guard: the policy over the state `store` keeps. Every read and decision
    holds `lock` (the core's: shared.FileLock across processes), so a decision's read, policy and
    write are one step that no other front end interleaves, and a reading never sees half a write."""

    def __init__(self, limit_s: float, num_slots: int, store: GuardStore | None = None, lock=None) -> None:
        self.limit_s = limit_s  # 0: off
        self.num_slots = num_slots
        self.store = store if store is not None else InMemory()
        self.lock = lock if lock is not None else threading.Lock()

    @property
    def cap(self) -> float | None:
        with self.lock:
            return self.store.load_guard().cap

    def verdict(self, delay_s: float, open_streams: int, now: float) -> Verdict:
        """What a stream arriving now would be told; reads only (/readyz)."""
        return self.judge(delay_s, open_streams, now, decide=False)

    def decide(self, delay_s: float, open_streams: int, now: float) -> str | None:
        """For a stream being admitted or refused now: why it is refused, or None. The only call
        that moves the guard's state."""
        return self.judge(delay_s, open_streams, now, decide=True).refusal

    def judge(self, delay_s: float, open_streams: int, now: float, decide: bool) -> Verdict:
        """The verdict on a stream arriving now; `decide`: it is being admitted or refused, and the
        state it leaves is stored."""
        with self.lock:
            state = self._next(self.store.load_guard(), delay_s, open_streams, now)
            if decide:
                self.store.save_guard(state)
        return Verdict(self._refusal(state, delay_s, open_streams), state.over, _whole(state.cap))

    def _next(self, old: GuardState, delay_s: float, open_streams: int, now: float) -> GuardState:
        """The state a decision taken now would leave."""
        if not self.limit_s:
            return old
        if delay_s > self.limit_s:
            # Just crossed: what is open now is too many. Still over: the cap stays.
            cap = old.cap if old.over else max(1.0, open_streams / 2)
            return GuardState(cap, True, now)
        cap = old.cap
        if cap is not None and old.last is not None and delay_s < self.limit_s / 2:
            cap += max(MIN_GROWTH_PER_S, GROWTH_PER_S * cap) * max(0.0, now - old.last)
        if cap is not None and cap >= self.num_slots:
            cap = None
        return GuardState(cap, False, now)

    def _refusal(self, state: GuardState, delay_s: float, open_streams: int) -> str | None:
        if state.over:
            return (f"server overloaded: the model is {delay_s:.2f} s behind real time (limit {self.limit_s:g} s); "
                    "retry later or another instance")  # fmt: skip
        if state.cap is not None and open_streams >= int(state.cap):
            return (f"server overloaded: recovering, admitting up to {int(state.cap)} open streams for now "
                    f"({open_streams} open); retry later or another instance")  # fmt: skip
        return None


def _whole(cap: float | None) -> int | None:
    return None if cap is None else int(cap)
