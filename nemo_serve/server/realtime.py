"""/v1/realtime: one OpenAI Realtime transcription session per socket, a wire format (session.py).

The `Session` is /ws's: the same receive and send tasks, admission, limits, idle and duration
timeouts, backpressure, bounded outbox, drain and `finally:` abort; this module says what a frame
means and what a result looks like. Each engine stream's tokens are /ws's:
the same decoder (PCM16 at 24 kHz resampled by soxr), push, finish and force_final.

  session.created        at once (the first append takes a slot, as /ws's first message does, so
                         a socket that only configures holds none); the mode comes from
                         `?context_right=` or the session's `context_right`, echoed in it
  append                 -> decode, engine.push into the current item's engine stream (a new
                            one after each commit: realtime_items.py)
  commit                 -> input_audio_buffer.committed now; the item's engine stream is
                            finished as an end of input is (its tail decoded with the same rule),
                            so `completed` carries all of its audio and equals NeMo's loop on it.
                            Audio after the commit opens a fresh engine stream; with no slot free
                            it waits, in order, for the committed one's slot (none in flight:
                            error, close 1013)
  clear                  -> input_audio_buffer.cleared; the item ends the same way and its
                            completion is not sent (its audio still went through the model)
  input_audio_buffer.done (NIM) -> end of input: the last item is completed with
                            `is_last_result: true`, then close 1000
  endpointer final       -> committed, completed (turn_detection on); off with `turn_detection: null`
  EOU model's <EOU>      -> the same at once, speech_stopped at the token's audio time (engine/eou.py);
                            such a model is the turn detector: no Silero detector is made for it
  speech detector        -> speech_started at the onset, speech_stopped after the turn's silence
                            (turn_detection on; speech_detector.py: Silero VAD per session, on the
                            appended audio). They time speech only: items end where the endpointer
                            or a commit ends them, so tokens stay /ws's
  partial                -> delta (text not sent yet)
  no audio               -> an item with uncommitted audio is finished like a commit before any
                            idle close, and with turn detection on once the audio stops for the
                            turn's silence_duration_ms; the idle clock stands still while
                            committed items are decoding

A NIM client (its update has `input_audio_params`) commits after every packet as a flush: its
session keeps one engine stream, a commit neither ends the item nor is answered, and items end at
the endpointer, an append's `runtime_config.force_eou` (engine.force_final once the model has
decoded every whole chunk before it) or the end of input (nim_items.py).
Items map one-to-one to engine segments (SegmentKeys numbers them across streams); `item_id`s
chain by `previous_item_id`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from dataclasses import replace

import numpy as np

from ..engine.endpoint import EndpointConfig
from ..engine.eou import EouTokens
from ..engine.errors import NoFreeSlotError
from ..engine.phrases import encodable_characters
from ..engine.results import StreamResult
from .audio import AudioDecoder
from .logsafe import clean, preview
from .protocol import (
    CLOSE_NORMAL,
    CLOSE_PROTOCOL_ERROR,
    CLOSE_TRY_AGAIN_LATER,
    MAX_REASON_CHARS,
    ProtocolError,
    ProtocolState,
    mode_number,
)
from .nim_items import ForcedEnds, LastUtterance
from .realtime_items import ItemStream, SegmentKeys
from .realtime_speakers import check_diarizing, diarization_option, segment_events
from . import speech_detector
from .realtime_protocol import (
    Append,
    BufferEvent,
    RealtimeConfig,
    RealtimeError,
    SessionUpdate,
    TurnDetection,
    check_model,
    completed_event,
    error_event,
    event,
    model_language,
    new_id,
    parse_client_event,
    transcription_phrases,
)
from .session import Session
from .speech_detector import SpeechDetector, SpeechEvent
from .wav_stream import WavStreamDecoder

log = logging.getLogger("nemo_serve.realtime")

TRANSCRIPTION = "conversation.item.input_audio_transcription"
# While committed items decode, the idle clock stands still; the receive task looks again this often.
PAUSED_IDLE_CHECK_S = 0.5
# A committed item's `done` can reach us a moment before the engine counts its slot free
# (release comes between steps, in the engine-core process): the next item retries.
SLOT_RETRY_S = 0.01
SLOT_RETRY_FOR_S = 2.0
STALL_POLL_S = 0.1
# Slots one session may hold at once: the item being appended to and the one committed before it,
# still decoding. Items committed beyond wait for one of the two to finish (their audio waits in
# `ItemStream.waiting`, bounded by the session's backpressure, MAX_AHEAD_S of audio). Rejected:
# refusing such commits, which loses audio a voice agent has already sent.
MAX_SLOTS_PER_SESSION = 2


class RealtimeFormat:
    """One /v1/realtime socket's events and its item streams (owner: the event loop)."""

    def __init__(self, session: Session) -> None:
        self.session = session
        ws, ctx = session.ws, session.ctx
        self.ctx = ctx
        self.config_error: str | None = None
        self.language: str | None = None
        self._loop = asyncio.get_running_loop()
        # The beta SDK says so in a header; a NIM client says so with its first update. Until
        # then, GA.
        self.dialect = "beta" if "realtime=v1" in ws.headers.get("openai-beta", "") else "ga"
        self.rt = RealtimeConfig(turn_detection=_turn_detection(ctx.settings.endpoint_config))
        self.rt.transcription_model = ctx.model.name
        self.rt.context_right = ctx.model.geometry.context_right
        mode = ws.query_params.get("context_right")
        if mode is not None:  # refused before any audio, as /ws's URL is
            self.config_error = self._query_mode(mode)
        self.nim = False  # a NIM client (input_audio_params): commits are flushes, one engine stream
        # Owner: the event loop (receive side, and the send task for what results announce).
        self.items: list[ItemStream] = []  # engine streams not yet done, in order
        self.current: ItemStream | None = None  # the one appends go to
        self.num_items = 0  # engine streams started
        self._num_opened = 0  # of them, given a slot (the first is the session's admission)
        self.num_items_sent = 0  # engine streams whose last result was sent (send task)
        self.keys = SegmentKeys()
        self.segment_to_item: dict[int, str] = {}  # session segment -> item_id
        self.last_item_id: str | None = None  # the previous completed or committed item
        self.sent_text: dict[int, str] = {}  # what the deltas of each open segment carried
        self.speaking: set[int] = set()  # segments speech_started was sent for
        self.vad: SpeechDetector | None = None  # with turn detection: speech events (speech_detector.py)
        self.committed: set[int] = set()  # segments a committed event announced
        self.cleared: set[int] = set()  # segments whose completion is not sent
        self.num_model_samples = 0  # samples given to the engine in the session, at the model's rate
        self.appended_since_commit = False
        self._last_audio = time.monotonic()
        self._last_release = float("-inf")  # when an item of ours last finished (its slot comes back)
        self.nim_ends = ForcedEnds()  # a NIM client's force_eou appends on its one engine stream
        self.aborted = False  # the session ended (abort): no item opens a stream any more
        self.nim_said = LastUtterance()  # what a NIM client's final repeats after trailing silence
        session.outbox.put(self._session_event("created"))

    def _query_mode(self, mode: str) -> str | None:
        """`?context_right=`: set the session's mode, or say what was wrong (None: set)."""
        modes = ", ".join(str(r) for r in sorted(self.ctx.model.geometries or [self.ctx.model.geometry.context_right]))
        number = mode_number(mode)
        if number is None:
            return f"invalid query parameter context_right: {preview(mode, 24)} is not one of the served modes {modes}"
        try:
            self.rt.context_right = self.ctx.model.geometry_for(number).context_right
        except ValueError as e:
            return f"invalid query parameter context_right: {e}"
        return None

    # ------------------------------------------------------------------ receive side
    def on_bytes(self, data: bytes) -> None:
        self._nonfatal(RealtimeError("binary frames are not part of this protocol; send input_audio_buffer.append"))

    def on_text(self, text: str) -> None:
        try:
            ev = parse_client_event(text)
            if isinstance(ev, SessionUpdate):
                self._update(ev)
            elif isinstance(ev, Append):
                self._append(ev)
            elif ev.kind == "done":
                self._done()
            else:
                self._commit(ev)
        except RealtimeError as e:
            self._nonfatal(e)

    def _nonfatal(self, e: RealtimeError) -> None:
        msg = clean(str(e), MAX_REASON_CHARS)
        self._queue(error_event(msg, code=e.code, param=e.param, event_id=e.event_id))

    def _queue(self, ev) -> None:
        """An event from the receive side, in order with the results; a full outbox ends the
        stream as it does for results (the client is not reading)."""
        s = self.session
        if not s.closing and not s.outbox.put(ev):
            s.fail(f"client is not reading events ({len(s.outbox)} waiting)", reason_label="slow_client")

    def _update(self, u: SessionUpdate) -> None:
        self.dialect = u.dialect
        fixed = u.rate or u.turn_detection_set or _language(u) or u.context_right is not None or u.nim or _phrases(u)
        if self.session.state is not ProtocolState.CONNECTED and fixed:
            raise RealtimeError(
                "audio format, language, phrases, turn_detection and context_right cannot change once audio was appended",
                code="session_update_after_audio", event_id=u.event_id,
            )  # fmt: skip
        rt = self.rt
        if u.context_right is not None:
            try:
                mode = self.ctx.model.geometry_for(u.context_right).context_right
            except ValueError as e:
                raise RealtimeError(str(e), param="session.context_right", event_id=u.event_id) from None
        if u.transcription is not None:
            if u.transcription.language is not None:
                try:
                    model_language(u.transcription.language, _languages(self.ctx.model))
                except RealtimeError as e:
                    e.event_id = u.event_id
                    raise
                rt.language = u.transcription.language or None
            check_model(u.transcription.model, self.ctx.model.name, u.event_id)
            check_diarizing(u.transcription.model, self.ctx.model.num_speakers, u.event_id)
            rt.transcription_model = u.transcription.model or rt.transcription_model
            rt.prompt = u.transcription.prompt if u.transcription.prompt is not None else rt.prompt
            phrases = transcription_phrases(u.transcription, self.ctx.settings.phrase_limits,
                                            encodable_characters(self.ctx.model.vocabulary), self.ctx.model.is_bpe,
                                            u.event_id)  # fmt: skip
            rt.phrases = phrases if phrases is not None else rt.phrases
        if u.context_right is not None:
            rt.context_right = mode
        rt.rate = u.rate or rt.rate
        rt.wav_header = u.wav_header if u.wav_header is not None else rt.wav_header
        self.nim = self.nim or u.nim
        if u.turn_detection_set:
            rt.turn_detection = u.turn_detection
        self._queue(self._session_event("updated"))

    def _append(self, a: Append) -> None:
        if self.session.state is ProtocolState.CONNECTED:
            self._open()
        if self.session.state is ProtocolState.ENDING and self.session.end_reason == "end":
            raise ProtocolError("input_audio_buffer.append after input_audio_buffer.done")
        if self.session.state is not ProtocolState.STREAMING:
            return  # the server ended input (drain, duration cap); the client may not know yet
        item = self.current or self._start_item()
        if item is None:
            return
        self._feed(item, item.decoder.decode(a.pcm))
        if len(a.pcm):
            self.appended_since_commit = True
            self._last_audio = time.monotonic()
        if a.force_eou and self.nim:
            self.nim_ends.add(self.ctx.model.whole_chunks_s(self.rt.context_right, item.num_samples))
            self._end_nim_items(item)
        if self.num_model_samples >= self.ctx.settings.max_stream_s * self.ctx.model.geometry.sample_rate:
            self.session.end_input("max_stream_duration")

    def _feed(self, item: ItemStream, samples: np.ndarray) -> None:
        if not len(samples):
            return
        item.num_samples += len(samples)
        self.num_model_samples += len(samples)
        if item.handle is None:
            item.waiting.append(samples)
        else:
            self.ctx.engine.push(item.handle, samples)
        if self.vad is not None:
            for ev in self.vad.push(samples):
                self._speech_event(item, ev)

    def _speech_event(self, item: ItemStream, ev: SpeechEvent) -> None:
        """The detector's onset or end, for the item being filled, on the session's audio clock
        (speech_started moved back by prefix_padding_ms, as OpenAI's is)."""
        key = self.keys.key(item, item.segment)
        item_id = self.segment_to_item.setdefault(key, new_id("item"))
        ms = ev.sample * 1000 / self.ctx.model.geometry.sample_rate
        if ev.kind == "started":
            self.speaking.add(key)
            pad_ms = self.rt.turn_detection.prefix_padding_ms or 0
            self._queue(event("input_audio_buffer.speech_started", item_id=item_id, audio_start_ms=max(0, round(ms - pad_ms))))
        else:
            self._queue(event("input_audio_buffer.speech_stopped", item_id=item_id, audio_end_ms=round(ms)))

    def _commit(self, b: BufferEvent) -> None:
        if self.nim and b.kind == "commit":
            return  # NIM's flush: the utterance goes on (nim_items.py); an error would end its client
        if b.kind == "clear":
            self._queue(event("input_audio_buffer.cleared"))
        if self.session.state is not ProtocolState.STREAMING or not self.appended_since_commit or self.current is None:
            if b.kind == "commit":
                raise RealtimeError("buffer is empty: no audio was appended since the last commit",
                                    code="input_audio_buffer_commit_empty", event_id=b.event_id)  # fmt: skip
            return
        self.appended_since_commit = False
        item = self.current
        key = self.keys.key(item, item.segment)
        if b.kind == "clear":
            self.cleared.add(key)
            item.cleared_from = item.segment
        elif key not in self.committed:  # a second commit before the item ended joins it
            self._queue(self._committed_event(key))
        self._finish_item(item)

    def _done(self) -> None:
        if self.session.state is ProtocolState.CONNECTED:
            self._open()
        if self.session.state is ProtocolState.STREAMING:
            if self.current is None and not self.items:
                self._start_item()  # nothing open or decoding: an empty item carries is_last_result
            self.session.end_input("end")
        elif self.session.end_reason == "end":
            raise ProtocolError("input_audio_buffer.done was already received")

    def end_input(self) -> None:
        """End of input (done, drain, duration cap): the current item is finished, the last item
        in flight is the session's last; close 1000 once it is done."""
        if self.current is not None:
            self._finish_item(self.current)
        if self.items:
            self.items[-1].last = True
        else:
            self.session.close(CLOSE_NORMAL, _end_reason(self.session.end_reason))

    # ------------------------------------------------------------------ item streams
    def _open(self) -> None:
        """Admit the session (the first append or done): refused as /ws refuses a stream. Each
        item then takes its own slot (_start_item)."""
        ctx, rt = self.ctx, self.rt
        try:
            self.language = model_language(rt.language, _languages(ctx.model))
        except RealtimeError as e:  # checked at the update already; the model has not changed
            raise ProtocolError(str(e)) from None
        self.session.open(rt.context_right)  # the session; each item takes its slot in _open_waiting
        if self.session.state is not ProtocolState.STREAMING:
            return  # refused: the session is failing
        rate = ctx.model.geometry.sample_rate
        td = rt.turn_detection
        # An EOU model ending turns (engine/eou.py) is the session's turn detector: speech events come
        # from its tokens and its EOU, not from a second detector that would disagree with it.
        eou_turns = bool(EouTokens.from_vocabulary(ctx.model.vocabulary)) and self._endpoint_rules().eou_endings
        if td is not None and not eou_turns and speech_detector.available(rate):
            threshold = 0.5 if td.threshold is None else td.threshold  # OpenAI's default and silero's
            self.vad = SpeechDetector(rate, threshold, self._endpoint_rules().rule2_min_trailing_silence_s)

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
            if item.handle is not None:
                continue
            if self.aborted or self._num_held() >= MAX_SLOTS_PER_SESSION:
                return  # the next `done` of ours opens it (or the session is over)
            boost = {"phrases": list(self.rt.phrases.phrases), "boost": self.rt.phrases.boost} if self.rt.phrases else {}
            if not self._num_opened and not self._admitted_by_guard():
                return
            try:
                item.handle = self.ctx.engine.open_stream(
                    self.session.engine_callback(functools.partial(self._take_item_result, item)),
                    language=self.language, endpoint=self._endpoint_rules(), context_right=self.rt.context_right, **boost,
                    **diarization_option(self.rt.transcription_model, self.ctx.model.num_speakers),
                )  # fmt: skip
                self._num_opened += 1
            except NoFreeSlotError as e:
                self._wait_for_slot(str(e))
                return
            except ValueError as e:  # the server-wide phrase total (the rest was checked at the update)
                self.session.fail(str(e), reason_label="bad_config")
                return
            for samples in item.waiting:
                self.ctx.engine.push(item.handle, samples)
            item.waiting.clear()
            if item.finishing:
                self.ctx.engine.finish(item.handle)

    def _admitted_by_guard(self) -> bool:
        """The session's first slot is its stream's admission: the overload guard moves here, once
        (ServerContext.refusal), as /ws's does where its slot is taken; the session's later items
        are the same stream. A full server: open_stream's own refusal, as for any item."""
        refusal = self.ctx.refusal()
        if refusal is None or refusal[0] == "no_free_slot":
            return True
        self.ctx.metrics.refusals.labels(reason=refusal[0]).inc()
        self.session.fail(refusal[1], code=CLOSE_TRY_AGAIN_LATER, reason_label="refused")
        return False

    def _num_held(self) -> int:
        return sum(i.handle is not None for i in self.items)

    def _wait_for_slot(self, why: str) -> None:
        if any(i.in_flight for i in self.items):
            return  # a committed item is decoding: its `done` tries again
        if time.monotonic() - self._last_release <= SLOT_RETRY_FOR_S:
            self._loop.call_later(SLOT_RETRY_S, self._retry_slot)  # ours just finished: its slot is on its way
            return
        self.ctx.metrics.refusals.labels(reason="no_free_slot").inc()
        self.session.fail(f"no free slot for the next item ({why}); retry later", code=CLOSE_TRY_AGAIN_LATER,
                          reason_label="refused")  # fmt: skip

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
        if item.handle is not None:
            self.ctx.engine.finish(item.handle)
        if self.current is item:
            self.current = None

    def _end_nim_items(self, item: ItemStream) -> None:
        """NIM: end the item once the model has caught up with its force_eou (engine.force_final),
        also after the input ended (a fast sender's done comes before the model catches up)."""
        if item.handle is None or item.done or self.session.closing:
            return
        if self.nim_ends.take_due(item.processed_s):
            self.ctx.engine.force_final(item.handle)
            self.nim_ends.final_requested = item.segment
            item.segment += 1

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
        """The one end of every engine stream of the session, however it ended (Session calls it
        on a failure, a drop, a send that failed and in run()'s `finally:`). After it no item opens
        a stream: a slot retry or a result already on its way would otherwise take a slot that
        nothing aborts."""
        self.aborted = True
        for item in self.items:
            if item.handle is not None:
                self.ctx.engine.abort(item.handle, reason)  # idempotent

    # ------------------------------------------------------------------ results (event loop)
    def _take_item_result(self, item: ItemStream, r: StreamResult) -> None:
        """An item stream's result, on the event loop (Session.engine_callback)."""
        self.session.consumed(r.audio_processed_s - item.processed_s)
        item.processed_s = max(item.processed_s, r.audio_processed_s)
        key = self.keys.key(item, r.segment)
        if item.cleared_from is not None and r.segment >= item.cleared_from:
            self.cleared.add(key)
        if r.is_final:
            self.nim_ends.on_final(r.segment, closed_by_engine=r.segment >= item.segment)
            item.segment = max(item.segment, r.segment + 1)
        if r.done:
            item.done = True
            self.items.remove(item)
            self.session.last_message = self._last_release = time.monotonic()  # the idle clock runs again from here
            self._open_waiting()
        elif self.nim:
            self._end_nim_items(item)
        self.session.queue(replace(r, segment=key))

    def reading_resumed(self) -> None:
        self._last_audio = time.monotonic()  # waiting on the model is not the client's audio stopping

    def behind_s(self) -> float:
        """Audio waiting for a slot counts."""
        rate = self.ctx.model.geometry.sample_rate
        return sum(i.num_samples / rate - i.processed_s for i in self.items)

    # ------------------------------------------------------------------ timeouts
    def receive_timeout(self, timeout: float | None) -> float | None:
        if self.session.state is not ProtocolState.STREAMING:
            return timeout
        if any(i.in_flight for i in self.items):
            return min(timeout, PAUSED_IDLE_CHECK_S)
        stall_s = self._stall_s()
        if stall_s is not None:
            # Not below STALL_POLL_S: a frame already queued (a busy event loop) must win the race.
            return max(STALL_POLL_S, min(timeout, self._last_audio + stall_s - time.monotonic()))
        return timeout

    def _stall_s(self) -> float | None:
        """With turn detection on, audio that stops for the turn's silence ends the turn, as the
        silence would have (a file that ends at its last word); None: no such rule now."""
        if self.rt.turn_detection is None or self.current is None or not self.appended_since_commit:
            return None
        return self._endpoint_rules().rule2_min_trailing_silence_s

    def on_timeout(self, now: float) -> bool:
        s, session = self.ctx.settings, self.session
        if session.state is ProtocolState.STREAMING and now < session.opened_at + s.max_stream_s:
            stall_s = self._stall_s()
            if any(i.in_flight for i in self.items):
                session.last_message = now  # committed items are decoding: not the client's silence
                return True
            idle = now >= session.last_message + s.idle_timeout_s
            if self.current is not None and self.appended_since_commit and (
                idle or (stall_s is not None and now >= self._last_audio + stall_s)
            ):
                self.appended_since_commit = False
                self._finish_item(self.current)  # what it has is finalized before any idle close
                session.last_message = now
                return True
        return False

    # ------------------------------------------------------------------ send side
    def error_frame(self, reason: str, code: int) -> str:
        kind = "invalid_request_error" if code == CLOSE_PROTOCOL_ERROR else "server_error"
        return error_event(reason, type_=kind, code="session_closed").model_dump_json()

    async def send_result(self, r: StreamResult) -> bool:
        """One engine result (its `segment` is the session's, SegmentKeys); True once closed."""
        item = self.keys.key_to_stream[r.segment]
        item_id = self.segment_to_item.setdefault(r.segment, new_id("item"))
        cleared = r.segment in self.cleared
        sent = self.sent_text.get(r.segment, "")
        if not cleared and r.text.startswith(sent) and len(r.text) > len(sent):
            if self.vad is None and self.rt.turn_detection is not None and r.segment not in self.speaking and r.token_times_s:
                self.speaking.add(r.segment)
                await self.session.send(event("input_audio_buffer.speech_started", item_id=item_id,
                                              audio_start_ms=self._speech_start_ms(item, r)))  # fmt: skip
            await self.session.send(event(f"{TRANSCRIPTION}.delta", item_id=item_id, content_index=0,
                                          delta=r.text[len(sent):]))  # fmt: skip
            self.sent_text[r.segment] = r.text
        if r.is_final:
            await self._send_final(r, item, item_id, cleared)
        if not r.done:
            return False
        self.keys.forget(item)
        self.num_items_sent += 1
        if self.session.state is not ProtocolState.ENDING or self.num_items_sent < self.num_items:
            return False
        await self.session.close_socket(CLOSE_NORMAL, _end_reason(self.session.end_reason or "end"))
        return True

    def _speech_start_ms(self, item: ItemStream, r: StreamResult) -> int:
        """The item's first token, moved back by prefix_padding_ms (not before the item's start),
        on the session's audio clock."""
        td = self.rt.turn_detection
        pad_s = (td.prefix_padding_ms or 0) / 1000 if td is not None else 0.0
        return int(round((item.start_s + max(r.segment_start_s, r.token_times_s[0] - pad_s)) * 1000))

    async def _send_final(self, r: StreamResult, item: ItemStream, item_id: str, cleared: bool) -> None:
        announced = r.segment in self.committed
        self.sent_text.pop(r.segment, None)
        self.speaking.discard(r.segment)
        last = r.done and item.last
        if cleared or not (r.text or announced or last):
            return  # silence the endpointer closed, an item the client cleared, audio that stopped in silence
        if not announced:  # the endpointer ended it, or the audio stopped: what server VAD says
            if self.vad is None and self.rt.turn_detection is not None and not last:
                end_s = r.eou_time_s if r.eou_time_s is not None else r.audio_processed_s  # an EOU: its audio time
                ms = int(round((item.start_s + end_s) * 1000))
                await self.session.send(event("input_audio_buffer.speech_stopped", item_id=item_id, audio_end_ms=ms))
            await self.session.send(self._committed_event(r.segment))
        completed = completed_event(r, item_id, self.ctx.model.vocabulary, item.start_s, last)
        if self.nim:
            self.nim_said.on_completed(completed, item_id, last)
        for segment in segment_events(r, item_id):  # a diarized item's speakers, before its completed
            await self.session.send(segment)
        await self.session.send(completed)

    def _committed_event(self, segment: int):
        """input_audio_buffer.committed for `segment`'s item, chained to the item before it."""
        item_id = self.segment_to_item.setdefault(segment, new_id("item"))
        previous, self.last_item_id = self.last_item_id, item_id
        self.committed.add(segment)
        return event("input_audio_buffer.committed", item_id=item_id, previous_item_id=previous)

    def _session_event(self, what: str):
        if self.dialect == "beta":
            return event(f"transcription_session.{what}", session=self.rt.beta())
        return event(f"session.{what}", session=self.rt.ga())


def _end_reason(reason: str) -> str:
    return {"end": "end of input", "draining": "server is draining (shutting down)",
            "max_stream_duration": "maximum stream duration reached"}.get(reason, reason)  # fmt: skip


def _languages(model) -> list[str] | None:
    return sorted(model.prompt_dictionary) if model.prompt_dictionary else None


def _phrases(u: SessionUpdate) -> bool:
    return u.transcription is not None and (u.transcription.phrases is not None or u.transcription.boost is not None)


def _language(u: SessionUpdate) -> bool:
    return u.transcription is not None and u.transcription.language is not None


def _turn_detection(rules: EndpointConfig) -> TurnDetection | None:
    """The server's endpoint rules as OpenAI's turn_detection: server VAD, or off."""
    if not rules.enabled:
        return None
    return TurnDetection(type="server_vad", silence_duration_ms=int(rules.rule2_min_trailing_silence_s * 1000))


