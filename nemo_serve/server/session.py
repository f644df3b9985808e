"""One WebSocket: a named receive task, a named send task, and the engine stream they share.

  receive task: frames -> protocol state -> engine.push / finish / force_final (never writes)
  send task:    outbox (ready, engine results, close) -> JSON frames -> close (the only writer)
  run():        starts both, waits, and in `finally:` aborts the stream, so a slot is never leaked
                whatever way the socket ends (client gone, error, cancellation at shutdown).

The engine calls `_on_result` on its loop thread; the result crosses into the event loop with
`call_soon_threadsafe` and waits in the outbox (outbox.py: bounded, partials coalesced). Nothing
here blocks the loop thread. Every write has a deadline: --send-timeout-s for results, then
CLOSE_TIMEOUT_S for the error and close frames; a client that cannot take those either is
dropped (TCP), so a client that stops reading frees its slot in bounded time, pings or not.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace

import msgspec
from starlette.websockets import WebSocket

from ..engine.endpoint import EndpointConfig
from ..engine.results import StreamResult
from .audio import AudioDecoder, AudioError
from .context import Refused, ServerContext
from .logsafe import clean
from .outbox import Outbox, PartialTail
from .protocol import (
    CLOSE_NORMAL,
    CLOSE_PROTOCOL_ERROR,
    CLOSE_SERVER_ERROR,
    CLOSE_TOO_BIG,
    CLOSE_TRY_AGAIN_LATER,
    END_OF_INPUT_REPLY,
    MAX_REASON_CHARS,
    BareEndMessage,
    ConfigMessage,
    DoneMessage,
    EndMessage,
    ErrorMessage,
    ForceFinalMessage,
    ProtocolError,
    ProtocolState,
    FinalMessage,
    ReadyMessage,
    ResultMessage,
    WordInfo,
    check_transition,
    close_reason,
    parse_client_text,
    parse_query_config,
    with_defaults,
)
from .tokens import token_pieces

log = logging.getLogger("nemo_serve.session")
_numbers = itertools.count(1)

# Backpressure: a stream may run this far ahead of the model before we stop reading its socket
# (TCP then slows the client down). Without it, a client sending an hour of audio at full speed
# would park it all in server memory. Real-time clients are never near it.
MAX_AHEAD_S = 20.0
# A stream that failed (slow client, drain deadline, error) gets this long to put its `error`
# and close frames on the wire; then the TCP connection is dropped.
CLOSE_TIMEOUT_S = 1.0


@dataclass
class _Close:
    """Outbox item: send `error` (if any), then close with `code`."""

    code: int
    reason: str
    error: bool


class Session:
    def __init__(self, ws: WebSocket, ctx: ServerContext, query: Mapping[str, str] | None = None) -> None:
        """`query`: the URL's parameters, whose encoding and sample_rate are this stream's defaults
        (/ws and /; None for subclasses with their own formats). A bad one is refused in run()."""
        self.ws = ws
        self.ctx = ctx
        self.number = next(_numbers)  # for task names and logs
        self.state = ProtocolState.CONNECTED
        self.outbox = Outbox()  # ReadyMessage | StreamResult | _Close
        self.tail = PartialTail()  # what the client holds of the current segment
        self.config = ConfigMessage(encoding=ctx.settings.default_encoding)  # until the client's config
        self._query_error: str | None = None
        if query is not None:
            try:
                self.config = parse_query_config(query, ctx.settings.default_encoding)
                ctx.model.geometry_for(self.config.context_right)  # a mode not served: refused before any audio
            except (ProtocolError, ValueError) as e:
                self._query_error = str(e)
        self.reply_done_text = False  # the client ended with bare "Done"/"eof": send "Done!" (sherpa-onnx)
        self.stream = None  # the engine's handle (has .stream_id) once admitted
        self.mode_label = str(ctx.model.geometry.context_right)  # the stream's chunk mode, for metrics
        self.decoder: AudioDecoder | None = None
        self.end_reason: str | None = None  # why input ended: "end", "draining", "max_stream_duration"
        self.closing = False  # a _Close is queued: ignore everything else
        self.client_gone = False
        self._loop = asyncio.get_running_loop()
        self._last_message = time.monotonic()
        self._opened_at = 0.0
        self._audio_processed_s = 0.0
        self._progress = asyncio.Event()  # set when the model consumed more audio, or the stream ends

    # ------------------------------------------------------------------ lifecycle
    async def run(self) -> None:
        self.ctx.add(self)
        if self._query_error is not None:  # refused as a bad config message is: error, then 1008
            self.fail(self._query_error, reason_label="bad_config")
        recv = asyncio.create_task(self._receive_loop(), name=f"ws{self.number}-receive")
        send = asyncio.create_task(self._send_loop(), name=f"ws{self.number}-send")
        try:
            await asyncio.wait({recv, send}, return_when=asyncio.FIRST_COMPLETED)
            if recv.done() and recv.exception() is not None:
                log.error("ws%d receive task failed", self.number, exc_info=recv.exception())
                self.fail("internal server error", code=CLOSE_SERVER_ERROR, reason_label="internal")
            if not send.done() and not self.client_gone:
                await send  # flush the results still owed, the error if any, then close
        finally:
            self._abort("connection closed")
            for task in (recv, send):
                task.cancel()
            await asyncio.gather(recv, send, return_exceptions=True)
            if self.state is ProtocolState.STREAMING or self.state is ProtocolState.ENDING:
                self.ctx.metrics.stream_closed(self.mode_label)
            if self.state is not ProtocolState.CLOSED:
                self._set_state(ProtocolState.CLOSED)
            self.ctx.remove(self)

    def drain(self) -> None:
        """Server shutdown: end input so the stream's final comes out; no slot yet: refuse."""
        if self.state is ProtocolState.CONNECTED:
            self.fail("server is draining (shutting down)", code=CLOSE_TRY_AGAIN_LATER, reason_label="draining")
        elif self.state is ProtocolState.STREAMING:
            self._end_input("draining")

    def fail(self, reason: str, code: int = CLOSE_PROTOCOL_ERROR, reason_label: str = "protocol") -> None:
        """Abort the stream (its slot comes back between steps), tell the client why, close.
        Idempotent. The close jumps the outbox queue: results still waiting are dropped."""
        if self.closing or self.client_gone:
            return
        self.closing = True
        self._progress.set()
        self._abort(reason)
        self.ctx.metrics.stream_errors.labels(reason=reason_label).inc()
        reason = clean(reason, MAX_REASON_CHARS)
        log.info("ws%d error (%s): %s", self.number, reason_label, reason)
        self.outbox.put_first(_Close(code, reason, error=True))

    def drop(self) -> None:
        """Drop the TCP connection now (a client that could not take its close frame in time).
        Without the hook (a server other than ours, the test client) the close stays pending."""
        self._abort("connection dropped")
        abort = self.ws.scope.get("extensions", {}).get("nemo_serve.connection", {}).get("abort")
        if abort is not None:
            log.info("ws%d dropped: the client does not read", self.number)
            self.client_gone = True
            abort()

    def _set_state(self, new: ProtocolState) -> None:
        self.state = check_transition(self.state, new)

    def _abort(self, reason: str) -> None:
        if self.stream is not None:
            self.ctx.engine.abort(self.stream, reason)  # idempotent; a no-op once the stream is done

    # ------------------------------------------------------------------ receive task
    async def _receive_loop(self) -> None:
        while not self.closing:
            timeout = self._receive_timeout()
            try:
                message = await asyncio.wait_for(self.ws.receive(), timeout)
            except asyncio.TimeoutError:  # TimeoutError itself only from 3.11
                self._on_timeout()
                continue
            if message["type"] == "websocket.disconnect":
                self._on_disconnect(message.get("code", 1005))
                return
            self._last_message = time.monotonic()
            try:
                if message.get("bytes") is not None:
                    self._on_audio(message["bytes"])
                else:
                    self._on_text(message.get("text") or "")
            except (ProtocolError, AudioError) as e:
                self.fail(str(e), reason_label="bad_audio" if isinstance(e, AudioError) else "protocol")
            await self._wait_for_model()

    async def _wait_for_model(self) -> None:
        """Stop reading while the model is more than MAX_AHEAD_S behind this stream's input."""
        while (
            self.state is ProtocolState.STREAMING
            and not self.closing
            and self.decoder.input_seconds - self._audio_processed_s > MAX_AHEAD_S
        ):
            self._progress.clear()
            await self._progress.wait()
            self._last_message = time.monotonic()  # waiting on us is not the client being idle

    def _receive_timeout(self) -> float | None:
        """Idle timeout while input is open (a client that went silent holds nothing forever);
        the stream duration cap while streaming; none once input ended (the server owes results,
        and the drain deadline bounds that wait at shutdown)."""
        s = self.ctx.settings
        now = time.monotonic()
        if self.state is ProtocolState.CONNECTED:
            return max(0.0, self._last_message + s.idle_timeout_s - now)
        if self.state is ProtocolState.STREAMING:
            idle = self._last_message + s.idle_timeout_s
            return max(0.0, min(idle, self._opened_at + s.max_stream_s) - now)
        return None

    def _on_timeout(self) -> None:
        s = self.ctx.settings
        now = time.monotonic()
        if self.state is ProtocolState.STREAMING and now >= self._opened_at + s.max_stream_s:
            self._end_input("max_stream_duration")
        elif self.state is not ProtocolState.ENDING and now >= self._last_message + s.idle_timeout_s:
            self.fail(f"idle timeout: no message for {s.idle_timeout_s:g} s", reason_label="idle_timeout")

    def _on_disconnect(self, code: int) -> None:
        self.client_gone = True
        if code == CLOSE_TOO_BIG:  # the transport refused an oversized frame and closed already
            self.ctx.metrics.stream_errors.labels(reason="message_too_big").inc()
        # Otherwise a client may leave at any time: run()'s finally aborts the stream.
        log.debug("ws%d client disconnected (%s) in state %s", self.number, code, self.state.value)

    def _on_text(self, text: str) -> None:
        msg = parse_client_text(text)
        if isinstance(msg, ConfigMessage):
            if self.state is not ProtocolState.CONNECTED:
                raise ProtocolError("config must be the first message (it came after audio or another config)")
            self._open(with_defaults(msg, self.config))
        elif isinstance(msg, EndMessage):
            self.reply_done_text = isinstance(msg, BareEndMessage)
            if self.state is ProtocolState.CONNECTED:
                self._open(self.config)
            if self.state is ProtocolState.STREAMING:
                self._end_input("end")
            elif self.end_reason == "end":
                raise ProtocolError("end of input was already received")
        elif isinstance(msg, ForceFinalMessage):
            if self.state is ProtocolState.CONNECTED:
                self._open(self.config)
            if self.state is ProtocolState.STREAMING:
                self.ctx.engine.force_final(self.stream)

    def _on_audio(self, data: bytes) -> None:
        if self.state is ProtocolState.CONNECTED:
            self._open(self.config)  # no config message: the URL's or the server's defaults
        self._push_audio(data, "audio after end of input")

    def _push_audio(self, data: bytes, after_end: str) -> int | None:
        """Decode one packet of the client's audio and hand it to the engine; the model-rate
        samples it gave, or None if the packet was not taken (input already ended)."""
        if self.state is ProtocolState.ENDING:
            if self.end_reason == "end":
                raise ProtocolError(after_end)
            return None  # the server ended input (drain, duration cap); the client may not know yet
        if self.state is not ProtocolState.STREAMING:
            return None
        samples = self.decoder.decode(data)
        if len(samples):
            self.ctx.engine.push(self.stream, samples)
        if self.decoder.input_seconds >= self.ctx.settings.max_stream_s:
            self._end_input("max_stream_duration")
        return len(samples)

    # ------------------------------------------------------------------ stream
    def _open(self, config: ConfigMessage) -> None:
        """Take a slot, or refuse: the only place a stream is admitted."""
        self.config = config
        ctx, model = self.ctx, self.ctx.model
        try:
            self.stream = ctx.admit(
                self._on_result, language=config.language, endpoint=self._endpoint(config),
                context_right=config.context_right, phrases=config.phrases, boost=config.boost,
            )
        except Refused as e:
            self.fail(e.reason, code=CLOSE_TRY_AGAIN_LATER, reason_label="refused")
            return
        except ValueError as e:  # unknown language or mode (the message lists the valid ones), bad phrases
            self.fail(str(e), reason_label="bad_config")
            return
        rate = model.geometry.sample_rate
        self.decoder = AudioDecoder(config.encoding, config.sample_rate or rate, rate)
        self._opened_at = time.monotonic()
        self._set_state(ProtocolState.STREAMING)
        mode = model.geometry_for(config.context_right)
        self.mode_label = str(mode.context_right)
        ctx.metrics.stream_opened(self.mode_label)
        self.outbox.put(
            ReadyMessage(
                id=config.id,
                stream_id=self.stream.stream_id,
                chunk_ms=mode.chunk_ms,
                context_right=mode.context_right,
                sample_rate=rate,
                input_sample_rate=self.decoder.input_rate,
                encoding=config.encoding,
                interim_results=config.interim_results,
                language=config.language or model.default_language,
                max_message_bytes=ctx.settings.max_message_bytes,
            )
        )

    def _endpoint(self, config: ConfigMessage) -> EndpointConfig:
        base = self.ctx.settings.endpoint_config
        if config.endpointing is None:
            return base
        override = {k: v for k, v in config.endpointing.model_dump().items() if v is not None}
        return replace(base, **override).validated()

    def _end_input(self, reason: str) -> None:
        tail = self.decoder.flush()
        if len(tail):
            self.ctx.engine.push(self.stream, tail)
        self.ctx.engine.finish(self.stream)
        self.end_reason = reason
        self._set_state(ProtocolState.ENDING)
        self._progress.set()

    def _on_result(self, result: StreamResult) -> None:
        """Engine callback, on the loop thread: hand over and return at once."""
        try:
            self._loop.call_soon_threadsafe(self._take_result, result)
        except RuntimeError:  # event loop closed at shutdown: nobody is listening any more
            pass

    def _take_result(self, r: StreamResult) -> None:
        """On the event loop: count the model's progress (whether or not the client reads, so
        the receive task's backpressure never waits on the client), then queue what is sent."""
        if self.closing or self.client_gone:
            return
        if r.error is not None:
            self.fail(f"engine error: {r.error}", code=CLOSE_SERVER_ERROR, reason_label="engine")
            return
        self.ctx.metrics.audio_seconds.inc(max(0.0, r.audio_processed_s - self._audio_processed_s))
        self._audio_processed_s = max(self._audio_processed_s, r.audio_processed_s)
        self._progress.set()
        if not (r.is_final or r.done or self.config.interim_results):
            return
        if not self.outbox.put(r):
            self.fail(
                f"client is not reading results ({len(self.outbox)} messages waiting)", reason_label="slow_client"
            )

    # ------------------------------------------------------------------ send task
    async def _send_loop(self) -> None:
        try:
            while True:
                item = await self.outbox.get()
                if isinstance(item, _Close):
                    await self._send_close(item)
                    return
                if self.closing:
                    continue  # results that raced the error are dropped
                try:
                    if isinstance(item, StreamResult):
                        if await self._send_result(item):
                            return
                    else:
                        await self._send(item)
                except asyncio.TimeoutError:
                    timeout_s = self.ctx.settings.send_timeout_s
                    self.fail(f"client is not reading results (none written for {timeout_s:g} s)",
                              reason_label="slow_client")  # fmt: skip
        except Exception as e:  # noqa: BLE001 - the client went away mid-send; run() cleans up
            log.debug("ws%d send failed: %r", self.number, e)
            self.client_gone = True

    async def _send_close(self, item: _Close) -> None:
        try:
            async with asyncio.timeout(CLOSE_TIMEOUT_S):
                if item.error:
                    await self.ws.send_text(ErrorMessage(id=self.config.id, reason=item.reason).model_dump_json())
                await self.ws.close(item.code, close_reason(item.reason))
        except TimeoutError:
            self.drop()

    async def _send(self, msg) -> None:
        """One frame, or TimeoutError when the socket took nothing for --send-timeout-s."""
        await asyncio.wait_for(self.ws.send_text(msg.model_dump_json()), self.ctx.settings.send_timeout_s)

    async def _send_result(self, r: StreamResult) -> bool:
        """Send one engine result (and `done` after the last one); True when the socket is closed."""
        if r.is_final or self.config.interim_results:
            m, vocabulary = self.ctx.metrics, self.ctx.model.vocabulary
            token_offset, text_offset = self.tail.offsets(r)
            ids = r.token_ids[token_offset:]
            sent = time.time()
            final = {"words": [WordInfo(**msgspec.structs.asdict(w)) for w in r.words or ()]} if r.is_final else {}
            await self._send(
                (FinalMessage if r.is_final else ResultMessage)(
                    type="final" if r.is_final else "partial",
                    id=self.config.id,
                    stream_id=r.stream_id,
                    segment=r.segment,
                    is_final=r.is_final,
                    text=r.text[text_offset:],
                    tokens=token_pieces(vocabulary, ids),
                    token_ids=ids,
                    timestamps=r.token_times_s[token_offset:],
                    token_offset=token_offset,
                    text_offset=text_offset,
                    start_time=r.segment_start_s,
                    audio_processed=r.audio_processed_s,
                    audio_arrival_time=r.audio_arrival_time,
                    sent_time=sent,
                    **final,
                )
            )
            m.result_sent(r.is_final, self.mode_label, max(0.0, sent - r.audio_arrival_time))
        if not r.done:
            return False
        if self.reply_done_text:
            # sherpa-onnx's clients stop reading at "Done!" and print the message before it as
            # the result, so it comes after the last final and before `done` (rejected: "Done!"
            # after `done`, which those clients would print as the transcript).
            await asyncio.wait_for(self.ws.send_text(END_OF_INPUT_REPLY), self.ctx.settings.send_timeout_s)
        await self._send(
            DoneMessage(
                id=self.config.id,
                stream_id=r.stream_id,
                audio_processed=r.audio_processed_s,
                reason=self.end_reason or "end",
            )
        )
        await asyncio.wait_for(self.ws.close(CLOSE_NORMAL), self.ctx.settings.send_timeout_s)
        return True
