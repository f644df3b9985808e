"""Every WebSocket stream (/ws, /v1/realtime, /v1/listen): a thin transport over its StreamSession
(stream_session.py), whose wire format is ws_format.py's (/ws), realtime.py's (/v1/realtime, a
session whose engine streams are its items) or deepgram_live.py's (/v1/listen). What is here is the WebSocket's own: the receive
task, the send task, the idle clock's timer, and the close code, chosen from the Failure's label
at this edge.

  receive task: frames -> wire.on_text / on_bytes -> session.push / end_input (never writes);
                through our listeners (picows_connection.py, uvicorn_protocols.py) a data frame
                that finds the task parked is handled in the transport's callback instead
                (take_frame), the same code with no task switch
  send task:    session.next_event() (messages, results, the Failure) -> wire's frames -> close
                (the only writer)

A wire format (WireFormat below) parses frames and renders results; it never writes.

Every write has a deadline: --send-timeout-s for results (session.send), then CLOSE_TIMEOUT_S for
the error and close frames; a client that cannot take those either is dropped (TCP), so a client
that stops reading frees its slot in bounded time. `finally:` closes the session: the engine
stream is aborted and its slot comes back, whatever way the socket ends.

The idle and duration clocks are one deadline (session.input_deadline) checked by a timer that
re-arms itself, not a timeout around each receive: asyncio.wait_for made a task and a timer
handle per frame (issue 48's packet profile), the deadline costs a clock read per frame.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable

from starlette.websockets import WebSocket

from ..engine.results import StreamResult
from .audio import AudioError
from .context import ServerContext
from .protocol import (
    CLOSE_GOING_AWAY,
    CLOSE_NORMAL,
    CLOSE_PROTOCOL_ERROR,
    CLOSE_SERVER_ERROR,
    CLOSE_TOO_BIG,
    CLOSE_TRY_AGAIN_LATER,
    ProtocolError,
    close_reason,
)
from .stream_session import Failure
from .wire import NormalClose, WireFormat
from .ws_format import WsFormat

log = logging.getLogger("nemo_serve.session")
_numbers = itertools.count(1)

# A stream that failed (slow client, drain deadline, error) gets this long to put its error
# and close frames on the wire; then the TCP connection is dropped.
CLOSE_TIMEOUT_S = 1.0


# A failure's close code by its label (stream_session.Failure); the rest (protocol, bad_audio,
# bad_config, slow_client, idle_timeout): 1008. docs/protocol.md lists them.
_CLOSE_FOR_LABEL = {
    "refused": CLOSE_TRY_AGAIN_LATER,
    "draining": CLOSE_TRY_AGAIN_LATER,
    "drain_timeout": CLOSE_GOING_AWAY,
    "engine": CLOSE_SERVER_ERROR,
    "internal": CLOSE_SERVER_ERROR,
}


def close_code(f: Failure) -> int:
    return _CLOSE_FOR_LABEL.get(f.label, CLOSE_PROTOCOL_ERROR)


WireFactory = Callable[..., WireFormat]  # (ws, ctx, name, log, on_drop) -> its wire format


def ws_wire(ws: WebSocket, ctx: ServerContext, name: str, log: logging.Logger, on_drop) -> WsFormat:
    return WsFormat(ctx, name, log, ws.query_params, on_drop=on_drop)


class WsSocket:
    def __init__(self, ws: WebSocket, ctx: ServerContext, make_wire: WireFactory = ws_wire) -> None:
        self.number = next(_numbers)  # for task names and logs
        self.ws, self.ctx = ws, ctx
        self.wire = make_wire(ws, ctx, f"ws{self.number}", log, self._drop_connection)
        self.session = self.wire.session
        # run() reached its `finally:`: no frame is handled after this (a frame that arrives with
        # the receive task's cancel must not act on a session that was closed, issue 45).
        self.finished = False
        self._clock: asyncio.TimerHandle | None = None
        self._clock_at = 0.0  # when the armed timer fires, in time.monotonic()
        self._waiting_for_model = False  # backpressure: not reading, so the client is not idle
        self._reading = False  # the receive task is parked in ws.receive() (take_frame may act)

    async def run(self) -> None:
        s = self.session
        self.ctx.add(s)
        if self.wire.config_error is not None:  # refused as a bad config message is: error, then 1008
            s.fail(self.wire.config_error, "bad_config")
        self._check_clock()
        frames_hook = self._connection_hook("take_frames")
        if frames_hook is not None:  # a transport that hands data frames over in its callback
            frames_hook(self.take_frame)
        recv = asyncio.create_task(self._receive_loop(), name=f"ws{self.number}-receive")
        send = asyncio.create_task(self._send_loop(), name=f"ws{self.number}-send")
        try:
            await asyncio.wait({recv, send}, return_when=asyncio.FIRST_COMPLETED)
            if recv.done() and recv.exception() is not None:
                log.error("ws%d receive task failed", self.number, exc_info=recv.exception())
                s.fail("internal server error", "internal")
            if not send.done() and not s.client_gone:
                await send  # flush the results still owed, the error if any, then close
        finally:
            self.finished = True
            if frames_hook is not None:
                frames_hook(None)
            if self._clock is not None:
                self._clock.cancel()
            for task in (recv, send):
                task.cancel()
            # The slot comes back and the session leaves the set before anything is awaited: the
            # handler itself may be cancelled here (a server's or test client's shutdown).
            s.close("connection closed")
            self.ctx.remove(s)
            # Rejected: asyncio.gather, whose own cancel re-raises a task's CancelledError, not the
            # handler's: a cancel scope around the handler (anyio's) then does not take it as its own.
            await asyncio.wait({recv, send})

    # ------------------------------------------------------------------ the idle and duration clocks
    def _check_clock(self) -> None:
        """The timer: act once the deadline passed, else wait for it (frames moved it later)."""
        self._clock = None
        s = self.session
        deadline = s.input_deadline()
        if self.finished or s.closing or s.client_gone or deadline is None:
            return  # nothing to time: ending, or input ended (no clock runs)
        now = time.monotonic()
        if self._waiting_for_model:  # waiting on us is not the client being idle: look again later
            deadline = max(deadline, now + s.ctx.settings.idle_timeout_s)
        if now < deadline:
            self._clock = asyncio.get_running_loop().call_later(deadline - now, self._check_clock)
            self._clock_at = deadline
            return
        s.input_deadline_passed()
        self._check_clock()  # idle failed: stops; the duration ended input: stops

    # ------------------------------------------------------------------ receive task
    async def _receive_loop(self) -> None:
        s = self.session
        while not s.closing:
            self._reading = True  # parked below: the transport may hand a frame to take_frame
            try:
                message = await self.ws.receive()
            finally:
                self._reading = False
            if self.finished or s.closing:
                return  # a frame that raced run()'s end or the failure
            if message["type"] == "websocket.disconnect":
                self._on_disconnect(message.get("code", 1005))
                return
            # A frame the transport queued because the model was behind (take_frame declined it)
            # waits here: a frame is handled only while the model is within MAX_AHEAD_S.
            await self._wait_for_model()
            if self.finished or s.closing:
                return
            self._on_frame(message["bytes"] if message.get("bytes") is not None else message.get("text") or "")
            await self._wait_for_model()

    def take_frame(self, data: bytes | str) -> bool:
        """A data frame straight from the transport's frame callback (the "take_frames" hook), with no
        task switch: what the receive task does with a frame, done now, when the task is parked in
        receive with nothing ahead of this frame (the transport checks its own queue is empty) and
        the model is not behind. False: the transport queues the frame for the task instead (it
        must wait for the model, or the socket is ending). Why: the wake-up and task switch for
        each lone packet were most of a paced packet's front-end CPU (issue 48's profile)."""
        s = self.session
        if not self._reading or self.finished or s.closing or s.model_behind():
            return False
        try:
            self._on_frame(data)
        except Exception:  # noqa: BLE001 - what run() does when the receive task fails
            log.exception("ws%d frame handling failed", self.number)
            s.fail("internal server error", "internal")
        return True

    def _on_frame(self, data: bytes | str) -> None:
        s = self.session
        s.last_input = time.monotonic()
        try:
            if isinstance(data, bytes):
                self.wire.on_bytes(data)
            else:
                self.wire.on_text(data)
        except (ProtocolError, AudioError) as e:
            s.fail(str(e), "bad_audio" if isinstance(e, AudioError) else "protocol")
        self._rearm_if_sooner()

    async def _wait_for_model(self) -> None:
        self._waiting_for_model = True
        try:
            await self.session.wait_for_model()
        finally:
            self._waiting_for_model = False

    def _rearm_if_sooner(self) -> None:
        """A frame moved the deadline sooner (the duration clock started at the open; a realtime
        append started the turn's silence clock): the timer is set again. Later moves need
        nothing: the timer looks again when it fires."""
        deadline = self.session.input_deadline()
        if self._clock is not None and deadline is not None and deadline < self._clock_at:
            self._clock.cancel()
            self._check_clock()

    def _on_disconnect(self, code: int) -> None:
        self.session.client_gone = True
        if code == CLOSE_TOO_BIG:  # the transport refused an oversized frame and closed already
            self.ctx.metrics.stream_errors.labels(reason="message_too_big").inc()
        # Otherwise a client may leave at any time: run()'s finally aborts the stream.
        log.debug("ws%d client disconnected (%s)", self.number, code)

    # ------------------------------------------------------------------ send task
    async def _send_loop(self) -> None:
        s = self.session
        try:
            # Not `while True`: asyncio.wait_for before Python 3.12 (inside session.send) returns a
            # write that completed with run()'s cancel instead of raising it; `finished` ends the loop.
            while not self.finished:
                item = await s.next_event()
                if isinstance(item, Failure):
                    await self._send_failure(item)
                    return
                if isinstance(item, NormalClose):
                    await self._close_within_deadline(CLOSE_NORMAL, item.reason)
                    return
                if s.closing:
                    continue  # results that raced the failure are dropped
                if isinstance(item, StreamResult):
                    if await self._send_result(item):
                        return
                else:
                    await s.send(self.ws.send_text(item.model_dump_json()))
        except Exception as e:  # noqa: BLE001 - the client went away mid-send
            log.debug("ws%d send failed: %r", self.number, e)
            s.gone()  # the stream aborted now, not only in run()'s finally

    async def _send_result(self, r: StreamResult) -> bool:
        """One engine result's frames, and the close 1000 the wire format asks for after them
        (each within --send-timeout-s); True once closed."""
        s = self.session
        out = self.wire.render(r)
        for frame in out.frames:
            if not await s.send(self.ws.send_text(frame)):
                return False  # failed (slow client): the Failure is next
        if out.observed:
            s.result_sent(r)
        if out.close is None:
            return False
        return await s.send(self.ws.close(CLOSE_NORMAL, out.close or None))

    async def _send_failure(self, f: Failure) -> None:
        try:
            async with asyncio.timeout(CLOSE_TIMEOUT_S):
                await self.ws.send_text(self.wire.error_frame(f.reason, close_code(f)))
                await self.ws.close(close_code(f), close_reason(f.reason))
        except TimeoutError:
            self.session.drop()

    async def _close_within_deadline(self, code: int, reason: str) -> None:
        try:
            async with asyncio.timeout(CLOSE_TIMEOUT_S):
                await self.ws.close(code, close_reason(reason))
        except TimeoutError:
            self.session.drop()

    def _drop_connection(self) -> None:
        """Drop the TCP connection now (a client that could not take its close frame in time).
        Without the hook (a server other than ours, the test client) the close stays pending."""
        abort = self._connection_hook("abort")
        if abort is not None:
            log.info("ws%d dropped: the client does not read", self.number)
            self.session.client_gone = True
            abort()

    def _connection_hook(self, name: str):
        """One of our transports' hooks (scope["extensions"]["nemo_serve.connection"]), or None."""
        return self.ws.scope.get("extensions", {}).get("nemo_serve.connection", {}).get(name)
