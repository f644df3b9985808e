"""The steps the engine launched and has not collected, and the calls that wait for them.

Launch, then collect (engine/loop.py): while a step is in flight its rows' slots are its own. They
are left out of planning (a stream's next chunk needs this one's caches), and an abort or a forced
final of their streams is applied when the step is collected: an abort then drops the step's results
and gives the slot back only once the step no longer writes its cache row; a forced final comes
after the step's tokens, where the sequential loop has it. One owner: the engine, on its thread.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .scheduler import Group
from .staging import LaunchedStep
from .stream import Stream


@dataclass
class InFlightStep:
    """A launched group, and what collecting it needs."""

    group: Group
    streams: list[Stream]  # the rows' streams, by identity: a result goes to the stream it was launched for
    launched: LaunchedStep
    started: float  # perf_counter at launch
    wall_started: float  # time.time() at launch


class InFlight:
    def __init__(self, num_slots: int) -> None:
        self.steps: list[InFlightStep] = []  # launched by the last iterate(), collected by the next
        self.flying = np.zeros(num_slots, dtype=bool)  # [S] slots of the steps in flight
        self._abort_reason: dict[int, str] = {}  # slot -> why its stream is aborted at collect
        self._owed_final: set[int] = set()  # slots whose stream gets a forced final at collect

    def take(self) -> list[InFlightStep]:
        """The steps in flight, to collect; the list starts again empty."""
        steps, self.steps = self.steps, []
        return steps

    def launched(self, step: InFlightStep, keep: bool) -> None:
        """`keep`: collected by the next iterate() (overlap), else right away by the caller."""
        self.flying[step.group.slots] = True
        if keep:
            self.steps.append(step)

    def landed(self, step: InFlightStep) -> None:
        self.flying[step.group.slots] = False

    def defer_abort(self, slot: int, reason: str) -> bool:
        """Whether the abort waits for the slot's step (then applied by `pop_abort`)."""
        if self.flying[slot]:
            self._abort_reason.setdefault(slot, reason)
        return bool(self.flying[slot])

    def defer_final(self, slot: int) -> bool:
        """Whether the forced final waits for the slot's step (then published by `pop_final`)."""
        if self.flying[slot]:
            self._owed_final.add(slot)
        return bool(self.flying[slot])

    def has_deferred(self) -> bool:
        """Some abort or forced final waits for a collect (else a collect need not ask per row)."""
        return bool(self._abort_reason or self._owed_final)

    def pop_abort(self, slot: int) -> str | None:
        """The reason of an abort deferred on `slot` (its forced final is moot then), or None."""
        reason = self._abort_reason.pop(slot, None)
        if reason is not None:
            self._owed_final.discard(slot)
        return reason

    def pop_final(self, slot: int) -> bool:
        owed = slot in self._owed_final
        self._owed_final.discard(slot)
        return owed

    def problems(self, held: np.ndarray) -> list[str]:
        """What disagrees with the slot table's `held` mask ([S] bool): empty when the books agree."""
        out = []
        stray = np.flatnonzero(self.flying & ~held).tolist()
        if stray:
            out.append(f"slots {stray} have a step in flight and no open stream")
        pending = sorted(set(self._abort_reason) | self._owed_final)
        if not all(self.flying[pending]):
            out.append(f"calls deferred on slots {pending}, not all of them in flight")
        return out

    def idle(self) -> bool:
        """Nothing in flight and nothing waiting for a collect."""
        return not self.steps and not self.flying.any() and not self._abort_reason and not self._owed_final
