"""gRPC over HTTP/2, server side, as an asyncio Protocol on the front end's own loop (--fast-grpc-port).

Why (benchmarks/grpc_layer_bench.py): grpc.aio's event-loop machinery and poller thread cost about
110 of the 120-140 µs of CPU a paced 20 ms packet costs through --grpc-port; a connection that
parses its frames by their 9-byte headers in data_received costs a fraction of that. Only what
gRPC needs of HTTP/2 is here (RFC 9113; gRPC's PROTOCOL-HTTP2.md):

  frames         a 9-byte header, the payload; over SETTINGS_MAX_FRAME_SIZE (16 KiB): GOAWAY
  HEADERS        + CONTINUATION: HPACK (the `hpack` package) only for a call's request headers and
                 our response headers and trailers; a header block over MAX_HEADER_BLOCK bytes
                 or MAX_BLOCK_FRAMES frames, or a header list decoding past MAX_HEADER_BLOCK: GOAWAY
  DATA           -> gRPC's 5-byte length prefix -> the call's inbox, one message at a time; a
                 prefix over --max-message-bytes ends the call RESOURCE_EXHAUSTED before a byte of
                 it is buffered; compressed messages: UNIMPLEMENTED (we announce no grpc-encoding)
  flow control   the connection window credited as bytes arrive, a stream's as its handler takes
                 whole messages (so a stream whose handler stopped reading, the session's
                 backpressure, stops its client), both in batched WINDOW_UPDATEs; our sends wait
                 for the peer's windows and for the transport (a client that stopped reading);
                 while the transport is over its high-water mark the connection is not read, so
                 a client that never reads cannot make us queue answers (PING, SETTINGS acks);
                 a window past 2^31-1: FLOW_CONTROL_ERROR, an increment of 0: PROTOCOL_ERROR
  SETTINGS/PING  acked, over MAX_SETTINGS_PER_S / MAX_PINGS_PER_S a second: GOAWAY ENHANCE_YOUR_CALM;
                 keepalive PINGs every --ping-interval-s, no ack in --ping-timeout-s: dropped
  empty frames   DATA without a byte or END_STREAM, empty CONTINUATIONs, header blocks with no
                 fields: over MAX_EMPTY_FRAMES in a row, GOAWAY ENHANCE_YOUR_CALM
  RST_STREAM     from the client cancels the call's handler; ours ends a stream we refuse; over
                 MAX_RESETS_PER_S of either a second (rapid reset): GOAWAY ENHANCE_YOUR_CALM; on
                 a stream never opened: GOAWAY PROTOCOL_ERROR
  errors         calls answered with an error at once, no handler run (an unknown method, not a
                 gRPC request: UNIMPLEMENTED), over MAX_ERROR_STREAMS_PER_S a second: GOAWAY
                 ENHANCE_YOUR_CALM
  PRIORITY       ignored (no priority tree); on stream 0: GOAWAY PROTOCOL_ERROR; of a length other
                 than 5, or making its stream depend on itself: RST_STREAM FRAME_SIZE_ERROR /
                 PROTOCOL_ERROR on its stream, open or closed (counted as a reset), GOAWAY with the
                 code on a stream never opened (RFC 9113 6.3, 5.3.1, 6.4); a HEADERS whose
                 priority makes its stream depend on itself: GOAWAY PROTOCOL_ERROR (nghttp2's), one too
                 short for its priority: GOAWAY FRAME_SIZE_ERROR
  GOAWAY         on a connection error (the client's protocol violation) and at shutdown

Here the connection's frame dispatch (frames in, a call's stream opened, its status and end);
its windows and the transport's backpressure are h2_flow.py's, its guards (rapid reset, floods, the
preface deadline, keepalive, GOAWAY) h2_guards.py's, both mixins of H2Connection; a call's stream
(message assembly, windows, sends) is grpc_stream.py's, the wire's constants and small pieces
h2_frames.py's. Owner of every stream and window: the event loop. What a call does is fast_grpc.py's.
"""

from __future__ import annotations

import asyncio
import logging
import struct

import hpack

from .grpc_stream import H2Stream
from .h2_flow import FlowControl
from .h2_frames import (
    CANCEL,
    COMPRESSION_ERROR,
    CONNECTION_WINDOW,
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    ENHANCE_YOUR_CALM,
    FLOW_CONTROL_ERROR,
    FRAME_HEAD,
    FRAME_SIZE_ERROR,
    GOAWAY,
    HEADERS,
    MAX_FRAME,
    MAX_BLOCK_FRAMES,
    MAX_HEADER_BLOCK,
    MAX_STREAMS,
    NO_ERROR,
    PADDED,
    PING,
    PREFACE,
    PRIORITY,
    PRIORITY_FLAG,
    PROTOCOL_ERROR,
    PUSH_PROMISE,
    ProtocolViolation,
    REFUSED_STREAM,
    RST_STREAM,
    SETTINGS,
    STREAM_CLOSED,
    STREAM_WINDOW,
    S_INITIAL_WINDOW_SIZE,
    S_MAX_CONCURRENT_STREAMS,
    S_MAX_FRAME_SIZE,
    WINDOW_UPDATE,
    frame,
    percent_encode,
    unpad,
    window_update,
)
from .h2_guards import ConnectionGuards

log = logging.getLogger("nemo_serve.riva")


class H2Connection(FlowControl, ConnectionGuards, asyncio.Protocol):
    """One client's HTTP/2 connection. `server` (fast_grpc.FastGrpcServer) is told of each new
    call (`start_call`) and of the connection's end; the rest is HTTP/2's and lives here."""

    def __init__(self, server) -> None:
        self.server = server
        s = server.settings
        self.max_message_bytes = s.max_message_bytes
        self.loop = asyncio.get_running_loop()
        self.transport = None
        self.peer = ("", 0)
        self.buf = bytearray()
        self.preface_seen = False
        self.streams: dict[int, H2Stream] = {}
        self.last_stream_id = 0
        self.decoder = hpack.Decoder()
        self.decoder.max_header_list_size = MAX_HEADER_BLOCK
        self.encoder = hpack.Encoder()
        self.block: bytearray | None = None  # a header block waiting for its CONTINUATION frames
        self.block_stream = 0
        self.block_end_stream = False
        self.block_frames = 0
        self._init_flow()  # the windows, the transport's backpressure: h2_flow.py
        self._init_guards()  # reset counting, timers, GOAWAY: h2_guards.py

    # ------------------------------------------------------------------ asyncio callbacks
    def connection_made(self, transport) -> None:
        self.transport = transport
        peer = transport.get_extra_info("peername") or ("", 0)
        self.peer = (peer[0], peer[1])
        self.server.connection_made(self)
        settings = struct.pack(">HLHLHL", S_MAX_CONCURRENT_STREAMS, MAX_STREAMS, S_INITIAL_WINDOW_SIZE, STREAM_WINDOW,
                               S_MAX_FRAME_SIZE, MAX_FRAME)  # fmt: skip
        transport.write(frame(SETTINGS, 0, 0, settings) + window_update(0, CONNECTION_WINDOW - 65535))
        self.timer = self.loop.call_later(self.server.settings.header_timeout_s, self._no_preface)

    def data_received(self, data: bytes) -> None:
        # Frames are parsed from `data` itself when nothing is held over from the last read (the
        # usual case: a paced client's packet arrives whole), else from the buffer it joins.
        buf = data
        if self.buf or not self.preface_seen:
            buf = self.buf
            buf += data
        try:
            if not self.preface_seen:
                if len(buf) < len(PREFACE):
                    if PREFACE.startswith(bytes(buf)):
                        return
                    raise ProtocolViolation(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                if buf[: len(PREFACE)] != PREFACE:
                    raise ProtocolViolation(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                del buf[: len(PREFACE)]
                self.preface_seen = True
                self._keepalive()
            pos, end = 0, len(buf)
            while end - pos >= 9:
                hi, lo, kind, flags, sid = FRAME_HEAD.unpack_from(buf, pos)
                n = hi << 8 | lo
                if n > MAX_FRAME:
                    raise ProtocolViolation(FRAME_SIZE_ERROR, f"a frame of {n} bytes (max {MAX_FRAME})")
                if end - pos < 9 + n:
                    break
                payload = buf[pos + 9 : pos + 9 + n]
                pos += 9 + n
                if kind == DATA and self.block is None:  # the audio: straight to its stream
                    self._data(flags, sid & 0x7FFFFFFF, payload)
                else:
                    self._frame(kind, flags, sid & 0x7FFFFFFF, payload)
            if buf is self.buf:
                del buf[:pos]
            elif pos < len(buf):
                self.buf += buf[pos:]
        except ProtocolViolation as e:
            self.fail(e.code, str(e))
        except hpack.HPACKError as e:
            self.fail(COMPRESSION_ERROR, f"bad header block: {type(e).__name__}")

    def connection_lost(self, exc) -> None:
        if self.timer is not None:
            self.timer.cancel()
        for stream in list(self.streams.values()):
            stream.closed = True
            stream.end_input()
            stream.wake()
            if stream.task is not None:
                stream.task.cancel()
        self.streams.clear()
        self.server.connection_lost(self)

    # ------------------------------------------------------------------ frames in
    def _frame(self, kind: int, flags: int, sid: int, payload: bytearray) -> None:
        if self.block is not None and kind != CONTINUATION:
            raise ProtocolViolation(PROTOCOL_ERROR, "a header block interrupted")
        if kind == DATA:
            self._data(flags, sid, payload)
        elif kind == HEADERS:
            self._headers(flags, sid, payload)
        elif kind == CONTINUATION:
            if self.block is None or sid != self.block_stream:
                raise ProtocolViolation(PROTOCOL_ERROR, "CONTINUATION without its HEADERS")
            self._add_block(payload, flags)
        elif kind == SETTINGS:
            self._settings(flags, sid, payload)
        elif kind == WINDOW_UPDATE:
            self._window_update(sid, payload)
        elif kind == PING:
            self._peer_ping(flags, sid, payload)
        elif kind == RST_STREAM:
            if len(payload) != 4:
                raise ProtocolViolation(FRAME_SIZE_ERROR, "RST_STREAM of a bad length")
            if sid % 2 == 0 or sid > self.last_stream_id:  # never opened (RFC 9113 5.1; we push none)
                raise ProtocolViolation(PROTOCOL_ERROR, f"RST_STREAM on idle stream {sid}")
            stream = self.streams.get(sid)
            if stream is not None:
                self._count_reset()
                self.close_stream(stream)
        elif kind == GOAWAY:
            self.going_away = True
        elif kind == PRIORITY:
            self._priority(sid, payload)
        elif kind == PUSH_PROMISE:
            raise ProtocolViolation(PROTOCOL_ERROR, "PUSH_PROMISE from a client")
        # unknown frame types: ignored (RFC 9113 5.5)

    def _priority(self, sid: int, payload: bytearray) -> None:
        """A PRIORITY frame: checked, then ignored (we keep no priority tree, RFC 9113 5.3.2)."""
        if sid == 0:
            raise ProtocolViolation(PROTOCOL_ERROR, "PRIORITY on stream 0")
        if len(payload) != 5:  # RFC 9113 6.3
            self._stream_error(sid, FRAME_SIZE_ERROR, f"PRIORITY of {len(payload)} bytes")
        elif int.from_bytes(payload[:4], "big") & 0x7FFFFFFF == sid:  # RFC 9113 5.3.1
            self._stream_error(sid, PROTOCOL_ERROR, "PRIORITY making a stream depend on itself")

    def _stream_error(self, sid: int, code: int, why: str) -> None:
        """A stream error (RFC 9113 5.4.2) for a frame that may name a stream in any state:
        RST_STREAM on an open or closed stream (a closed one stays closed: nothing is opened), the
        connection's error on an idle one, which may not be reset (6.4; 5.4.1 allows it). Each
        RST_STREAM is an answer, so a flood of them is bounded by the reset budget, as a PING
        flood is by its own."""
        if sid % 2 == 0 or sid > self.last_stream_id:
            raise ProtocolViolation(code, f"{why} on idle stream {sid}")
        self._count_reset()
        stream = self.streams.get(sid)
        if stream is not None:
            self._reset(stream, code)
        else:
            self.write(frame(RST_STREAM, 0, sid, code.to_bytes(4, "big")))

    def _data(self, flags: int, sid: int, payload: bytearray) -> None:
        n = len(payload)
        if n:
            self.empty_frames = 0
        elif not flags & END_STREAM:
            self._count_empty()
        self.unacked += n
        if self.unacked >= CONNECTION_WINDOW // 4:
            self.write(window_update(0, self.unacked))
            self.unacked = 0
        stream = self.streams.get(sid)
        if stream is None:
            if sid == 0 or sid > self.last_stream_id:
                raise ProtocolViolation(PROTOCOL_ERROR, f"DATA on idle stream {sid}")
            return  # a stream we closed: its late data is dropped (credited to the connection above)
        if stream.in_ended:
            self._reset(stream, STREAM_CLOSED)
            return
        if flags & PADDED:
            payload = unpad(payload)
        stream.recv_window -= n  # the whole frame, padding included, counts (RFC 9113 6.9.1)
        if stream.recv_window < 0:
            raise ProtocolViolation(FLOW_CONTROL_ERROR, f"stream {sid} sent past its window")
        stream.data(payload, n, bool(flags & END_STREAM))

    def _headers(self, flags: int, sid: int, payload: bytearray) -> None:
        if flags & PADDED:
            payload = unpad(payload)
        if flags & PRIORITY_FLAG:
            if len(payload) < 5:  # too small for its mandatory fields (RFC 9113 4.2): the connection's error, as nghttp2's
                raise ProtocolViolation(FRAME_SIZE_ERROR, f"HEADERS of {len(payload)} bytes with the PRIORITY flag")
            # A stream error by RFC 9113 5.3.1; the connection's here, as nghttp2's (grpc-core skips
            # the 5 bytes unread): the block must be decoded either way for HPACK's table, and a
            # client that sends it is not a gRPC client.
            if int.from_bytes(payload[:4], "big") & 0x7FFFFFFF == sid:
                raise ProtocolViolation(PROTOCOL_ERROR, f"HEADERS making stream {sid} depend on itself")
            payload = payload[5:]
        self.block, self.block_stream, self.block_end_stream = bytearray(), sid, bool(flags & END_STREAM)
        self.block_frames = 0
        self._add_block(payload, flags)

    def _add_block(self, payload: bytearray, flags: int) -> None:
        if not payload and not flags & END_HEADERS:
            self._count_empty()
        self.block += payload
        self.block_frames += 1
        if len(self.block) > MAX_HEADER_BLOCK:
            raise ProtocolViolation(ENHANCE_YOUR_CALM, f"a header block over {MAX_HEADER_BLOCK} bytes")
        if self.block_frames > MAX_BLOCK_FRAMES:  # empty CONTINUATIONs: a block that never ends
            raise ProtocolViolation(ENHANCE_YOUR_CALM, f"a header block in over {MAX_BLOCK_FRAMES} frames")
        if flags & END_HEADERS:
            block, self.block = bytes(self.block), None
            headers = self.decoder.decode(block)  # always: the decoder's table follows every block
            self._header_block(self.block_stream, headers, self.block_end_stream)

    def _header_block(self, sid: int, headers: list, end_stream: bool) -> None:
        if headers:
            self.empty_frames = 0
        else:
            self._count_empty()
        stream = self.streams.get(sid)
        if stream is not None:  # trailers from the client: only END_STREAM matters
            if not end_stream:
                raise ProtocolViolation(PROTOCOL_ERROR, "a second header block without END_STREAM")
            stream.end_input()
            return
        if sid % 2 == 0 or sid <= self.last_stream_id:
            raise ProtocolViolation(PROTOCOL_ERROR, f"HEADERS opening stream {sid}")
        self.last_stream_id = sid
        stream = H2Stream(self, sid, headers)
        if len(self.streams) >= MAX_STREAMS or self.going_away:
            self._count_reset()
            self.write(frame(RST_STREAM, 0, sid, REFUSED_STREAM.to_bytes(4, "big")))
            return
        self.streams[sid] = stream
        if end_stream:
            stream.in_ended = True
        self.server.start_call(stream)

    # ------------------------------------------------------------------ frames out
    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def send_headers(self, stream: H2Stream) -> None:
        if not stream.headers_sent:
            stream.headers_sent = True
            block = self.encoder.encode([(":status", "200"), ("content-type", "application/grpc")])
            self.write(frame(HEADERS, END_HEADERS, stream.id, block))

    def finish(self, stream: H2Stream, code: int, message: str) -> None:
        """The call's status: trailers (or headers and trailers in one block, a trailers-only
        response), then the stream is closed; a stream still owed data is reset instead."""
        if stream.closed:
            return
        if code and stream.task is None:  # answered at once, no handler (an unknown method): its budget
            self._count_error()  # past it, raised: data_received's GOAWAY, this call unanswered
        if stream.out:  # the client never granted the window for what we owe it: no status can follow
            self._reset(stream, CANCEL)
            return
        fields = [("grpc-status", str(code))] + ([("grpc-message", percent_encode(message))] if message else [])
        if not stream.headers_sent:
            fields = [(":status", "200"), ("content-type", "application/grpc"), *fields]
        stream.headers_sent = True
        self.write(frame(HEADERS, END_HEADERS | END_STREAM, stream.id, self.encoder.encode(fields)))
        if not stream.in_ended:  # the client may stop sending: its request is answered (RFC 9113 8.1)
            self.write(frame(RST_STREAM, 0, stream.id, NO_ERROR.to_bytes(4, "big")))
        self.close_stream(stream)

    def _reset(self, stream: H2Stream, code: int) -> None:
        if not stream.closed:
            self.write(frame(RST_STREAM, 0, stream.id, code.to_bytes(4, "big")))
        self.close_stream(stream)

    def close_stream(self, stream: H2Stream) -> None:
        """The stream is over (our status sent, or reset by either side): its handler, if still
        running, is cancelled; its late frames are dropped."""
        stream.closed = True
        if not stream.in_ended:
            stream.end_input()
        stream.wake()
        self.streams.pop(stream.id, None)
        if stream.task is not None and not stream.task.done() and stream.task is not asyncio.current_task():
            stream.task.cancel()
        if self.going_away and not self.streams and self.transport is not None:
            self.transport.close()
