"""Which slots step next, and in which batched calls: array operations over per-slot state.

The loop thread tells the scheduler what it learns (a slot admitted, audio taken in, a chunk
stepped) and asks it for a plan over the slots that hold an open stream: that mask is the slot
table's (engine/slot_table.py, the one record of which streams are open), passed to `plan`, so a
released slot needs no word here and its row is reset when the slot is admitted again. Readiness,
the chunk each ready slot steps next, oldest-first order and grouping are numpy operations over the
open slots: no Python pass over every stream each iteration, so an iteration costs Python work only
for the streams that changed or step.

The rules are NeMo's loop's (see step.py for why calls cannot mix them):
- each stream has its own chunk mode (right context); streams of different modes never share a call;
- a first chunk is `first_frames` new frames (drop 0); first and later chunks never share a call;
- a later chunk is `chunk_frames` new frames; only a stream's final chunk may be shorter;
- at end of input, a tail shorter than NeMo's `sampling_frames` is not encoded (the stream is done).

Order: earliest deadline first. A chunk that became ready at t is due at t + its mode's chunk
duration (the next chunk of that stream is ready then; a stream stepped later than that falls
behind). At most `max_batch` chunks per plan, the earliest-due; ties go to the stream admitted
first. Modes are listed in the order of their earliest deadline, and within a mode first chunks
first; the engine steps the first mode's groups and plans again (loop.py). So under mixed load an 80 ms chunk,
due 80 ms after it is ready, goes before a 1120 ms chunk that became ready up to a second earlier:
a burst of long-chunk work waits (it has the slack) instead of starving the short-chunk streams.
With one mode this is oldest-ready first, as before.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .frontend import frames_available


@dataclass
class Group:
    """One batched encoder call: the chunks of the streams in `slots`, in plan order."""

    is_first: bool
    slots: np.ndarray  # [B] int64 slot rows
    t0: np.ndarray  # [B] first new feature frame of each chunk
    widths: np.ndarray  # [B] new feature frames (only a final chunk is shorter than the mode's)
    is_last: np.ndarray  # [B] bool: the stream's final chunk
    context_right: int | None = None  # the chunk mode every row shares

    def __len__(self) -> int:
        return len(self.slots)


class Scheduler:
    """Per-slot chunk positions and audio levels; plans the next batched calls. Loop thread only.
    A slot's row means something from `admit` until the slot is given back (then it is ignored)."""

    def __init__(self, geometry, num_slots: int, max_batch: int, margin_samples: int) -> None:
        self.g = geometry  # the default mode's; a slot may be admitted with another mode's
        self.max_batch = max_batch
        self.hop = geometry.hop_samples
        self.margin = margin_samples  # samples past a frame's centre that its window reads
        self.first_done = np.zeros(num_slots, bool)
        self.next_frame = np.zeros(num_slots, np.int64)  # first feature frame of the next chunk
        self.num_samples = np.zeros(num_slots, np.int64)  # samples absorbed
        self.finished = np.zeros(num_slots, bool)  # end of input absorbed
        self.ready_since = np.full(num_slots, math.inf)  # when the pending chunk became ready
        self.admit_seq = np.zeros(num_slots, np.int64)  # tie-break: earlier admission first
        # The slot's chunk mode: right context, chunk widths, shortest encodable tails, chunk duration.
        self.mode = np.zeros(num_slots, np.int64)
        self.first_w = np.zeros(num_slots, np.int64)
        self.chunk_w = np.zeros(num_slots, np.int64)
        self.min_first = np.zeros(num_slots, np.int64)
        self.min_later = np.zeros(num_slots, np.int64)
        self.period_s = np.zeros(num_slots, np.float64)
        self._seq = 0

    # ------------------------------------------------------------------ what the loop learns
    def admit(self, slot: int, geometry=None) -> None:
        """A stream got `slot`; `geometry`: its chunk mode (None: the default)."""
        g = geometry or self.g
        self.mode[slot] = g.context_right
        self.first_w[slot] = g.first_frames
        self.chunk_w[slot] = g.chunk_frames
        self.min_first[slot] = g.min_first_frames
        self.min_later[slot] = g.min_later_frames
        self.period_s[slot] = g.chunk_ms / 1000.0
        self.first_done[slot] = False
        self.next_frame[slot] = 0
        self.num_samples[slot] = 0
        self.finished[slot] = False
        self.ready_since[slot] = math.inf
        self._seq += 1
        self.admit_seq[slot] = self._seq

    def set_audio(self, slot: int, num_samples: int, finished: bool) -> None:
        self.num_samples[slot] = num_samples
        self.finished[slot] = finished

    def advance(self, group: Group) -> None:
        """The group's chunks were stepped."""
        s = group.slots
        self.next_frame[s] = group.t0 + group.widths
        self.first_done[s] = True
        self.ready_since[s] = math.inf

    def frames_available(self, slots: np.ndarray) -> np.ndarray:
        """Feature frames whose every input sample has arrived (all of them once input ended;
        NeMo's buffer then holds floor(L / hop) + 1 frames, the last one masked)."""
        return frames_available(self.num_samples[slots], self.finished[slots], self.hop, self.margin)

    # ------------------------------------------------------------------ the plan
    def plan(self, now: float, held: np.ndarray) -> tuple[list[Group], np.ndarray]:
        """(groups to step in order, slots whose input ended with nothing left to encode), over
        the slots `held` marks ([S] bool: the slot table's)."""
        act = np.flatnonzero(held)
        if act.size == 0:
            return [], act
        avail = self.frames_available(act)
        first = ~self.first_done[act]
        fin = self.finished[act]
        remaining = np.where(first, avail, avail - self.next_frame[act])
        full_width = np.where(first, self.first_w[act], self.chunk_w[act])
        min_width = np.where(first, self.min_first[act], self.min_later[act])
        full = remaining >= full_width
        ready = full | (fin & (remaining >= min_width))
        done = act[fin & ~ready]
        since = self.ready_since[act]
        since = np.where(ready, np.where(np.isinf(since), now, since), math.inf)
        self.ready_since[act] = since
        idx = np.flatnonzero(ready)
        if idx.size == 0:
            return [], done
        due = since[idx] + self.period_s[act[idx]]
        order = np.lexsort((self.admit_seq[act[idx]], due))[: self.max_batch]
        idx, due = idx[order], due[order]
        width = np.where(full[idx], full_width[idx], remaining[idx])
        t0 = np.where(first[idx], 0, self.next_frame[act[idx]])
        is_last = fin[idx] & (remaining[idx] == width)
        mode = self.mode[act[idx]]
        # One group per (mode, first/later). Modes in order of their earliest deadline (idx is sorted
        # by it); within a mode, first chunks first (a new stream's first result comes soonest).
        modes, firsts = np.unique(mode, return_index=True)
        groups = []
        for m in modes[np.argsort(firsts, kind="stable")].tolist():
            for is_first in (True, False):
                k = (mode == m) & (first[idx] == is_first)
                if k.any():
                    groups.append(Group(is_first, act[idx[k]], t0[k], width[k], is_last[k], m))
        return groups, done
