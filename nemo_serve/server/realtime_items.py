"""The engine streams of one /v1/realtime session: one per committed span of audio.

A commit means "everything before this is one utterance" (OpenAI's semantics): the span's engine
stream is finished as an end of input is (the tail decoded with the same rule), and the audio
after it goes to a fresh engine stream, so each committed item equals NeMo's loop on its own
audio. A NIM client commits every packet as a flush; its session keeps one engine stream and
nim_items.py says where its items end. An item that holds a slot is a StreamSession
(stream_session.py): its engine stream, the audio pushed, the model's progress. At most
realtime.MAX_SLOTS_PER_SESSION of them at once. Owner: the event loop (realtime.RealtimeFormat).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .audio import AudioDecoder
from .stream_session import StreamSession


@dataclass
class ItemStream:
    """One engine stream of a session and the audio it was given."""

    number: int  # 0, 1, ... in the session's order
    decoder: AudioDecoder  # its own resampler: the span is resampled as if it were alone
    start_s: float = 0.0  # where its audio begins in the session's audio (model-rate seconds)
    session: StreamSession | None = None  # its engine stream's session; None while it waits for a slot
    waiting: list[np.ndarray] = field(default_factory=list)  # model-rate audio until a slot frees
    num_samples: int = 0  # model-rate samples pushed or waiting
    segment: int = 0  # the engine segment now being filled (the receive side's view)
    forced_at: list[int] = field(default_factory=list)  # NIM's forced ends (sample positions) while it waits for a slot
    finishing: bool = False  # committed, or input ended: decoded to its end, then released
    done: bool = False  # its last result came
    last: bool = False  # the session's input ended with it: its last item is `is_last_result`
    cleared_from: int | None = None  # engine segments from here on are not sent (clear)

    @property
    def processed_s(self) -> float:
        """Audio the model consumed (its results say)."""
        return 0.0 if self.session is None else self.session.processed_s

    @property
    def in_flight(self) -> bool:
        """Finished by the session, not yet by the model."""
        return self.finishing and not self.done


class SegmentKeys:
    """(stream number, engine segment) -> one session-wide segment number, in order of first
    use: results of two streams decoding at once then never share a segment number (the outbox
    coalesces partials by it, and items are keyed by it)."""

    def __init__(self) -> None:
        self._keys: dict[tuple[int, int], int] = {}
        self._next = 0
        self.key_to_stream: dict[int, ItemStream] = {}

    def key(self, item: ItemStream, segment: int) -> int:
        k = self._keys.get((item.number, segment))
        if k is None:
            k = self._keys[(item.number, segment)] = self._next
            self._next += 1
            self.key_to_stream[k] = item
        return k

    def forget(self, item: ItemStream) -> None:
        """Its results are all sent: drop its keys (a long session does not grow)."""
        for pair in [p for p in self._keys if p[0] == item.number]:
            self.key_to_stream.pop(self._keys.pop(pair), None)
