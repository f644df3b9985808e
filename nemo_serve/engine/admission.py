"""Streams in: a stream's options checked, its admission, its audio, end of input, a forced final,
an abort, and its release (engine/loop.py's module docstring: every call acts at once, on the thread
that owns the engine). Mixed into `Engine` (engine/loop.py), whose attributes it uses: a mixin, not
functions over an engine, so the Engine's public methods stay where callers and tests find them."""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass

import numpy as np

from .biasing import BiasingRegistry
from .endpoint import EndpointConfig
from .geometry import whole_chunk_frames
from .forced_ends import closes_speech
from .frontend import AudioBuffer
from .outputs import ReleasedStream
from .phrases import NO_BIASING, PhraseRequest, check_phrases
from .speakers import DiarizationRequest, check_diarization
from .stream import Stream

# The engine's logger, as before these methods left engine/loop.py: one name for its messages.
log = logging.getLogger("nemo_serve.engine.loop")


@dataclass(frozen=True)
class StreamOptions:
    """A stream's options, checked (`Engine.check_options`): what admission builds it from."""

    language_index: int
    context_right: int  # the chunk mode, resolved (a served one)
    phrases: PhraseRequest
    diarization: DiarizationRequest | None = None  # speakers asked for (engine/speakers.py)



class AdmissionMixin:
    """Engine methods that open, feed and close streams (module docstring)."""

    def check_options(
        self,
        *,
        language: str | None = None,
        language_index: int | None = None,
        context_right: int | None = None,
        phrases: list[str] | None = None,
        boost: float | None = None,
        diarization: dict | None = None,
    ) -> StreamOptions:
        """A stream's options checked, or ValueError: a bad language, a chunk mode `context_right`
        the engine does not serve (the message lists those it does), bad `phrases` / `boost`
        (over a limit, or not spelled by the tokenizer), `diarization` asked of a server without a
        diarizer or malformed (engine/speakers.py). Pure: reads only the model and the
        limits, so any thread may call it (the harness does, in the caller's thread)."""
        lang = self.model.language_index(language) if language_index is None else language_index
        mode = self.model.geometry_for(context_right).context_right
        return StreamOptions(lang, mode, self.check_phrases(phrases, boost), check_diarization(diarization, self.model_info.num_speakers))

    def check_phrases(self, phrases: list[str] | None, boost: float | None) -> PhraseRequest:
        """The stream's phrases checked against the limits and the tokenizer (no <unk>)."""
        request = check_phrases(phrases, boost, self.phrase_limits, self.encodable, self.model.is_bpe)
        tokenizer = getattr(self.model.nemo, "tokenizer", None)
        unk = getattr(tokenizer, "unk_id", None)
        for phrase in request.phrases if tokenizer is not None else ():
            if unk is not None and unk in tokenizer.text_to_ids(phrase):
                raise ValueError(f"phrase {phrase!r} has characters the model cannot spell")
        return request

    def phrase_total_error(self, held: int, request: PhraseRequest) -> str | None:
        """Why `request` would take the open streams' phrases (`held` of them) over the server's
        limit, or None."""
        if request and held + len(request.phrases) > self.phrase_limits.max_phrases_total:
            return f"the server holds {held} boosted phrases; at most {self.phrase_limits.max_phrases_total} in all"
        return None

    def admit(
        self,
        *,
        slot: int,
        stream_id: str | None = None,
        language: str | None = None,
        language_index: int | None = None,
        endpoint: EndpointConfig | None = None,
        context_right: int | None = None,
        phrases: list[str] | None = None,
        boost: float | None = None,
        diarization: dict | None = None,
    ) -> Stream:
        """Open a stream on `slot` (free: the caller allocated it, as a front end does in shared
        memory): the slot, its cache row and its scheduler row at once. ValueError as
        `check_options`, for the server's phrase total, a stream id already open or a slot that
        is not free. Its results come out of `iterate()`."""
        options = self.check_options(language=language, language_index=language_index, context_right=context_right,
                                     phrases=phrases, boost=boost, diarization=diarization)  # fmt: skip
        request = options.phrases
        error = self.phrase_total_error(self._num_phrases, request)
        if error is not None:
            raise ValueError(error)
        stream = Stream(
            stream_id=stream_id or uuid.uuid4().hex,
            language_index=options.language_index,
            endpoint_config=endpoint or self.endpoint,
            frame_s=self.geometry.encoder_frame_s,
            context_right=options.context_right,
            phrases=request,
            audio=self._audio_buffer(self._audio_capacity(self.model.geometries[options.context_right])),
        )
        if options.diarization is not None:  # before the slot is taken: a refusal must leave nothing held
            self.diarizer.check_open(stream.stream_id)
        self.slots.take(stream, slot)
        if options.diarization is not None:  # its diarizer slot: one per engine slot, so one is free
            self.diarizer.open(stream.stream_id, options.diarization.max_speakers)
            self.speakers.open(stream.stream_id, options.diarization.split_on_speaker_change)
            stream.diarized = True
        tree_state = 0
        if request:  # checked above: the tree builds
            stream.biasing_id, tree_state = self._biasing().acquire(request)
        self.runner.open_row(slot, language_index=stream.language_index, biasing_id=stream.biasing_id, tree_state=tree_state)
        self.scheduler.admit(slot, self.model.geometries[stream.context_right])
        self.last_packet.open(slot)
        self._due[slot] = -np.inf
        self.forced_ends.open(slot)
        self._num_phrases += len(request.phrases)
        return stream

    def _audio_buffer(self, capacity: int) -> AudioBuffer:
        """A new stream's buffer on a row of the arena (engine/frontend.py AudioArena)."""
        return AudioBuffer(capacity, storage=self.audio_arena.take(capacity))

    def _audio_capacity(self, g) -> int:
        """Samples a stream's buffer holds (engine/frontend.py AudioBuffer): two chunks (or a first
        chunk) and the history a chunk reads, so a stream at real-time pace compacts now and then
        and never reallocates; at least one second (80 ms chunks compact every ten or so steps)."""
        history = g.pre_cache_frames * g.hop_samples + 2 * self.features.margin
        return max(16000, 2 * max(g.chunk_frames, g.first_frames) * g.hop_samples + history)

    def _biasing(self) -> BiasingRegistry:
        """The registry, made with the first boosted stream (its multi-model holds device memory)."""
        if self.pool.biasing is None:
            blank = self.model.blank_id  # nemo_private.blank_index, read at load
            self.pool.biasing = BiasingRegistry(self.model.nemo.tokenizer, blank, self.model.device)
        return self.pool.biasing

    def take_audio(self, stream: Stream, parts: tuple[np.ndarray, ...], arrived: float) -> None:
        """Float32 samples, in one or two pieces (a wrapped ring), into an open stream's buffer
        (one copy: the caller may reuse `parts` once this returns) and the scheduler. `arrived`:
        when they reached the server, so latency counts any wait before the engine got them."""
        self.take_audio_many(np.array([stream.slot], dtype=np.int64), [parts], [arrived])

    def take_audio_many(self, slots: np.ndarray, parts: list[tuple[np.ndarray, ...]], arrivals: list[float]) -> None:
        """`take_audio` for the open streams on `slots` ([N] int64), one call per iteration: the
        samples into each stream's buffer, the scheduler's sample counts and the last packets
        (engine/collect.py) set in array stores. Each buffer may drop the samples before the first
        one its stream's next chunk reads (the scheduler's next frame, with the pre-encode history
        before it: nothing in flight reads them, its features were computed at launch)."""
        by_slot, num_samples = self.slots.by_slot, []
        before = self.scheduler.num_samples[slots]
        keep_from = self.features.first_sample_needed(self.scheduler.next_frame[slots] - self.geometry.pre_cache_frames)
        for slot, pieces, arrived, keep in zip(slots.tolist(), parts, arrivals, keep_from.tolist()):
            stream = by_slot[slot]
            audio = stream.audio
            audio.extend(pieces, arrived, keep)
            num_samples.append(audio.num_samples)
            if stream.diarized:
                self.diarizer.take_audio(stream.stream_id, pieces, arrived)
        after = np.array(num_samples, dtype=np.int64)
        self.scheduler.num_samples[slots] = after  # `finished` unchanged: only finish() sets it
        took = after != before  # an empty packet records no arrival (AudioBuffer.extend)
        self.last_packet.took(slots[took], before[took], np.asarray(arrivals, dtype=np.float64)[took])

    def finish(self, stream: Stream, at: float | None = None) -> None:
        """End of input; `at`: when it reached the server (default now). Its final comes out of a
        later `iterate()`. A stream no longer open is left alone."""
        if self.slots.holds(stream):
            audio = stream.audio
            audio.finish(at)
            self.scheduler.set_audio(stream.slot, audio.num_samples, audio.finished)
            if stream.diarized:
                self.diarizer.finish(stream.stream_id)

    def force_final(self, stream: Stream, at_sample: int | None = None) -> None:
        """Close the stream's segment now: a final with what it has, in the next `iterate()`'s
        output; decoding goes on. A stream no longer open is left alone. `at_sample`: close it
        instead right after the step that decodes the whole chunks before that sample (counted
        from the stream's start; engine/forced_ends.py), now if they are decoded already; no
        final then if an earlier final ended the speech and nothing was said since."""
        if not self.slots.holds(stream):
            return
        if at_sample is not None and (self._force_later(stream, at_sample)
                                      or not closes_speech(stream.segment, stream.endpoint.has_text)):
            return  # at its step (collect), or nothing said since the speech ended (forced_ends.py)
        if self.in_flight.defer_final(stream.slot):  # after its step's tokens, as the sequential loop has them
            return
        self._publish_final(stream, [], [], time.time(), done=False)

    def _force_later(self, stream: Stream, at_sample: int) -> bool:
        """Whether the positional forced final waits for a step: its frame not stepped yet, or
        maybe by the step in flight (collect decides). Else those chunks are decoded: now."""
        slot = stream.slot
        target = whole_chunk_frames(self.model.geometries[stream.context_right], at_sample, self.features.margin)
        if target > self.scheduler.next_frame[slot] or self.in_flight.flying[slot]:
            self.forced_ends.add(slot, target)
            return True
        return False

    def abort(self, stream: Stream, reason: str = "aborted") -> None:
        """Release the stream now: nothing more is published for it; its release is in the next
        `iterate()`'s output. Idempotent. `reason`: for the debug log."""
        if not self.slots.holds(stream):
            return
        if self.in_flight.defer_abort(stream.slot, reason):  # its step owns the row until collected
            return
        log.debug("stream %s aborted: %s", stream.stream_id, reason)
        self._release(stream, aborted=True)

    def _release(self, s: Stream, aborted: bool = False) -> None:
        """Close the stream's cache row and give its slot back (its scheduler row is ignored from
        now on: the slot is no longer held); the release is in the next output, a diarized
        stream's once its results have their speakers (engine/speakers.py), an aborted one's at once."""
        self.runner.close_row(s.slot)
        self.forced_ends.open(s.slot)  # its pending forced finals are moot
        if s.biasing_id != NO_BIASING:
            self.pool.biasing.release(s.biasing_id)
        self.slots.give_back(s)
        storage = s.audio.release_storage()  # its step, if any, read its samples at launch
        if storage is not None:
            self.audio_arena.give_back(storage)
        self._num_phrases -= len(s.phrases.phrases) if s.phrases else 0
        released = ReleasedStream(s.stream_id, s.slot)
        if s.diarized and not aborted:
            self.diarizer.asr_stopped(s.stream_id)  # its last frames, if the ASR side never computed them
            self.speakers.hold_release(released)
            return
        if s.diarized:
            self.speakers.drop(s.stream_id)
        self._released.append(released)
