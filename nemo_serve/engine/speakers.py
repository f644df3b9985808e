"""Speakers on a diarized stream's results: its updates held until the diarizer has reached them.

One owner: `SpeakerAttacher` owns, per diarized stream, the updates the ASR model produced that
wait for speakers, the speaker tally of the open segment, and the stream's release while updates
wait; only the engine's loop thread calls it. Plain streams never enter it.

The diarizer reports later than the ASR model (its chunk plus look-ahead, 1.04 s at the model
card's low-latency setting, against 80 ms to 1.12 s of ASR chunk), so an update is published once
the diarizer has covered the time of its last token: then each new token gets the speaker the
diarizer found most probable at the token's time (`new_token_speakers`, mapped by frame time: ASR
encoder frame x ASR frame seconds -> diarizer frame), and a final gets the speaker of most of its
segment's tokens (`speaker`, None for a segment without tokens). An update without tokens that
is not the stream's last waits only for the updates before it (order is kept per stream); the
last waits until the diarizer has stepped all of the stream's audio. The rejected alternative, a
separate speaker message the front end joins with the words, would leave finals without a
speaker and every protocol adapter to join them.

A stream released while updates wait (its input ended: the ASR side is done first) keeps its
release here until they are out: the front end frees the slot only on the release, so the slot is
not reused meanwhile. An aborted stream's waiting updates are dropped with it.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from .outputs import ReleasedStream
from .results import StreamUpdate


@dataclass(frozen=True)
class DiarizationRequest:
    """A stream's `diarization` option, checked."""

    max_speakers: int  # speakers reported: 0 .. max_speakers - 1
    split_on_speaker_change: bool = False  # not served yet: refused (docs/diarization.md)


def check_diarization(value: dict | None, num_speakers: int | None) -> DiarizationRequest | None:
    """The stream's `diarization` option ({"max_speakers": N}) checked before any work, or
    ValueError: asked of a server without a diarizer (`num_speakers` None: the front ends read it
    from ModelInfo), unknown keys, N outside the diarizer's 1..num_speakers. Pure, no torch."""
    if value is None:
        return None
    if num_speakers is None:
        raise ValueError("diarization: this server has no diarizer loaded (start it with --diarizer)")
    if not isinstance(value, dict):
        raise ValueError(f"diarization must be an object such as {{\"max_speakers\": 2}}, got {value!r}")
    unknown = sorted(set(value) - {"max_speakers", "split_on_speaker_change"})
    if unknown:
        raise ValueError(f"diarization: unknown option(s) {unknown}; known: max_speakers, split_on_speaker_change")
    max_speakers = value.get("max_speakers", num_speakers)
    if isinstance(max_speakers, bool) or not isinstance(max_speakers, int) or not 1 <= max_speakers <= num_speakers:
        raise ValueError(f"diarization.max_speakers must be an integer from 1 to {num_speakers} "
                         f"(the diarizer's speakers), got {max_speakers!r}")  # fmt: skip
    split = value.get("split_on_speaker_change", False)
    if split is not False:
        raise ValueError("diarization.split_on_speaker_change is not supported yet")
    return DiarizationRequest(max_speakers)


@dataclass
class _Waiting:
    updates: deque = field(default_factory=deque)  # (StreamUpdate, slot), oldest first
    tally: Counter = field(default_factory=Counter)  # speaker -> tokens, in the open segment
    release: ReleasedStream | None = None  # held until `updates` is empty


class SpeakerAttacher:
    def __init__(self, diarizer, asr_frame_s: float) -> None:
        self.diarizer = diarizer  # diarization/runner.py SortformerRunner
        self.asr_frame_s = asr_frame_s
        self._streams: dict[str, _Waiting] = {}  # stream_id -> its waiting updates, while diarized

    def open(self, stream_id: str) -> None:
        self._streams[stream_id] = _Waiting()

    def holds(self, stream_id: str) -> bool:
        return stream_id in self._streams

    def __bool__(self) -> bool:
        return bool(self._streams)

    def hold(self, update: StreamUpdate, slot: int) -> None:
        self._streams[update.stream_id].updates.append((update, slot))

    def hold_release(self, released: ReleasedStream) -> None:
        self._streams[released.stream_id].release = released

    def drop(self, stream_id: str) -> None:
        """An aborted stream: nothing more is published for it (its release goes out at once)."""
        self._streams.pop(stream_id, None)
        self.diarizer.close(stream_id)

    def publish(self, updates: list, slots: list, released: list) -> None:
        """Append every update whose speakers are known (in order per stream), and each stream's
        release once nothing of it waits; the diarizer lets such a stream go."""
        for stream_id in list(self._streams):
            waiting = self._streams[stream_id]
            while waiting.updates and self._attach(waiting, waiting.updates[0][0]):
                update, slot = waiting.updates.popleft()
                updates.append(update)
                slots.append(slot)
            if waiting.release is not None and not waiting.updates:
                released.append(waiting.release)
                del self._streams[stream_id]
                self.diarizer.close(stream_id)

    def _attach(self, waiting: _Waiting, u: StreamUpdate) -> bool:
        """Set the update's speakers if the diarizer has reached them; False if not yet."""
        if u.done and not self.diarizer.is_done(u.stream_id):
            return False
        speakers = [self.diarizer.speaker_at(u.stream_id, f * self.asr_frame_s) for f in u.new_token_frames]
        if None in speakers:
            return False
        u.new_token_speakers = speakers
        waiting.tally.update(speakers)
        if u.is_final:
            u.speaker = min(waiting.tally, key=lambda k: (-waiting.tally[k], k)) if waiting.tally else None
            waiting.tally.clear()
        return True
