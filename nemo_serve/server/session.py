"""/v1/realtime's WebSocket: transport and lifecycle (the CLOSE_TIMEOUT_S of every WebSocket).
/ws runs on a StreamSession (stream_session.py) with its thin transport in ws_socket.py; realtime
goes there next, as an item manager over StreamSessions.

  Session (here)       owns the socket and the stream's lifecycle: a named receive task and
                       send task, the protocol state (CONNECTED -> STREAMING -> ENDING -> CLOSED),
                       admission (`open`: the one call, ServerContext.admit), idle and duration
                       timeouts, backpressure, the bounded outbox, drain, the error and close
                       frames, and in `finally:` the abort of every engine stream, so a slot is
                       never leaked whatever way the socket ends (lifecycle.py).
  WireFormat (below)   parses a client frame and acts through the session's public methods
                       (open, end_input, queue, fail), owns its engine streams, and renders the
                       results the send task takes from the outbox: realtime.py.

  receive task: frames -> wire.on_text / on_bytes -> engine.push / finish (never writes)
  send task:    outbox (messages, engine results, Close) -> frames -> close (the only writer)

`engine_callback` (lifecycle.py) moves an engine result into the event loop, where it waits in
the outbox (outbox.py: bounded, partials coalesced). Every write has a deadline: --send-timeout-s for
results, then CLOSE_TIMEOUT_S for the error and close frames; a client that cannot take those
either is dropped (TCP), so a client that stops reading frees its slot in bounded time.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from starlette.websockets import WebSocket

from ..engine.results import StreamResult
from .audio import AudioError
from .context import Refused, ServerContext
from .lifecycle import StreamLifecycle
from .stream_session import MAX_AHEAD_S  # backpressure: one bound for every protocol
from .protocol import (
    CLOSE_SERVER_ERROR,
    CLOSE_TOO_BIG,
    CLOSE_TRY_AGAIN_LATER,
    ProtocolError,
    ProtocolState,
    check_transition,
    close_reason,
)

log = logging.getLogger("nemo_serve.session")
_numbers = itertools.count(1)

# A stream that failed (slow client, drain deadline, error) gets this long to put its `error`
# and close frames on the wire; then the TCP connection is dropped.
CLOSE_TIMEOUT_S = 1.0


@dataclass
class Close:
    """Outbox item: send the wire format's error frame (if `error`), then close with `code`."""

    code: int
    reason: str
    error: bool


class WireFormat(Protocol):
    """One WebSocket protocol: what the session asks of it. It is made with its session
    (`make_wire(session)`) and reaches the engine, the model and the settings through
    `session.ctx`. ProtocolError or AudioError raised by on_text / on_bytes fail the stream."""

    config_error: str | None  # a bad URL parameter: refused with 1008 before any frame is read

    def on_text(self, text: str) -> None: ...

    def on_bytes(self, data: bytes) -> None: ...

    def end_input(self) -> None:
        """Input ended (the client, drain, the duration cap): decode every engine stream to its end."""

    def abort(self, reason: str) -> None:
        """Abort every engine stream (idempotent; a no-op for streams already done)."""

    def behind_s(self) -> float:
        """Input the model has not consumed yet, in seconds (backpressure; while STREAMING)."""

    def reading_resumed(self) -> None:
        """The receive task reads again after waiting for the model (backpressure)."""

    def receive_timeout(self, timeout_s: float | None) -> float | None:
        """The receive wait: the session's idle and duration clocks, or shorter."""

    def on_timeout(self, now: float) -> bool:
        """The receive wait ran out; True when the wire format handled it (else the session's
        idle and duration rules apply)."""

    def error_frame(self, reason: str, code: int) -> str:
        """The text frame sent before a failure's close."""

    async def send_result(self, r: StreamResult) -> bool:
        """Render and send one engine result from the outbox; True once the socket is closed."""


class Session(StreamLifecycle):
    def __init__(self, ws: WebSocket, ctx: ServerContext, make_wire: Callable[["Session"], WireFormat]) -> None:
        number = next(_numbers)
        super().__init__(ctx, f"ws{number}", log)  # outbox: rendered messages | StreamResult | Close
        self.ws = ws
        self.number = number  # for task names and logs
        self.state = ProtocolState.CONNECTED
        self.end_reason: str | None = None  # why input ended: "end", "draining", "max_stream_duration"
        self.last_message = time.monotonic()  # the idle clock
        # run() reached its `finally:` (streams aborted): no frame is handled after this. The
        # receive task's cancel is not enough: asyncio.wait_for before Python 3.12 returns a frame
        # that arrived with the cancel instead of raising, and the frame (an append) opened an
        # engine stream that nothing aborted (issue 45: a clean close right after appends leaked).
        self.finished = False
        self.wire = make_wire(self)

    # ------------------------------------------------------------------ lifecycle
    async def run(self) -> None:
        self.ctx.add(self)
        if self.wire.config_error is not None:  # refused as a bad config message is: error, then 1008
            self.fail(self.wire.config_error, reason_label="bad_config")
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
            self.finished = True
            self.abort_streams("connection closed")
            for task in (recv, send):
                task.cancel()
            await asyncio.gather(recv, send, return_exceptions=True)
            self.settle()
            if self.state is not ProtocolState.CLOSED:
                self._set_state(ProtocolState.CLOSED)
            self.ctx.remove(self)

    def open(self, context_right: int | None, on_result: Callable | None = None, **stream_options):
        """Admit this socket's stream (ServerContext.admit, the only admission) and start
        streaming in mode `context_right`. With `on_result` the engine stream is opened with the
        options and its handle returned; without, only the admission is judged (a wire format
        whose engine streams open later). Refused: 1013; options the engine does not serve:
        1008; either way the session stays CONNECTED, which is what callers check."""
        try:
            handle = self.admit(on_result, context_right, **stream_options)
        except Refused as e:
            self.fail(e.reason, code=CLOSE_TRY_AGAIN_LATER, reason_label="refused")
            return None
        except ValueError as e:  # unknown language or mode (the message lists the valid ones), bad phrases
            self.fail(str(e), reason_label="bad_config")
            return None
        self._set_state(ProtocolState.STREAMING)
        return handle

    def end_input(self, reason: str) -> None:
        """Input ends (`reason`: "end", "draining", "max_stream_duration"): the wire format
        decodes its streams to their end; the results still owed are sent, then the close."""
        self.end_reason = reason
        self.wire.end_input()
        self._set_state(ProtocolState.ENDING)
        self._progress.set()

    def drain(self) -> None:
        """Server shutdown: end input so the stream's final comes out; no slot yet: refuse."""
        if self.state is ProtocolState.CONNECTED:
            self.fail("server is draining (shutting down)", code=CLOSE_TRY_AGAIN_LATER, reason_label="draining")
        elif self.state is ProtocolState.STREAMING:
            self.end_input("draining")

    def abort_streams(self, reason: str) -> None:
        self.wire.abort(reason)

    def ending_item(self, reason: str, code: int) -> Close:
        """After a failure: the wire format's error frame, then the close."""
        return Close(code, reason, error=True)

    def close(self, code: int, reason: str) -> None:
        """Close normally once what is queued before it was sent."""
        self.outbox.put(Close(code, reason, error=False))

    def drop(self) -> None:
        """Drop the TCP connection now (a client that could not take its close frame in time).
        Without the hook (a server other than ours, the test client) the close stays pending."""
        self.wire.abort("connection dropped")
        abort = self.ws.scope.get("extensions", {}).get("nemo_serve.connection", {}).get("abort")
        if abort is not None:
            log.info("ws%d dropped: the client does not read", self.number)
            self.client_gone = True
            abort()

    def _set_state(self, new: ProtocolState) -> None:
        self.state = check_transition(self.state, new)

    # ------------------------------------------------------------------ engine results
    def consumed(self, seconds: float) -> None:
        """The model consumed `seconds` more of this socket's audio (counted whether or not the
        client reads, so backpressure never waits on the client)."""
        self.ctx.metrics.audio_seconds.inc(max(0.0, seconds))
        self._progress.set()

    def queue(self, item) -> None:
        """A result (or rendered message) for the send task; a full outbox: the client is not reading."""
        if not self.outbox.put(item):
            self.fail(f"client is not reading results ({len(self.outbox)} messages waiting)",
                      reason_label="slow_client")  # fmt: skip

    # ------------------------------------------------------------------ receive task
    async def _receive_loop(self) -> None:
        while not self.closing:
            timeout = self.wire.receive_timeout(self._receive_timeout())
            try:
                message = await asyncio.wait_for(self.ws.receive(), timeout)
            except asyncio.TimeoutError:  # TimeoutError itself only from 3.11
                self._on_timeout()
                continue
            if self.finished:
                return  # a frame that raced run()'s end (see `finished`)
            if message["type"] == "websocket.disconnect":
                self._on_disconnect(message.get("code", 1005))
                return
            self.last_message = time.monotonic()
            try:
                if message.get("bytes") is not None:
                    self.wire.on_bytes(message["bytes"])
                else:
                    self.wire.on_text(message.get("text") or "")
            except (ProtocolError, AudioError) as e:
                self.fail(str(e), reason_label="bad_audio" if isinstance(e, AudioError) else "protocol")
            await self._wait_for_model()

    async def _wait_for_model(self) -> None:
        """Stop reading while the model is more than MAX_AHEAD_S behind this stream's input."""
        while self.state is ProtocolState.STREAMING and not self.closing and self.wire.behind_s() > MAX_AHEAD_S:
            self._progress.clear()
            await self._progress.wait()
            self.last_message = time.monotonic()  # waiting on us is not the client being idle
            self.wire.reading_resumed()

    def _receive_timeout(self) -> float | None:
        """Idle timeout while input is open (a client that went silent holds nothing forever);
        the stream duration cap while streaming; none once input ended (the server owes results,
        and the drain deadline bounds that wait at shutdown)."""
        s = self.ctx.settings
        now = time.monotonic()
        if self.state is ProtocolState.CONNECTED:
            return max(0.0, self.last_message + s.idle_timeout_s - now)
        if self.state is ProtocolState.STREAMING:
            idle = self.last_message + s.idle_timeout_s
            return max(0.0, min(idle, self.opened_at + s.max_stream_s) - now)
        return None

    def _on_timeout(self) -> None:
        s = self.ctx.settings
        now = time.monotonic()
        if self.wire.on_timeout(now):
            return
        if self.state is ProtocolState.STREAMING and now >= self.opened_at + s.max_stream_s:
            self.end_input("max_stream_duration")
        elif self.state is not ProtocolState.ENDING and now >= self.last_message + s.idle_timeout_s:
            self.fail(f"idle timeout: no message for {s.idle_timeout_s:g} s", reason_label="idle_timeout")

    def _on_disconnect(self, code: int) -> None:
        self.client_gone = True
        if code == CLOSE_TOO_BIG:  # the transport refused an oversized frame and closed already
            self.ctx.metrics.stream_errors.labels(reason="message_too_big").inc()
        # Otherwise a client may leave at any time: run()'s finally aborts the stream.
        log.debug("ws%d client disconnected (%s) in state %s", self.number, code, self.state.value)

    # ------------------------------------------------------------------ send task
    async def _send_loop(self) -> None:
        try:
            while True:
                item = await self.outbox.get()
                if isinstance(item, Close):
                    await self._send_close(item)
                    return
                if self.closing:
                    continue  # results that raced the error are dropped
                try:
                    if isinstance(item, StreamResult):
                        if await self.wire.send_result(item):
                            return
                    else:
                        await self.send(item)
                except asyncio.TimeoutError:
                    timeout_s = self.ctx.settings.send_timeout_s
                    self.fail(f"client is not reading results (none written for {timeout_s:g} s)",
                              reason_label="slow_client")  # fmt: skip
        except Exception as e:  # noqa: BLE001 - the client went away mid-send
            log.debug("ws%d send failed: %r", self.number, e)
            self.client_gone = True
            self.abort_streams("send failed")  # now, not only in run()'s finally (idempotent)

    async def _send_close(self, item: Close) -> None:
        try:
            async with asyncio.timeout(CLOSE_TIMEOUT_S):
                if item.error:
                    await self.ws.send_text(self.wire.error_frame(item.reason, item.code))
                await self.ws.close(item.code, close_reason(item.reason))
        except TimeoutError:
            self.drop()

    async def send(self, msg) -> None:
        """One message (a pydantic model), or TimeoutError when the socket took nothing for --send-timeout-s."""
        await asyncio.wait_for(self.ws.send_text(msg.model_dump_json()), self.ctx.settings.send_timeout_s)

    async def close_socket(self, code: int, reason: str | None = None) -> None:
        """Close after the last result (the send task's own close, with --send-timeout-s)."""
        await asyncio.wait_for(self.ws.close(code, reason), self.ctx.settings.send_timeout_s)
