"""Positional forced finals: a segment ends after the stream's whole chunks before a given sample,
however far ahead of or behind the engine the request was (NIM's force_eou, issue 45).

A forced final without a position (/ws's `force_final`) ends the segment wherever the engine is
when the call arrives. A client that says "end the utterance after this audio" needs the end at
that audio: a front end that waited for the results to catch up and then called force_final lost
the end, or put it late, whenever the engine decoded past the point before the front end heard of
it (a fast sender, a loaded core). So the request carries the sample; the engine turns it into a
feature frame (geometry.whole_chunk_frames: the whole chunks before it, as a continuing stream
steps them) and ends the segment right after the step that reaches that frame. The front end
sends it before any audio past the point, so the engine sees it before it can step past.

A forced end closes what was said before its point. When an endpoint or an <EOU> token already
closed it and nothing was said since, there is nothing to close: no final (`closes_speech`), the
segment goes on from where the speech ended. An empty final there reached no client (NIM's
renderer drops empty finals, and would else overwrite the final NVIDIA's client keeps) and only
moved the segment's start, so the endpointer's rules and the next item's start depended on a
no-op. The stream's first segment is the exception: nothing was ever closed, so a forced end
there answers with a final, empty or not, as /ws's force_final does. Decided per segment, on
decoded tokens, never on timing: the same audio and points give the same finals.

Owner: the engine (engine/loop.py), on its thread. Per slot, the nearest target is an array entry,
so a collect finds its due rows with one comparison over the group (STYLE 14); later targets of
the same stream wait in a deque (rare: a client forcing again before the engine got there).
"""

from __future__ import annotations

import bisect
from collections import deque

import numpy as np

NONE = np.iinfo(np.int64).max  # no forced end pending on the slot


def closes_speech(segment: int, has_text: bool) -> bool:
    """Whether a positional forced end publishes a final for the stream's current segment:
    it has tokens, or it is the stream's first (module docstring)."""
    return has_text or segment == 0


class ForcedEnds:
    def __init__(self, num_slots: int) -> None:
        self.next_frame = np.full(num_slots, NONE, np.int64)  # [S] the nearest target (a feature frame)
        self._later: dict[int, deque[int]] = {}  # slot -> targets after the nearest, in order

    def open(self, slot: int) -> None:
        """A new stream on `slot` (admission and release both call it: nothing stale survives)."""
        self.next_frame[slot] = NONE
        self._later.pop(slot, None)

    def add(self, slot: int, frame: int) -> None:
        """A target, kept in order: each point ends a segment in the audio's order, whatever order
        the calls came in (engine.force_final is the engine's API; our NIM front end sends them in
        order, another caller need not). Rejected: refusing one out of order, which would make a
        caller's end depend on the order of two calls that say the same about the audio."""
        nearest = int(self.next_frame[slot])
        if frame == nearest:
            return  # the same point: one final
        if frame < nearest:  # the nearest (NONE is above every frame: the first target lands here)
            if nearest != NONE:
                self._later.setdefault(slot, deque()).appendleft(nearest)
            self.next_frame[slot] = frame
            return
        later = self._later.setdefault(slot, deque())
        i = bisect.bisect_left(later, frame)
        if i == len(later) or later[i] != frame:
            later.insert(i, frame)

    def due(self, slots: np.ndarray, next_frames: np.ndarray) -> np.ndarray:
        """Rows ([B] bool) whose step reached their slot's nearest target."""
        return next_frames >= self.next_frame[slots]

    def take(self, slot: int, reached_frame: int) -> None:
        """The targets up to `reached_frame` are met (one final ends them all)."""
        later = self._later.get(slot)
        while later and later[0] <= reached_frame:
            later.popleft()
        self.next_frame[slot] = later.popleft() if later else NONE
        if not later:
            self._later.pop(slot, None)

    def pending(self) -> list[int]:
        """Slots with a target (the engine's books: none on a free slot)."""
        return np.flatnonzero(self.next_frame != NONE).tolist()
