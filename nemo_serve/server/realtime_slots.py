"""/v1/realtime's items and their slots: the half of realtime.RealtimeFormat that holds engine
streams (the other half, realtime.py, says what a client frame means).

Each item (the audio between commits, or NIM's utterance) is one StreamSession once it holds a
slot; at most MAX_SLOTS_PER_SESSION at once, the rest wait in order with their audio. Here: the
slots taken and given back, the items' results (on the event loop), backpressure's count, and the
idle clock's rules that RealtimeSession asks for. Owner: the event loop.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import replace

import numpy as np

from ..engine.endpoint import EndpointConfig
from ..engine.errors import NoFreeSlotError
from ..engine.results import StreamResult
from .audio import AudioDecoder
from .realtime_items import ItemStream
from .realtime_speakers import diarization_option
from .stream_session import StreamSession
from .wav_stream import WavStreamDecoder

log = logging.getLogger("nemo_serve.realtime")

# While committed items decode, the idle clock stands still; the clock looks again this often.
PAUSED_IDLE_CHECK_S = 0.5
# A committed item's `done` can reach us a moment before the engine counts its slot free
# (release comes between steps, in the engine-core process): the next item retries.
SLOT_RETRY_S = 0.01
SLOT_RETRY_FOR_S = 2.0
# The turn's silence clock runs out no sooner than this after the last frame: a frame already
# queued (a busy event loop) must win the race.
STALL_POLL_S = 0.1
# Slots one session may hold at once: the item being appended to and the one committed before it,
# still decoding. Items committed beyond wait for one of the two to finish (their audio waits in
# `ItemStream.waiting`, bounded by the session's backpressure, MAX_AHEAD_S of audio). Rejected:
# refusing such commits, which loses audio a voice agent has already sent.
MAX_SLOTS_PER_SESSION = 2


class ItemSlots:
    """RealtimeFormat's items (a base class: realtime.py sets the state it reads: `ctx`, `name`,
    `session`, `rt`, `items`, `current`, `keys`, `renderer`, `vad`, `nim`, and
    defines `_speech_event`)."""

    def _feed(self, item: ItemStream, samples: np.ndarray) -> None:
        if not len(samples):
            return
        item.num_samples += len(samples)
        self.num_model_samples += len(samples)
        if item.session is None:
            item.waiting.append(samples)
        else:
            item.session.push(samples)
        if self.vad is not None:
            for ev in self.vad.push(samples):
                self._speech_event(item, ev)

    def _start_item(self) -> ItemStream | None:
        """A new engine stream for the audio from here to the next commit."""
        rate = self.ctx.model.geometry.sample_rate
        # "none" (NVIDIA's client sends its file as is): the session's audio opens with a WAV header
        first_is_wav = self.rt.wav_header and self.num_items == 0
        decoder = WavStreamDecoder(self.rt.rate, rate) if first_is_wav else AudioDecoder("pcm_s16le", self.rt.rate, rate)
        item = ItemStream(self.num_items, decoder, start_s=self.num_model_samples / rate)
        self.num_items += 1
        self.items.append(item)
        self.current = item
        self._open_waiting()
        return None if self.session.closing else item

    def _open_waiting(self) -> None:
        """Give slots to the items waiting for one, in order, up to MAX_SLOTS_PER_SESSION; none
        free: wait while a committed item of this session is decoding (its slot comes back), else
        refuse (1013)."""
        for item in self.items:
            if item.session is not None:
                continue
            if self.aborted or self._num_held() >= MAX_SLOTS_PER_SESSION:
                return  # the next `done` of ours opens it (or the session is over)
            if not self._num_opened and not self._admitted_by_guard():
                return
            if not self._open_item(item):
                return
            for at_sample in item.forced_at:  # positions: sent before the audio past them
                item.session.force_final(at_sample)
            item.forced_at.clear()
            for samples in item.waiting:
                item.session.push(samples)
            item.waiting.clear()
            if item.finishing:
                item.session.end_input()

    def _open_item(self, item: ItemStream) -> bool:
        """The item's StreamSession and its engine stream; False when none could be opened."""
        session = StreamSession(self.ctx, f"{self.name}.{item.number}", log,
                                results=functools.partial(self._take_item_result, item))  # fmt: skip
        rt = self.rt
        boost = {"phrases": list(rt.phrases.phrases), "boost": rt.phrases.boost} if rt.phrases else {}
        try:
            session.open_item(rt.context_right, language=self.language, endpoint=self._endpoint_rules(), **boost,
                              **diarization_option(rt, self.ctx.model.num_speakers))  # fmt: skip
        except NoFreeSlotError as e:
            self._wait_for_slot(str(e))
            return False
        except ValueError as e:  # the server-wide phrase total (the rest was checked at the update)
            self.session.fail(str(e), "bad_config")
            return False
        item.session = session
        self._num_opened += 1
        return True

    def _admitted_by_guard(self) -> bool:
        """The session's first slot is its stream's admission: the overload guard moves here, once
        (ServerContext.refusal), as /ws's does where its slot is taken; the session's later items
        are the same stream. A full server: open_stream's own refusal, as for any item."""
        refusal = self.ctx.refusal()
        if refusal is None or refusal[0] == "no_free_slot":
            return True
        self.ctx.metrics.refusals.labels(reason=refusal[0]).inc()
        self.session.fail(refusal[1], "refused", refusal=refusal[0])
        return False

    def _num_held(self) -> int:
        return sum(i.session is not None for i in self.items)

    def _wait_for_slot(self, why: str) -> None:
        if any(i.in_flight for i in self.items):
            return  # a committed item is decoding: its `done` tries again
        if time.monotonic() - self._last_release <= SLOT_RETRY_FOR_S:
            self._loop.call_later(SLOT_RETRY_S, self._retry_slot)  # ours just finished: its slot is on its way
            return
        self.ctx.metrics.refusals.labels(reason="no_free_slot").inc()
        self.session.fail(f"no free slot for the next item ({why}); retry later", "refused", refusal="no_free_slot")

    def _retry_slot(self) -> None:
        if not self.session.closing and not self.session.client_gone:
            self._open_waiting()  # a no-op once aborted

    def _finish_item(self, item: ItemStream) -> None:
        """Decode the item to its end (commit, end of input, or its audio stopped)."""
        self._feed(item, item.decoder.flush())
        if self.vad is not None:
            for ev in self.vad.flush():  # speech still on ends with the item's audio
                self._speech_event(item, ev)
        item.finishing = True
        if item.session is not None:
            item.session.end_input()
        if self.current is item:
            self.current = None

    def _force_nim_end(self, item: ItemStream) -> None:
        """NIM's force_eou: the item ends after the whole chunks of the audio appended so far,
        wherever the model is now (a positional force_final: engine/forced_ends.py), sent before
        any later audio. Rejected: force_final once results showed the model there, which lost
        the end, or put it late, when the model decoded past the point before we heard of it."""
        if item.session is None:
            item.forced_at.append(item.num_samples)  # sent when it gets its slot (_open_waiting)
        else:
            item.session.force_final(item.num_samples)

    def _endpoint_rules(self) -> EndpointConfig:
        """turn_detection null: no endpointer (items end at commits only); server VAD: the
        server's rules with silence_duration_ms as rule 2 (silence after text)."""
        base, td = self.ctx.settings.endpoint_config, self.rt.turn_detection
        if td is None:
            return EndpointConfig.off()
        if td.silence_duration_ms:
            return replace(base, enabled=True, rule2_min_trailing_silence_s=td.silence_duration_ms / 1000).validated()
        return replace(base, enabled=True)

    def abort(self, reason: str) -> None:
        """The one end of every item's engine stream, however the session ended (RealtimeSession
        calls it on a failure, a drop, the client gone and in the transport's `finally:`). After
        it no item opens a stream: a slot retry or a result already on its way would otherwise
        take a slot that nothing aborts."""
        self.aborted = True
        for item in self.items:
            if item.session is not None:
                item.session.close(reason)  # idempotent

    # ------------------------------------------------------------------ results (event loop)
    def _take_item_result(self, item: ItemStream, r: StreamResult) -> None:
        """An item's result, on the event loop (its StreamSession hands it over)."""
        s = self.session
        if s.closing or s.client_gone:
            return
        if r.error is not None:
            s.fail(f"engine error: {r.error}", "engine")
            return
        item.session.progressed(r)
        s.item_progressed()
        key = self.keys.key(item, r.segment)
        if item.cleared_from is not None and r.segment >= item.cleared_from:
            self.renderer.cleared.add(key)
        if r.is_final:
            item.segment = max(item.segment, r.segment + 1)
        if r.done:
            item.done = True
            self.items.remove(item)
            s.last_input = self._last_release = time.monotonic()  # the idle clock runs again from here
            self._open_waiting()
        s.queue(replace(r, segment=key))

    def reading_resumed(self) -> None:
        self._last_audio = time.monotonic()  # waiting on the model is not the client's audio stopping

    def behind_s(self) -> float:
        """Audio waiting for a slot counts."""
        rate = self.ctx.model.geometry.sample_rate
        return sum(i.num_samples / rate - i.processed_s for i in self.items)

    # ------------------------------------------------------------------ the idle clock (RealtimeSession)
    def idle_deadline(self, idle_deadline: float, last_input: float) -> float:
        """While streaming: committed items decoding hold the idle clock (looked at again every
        PAUSED_IDLE_CHECK_S); with turn detection, audio that stops for the turn's silence ends
        the turn sooner."""
        if any(i.in_flight for i in self.items):
            return min(idle_deadline, last_input + PAUSED_IDLE_CHECK_S)
        stall_s = self._stall_s()
        if stall_s is not None:
            return max(last_input + STALL_POLL_S, min(idle_deadline, self._last_audio + stall_s))
        return idle_deadline

    def _stall_s(self) -> float | None:
        """With turn detection on, audio that stops for the turn's silence ends the turn, as the
        silence would have (a file that ends at its last word); None: no such rule now."""
        if self.rt.turn_detection is None or self.current is None or not self.appended_since_commit:
            return None
        return self._endpoint_rules().rule2_min_trailing_silence_s

    def deadline_passed(self, now: float) -> bool:
        """The idle deadline passed while streaming: True when handled here (an item with
        uncommitted audio finished before any idle close, or the clock held while items decode)."""
        s, session = self.ctx.settings, self.session
        if any(i.in_flight for i in self.items):
            session.last_input = now  # committed items are decoding: not the client's silence
            return True
        stall_s = self._stall_s()
        idle = now >= session.last_input + s.idle_timeout_s
        if self.current is not None and self.appended_since_commit and (
            idle or (stall_s is not None and now >= self._last_audio + stall_s)
        ):
            self.appended_since_commit = False
            self._finish_item(self.current)  # what it has is finalized before any idle close
            session.last_input = now
            return True
        return False
