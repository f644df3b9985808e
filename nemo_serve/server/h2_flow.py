"""The HTTP/2 connection's flow control (--fast-grpc-port; RFC 9113 5.2, 6.5, 6.9): the peer's
windows our sends wait for, the peer's SETTINGS that move them, and the transport's own
backpressure (a client that stopped reading).

  windows        the connection's and each stream's (H2Stream.send_window), the peer's to grant in
                 WINDOW_UPDATEs; a window past 2^31-1: FLOW_CONTROL_ERROR (on a stream: that
                 stream reset), an increment of 0: PROTOCOL_ERROR
  SETTINGS       INITIAL_WINDOW_SIZE moves every open stream's window once per frame;
                 MAX_FRAME_SIZE bounds our DATA frames; HEADER_TABLE_SIZE our HPACK encoder's
  the transport  while it is over its high-water mark the connection is not read, so a client
                 that never reads cannot make us queue answers (PING, SETTINGS acks)

What we grant (the connection's window credited as bytes arrive, a stream's as its handler takes
whole messages) is grpc_h2.py's and grpc_stream.py's. A mixin of grpc_h2.H2Connection, which owns
this state (declared in _init_flow) on the event loop.
"""

from __future__ import annotations

import struct

from .grpc_stream import H2Stream
from .h2_frames import (
    ACK,
    DATA,
    FLOW_CONTROL_ERROR,
    FRAME_SIZE_ERROR,
    MAX_WINDOW,
    PROTOCOL_ERROR,
    SETTINGS,
    S_HEADER_TABLE_SIZE,
    S_INITIAL_WINDOW_SIZE,
    S_MAX_FRAME_SIZE,
    ProtocolViolation,
    frame,
)


class FlowControl:
    """The send side's windows and the transport's backpressure, for H2Connection."""

    def _init_flow(self) -> None:
        self.peer_initial_window = 65535
        self.peer_max_frame = 16384
        self.send_window = 65535  # the connection's, the peer's to grant
        self.unacked = 0  # connection bytes received, not credited back yet
        self.writable = True

    # ------------------------------------------------------------------ the transport
    def pause_writing(self) -> None:
        # A client that does not read must not make us write: PING, SETTINGS and refusals are
        # answered, so their answers would pile up in the transport without bound. Reading stops
        # until it reads: what is buffered is the high-water mark and one read's answers.
        self.writable = False
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        self.writable = True
        if self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()
        for stream in list(self.streams.values()):
            if not stream.out:
                stream.wake()

    # ------------------------------------------------------------------ the peer's frames
    def _settings(self, flags: int, sid: int, payload: bytearray) -> None:
        if sid:
            raise ProtocolViolation(PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:
            return
        self.settings_frames.spend(self.loop.time())  # each is acked: a flood's budget, h2_guards.py
        if len(payload) % 6:
            raise ProtocolViolation(FRAME_SIZE_ERROR, "SETTINGS of a bad length")
        initial_window = self.peer_initial_window
        for i in range(0, len(payload), 6):
            key, value = struct.unpack_from(">HL", payload, i)
            if key == S_INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise ProtocolViolation(FLOW_CONTROL_ERROR, "SETTINGS_INITIAL_WINDOW_SIZE too large")
                initial_window = value
            elif key == S_MAX_FRAME_SIZE:
                if not 16384 <= value < 1 << 24:
                    raise ProtocolViolation(PROTOCOL_ERROR, "SETTINGS_MAX_FRAME_SIZE out of range")
                self.peer_max_frame = value
            elif key == S_HEADER_TABLE_SIZE:
                self.encoder.header_table_size = min(value, 4096)
        self.write(frame(SETTINGS, ACK, 0))
        # The streams' windows move once per frame, not per entry, and are flushed only when they
        # grew: a SETTINGS flood must not cost a pass over every stream per frame (or per entry).
        delta, self.peer_initial_window = initial_window - self.peer_initial_window, initial_window
        if delta:
            for stream in list(self.streams.values()):
                stream.send_window += delta
                if stream.send_window > MAX_WINDOW:
                    raise ProtocolViolation(FLOW_CONTROL_ERROR, f"stream {stream.id}'s window over 2^31-1")
                if delta > 0:
                    self.flush(stream)

    def _window_update(self, sid: int, payload: bytearray) -> None:
        if len(payload) != 4:
            raise ProtocolViolation(FRAME_SIZE_ERROR, "WINDOW_UPDATE of a bad length")
        n = int.from_bytes(payload, "big") & 0x7FFFFFFF
        if sid == 0:
            if not n:
                raise ProtocolViolation(PROTOCOL_ERROR, "a WINDOW_UPDATE of 0")
            blocked = self.send_window <= 0  # else no stream waits for the connection's window
            self.send_window += n
            if self.send_window > MAX_WINDOW:
                raise ProtocolViolation(FLOW_CONTROL_ERROR, "connection window over 2^31-1")
            if blocked:
                for stream in list(self.streams.values()):
                    self.flush(stream)
        elif (stream := self.streams.get(sid)) is not None:
            stream.send_window += n
            if not n or stream.send_window > MAX_WINDOW:  # stream errors (RFC 9113 6.9, 6.9.1)
                self._reset(stream, PROTOCOL_ERROR if not n else FLOW_CONTROL_ERROR)
                return
            self.flush(stream)

    # ------------------------------------------------------------------ our DATA
    def flush(self, stream: H2Stream) -> None:
        """DATA frames from the stream's bytes, as far as the windows allow."""
        out = stream.out
        while out and not stream.closed:
            n = min(len(out), stream.send_window, self.send_window, self.peer_max_frame)
            if n <= 0:
                return
            self.write(frame(DATA, 0, stream.id, bytes(out[:n])))
            del out[:n]
            stream.send_window -= n
            self.send_window -= n
        if self.writable:
            stream.wake()
