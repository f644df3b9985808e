"""The slot table: which stream holds each slot, and the one record of whether a stream is open.

A slot is a stream's cache row in the slot pool (engine/slots.py), its row in the scheduler's
arrays (engine/scheduler.py) and, in an engine core, the audio ring its front end was given
(core/shared.py): one index everywhere, recorded here only.

A stream's lifecycle in the engine is this table and nothing else: it is open from `take` to
`give_back`, and the engine opens its cache row and scheduler row in the same call as `take`
(admission) and closes them in the same call as `give_back` (release: its last result published, or
aborted). Everything happens on the loop thread, so there is no state in between: nothing is
admitted but not yet taken in, or ended but not yet released, when the engine returns. The
scheduler plans over `held`; the core routes audio and control by it. Why here and not in the
scheduler: this is what admission asks (is the slot free, is the id taken) and what the engine
core reads to find a slot's stream; the scheduler's per-slot arrays only mean something while the
slot is held, so they need no "open" flag of their own.

Who picks the slot is the caller's business: the engine core passes the one its front end
allocated in shared memory, the in-process engine (core/inproc.py) one from the same slot table
code in local memory.
Loop thread only: no lock.
"""

from __future__ import annotations

import numpy as np


class SlotTable:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._streams: list = [None] * num_slots  # slot -> Stream
        self._slot_of: dict[str, int] = {}  # stream_id -> slot
        self.held = np.zeros(num_slots, dtype=bool)  # [S] slots with an open stream: for array operations

    @property
    def num_used(self) -> int:
        return len(self._slot_of)

    @property
    def num_free(self) -> int:
        return self.num_slots - len(self._slot_of)

    def stream_at(self, slot: int):
        return self._streams[slot]

    @property
    def by_slot(self) -> list:
        """slot -> Stream or None, read-only: for loops over many slots (no call per slot)."""
        return self._streams

    def holds(self, stream) -> bool:
        """`stream` is open: admitted and not released (its slot may since hold another stream)."""
        return stream.slot is not None and self._streams[stream.slot] is stream

    def streams(self) -> list:
        return [s for s in self._streams if s is not None]

    def take(self, stream, slot: int) -> None:
        """`stream` now holds `slot`; ValueError for a stream id already held or a slot that is not free."""
        if stream.stream_id in self._slot_of:
            raise ValueError(f"stream id {stream.stream_id!r} is already open")
        if not 0 <= slot < self.num_slots or self._streams[slot] is not None:
            raise ValueError(f"slot {slot} is not free")
        self._streams[slot] = stream
        self._slot_of[stream.stream_id] = slot
        self.held[slot] = True
        stream.slot = slot

    def give_back(self, stream) -> None:
        slot = self._slot_of.pop(stream.stream_id)
        self._streams[slot] = None
        self.held[slot] = False

    def problems(self) -> list[str]:
        """What disagrees in the table (engine/invariants.py): empty when its books agree."""
        out = []
        used = [slot for slot, s in enumerate(self._streams) if s is not None]
        if used != np.flatnonzero(self.held).tolist():
            out.append(f"slots used {used}, marked held {np.flatnonzero(self.held).tolist()}")
        for slot in used:
            s = self._streams[slot]
            if self._slot_of.get(s.stream_id) != slot or s.slot != slot:
                out.append(f"slot {slot} holds stream {s.stream_id}, which says slot {s.slot}, the id map {self._slot_of.get(s.stream_id)}")
        if len(self._slot_of) != len(used):
            out.append(f"{len(self._slot_of)} stream ids held, {len(used)} slots used")
        return out
