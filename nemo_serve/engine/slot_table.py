"""The slot table: which stream holds each slot. A slot is a stream's cache row in the slot pool
(engine/slots.py), its row in the scheduler's arrays (engine/scheduler.py) and, in an engine core,
the audio ring its front end was given (core/shared.py): one index everywhere, recorded here only.

A slot is taken at admission (any thread: the caller holds the engine's admission lock) and given
back when the loop releases the stream, so a full engine refuses at once. The engine core passes
the slot its front end allocated in shared memory (free here too: the core frees a shared slot only
after the engine released it); the in-process engine takes the lowest free one.
"""

from __future__ import annotations

import numpy as np

from .errors import NoFreeSlotError


class SlotTable:
    """Guarded by the engine's admission lock; `held` and `stream_at` are read by the loop thread,
    whose own releases are the only changes to a slot it holds."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._streams: list = [None] * num_slots  # slot -> Stream
        self._slot_of: dict[str, int] = {}  # stream_id -> slot
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # stack: lowest slot first
        self.held = np.zeros(num_slots, dtype=bool)  # [S] slots with a stream: for array operations

    @property
    def num_used(self) -> int:
        return len(self._slot_of)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def stream_at(self, slot: int):
        return self._streams[slot]

    @property
    def by_slot(self) -> list:
        """slot -> Stream or None, read-only: for loops over many slots (no call per slot)."""
        return self._streams

    def holds(self, stream_id: str) -> bool:
        return stream_id in self._slot_of

    def streams(self) -> list:
        return [s for s in self._streams if s is not None]

    def take(self, stream, slot: int | None = None) -> int:
        """`stream` now holds `slot` (None: the lowest free one); NoFreeSlotError when none is free,
        ValueError for a stream id already held or a slot that is not free."""
        if stream.stream_id in self._slot_of:
            raise ValueError(f"stream id {stream.stream_id!r} is already open")
        if slot is None:
            if not self._free:
                raise NoFreeSlotError(f"all {self.num_slots} slots are in use")
            slot = self._free.pop()
        elif not 0 <= slot < self.num_slots or self._streams[slot] is not None:
            raise ValueError(f"slot {slot} is not free")
        else:
            self._free.remove(slot)  # O(free slots): once per stream, not per step
        self._streams[slot] = stream
        self._slot_of[stream.stream_id] = slot
        self.held[slot] = True
        stream.slot = slot
        return slot

    def give_back(self, stream) -> None:
        slot = self._slot_of.pop(stream.stream_id)
        self._streams[slot] = None
        self.held[slot] = False
        self._free.append(slot)

    def problems(self) -> list[str]:
        """What disagrees in the table (engine/invariants.py): empty when its books agree."""
        out = []
        used = [slot for slot, s in enumerate(self._streams) if s is not None]
        if len(used) + len(self._free) != self.num_slots or set(used) & set(self._free) or len(set(self._free)) != len(self._free):
            out.append(f"slots used {used} and free {sorted(self._free)} do not partition {self.num_slots} slots")
        if used != np.flatnonzero(self.held).tolist():
            out.append(f"slots used {used}, marked held {np.flatnonzero(self.held).tolist()}")
        for slot in used:
            s = self._streams[slot]
            if self._slot_of.get(s.stream_id) != slot or s.slot != slot:
                out.append(f"slot {slot} holds stream {s.stream_id}, which says slot {s.slot}, the id map {self._slot_of.get(s.stream_id)}")
        if len(self._slot_of) != len(used):
            out.append(f"{len(self._slot_of)} stream ids held, {len(used)} slots used")
        return out
