"""/v1/realtime: one OpenAI Realtime transcription session per socket, on the /ws machinery.

A `Session` (session.py) with another wire format: the same receive and send tasks, admission,
limits, idle and duration timeouts, backpressure, bounded outbox, drain and `finally:` abort; only
what a frame means and what a result looks like differ. The engine stream and its tokens are
/ws's: the same decoder (PCM16 at 24 kHz resampled by soxr), push, finish and force_final.

  session.created        at once (the slot is taken at the first append, as /ws takes it at the
                         first message, so a socket that only configures holds none)
  append                 -> decode, engine.push
  commit                 -> input_audio_buffer.committed now; the item ends (engine.force_final)
                            once the model has decoded every whole chunk of the audio appended
                            before the commit. Rejected: force_final at once, which publishes the
                            item before a fast sender's audio is decoded and leaves it nearly empty.
  clear                  -> input_audio_buffer.cleared; the current item ends the same way, and
                            its completion is not sent (its audio still went through the model)
  input_audio_buffer.done (NIM) -> end of input: the last item is completed with
                            `is_last_result: true`, then close 1000
  endpointer final       -> speech_stopped, committed, completed (turn_detection on)
  partial                -> speech_started (first text of an item), delta (text not sent yet)

Items map one-to-one to the engine's segments; `item_id`s chain by `previous_item_id`. The
audio before a commit that does not fill a model chunk (under one chunk) cannot be decoded until
more audio or the end of input comes, so it opens the next item; `input_audio_buffer.done`
decodes it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import replace

import msgspec
from starlette.websockets import WebSocket

from ..engine.endpoint import EndpointConfig
from ..engine.errors import NoFreeSlotError
from ..engine.geometry import frames_available
from ..engine.phrases import encodable_characters
from ..engine.results import StreamResult
from .audio import AudioDecoder
from .context import ServerContext
from .logsafe import clean
from .protocol import (
    CLOSE_NORMAL,
    CLOSE_PROTOCOL_ERROR,
    CLOSE_TRY_AGAIN_LATER,
    MAX_REASON_CHARS,
    ConfigMessage,
    ProtocolError,
    ProtocolState,
    close_reason,
)
from .realtime_protocol import (
    Append,
    BufferEvent,
    RealtimeConfig,
    RealtimeError,
    SessionUpdate,
    TurnDetection,
    error_event,
    event,
    model_language,
    new_id,
    parse_client_event,
    transcription_phrases,
)
from .session import CLOSE_TIMEOUT_S, Session, _Close

log = logging.getLogger("nemo_serve.realtime")

TRANSCRIPTION = "conversation.item.input_audio_transcription"


class RealtimeSession(Session):
    def __init__(self, ws: WebSocket, ctx: ServerContext) -> None:
        super().__init__(ws, ctx)
        # The beta SDK says so in a header; a NIM client says so with its first update. Until
        # then, GA.
        self.dialect = "beta" if "realtime=v1" in ws.headers.get("openai-beta", "") else "ga"
        self.rt = RealtimeConfig(turn_detection=_turn_detection(ctx.settings.endpoint_config))
        self.rt.transcription_model = ctx.model.name
        # Owner: the event loop (receive side, and the send task for what results announce).
        self.segment_to_item: dict[int, str] = {}  # engine segment -> item_id
        self.last_item_id: str | None = None  # the previous completed or committed item
        self.segment = 0  # the engine segment now being filled (receive side's view)
        self.sent_text = ""  # what the deltas of the current segment carried
        self.speaking = False  # speech_started sent for the current segment
        self.committed: set[int] = set()  # segments a committed event announced
        self.cleared: set[int] = set()  # segments whose completion is not sent
        self.commit_targets: deque[float] = deque()  # audio_processed_s that ends a pending item
        self.final_requested: int | None = None  # segment a force_final was asked for, until its final
        self.num_model_samples = 0  # samples pushed to the engine, at the model's rate
        self.appended_since_commit = False
        self.outbox.put(self._session_event("created"))

    # ------------------------------------------------------------------ receive side
    def _on_audio(self, data: bytes) -> None:
        self._nonfatal(RealtimeError("binary frames are not part of this protocol; send input_audio_buffer.append"))

    def _on_text(self, text: str) -> None:
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
        if not self.closing and not self.outbox.put(ev):
            self.fail(f"client is not reading events ({len(self.outbox)} waiting)", reason_label="slow_client")

    def _update(self, u: SessionUpdate) -> None:
        self.dialect = u.dialect
        if self.state is not ProtocolState.CONNECTED and (u.rate or u.turn_detection_set or _language(u) or _phrases(u)):
            raise RealtimeError(
                "audio format, language, phrases and turn_detection cannot change once audio was appended",
                code="session_update_after_audio", event_id=u.event_id,
            )  # fmt: skip
        rt = self.rt
        if u.transcription is not None:
            if u.transcription.language is not None:
                try:
                    model_language(u.transcription.language, _languages(self.ctx.model))
                except RealtimeError as e:
                    e.event_id = u.event_id
                    raise
                rt.language = u.transcription.language or None
            rt.transcription_model = u.transcription.model or rt.transcription_model
            rt.prompt = u.transcription.prompt if u.transcription.prompt is not None else rt.prompt
            phrases = transcription_phrases(u.transcription, self.ctx.settings.phrase_limits,
                                            encodable_characters(self.ctx.model.vocabulary), self.ctx.model.is_bpe,
                                            u.event_id)  # fmt: skip
            rt.phrases = phrases if phrases is not None else rt.phrases
        rt.rate = u.rate or rt.rate
        if u.turn_detection_set:
            rt.turn_detection = u.turn_detection
        self._queue(self._session_event("updated"))

    def _append(self, a: Append) -> None:
        if self.state is ProtocolState.CONNECTED:
            self._open()
        n = self._push_audio(a.pcm, "input_audio_buffer.append after input_audio_buffer.done")
        if n is not None:
            self.num_model_samples += n
            self.appended_since_commit = self.appended_since_commit or len(a.pcm) > 0

    def _commit(self, b: BufferEvent) -> None:
        if b.kind == "clear":
            self._queue(event("input_audio_buffer.cleared"))
        if self.state is not ProtocolState.STREAMING or not self.appended_since_commit:
            if b.kind == "commit":
                raise RealtimeError("buffer is empty: no audio was appended since the last commit",
                                    code="input_audio_buffer_commit_empty", event_id=b.event_id)  # fmt: skip
            return
        self.appended_since_commit = False
        if b.kind == "clear":
            self.cleared.add(self.segment)
        elif self.segment not in self.committed:  # a second commit before the item ended joins it
            self._queue(self._committed_event(self.segment))
        self.commit_targets.append(self._decodable_s())
        self._end_items()

    def _done(self) -> None:
        if self.state is ProtocolState.CONNECTED:
            self._open()
        if self.state is ProtocolState.STREAMING:
            self._end_input("end")
        elif self.end_reason == "end":
            raise ProtocolError("input_audio_buffer.done was already received")

    def _decodable_s(self) -> float:
        """audio_processed_s once the model has stepped every whole chunk of what was pushed
        (the engine's readiness rule, engine/frontend.frames_available: a chunk needs its feature windows)."""
        g, margin = self.ctx.model.geometry, self.ctx.model.feature_margin
        n = self.num_model_samples
        frames = int(frames_available(n, False, g.hop_samples, margin))
        if frames < g.first_frames:
            return 0.0
        frames = g.first_frames + (frames - g.first_frames) // g.chunk_frames * g.chunk_frames
        return round(frames * g.hop_samples / g.sample_rate, 3)

    def _end_items(self) -> None:
        """force_final for the pending commits the model has caught up with. One request at a
        time: requests the loop has not taken yet merge into one final (a flag), and the
        segment count here would run ahead of the engine's."""
        if self.final_requested is not None:
            return
        due = False
        while self.commit_targets and self.commit_targets[0] <= self._audio_processed_s + 1e-6:
            self.commit_targets.popleft()
            due = True
        if due and self.state is ProtocolState.STREAMING:
            self.ctx.engine.force_final(self.stream)
            self.final_requested = self.segment
            self.segment += 1

    def _open(self) -> None:
        """Take a slot, or refuse: as Session._open, with the session's config and no `ready`."""
        ctx, rt = self.ctx, self.rt
        try:
            language = model_language(rt.language, _languages(ctx.model))
        except RealtimeError as e:  # checked at the update already; the model has not changed
            raise ProtocolError(str(e)) from None
        self.config = ConfigMessage(sample_rate=rt.rate, encoding="pcm_s16le", language=language)
        refusal = ctx.refusal()
        if refusal is None:
            try:
                boost = {"phrases": list(rt.phrases.phrases), "boost": rt.phrases.boost} if rt.phrases else {}
                self.stream = ctx.engine.open_stream(self._on_result, language=language, endpoint=self._endpoint_rules(),
                                                     **boost)  # fmt: skip
            except NoFreeSlotError as e:
                refusal = "no_free_slot", f"no free slot ({e}); retry later"
            except ValueError as e:  # the server-wide phrase total (the rest was checked at the update)
                self.fail(str(e), reason_label="bad_config")
                return
        if refusal is not None:
            label, reason = refusal
            ctx.metrics.refusals.labels(reason=label).inc()
            self.fail(reason, code=CLOSE_TRY_AGAIN_LATER, reason_label="refused")
            return
        rate = ctx.model.geometry.sample_rate
        self.decoder = AudioDecoder("pcm_s16le", rt.rate, rate)
        self._opened_at = time.monotonic()
        self._set_state(ProtocolState.STREAMING)
        self.mode_label = str(ctx.model.geometry.context_right)  # the default mode
        ctx.metrics.stream_opened(self.mode_label)

    def _endpoint_rules(self) -> EndpointConfig:
        base, td = self.ctx.settings.endpoint_config, self.rt.turn_detection
        if td is None:
            return EndpointConfig.off()
        if td.silence_duration_ms:
            return replace(base, enabled=True, rule2_min_trailing_silence_s=td.silence_duration_ms / 1000).validated()
        return replace(base, enabled=True)

    def _take_result(self, r: StreamResult) -> None:
        super()._take_result(r)
        if r.is_final and r.segment >= self.segment:  # an endpoint closed it (or the end)
            self.segment = r.segment + 1
            self.commit_targets.clear()  # commits of the closed segment came due with it
        if r.is_final and self.final_requested is not None and r.segment >= self.final_requested:
            self.final_requested = None
        self._end_items()

    # ------------------------------------------------------------------ send side
    async def _send_close(self, item: _Close) -> None:
        try:
            async with asyncio.timeout(CLOSE_TIMEOUT_S):
                if item.error:
                    kind = "invalid_request_error" if item.code == CLOSE_PROTOCOL_ERROR else "server_error"
                    await self.ws.send_text(error_event(item.reason, type_=kind, code="session_closed").model_dump_json())
                await self.ws.close(item.code, close_reason(item.reason))
        except TimeoutError:
            self.drop()

    async def _send_result(self, r: StreamResult) -> bool:
        item_id = self.segment_to_item.setdefault(r.segment, new_id("item"))
        cleared = r.segment in self.cleared
        tds = self.rt.turn_detection is not None
        if not cleared and r.text.startswith(self.sent_text) and len(r.text) > len(self.sent_text):
            if tds and not self.speaking and r.token_times_s:
                self.speaking = True
                await self._send(event("input_audio_buffer.speech_started", item_id=item_id,
                                       audio_start_ms=int(r.token_times_s[0] * 1000)))  # fmt: skip
            await self._send(event(f"{TRANSCRIPTION}.delta", item_id=item_id, content_index=0,
                                   delta=r.text[len(self.sent_text):]))  # fmt: skip
            self.sent_text = r.text
        if r.is_final:
            await self._send_final(r, item_id, cleared)
        if not r.done:
            return False
        reason = {"end": "end of input", "draining": "server is draining (shutting down)"}.get(self.end_reason or "end")
        await asyncio.wait_for(self.ws.close(CLOSE_NORMAL, reason or "maximum stream duration reached"),
                               self.ctx.settings.send_timeout_s)  # fmt: skip
        return True

    async def _send_final(self, r: StreamResult, item_id: str, cleared: bool) -> None:
        announced = r.segment in self.committed
        self.sent_text, self.speaking = "", False
        if cleared or not (r.text or announced or r.done):
            return  # silence the endpointer closed, or an item the client cleared
        if not announced:  # the endpointer ended it: what server VAD says
            if self.rt.turn_detection is not None and not r.done:
                ms = int(r.audio_processed_s * 1000)
                await self._send(event("input_audio_buffer.speech_stopped", item_id=item_id, audio_end_ms=ms))
            await self._send(self._committed_event(r.segment))
        vocabulary = self.ctx.model.vocabulary
        extra = {"is_last_result": True} if r.done else {}
        await self._send(event(
            f"{TRANSCRIPTION}.completed", item_id=item_id, content_index=0, transcript=r.text,
            usage={"type": "duration", "seconds": round(max(0.0, r.audio_processed_s - r.segment_start_s), 3)},
            nemo_serve={
                "segment": r.segment,
                "tokens": [vocabulary[t] if t < len(vocabulary) else "" for t in r.token_ids],
                "token_ids": r.token_ids,
                "timestamps": r.token_times_s,
                "words": [msgspec.structs.asdict(w) for w in r.words or ()],
                "start_time": r.segment_start_s,
                "audio_processed": r.audio_processed_s,
            },
            **extra,
        ))  # fmt: skip

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


