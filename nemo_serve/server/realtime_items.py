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


# A detector onset may come this long after the time of the first token the model gives its speech
# (the detector needs a 32 ms window above threshold; a token's time is its 80 ms encoder frame's
# start, and a word's first token may sit a frame or two before the onset the detector hears).
ONSET_AFTER_TOKEN_S = 0.32


@dataclass
class Turn:
    """A span of speech the detector heard, announced by speech_started with the id of the item
    that will hold it. The engine's endpointer, not the detector, ends items, and the receive side
    reads audio ahead of the engine, so which segment holds the speech is known only when the
    segment's results come: the segment then claims the turn (claim_turn). A turn no segment
    claims gets an empty item of its own (an orphan: noise the model decoded to nothing, or a
    second turn whose words the endpointer kept in the item before), so that every id announced is
    committed and completed, as OpenAI's server commits every turn its VAD ends."""

    item_id: str
    onset_s: float  # on the session's audio clock
    stop_s: float | None = None  # None: speech still on
    claimed: bool = False


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
    turns: list[Turn] = field(default_factory=list)  # the detector's turns that began in its audio, in order

    @property
    def processed_s(self) -> float:
        """Audio the model consumed (its results say)."""
        return 0.0 if self.session is None else self.session.processed_s

    @property
    def in_flight(self) -> bool:
        """Finished by the session, not yet by the model."""
        return self.finishing and not self.done


def claim_turn(item: ItemStream, first_token_s: float | None) -> tuple[Turn | None, list[Turn]]:
    """An engine segment of `item` is named (its first text, or a commit): the turn it holds, and
    the unclaimed turns before that one (orphans: no later segment can hold them). The turn is the
    last unclaimed one that began by the segment's first token (session clock), or, with no token
    (a commit), the first unclaimed one; None: the detector heard no speech for it."""
    unclaimed = [t for t in item.turns if not t.claimed]
    if first_token_s is None:
        began = unclaimed[:1]
    else:
        began = [t for t in unclaimed if t.onset_s <= first_token_s + ONSET_AFTER_TOKEN_S]
    _claim(item, began)
    return (began[-1], began[:-1]) if began else (None, [])


def ended_turns(item: ItemStream, end_s: float | None) -> list[Turn]:
    """Orphans: the unclaimed turns of `item` that ended by `end_s` (a segment's end on the session
    clock, after it claimed its own; None: the stream is done, every turn has ended)."""
    ended = [t for t in item.turns if not t.claimed and (end_s is None or (t.stop_s is not None and t.stop_s <= end_s))]
    _claim(item, ended)
    return ended


def _claim(item: ItemStream, turns: list[Turn]) -> None:
    """Mark them claimed and drop them from the stream's list (a NIM session's one stream lives as
    long as the session: its list holds only the turns still unclaimed)."""
    for t in turns:
        t.claimed = True
    if turns:
        item.turns = [t for t in item.turns if not t.claimed]


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
