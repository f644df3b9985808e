"""uvicorn's two protocol classes, extended with what connections.py describes (caps, a request
deadline, a small send buffer, an abort, a quiet denied handshake, an answered bad upgrade
request, a lingering close).

The one module that uses uvicorn's private API: it subclasses `HttpToolsProtocol` and
`WebSocketsSansIOProtocol` (the latter first shipped in uvicorn 0.35), overrides their hooks and
reads and writes their internals (`flow` and its FlowControl, `pipeline`, `on_response_complete`,
`conn`, `queue`, `frames`, `curr_msg_data_type`, `close_sent`, `close_timer`, `read_paused`,
`writable`, `handshake_initiated`, `handshake_complete`, `scope`, `cycle` and its `disconnected`,
`response_complete`, `message_event`, `send_receive_event_to_app`, `handle_bytes`, `handle_text`).
So the installed uvicorn is checked at import against the range these were tested with
(UVICORN_VERSIONS; pyproject.toml pins the same, and tests/test_private_apis.py checks both): a
newer uvicorn fails here with one clear message.

It also reads the websockets protocol's parser state (`conn.state`, `conn.parser` and the generators
it waits in, `conn.reader`, `conn.current_size`, `conn.extensions`, `conn.debug`, `conn.parser_exc`,
`conn.max_message_size`, `conn.max_fragment_size`)
to parse a whole, plain data frame itself (WebSocketProtocol._take_data_frames): only with the
websockets versions in WEBSOCKETS_FAST_FRAMES; another one gets websockets' own parser for every
frame (the same behaviour at the old cost, not an import error: nothing but speed depends on it).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math

from ..versions import in_range, require
from .connections import (
    LINGER_S,
    MAX_REFUSED_REQUEST_BYTES,
    REFUSE_GRACE_S,
    SHUTDOWN_ABORT_S,
    ConnectionLimits,
    bound_send_buffer,
    http_response,
    is_probe,
)

UVICORN_VERSIONS = ("0.35", "0.55")  # >=, <: tested with 0.54 (env/cpu.lock.txt)
require("uvicorn", *UVICORN_VERSIONS, uses="protocol classes (websockets_sansio_impl, httptools_impl)")

from uvicorn.protocols.http.flow_control import FlowControl  # noqa: E402
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol  # noqa: E402
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol  # noqa: E402
from websockets import __version__ as websockets_version  # noqa: E402
from websockets.frames import Frame, Opcode, apply_mask  # noqa: E402
from websockets.protocol import State  # noqa: E402
from websockets.streams import StreamReader  # noqa: E402

WEBSOCKETS_FAST_FRAMES = ("13", "18")  # >=, <: the parser state read here is the same; tested with 17.4
FAST_FRAMES = in_range(websockets_version, *WEBSOCKETS_FAST_FRAMES)
# The first byte of a final, unfragmented data frame with no reserved bit set (0x80 FIN | opcode).
_DATA_FRAME_OPCODES = {0x81: Opcode.TEXT, 0x82: Opcode.BINARY}
_AT_EOF_CODE = StreamReader.at_eof.__code__

log = logging.getLogger("nemo_serve.connections")
# Bytes of a read parsed at a time (HttpProtocol._feed): at most this many bytes of pipelined
# requests (a few hundred of the smallest) are parsed and queued ahead of their answers.
PARSE_SLICE_BYTES = 4096


class _HeldFlow(FlowControl):
    """uvicorn's flow control, except that reading stays paused while HttpProtocol holds unparsed
    bytes: uvicorn resumes reading at every answer and every body read, pipelined requests waiting."""

    held = False

    def resume_reading(self) -> None:
        if not self.held:
            super().resume_reading()


class HttpProtocol(HttpToolsProtocol):
    limits: ConnectionLimits  # set by protocol_classes()

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._refusal: str | None = None
        self._refused_request = b""
        self._headers_done = False  # of the request being read
        self._mid_request = False  # a request begun, not complete
        self._probe = False  # served beyond the caps (connections.py): probe requests only
        self._probe_only = ""  # the refusal of a non-probe request on a probe's connection
        self._held = b""  # read, not yet parsed: the requests after a pipelined one (_feed)
        self._answering = None  # the cycle whose app runs (uvicorn's `cycle` is the last one parsed)
        self._deadline_after_answer = False  # a pipelined request's deadline, waiting for the answer before it

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.flow = _HeldFlow(transport)
        self._refusal = self.limits.limiter.acquire(transport, self.client[0] if self.client else "")
        if self._refusal is None:
            bound_send_buffer(transport)
        self._arm(REFUSE_GRACE_S if self._refusal else self.limits.header_timeout_s)

    def connection_lost(self, exc) -> None:
        self._disarm()
        self.limits.limiter.release(self.transport)
        answering = self._answering
        if answering is not None and not answering.response_complete:
            # uvicorn tells only the last parsed cycle: a pipelined one's app, answering while the
            # client left, wrote on the closed transport (a RuntimeError traceback) instead of ending
            answering.disconnected = True
            answering.message_event.set()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refusal is None:
            self._feed(data)
            return
        self._refused_request += data  # read the request, so that the answer is not reset away
        if b"\r\n\r\n" in self._refused_request or len(self._refused_request) > MAX_REFUSED_REQUEST_BYTES:
            if b"\r\n\r\n" in self._refused_request and is_probe(self._refused_request) \
                    and self.limits.limiter.acquire_probe(self.transport):  # fmt: skip
                self._serve_probe()
                return
            self._answer(503, "Service Unavailable", self._refusal)

    def _serve_probe(self) -> None:
        """A probe over the caps: parse and answer it as any request, under the request deadline."""
        self._probe_only = f"{self._refusal} (only probes are answered beyond it)"
        self._refusal, self._probe = None, True
        request, self._refused_request = self._refused_request, b""
        self._arm(self.limits.header_timeout_s)
        self._feed(request)

    def _feed(self, data: bytes) -> None:
        """uvicorn parses a whole read (up to 256 kB) at once and queues every pipelined request
        in it, resuming reading at each answer: a client that pipelined `GET /readyz` as fast as it
        could and never read grew the server by 720 MB in 3 s (test_hardening's pipelining flood).
        Here a read is parsed PARSE_SLICE_BYTES at a time, and once a request waits for the answer
        before it the rest is held unparsed, reading paused, until the queue is answered
        (on_response_complete): a connection holds one read and the requests of one slice. Bytes
        after an upgrade request or a refusal are dropped, as uvicorn drops them."""
        if self._held:  # read before the pause took effect
            self._held += data
            return
        view, pos = memoryview(data), 0
        while pos < len(data) and not self.pipeline:
            if self.transport.is_closing() or self.transport.get_protocol() is not self:
                return
            super().data_received(view[pos : pos + PARSE_SLICE_BYTES])
            pos += PARSE_SLICE_BYTES
        if pos < len(data) and not self.transport.is_closing():
            self._held = bytes(view[pos:])
            self.flow.held = True
            self.flow.pause_reading()
            self._disarm()  # a request cut at the slice waits on us, not on the client: re-armed when fed

    def on_response_complete(self) -> None:
        self._answering = self.pipeline[-1][0] if self.pipeline else None  # the one uvicorn starts next
        super().on_response_complete()
        if self._deadline_after_answer and not self.transport.is_closing():
            self._deadline_after_answer = False
            self._arm(self.limits.header_timeout_s)  # the stalled request's own deadline, from now
        if self._held and not self.pipeline and not self.transport.is_closing():
            held, self._held = self._held, b""
            self.flow.held = False
            self.flow.resume_reading()  # as uvicorn does before parsing on; _feed pauses again if need be
            if self._mid_request:
                self._arm(self.limits.header_timeout_s)
            self._feed(held)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._headers_done, self._mid_request = False, True
        if self._deadline is None:  # a later keep-alive request: its own deadline
            self._arm(self.limits.header_timeout_s)

    def on_headers_complete(self) -> None:
        self._headers_done = True
        if self._probe and not is_probe(self.parser.get_method() + b" " + self.url):
            # a later keep-alive request on a probe's connection: the probe reserve is for probes
            self._answer(503, "Service Unavailable", self._probe_only)
            return
        super().on_headers_complete()
        if not self.pipeline:  # uvicorn started its app at once (queued: on_response_complete starts it)
            self._answering = self.cycle

    def on_message_complete(self) -> None:
        self._disarm()
        self._mid_request = False
        super().on_message_complete()

    def handle_websocket_upgrade(self) -> None:
        self._disarm()  # the request is complete; the WebSocket protocol takes the socket over
        super().handle_websocket_upgrade()

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(seconds, self._on_deadline)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _on_deadline(self) -> None:
        self._deadline = None
        if self._refusal is not None:
            self._answer(503, "Service Unavailable", self._refusal)
            return
        earlier = self._answering
        if earlier is not None and not earlier.response_complete and not (self._headers_done and earlier is self.cycle):
            # A pipelined request stalled behind an answer still in progress: a 408 now would land in
            # that answer, or be taken for it. Its deadline starts again once that answer is complete.
            self._deadline_after_answer = True
            return
        if self.limits.limiter.metrics is not None:
            self.limits.limiter.metrics.refusals.labels(reason="header_timeout").inc()
        log.info("closed a connection from %s: request not complete in %g s", self.client and self.client[0],
                 self.limits.header_timeout_s)  # fmt: skip
        reason = f"request not received within {self.limits.header_timeout_s:g} s"
        if self._headers_done:  # the app has the request; only its body is missing
            self._end_cycle(reason)
            return
        self._answer(408, "Request Timeout", reason)

    def _end_cycle(self, reason: str) -> None:
        """A body that stopped coming: answer 408 unless the app has begun its own answer, and
        tell the app the client is gone (its body read ends as a disconnect), so that its
        answer is dropped, not written after ours."""
        cycle = self.cycle
        if cycle is None or cycle.response_started:
            self.transport.close()
            return
        cycle.disconnected = True
        cycle.message_event.set()
        self._answer(408, "Request Timeout", reason)

    def _answer(self, status: int, phrase: str, reason: str) -> None:
        if not self.transport.is_closing():
            self.transport.write(http_response(status, phrase, reason, retry_after=status == 503))
            self.transport.close()


class WebSocketProtocol(WebSocketsSansIOProtocol):
    limits: ConnectionLimits  # set by protocol_classes()
    _lingering = False
    _at_frame_start = False  # websockets' parser waits for the first byte of a frame (data_received)
    take_frame = None  # the app's socket's frame handler (ws_socket.WsSocket.take_frame), or None

    def send_receive_event_to_app(self) -> None:
        """A whole message: handed to the app's socket in this callback when nothing is queued
        and it takes it (picows_connection.py's hand-over: no task wake-up, and no pause and resume
        of reading, which uvicorn does for every queued message); else queued, as uvicorn does."""
        if self.take_frame is not None and self.queue.empty() and not self.close_sent:
            data = self.frames[0] if len(self.frames) == 1 else b"".join(self.frames)
            if self.curr_msg_data_type == "text":
                try:
                    data = data.decode()
                except UnicodeDecodeError:
                    data = None  # uvicorn's own path closes with 1007
            if data is not None and self.take_frame(data):
                self.frames = []
                return
        super().send_receive_event_to_app()

    def _take_data_frames(self, data: bytes) -> bool:
        """`data` handled as websockets' parser and uvicorn's handle_events would handle it, when it
        is nothing but whole, final, masked text and binary frames under the size limit (and the
        parser waits where a frame starts: data_received's check): every frame parsed first, then
        handed to handle_text / handle_bytes in order (as handle_events does with the parser's
        events), the same Frame, without the parser's generators, reader buffer and event list
        (issue 48: they were most of what a lone packet cost uvicorn's protocol over picows's
        Cython parser; docs/performance.md has the before and after). False, with nothing done:
        `data` goes to websockets' parser whole (a control frame, a fragment, a partial frame,
        reserved bits, an unmasked or oversized frame, a closing connection). All or nothing: a
        data frame in the same read as a bad frame is dropped by uvicorn (the parser failed
        before any event is handled), so it must be here too."""
        conn = self.conn
        if conn.state is not State.OPEN or conn.parser_exc is not None or conn.current_size is not None \
                or conn.extensions or conn.debug or self.close_sent:  # fmt: skip
            return False
        frames, pos, end = [], 0, len(data)
        while pos < end:
            if end - pos < 6:
                return False
            opcode = _DATA_FRAME_OPCODES.get(data[pos])
            length = data[pos + 1] ^ 0x80  # the mask bit set: the payload length (or 126, 127)
            if opcode is None or length > 126:  # not a plain data frame, unmasked, or a 64-bit length
                return False
            if length == 126:
                length, start = int.from_bytes(data[pos + 2 : pos + 4], "big"), pos + 8
            else:
                start = pos + 6
            pos = start + length
            if pos > end or length > self._max_frame_bytes:
                return False
            frames.append(Frame(opcode, apply_mask(memoryview(data)[start:pos], data[start - 4 : start])))
        for frame in frames:
            if frame.opcode is Opcode.BINARY:
                self.handle_bytes(frame)
            else:
                self.handle_text(frame)
        return True

    @functools.cached_property
    def _max_frame_bytes(self) -> float:
        """websockets' limit on a frame that starts a message (Protocol.parse: max_size)."""
        limits = [n for n in (self.conn.max_message_size, self.conn.max_fragment_size) if n is not None]
        return min(limits, default=math.inf)

    def _take_frames(self, handler) -> None:
        self.take_frame = handler

    def handle_ping(self) -> None:
        """websockets queued the pong: written only while the client takes what it is sent. A
        client that sent pings as fast as it could and never read piled the pongs up in the
        transport's buffer (75 MB in 2 s, test_hardening's ping flood); RFC 6455 5.5.3 lets an
        endpoint answer only the latest ping. picows_connection.py answers pings by the same rule.
        Whatever else websockets queued with the pong (a close's echo in the same read) is dropped
        with it while writes are paused; handle_close closes the transport either way."""
        output = self.conn.data_to_send()
        if self.writable.is_set():
            self.transport.write(b"".join(output))

    def data_received(self, data: bytes) -> None:
        if self._lingering:  # discarded: the close frame is out, the close is timed
            return
        if self._at_frame_start and self.handshake_complete and self._take_data_frames(data):
            return
        super().data_received(data)
        # Where websockets' parser stopped, looked at only when it ran: the fast path leaves it there.
        self._at_frame_start = FAST_FRAMES and _waits_for_a_frame(self.conn)
        if self.conn.handshake_exc is not None and not self.handshake_initiated:
            # websockets refused the upgrade request itself (a header line over 8 kB: 431, a
            # request line too long: 414, or no valid request) and queued its answer, which
            # uvicorn never writes: the client waited for nothing. Send it, then close.
            self.transport.write(b"".join(self.conn.data_to_send()))
            self.transport.close()

    def handle_parser_exception(self) -> None:
        close = self.conn.close_sent
        self.queue.put_nowait({"type": "websocket.disconnect", "code": close.code, "reason": close.reason})
        self.transport.write(b"".join(self.conn.data_to_send()))
        self.close_sent = True
        # After invalid UTF-8 (1007) the frame parser is intact, and the client's close reply
        # ends the linger at once (handle_close); after a parser failure (a frame too big:
        # 1009) nothing more can be parsed, and the rest is discarded until LINGER_S.
        self._lingering = self.conn.parser_exc is not None
        if self.read_paused:
            self.read_paused = False
            self.transport.resume_reading()
        if self.close_timer is not None:  # the app's close (10 s for the reply) came first
            self.close_timer.cancel()
        # As close_timer, so that uvicorn does not close at once when the app returns.
        self.close_timer = self.loop.call_later(LINGER_S, self.transport.close)

    def connection_lost(self, exc) -> None:
        self.limits.limiter.release(self.transport)
        super().connection_lost(exc)

    def handle_connect(self, event) -> None:
        super().handle_connect(event)
        scope = getattr(self, "scope", None)  # absent when the upgrade request itself was refused
        if scope is not None:
            scope["extensions"]["nemo_serve.connection"] = {"abort": self.abort, "take_frames": self._take_frames}

    def abort(self) -> None:
        """Drop the TCP connection now, whatever is still buffered for it."""
        self.transport.abort()

    async def send(self, message) -> None:
        await super().send(message)
        if message["type"] == "websocket.http.response.body" and not message.get("more_body", False):
            self.handshake_complete = True  # the denial answered the handshake

    def shutdown(self) -> None:
        super().shutdown()
        self.loop.call_later(SHUTDOWN_ABORT_S, self.transport.abort)  # a no-op once closed


def _waits_for_a_frame(conn) -> bool:
    """websockets' parser is suspended where a frame starts: in StreamReader.at_eof (Protocol.parse's
    loop), with no byte of the next frame read. Not merely an empty buffer: after a header that
    came alone the buffer is empty too, the parser waiting in read_exact for the payload. Walks the
    generators' `yield from` chain; another websockets' layout answers False (its parser for every
    frame: slower, the same behaviour)."""
    g = conn.parser
    while g.gi_yieldfrom is not None:
        g = g.gi_yieldfrom
    return g.gi_code is _AT_EOF_CODE and not conn.reader.buffer and not conn.reader.eof


def protocol_classes(limits: ConnectionLimits) -> tuple[type, type]:
    """(HTTP, WebSocket) protocol classes for uvicorn.Config(http=..., ws=...), bound to `limits`."""
    http = type("HttpProtocol", (HttpProtocol,), {"limits": limits})
    ws = type("WebSocketProtocol", (WebSocketProtocol,), {"limits": limits})
    return http, ws
