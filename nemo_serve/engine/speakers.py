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
last waits until the diarizer has stepped all of the stream's audio. A forced final (a client's
force_final) does not wait: it and the updates before it go out in the same iteration, tokens the
diarizer has not reached attributed to the speaker of its latest frame, 0 before any (`_attach_known`). The rejected alternative, a
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
    split_on_speaker_change: bool = False  # a speaker change ends the segment (SpeakerAttacher._split)


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
    if not isinstance(split, bool):
        raise ValueError(f"diarization.split_on_speaker_change must be true or false, got {split!r}")
    return DiarizationRequest(max_speakers, split)


@dataclass
class _Waiting:
    updates: deque = field(default_factory=deque)  # (StreamUpdate, slot), oldest first
    tally: Counter = field(default_factory=Counter)  # speaker -> tokens, in the open segment
    release: ReleasedStream | None = None  # held until `updates` is empty
    split: bool = False  # end a segment where the speaker changes
    last_speaker: int | None = None  # of the open segment's last token (split only)
    segments_added: int = 0  # finals this attacher added (split): later segment numbers shift by it
    split_start_frame: int | None = None  # where the open segment starts, if a split started it
    asr_s: float = 0.0  # how far the ASR model has stepped: its later tokens are at or after it


class SpeakerAttacher:
    def __init__(self, diarizer, asr_frame_s: float) -> None:
        self.diarizer = diarizer  # diarization/runner.py SortformerRunner
        self.asr_frame_s = asr_frame_s
        self._streams: dict[str, _Waiting] = {}  # stream_id -> its waiting updates, while diarized

    def open(self, stream_id: str, split_on_speaker_change: bool = False) -> None:
        self._streams[stream_id] = _Waiting(split=split_on_speaker_change)

    def holds(self, stream_id: str) -> bool:
        return stream_id in self._streams

    def __bool__(self) -> bool:
        return bool(self._streams)

    def hold(self, update: StreamUpdate, slot: int) -> None:
        waiting = self._streams[update.stream_id]
        waiting.updates.append((update, slot))
        waiting.asr_s = max(waiting.asr_s, update.audio_processed_s)

    def hold_release(self, released: ReleasedStream) -> None:
        self._streams[released.stream_id].release = released

    def drop(self, stream_id: str) -> None:
        """An aborted stream: nothing more is published for it (its release goes out at once)."""
        self._streams.pop(stream_id, None)
        self.diarizer.close(stream_id)

    def problems(self, diarized: set[str], plain: set[str]) -> list[str]:
        """What disagrees between the attacher, the diarizer and the engine's open streams
        (`diarized`, `plain`: their ids; Engine.check_accounting): the attacher and the diarizer
        hold the same streams; every open diarized stream is held; a stream the ASR side let go
        waits with its release (else nothing would ever release it: a leaked diarizer slot); an
        open one has none yet; no plain stream is held."""
        held, found = set(self._streams), []
        if held != set(self.diarizer.streams):
            found.append(f"speakers held for {sorted(held)}, the diarizer has {sorted(self.diarizer.streams)}")
        if diarized - held:
            found.append(f"diarized streams {sorted(diarized - held)} open without their speakers' books")
        if held & plain:
            found.append(f"plain streams {sorted(held & plain)} held for speakers")
        stranded = sorted(i for i in held - diarized if self._streams[i].release is None)
        if stranded:
            found.append(f"streams {stranded} released by the engine hold diarizer slots with no release waiting")
        early = sorted(i for i in held & diarized if self._streams[i].release is not None)
        if early:
            found.append(f"open streams {early} already have a release waiting")
        return found

    def publish(self, updates: list, slots: list, released: list) -> None:
        """Append every update whose speakers are known (in order per stream), and each stream's
        release once nothing of it waits; the diarizer lets such a stream go."""
        for stream_id in list(self._streams):
            waiting = self._streams[stream_id]
            forced = _through_last_forced_final(waiting.updates)
            while waiting.updates and (self._attach(waiting.updates[0][0]) or forced > 0):
                if forced > 0 and waiting.updates[0][0].new_token_speakers is None:
                    self._attach_known(waiting.updates[0][0])
                forced -= 1
                update, slot = waiting.updates.popleft()
                for part in self._split(waiting, update) if waiting.split else (update,):
                    self._close_segment_if_final(waiting, part)
                    updates.append(part)
                    slots.append(slot)
            if waiting.release is not None and not waiting.updates:
                released.append(waiting.release)
                del self._streams[stream_id]
                self.diarizer.close(stream_id)
            else:
                self.diarizer.forget_before(stream_id, self._first_time_needed(waiting))

    def _first_time_needed(self, waiting: _Waiting) -> float:
        """The earliest time a token still to be attached can have: the first waiting token's, or
        (none waits) where the ASR model has stepped to, one diarizer frame early for rounding.
        This bounds what the diarizer keeps per stream to the frames between the older of the two
        and its own position, however long the stream (docs/diarization.md)."""
        times = [f * self.asr_frame_s for u, _ in waiting.updates for f in u.new_token_frames[:1]]
        return max(0.0, min([waiting.asr_s, *times]) - self.diarizer.frame_s)

    def _attach(self, u: StreamUpdate) -> bool:
        """Set the update's token speakers if the diarizer has reached them; False if not yet."""
        if u.done and not self.diarizer.is_done(u.stream_id):
            return False
        speakers = [self.diarizer.speaker_at(u.stream_id, f * self.asr_frame_s) for f in u.new_token_frames]
        if None in speakers:
            return False
        u.new_token_speakers = speakers
        return True

    def _attach_known(self, u: StreamUpdate) -> None:
        """A forced final (and the updates before it) out now, with what the diarizer knows: each
        token it has reached gets its speaker, each later one the speaker of the diarizer's latest
        frame, or speaker 0 before its first chunk: Sortformer numbers speakers in the order they
        first speak, so the stream's first voice is 0 (and the wire types a speaker as an integer).
        Waiting would hold a client's force_final until later audio or the end of input; stepping
        the diarizer on the audio there is would cut a chunk short and change the stream's state
        from NeMo's, so later speakers would no longer be exact."""
        latest = self.diarizer.latest_speaker(u.stream_id)
        latest = 0 if latest is None else latest
        at = [self.diarizer.speaker_at(u.stream_id, f * self.asr_frame_s) for f in u.new_token_frames]
        u.new_token_speakers = [latest if speaker is None else speaker for speaker in at]

    @staticmethod
    def _close_segment_if_final(waiting: _Waiting, u: StreamUpdate) -> None:
        """Count the update's speakers into its segment's tally; a final gets the segment's speaker."""
        waiting.tally.update(u.new_token_speakers)
        if u.is_final:
            u.speaker = min(waiting.tally, key=lambda k: (-waiting.tally[k], k)) if waiting.tally else None
            waiting.tally.clear()

    @staticmethod
    def _split(waiting: _Waiting, u: StreamUpdate) -> list[StreamUpdate]:
        """`u` cut before each token whose speaker differs from the token before it in its segment:
        a final (end_reason "speaker_change") closes the segment there, the next one starts at that
        token's frame. The engine's later segment numbers and starts are shifted to match."""
        segment = u.segment + waiting.segments_added
        start = u.segment_start_frame if waiting.split_start_frame is None else waiting.split_start_frame
        parts, first = [], 0
        for i, speaker in enumerate(u.new_token_speakers):
            if waiting.last_speaker is not None and speaker != waiting.last_speaker:
                parts.append(_cut(u, first, i, segment, start))
                segment, start, first = segment + 1, u.new_token_frames[i], i
                waiting.segments_added += 1
                waiting.split_start_frame = start
            waiting.last_speaker = speaker
        u.segment, u.segment_start_frame = segment, start  # the rest: what the engine made of it
        if first:
            u.new_token_ids, u.new_token_frames = u.new_token_ids[first:], u.new_token_frames[first:]
            u.new_token_speakers = u.new_token_speakers[first:]
            if u.new_token_confidences is not None:
                u.new_token_confidences = u.new_token_confidences[first:]
        if u.is_final:  # the engine's next segment starts where the engine says
            waiting.last_speaker = waiting.split_start_frame = None
        return [*parts, u]


def _through_last_forced_final(updates: deque) -> int:
    """How many of the waiting updates, oldest first, end with the last forced final (0 if none)."""
    for i in range(len(updates) - 1, -1, -1):
        if updates[i][0].is_final and updates[i][0].end_reason == "force_final":
            return i + 1
    return 0


def _cut(u: StreamUpdate, lo: int, hi: int, segment: int, start_frame: int) -> StreamUpdate:
    """Tokens [lo, hi) of `u` as the final of segment `segment`, ended by a speaker change."""
    return StreamUpdate(
        stream_id=u.stream_id, segment=segment, is_final=True, done=False, new_token_ids=u.new_token_ids[lo:hi],
        new_token_frames=u.new_token_frames[lo:hi], segment_start_frame=start_frame,
        audio_processed_s=u.audio_processed_s, audio_arrival_time=u.audio_arrival_time,
        new_token_confidences=u.new_token_confidences[lo:hi] if u.new_token_confidences is not None else None,
        end_reason="speaker_change", new_token_speakers=u.new_token_speakers[lo:hi],
    )  # fmt: skip
