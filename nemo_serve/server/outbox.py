"""One socket's outgoing side: a bounded queue, and what the client already holds of a segment.

Outbox: what waits to be written, in order. Its policy when the client reads slower than
results come (or not at all):
  1. interim results go first: a partial waiting behind an unsent partial of the same segment
     replaces it (the newer one carries everything the older one did, see PartialTail);
  2. past MAX_QUEUED messages (finals, ready, done) `put` refuses, and the session closes the
     stream with a reason (close 1008);
  3. a write that does not complete in --send-timeout-s closes it the same way (stream_session.py):
     that frees the slot whatever the ping setting.
A close jumps the queue: results that raced an error are dropped anyway.

PartialTail: a partial carries the segment from `token_offset` / `text_offset` on. While the
segment has at most WHOLE_PARTIAL_MAX_TOKENS tokens the offsets are 0 (the whole segment, as
before); beyond, they are what the client already received in earlier partials, so each
partial carries only what is new and a long segment costs linear, not quadratic, bytes.
Greedy RNN-T decoding only appends tokens, so what was sent stays true, and the segment text
(stripped) only grows at its end. Finals always carry the whole segment. Rejected: a cap with a
forced segment end, which changes where the finals split (and can split a word in two); the
offsets leave finals exactly as they were.
Owner: the event loop (the session's send task and the engine callback it schedules).
"""

from __future__ import annotations

import asyncio
from collections import deque

from ..engine.results import StreamResult

MAX_QUEUED = 64  # messages (other than the one coalesced partial) waiting for a slow client
WHOLE_PARTIAL_MAX_TOKENS = 256  # up to this, a partial carries the whole segment


class Outbox:
    def __init__(self, max_queued: int = MAX_QUEUED) -> None:
        self.max_queued = max_queued
        self.num_coalesced = 0  # partials replaced by newer ones before they were sent
        self._items: deque = deque()
        self._ready = asyncio.Event()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, item) -> bool:
        """Queue `item`; False when the queue is full (the caller closes the stream)."""
        if _is_partial(item) and self._items and _is_partial(self._items[-1]) and self._items[-1].segment == item.segment:
            self._items[-1] = item
            self.num_coalesced += 1
            return True
        if len(self._items) >= self.max_queued:
            return False
        self._items.append(item)
        self._ready.set()
        return True

    def put_first(self, item) -> None:
        """Queue `item` ahead of everything else, which is dropped (a close)."""
        self._items.clear()
        self._items.append(item)
        self._ready.set()

    async def get(self):
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        return self._items.popleft()


def _is_partial(item) -> bool:
    return isinstance(item, StreamResult) and not item.is_final


class PartialTail:
    """What the client holds of the current segment, from the partials already written."""

    def __init__(self, whole_max_tokens: int = WHOLE_PARTIAL_MAX_TOKENS) -> None:
        self.whole_max_tokens = whole_max_tokens
        self.segment = 0
        self.num_tokens = 0
        self.num_chars = 0

    def offsets(self, r: StreamResult) -> tuple[int, int]:
        """(token_offset, text_offset) for result `r`, about to be written."""
        if r.segment != self.segment:
            self.segment, self.num_tokens, self.num_chars = r.segment, 0, 0
        if r.is_final:  # the whole segment; the next one starts from nothing
            self.segment, self.num_tokens, self.num_chars = r.segment + 1, 0, 0
            return 0, 0
        held = (0, 0) if len(r.token_ids) <= self.whole_max_tokens else (self.num_tokens, self.num_chars)
        self.num_tokens, self.num_chars = len(r.token_ids), len(r.text)
        return held
