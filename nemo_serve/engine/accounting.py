"""What the engine holds: its open streams and free slots, how far behind real time it is, and the
accounting check that its books agree (engine/invariants.py). Mixed into `Engine` (engine/loop.py),
whose attributes it reads; between calls, on the thread that owns the engine."""

from __future__ import annotations

import time

import numpy as np

from .invariants import check
from .phrases import NO_BIASING


class AccountingMixin:
    """Engine properties and checks over what it holds (module docstring)."""

    @property
    def num_free_slots(self) -> int:
        return self.slots.num_free

    @property
    def num_open_streams(self) -> int:
        return self.slots.num_used

    @property
    def queue_delay_s(self) -> float:
        """How far behind real time the engine was in the last seconds (queue_delay.py)."""
        return self.queue_delay.value(time.time())

    def open_by_mode(self) -> dict[int, int]:
        """Open streams, by chunk mode (right context)."""
        modes = [s.context_right for s in self.slots.streams()]
        return {r: modes.count(r) for r in sorted(set(modes))}

    @property
    def loop_stream_ids(self) -> list[str]:
        """Ids of the open streams."""
        return [s.stream_id for s in self.slots.streams()]

    def check_accounting(self) -> int:
        """Raise AccountingError unless the books that remain agree (engine/invariants.py): the
        slot table (each open stream under its own slot and id, the held mask the same slots), the
        scheduler row of each open slot in its stream's chunk mode, the boosted cache rows exactly
        the open streams' with phrases, the phrase count their phrases, a step in flight only on open
        streams and calls deferred to a collect only on slots in flight, and (diarizer served) the
        diarizer's slots and waiting results only for its streams (engine/speakers.py). Returns the open
        streams (each holds a cache row). Between calls, on the owning thread."""
        for problem in self.slots.problems():
            check(False, problem)
        streams = self.slots.streams()
        slots = [s.slot for s in streams]
        modes = self.scheduler.mode[slots].tolist()
        wrong = [s.stream_id for s, mode in zip(streams, modes) if mode != s.context_right]
        check(not wrong, f"streams {wrong} have a scheduler row of another chunk mode")
        boosted = set(np.flatnonzero(self.pool.boosted[: self.num_slots]).tolist())
        want = {s.slot for s in streams if s.biasing_id != NO_BIASING}
        check(boosted == want, f"cache rows {sorted(boosted)} boosted, streams with phrases on {sorted(want)}")
        phrases = sum(len(s.phrases.phrases) for s in streams if s.phrases)
        check(phrases == self._num_phrases, f"{self._num_phrases} boosted phrases counted, the open streams hold {phrases}")
        for problem in self.in_flight.problems(self.slots.held):
            check(False, problem)
        stray = [slot for slot in self.forced_ends.pending() if not self.slots.held[slot]]
        check(not stray, f"forced finals pending on free slots {stray}")
        if self.speakers is not None:  # the diarizer's slots and the results waiting for speakers
            diarized = {s.stream_id for s in streams if s.diarized}
            plain = {s.stream_id for s in streams if not s.diarized}
            for problem in [*self.diarizer.problems(), *self.speakers.problems(diarized, plain)]:
                check(False, problem)
        return len(streams)
