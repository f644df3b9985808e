"""/v1/realtime: one OpenAI Realtime transcription session per socket, an item manager over
StreamSessions: each item that holds a slot is one StreamSession (its engine stream), and the
socket's own is a RealtimeSession (realtime_session.py: admission, limits, idle and duration
clocks, backpressure, bounded outbox, drain, the failure, the `finally:` abort of every item).
The WebSocket transport is /ws's (ws_socket.py); the send side renders results per dialect
(realtime_render.py). This module says what a client frame means. Each engine stream's tokens are /ws's:
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
                            or a commit ends them, so tokens stay /ws's. Their item_id is the item
                            then committed for the speech (realtime_items.Turn: the segment that
                            holds it claims the id; a turn none holds completes empty)
  partial                -> delta (text not sent yet)
  no audio               -> an item with uncommitted audio is finished like a commit before any
                            idle close, and with turn detection on once the audio stops for the
                            turn's silence_duration_ms; the idle clock stands still while
                            committed items are decoding

A NIM client (its update has `input_audio_params`) commits after every packet as a flush: its
session keeps one engine stream, a commit neither ends the item nor is answered, and items end at
the endpointer, an append's `runtime_config.force_eou` (a positional engine.force_final: after
the whole chunks before it, engine/forced_ends.py) or the end of input (nim_items.py).
Items map one-to-one to engine segments (SegmentKeys numbers them across streams); `item_id`s
chain by `previous_item_id`.
"""

from __future__ import annotations

import asyncio
import logging
import time

from starlette.websockets import WebSocket

from ..engine.endpoint import EndpointConfig
from ..engine.eou import EouTokens
from ..engine.phrases import encodable_characters
from ..engine.results import StreamResult
from . import speech_detector
from .context import ServerContext
from .logsafe import clean, preview
from .protocol import CLOSE_PROTOCOL_ERROR, MAX_REASON_CHARS, ProtocolError, mode_number
from .realtime_items import ItemStream, SegmentKeys, Turn
from .realtime_slots import MAX_SLOTS_PER_SESSION, ItemSlots
from .realtime_protocol import (
    Append,
    BufferEvent,
    RealtimeConfig,
    RealtimeError,
    SessionUpdate,
    TurnDetection,
    check_model,
    error_event,
    event,
    model_language,
    transcription_phrases,
)
from .realtime_parse import parse_client_event
from .realtime_render import TRANSCRIPTION, NimRenderer, OpenAIRenderer, end_reason_text
from .realtime_session import RealtimeSession
from .realtime_speakers import check_diarizing, transcription_diarization
from .speech_detector import SpeechDetector, SpeechEvent
from .wire import NormalClose, Rendered

__all__ = ["MAX_SLOTS_PER_SESSION", "TRANSCRIPTION", "RealtimeFormat", "realtime_wire"]

log = logging.getLogger("nemo_serve.realtime")


def realtime_wire(ws: WebSocket, ctx: ServerContext, name: str, log_: logging.Logger, on_drop) -> "RealtimeFormat":
    """ws_socket.WsSocket's wire factory for /v1/realtime."""
    return RealtimeFormat(ctx, name, ws.headers, ws.query_params, on_drop=on_drop)


class RealtimeFormat(ItemSlots):
    """One /v1/realtime socket's events (here) and its items (realtime_slots.ItemSlots); owner: the event loop."""

    def __init__(self, ctx: ServerContext, name: str, headers, query, on_drop=None) -> None:
        self.ctx = ctx
        self.name = name
        self.session = RealtimeSession(ctx, name, log, on_drop=on_drop)
        self.session.items = self
        self.config_error: str | None = None
        self.language: str | None = None
        self._loop = asyncio.get_running_loop()
        # The beta SDK says so in a header; a NIM client says so with its first update. Until
        # then, GA.
        self.dialect = "beta" if "realtime=v1" in headers.get("openai-beta", "") else "ga"
        self.rt = RealtimeConfig(turn_detection=_turn_detection(ctx.settings.endpoint_config))
        self.rt.transcription_model = ctx.model.name
        self.rt.context_right = ctx.model.geometry.context_right
        mode = query.get("context_right")
        if mode is not None:  # refused before any audio, as /ws's URL is
            self.config_error = self._query_mode(mode)
        self.nim = False  # a NIM client (input_audio_params): commits are flushes, one engine stream
        self.renderer: OpenAIRenderer = OpenAIRenderer(self)  # NimRenderer once the client says NIM
        # Owner: the event loop (receive side, and the send task for what results announce).
        self.items: list[ItemStream] = []  # engine streams not yet done, in order
        self.current: ItemStream | None = None  # the one appends go to
        self.num_items = 0  # engine streams started
        self._num_opened = 0  # of them, given a slot (the first is the session's admission)
        self.num_items_sent = 0  # engine streams whose last result was sent (send task)
        self.keys = SegmentKeys()
        self.vad: SpeechDetector | None = None  # with turn detection: speech events (speech_detector.py)
        self.turn: Turn | None = None  # the detector's speech now on (speech_started sent, not speech_stopped)
        self.num_model_samples = 0  # samples given to the engine in the session, at the model's rate
        self.appended_since_commit = False
        self._last_audio = time.monotonic()
        self._last_release = float("-inf")  # when an item of ours last finished (its slot comes back)
        self.aborted = False  # the session ended (abort): no item opens a stream any more
        self.session.outbox.put(self._session_event("created"))

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
            s.fail(f"client is not reading events ({len(s.outbox)} waiting)", "slow_client")

    def _update(self, u: SessionUpdate) -> None:
        self.dialect = u.dialect
        fixed = u.rate or u.turn_detection_set or _language(u) or u.context_right is not None or u.nim or _phrases(u)
        if self.session.opened and fixed:
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
            self._update_transcription(u)
        if u.context_right is not None:
            rt.context_right = mode
        rt.rate = u.rate or rt.rate
        rt.wav_header = u.wav_header if u.wav_header is not None else rt.wav_header
        if u.nim and not self.nim:  # before any audio (fixed above): no item was rendered yet
            self.nim, self.renderer = True, NimRenderer(self)
        if u.turn_detection_set:
            rt.turn_detection = u.turn_detection
        self._queue(self._session_event("updated"))

    def _update_transcription(self, u: SessionUpdate) -> None:
        rt, t = self.rt, u.transcription
        if t.language is not None:
            try:
                model_language(t.language, _languages(self.ctx.model))
            except RealtimeError as e:
                e.event_id = u.event_id
                raise
        check_model(t.model, self.ctx.model.name, u.event_id)
        check_diarizing(t.model, self.ctx.model.num_speakers, u.event_id)
        model = t.model or rt.transcription_model
        speakers = transcription_diarization(t, model, self.ctx.model.num_speakers, u.event_id)
        phrases = transcription_phrases(t, self.ctx.settings.phrase_limits, encodable_characters(self.ctx.model.vocabulary),
                                        self.ctx.model.is_bpe, u.event_id)  # fmt: skip
        # Checked: from here on nothing refuses, so a refused update changed nothing.
        if t.language is not None:
            rt.language = t.language or None
        rt.transcription_model = model
        rt.max_speakers = speakers.get("max_speakers", rt.max_speakers)
        rt.split_on_speaker_change = speakers.get("split_on_speaker_change", rt.split_on_speaker_change)
        rt.prompt = t.prompt if t.prompt is not None else rt.prompt
        rt.phrases = phrases if phrases is not None else rt.phrases

    def _append(self, a: Append) -> None:
        s = self.session
        if not s.opened:
            self._open()
        if s.input_ended and s.end_reason == "end":
            raise ProtocolError("input_audio_buffer.append after input_audio_buffer.done")
        if not s.streaming:
            return  # refused, or the server ended input (drain, duration cap); the client may not know yet
        item = self.current or self._start_item()
        if item is None:
            return
        self._feed(item, item.decoder.decode(a.pcm))
        if len(a.pcm):
            self.appended_since_commit = True
            self._last_audio = time.monotonic()
        if a.force_eou and self.nim:
            self._force_nim_end(item)
        if self.num_model_samples >= self.ctx.settings.max_stream_s * self.ctx.model.geometry.sample_rate:
            s.end_input("max_stream_duration")

    def _speech_event(self, item: ItemStream, ev: SpeechEvent) -> None:
        """The detector's onset or end, on the session's audio clock (speech_started moved back by
        prefix_padding_ms, as OpenAI's is). An onset names the item that will hold the speech (the
        renderer's `announce`: the engine, behind the audio, has not decided yet which segment
        that is); the end names the same."""
        rate = self.ctx.model.geometry.sample_rate
        ms = ev.sample * 1000 / rate
        if ev.kind == "started":
            self.turn = self.renderer.announce(item, ev.sample / rate)
            pad_ms = self.rt.turn_detection.prefix_padding_ms or 0
            self._queue(event("input_audio_buffer.speech_started", item_id=self.turn.item_id,
                              audio_start_ms=max(0, round(ms - pad_ms))))  # fmt: skip
        elif self.turn is not None:
            self.turn.stop_s, turn, self.turn = ev.sample / rate, self.turn, None
            self._queue(event("input_audio_buffer.speech_stopped", item_id=turn.item_id, audio_end_ms=round(ms)))

    def _commit(self, b: BufferEvent) -> None:
        if self.nim and b.kind == "commit":
            return  # NIM's flush: the utterance goes on (nim_items.py); an error would end its client
        if b.kind == "clear":
            self._queue(event("input_audio_buffer.cleared"))
        if not self.session.streaming or not self.appended_since_commit or self.current is None:
            if b.kind == "commit":
                raise RealtimeError("buffer is empty: no audio was appended since the last commit",
                                    code="input_audio_buffer_commit_empty", event_id=b.event_id)  # fmt: skip
            return
        self.appended_since_commit = False
        item = self.current
        key = self.keys.key(item, item.segment)
        if b.kind == "clear":
            self.renderer.cleared.add(key)
            item.cleared_from = item.segment
        elif key not in self.renderer.committed:  # a second commit before the item ended joins it
            self._queue(self.renderer.committed_event(key, item))
        self._finish_item(item)

    def _done(self) -> None:
        s = self.session
        if not s.opened:
            self._open()
        if s.streaming:
            if self.current is None and not self.items:
                self._start_item()  # nothing open or decoding: an empty item carries is_last_result
            s.end_input("end")
        elif s.input_ended and s.end_reason == "end":
            raise ProtocolError("input_audio_buffer.done was already received")

    def end_input(self) -> None:
        """End of input (done, drain, duration cap; RealtimeSession.end_input): the current item is
        finished, the last item in flight is the session's last; close 1000 once it is done."""
        if self.current is not None:
            self._finish_item(self.current)
        if self.items:
            self.items[-1].last = True
        else:
            self.session.outbox.put(NormalClose(end_reason_text(self.session.end_reason)))

    # ------------------------------------------------------------------ items
    def _open(self) -> None:
        """Admit the session (the first append or done): refused as /ws refuses a stream. Each
        item then takes its own slot (_start_item)."""
        ctx, rt = self.ctx, self.rt
        try:
            self.language = model_language(rt.language, _languages(ctx.model))
        except RealtimeError as e:  # checked at the update already; the model has not changed
            raise ProtocolError(str(e)) from None
        if not self.session.open(rt.context_right):  # the session; each item takes its slot in _open_waiting
            return  # refused: the session is failing
        rate = ctx.model.geometry.sample_rate
        td = rt.turn_detection
        # An EOU model ending turns (engine/eou.py) is the session's turn detector: speech events come
        # from its tokens and its EOU, not from a second detector that would disagree with it.
        eou_turns = bool(EouTokens.from_vocabulary(ctx.model.vocabulary)) and self._endpoint_rules().eou_endings
        if td is not None and not eou_turns and speech_detector.available(rate):
            threshold = 0.5 if td.threshold is None else td.threshold  # OpenAI's default and silero's
            self.vad = SpeechDetector(rate, threshold, self._endpoint_rules().rule2_min_trailing_silence_s)

    # ------------------------------------------------------------------ send side
    def error_frame(self, reason: str, code: int) -> str:
        kind = "invalid_request_error" if code == CLOSE_PROTOCOL_ERROR else "server_error"
        return error_event(reason, type_=kind, code="session_closed").model_dump_json()

    def render(self, r: StreamResult) -> Rendered:
        return self.renderer.render(r)

    def _session_event(self, what: str):
        if self.dialect == "beta":
            return event(f"transcription_session.{what}", session=self.rt.beta())
        return event(f"session.{what}", session=self.rt.ga())


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
