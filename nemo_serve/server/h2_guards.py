"""The HTTP/2 connection's guards against clients that flood or stall it (--fast-grpc-port), and
how a connection ends:

  rapid reset    streams reset by the client or refused by us (or reset for a PRIORITY frame of a
                 bad length or making its stream depend on itself), over MAX_RESETS_PER_S of these
                 a second: GOAWAY ENHANCE_YOUR_CALM (CVE-2023-44487)
  floods         from a client that reads its answers (2019's HTTP/2 DoS family), GOAWAY
                 ENHANCE_YOUR_CALM past: MAX_PINGS_PER_S PINGs a second (CVE-2019-9512; debug
                 data "too_many_pings", as grpc-core's), MAX_SETTINGS_PER_S SETTINGS a second
                 (CVE-2019-9515), MAX_EMPTY_FRAMES empty frames in a row (CVE-2019-9518),
                 MAX_ERROR_STREAMS_PER_S calls answered with an error at once, no handler run, a
                 second (calls to an unknown method, each answered UNIMPLEMENTED). PRIORITY
                 frames (CVE-2019-9513) and WINDOW_UPDATEs cost only their dispatch: we keep no
                 priority tree, and a WINDOW_UPDATE moves one number (test_hostile_h2.py times them)
  preface        no HTTP/2 preface within --header-timeout-s: the connection dropped
  keepalive      a PING every --ping-interval-s, no ack in --ping-timeout-s: dropped
  ending         a connection error (the client's protocol violation): GOAWAY with its code and
                 the connection closed; at shutdown GOAWAY NO_ERROR, closed once its calls end

The header block's limits (MAX_HEADER_BLOCK, MAX_BLOCK_FRAMES) are checked where the block is
assembled (grpc_h2.py), a message's (--max-message-bytes) where it is (grpc_stream.py). A mixin of
grpc_h2.H2Connection, which owns this state (declared in _init_guards) on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import struct

from .h2_frames import (
    ACK,
    ENHANCE_YOUR_CALM,
    FRAME_SIZE_ERROR,
    GOAWAY,
    MAX_EMPTY_FRAMES,
    MAX_ERROR_STREAMS_PER_S,
    MAX_PINGS_PER_S,
    MAX_RESETS_PER_S,
    MAX_SETTINGS_PER_S,
    NO_ERROR,
    PING,
    ProtocolViolation,
    frame,
)

log = logging.getLogger("nemo_serve.riva")


class Budget:
    """At most `max_per_s` of one kind of event in a second, else the connection's end: GOAWAY
    ENHANCE_YOUR_CALM with `why`. Fixed one-second windows (a burst across a boundary may reach
    twice the budget): a counter and a clock read per event; a sliding window's deque, rejected,
    would cost a list of times per connection to bound the same flood no better."""

    __slots__ = ("max_per_s", "why", "count", "since")

    def __init__(self, max_per_s: int, why: str) -> None:
        self.max_per_s, self.why = max_per_s, why
        self.count = 0  # events since `since` (the event loop's clock)
        self.since = 0.0

    def spend(self, now: float) -> None:
        if now - self.since >= 1.0:
            self.count, self.since = 0, now
        self.count += 1
        if self.count > self.max_per_s:
            raise ProtocolViolation(ENHANCE_YOUR_CALM, self.why)


class ConnectionGuards:
    """Rapid-reset and flood budgets, the preface deadline, keepalive pings and GOAWAY, for H2Connection."""

    def _init_guards(self) -> None:
        self.resets = Budget(MAX_RESETS_PER_S, f"over {MAX_RESETS_PER_S} streams reset in a second")
        self.pings = Budget(MAX_PINGS_PER_S, "too_many_pings")  # grpc-core's words: grpc clients back off
        self.settings_frames = Budget(MAX_SETTINGS_PER_S, f"over {MAX_SETTINGS_PER_S} SETTINGS in a second")
        self.error_streams = Budget(MAX_ERROR_STREAMS_PER_S,
                                    f"over {MAX_ERROR_STREAMS_PER_S} calls to no method in a second")  # fmt: skip
        self.empty_frames = 0  # in a row; a DATA frame with a payload or a header block with fields: 0
        self.going_away = False
        self.timer: asyncio.TimerHandle | None = None  # the preface deadline, then keepalive pings
        self.ping_due = False

    def _count_reset(self) -> None:
        """A stream reset by the client, refused by us or reset for a bad PRIORITY; over MAX_RESETS_PER_S: GOAWAY."""
        self.resets.spend(self.loop.time())

    def _count_error(self) -> None:
        """A call answered with an error at once, no handler run; past MAX_ERROR_STREAMS_PER_S a second: GOAWAY."""
        self.error_streams.spend(self.loop.time())

    def _count_empty(self) -> None:
        """An empty frame that does not end its stream (CVE-2019-9518); past MAX_EMPTY_FRAMES in a row: GOAWAY."""
        self.empty_frames += 1
        if self.empty_frames > MAX_EMPTY_FRAMES:
            raise ProtocolViolation(ENHANCE_YOUR_CALM, f"over {MAX_EMPTY_FRAMES} empty frames in a row")

    def _peer_ping(self, flags: int, sid: int, payload: bytearray) -> None:
        """The client's PING, acked within its budget; its ack of ours, our keepalive answered."""
        if len(payload) != 8 or sid:
            raise ProtocolViolation(FRAME_SIZE_ERROR, "a PING of the wrong size or on a stream")
        if flags & ACK:
            self.ping_due = False
            return
        self.pings.spend(self.loop.time())
        self.write(frame(PING, ACK, 0, bytes(payload)))

    # ------------------------------------------------------------------ ending
    def fail(self, code: int, why: str) -> None:
        """A connection error: GOAWAY with `code` and the connection closed (every call cancelled)."""
        log.info("closed an HTTP/2 connection from %s: %s", self.peer[0], why)
        self.goaway(code, why)
        if self.transport is not None:
            self.transport.close()
        self.buf.clear()

    def goaway(self, code: int = NO_ERROR, why: str = "") -> None:
        self.going_away = True
        self.write(frame(GOAWAY, 0, 0, struct.pack(">LL", self.last_stream_id, code) + why.encode()[:200]))

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    # ------------------------------------------------------------------ timers
    def _no_preface(self) -> None:
        self.timer = None
        log.info("closed a connection from %s: no HTTP/2 preface within %g s", self.peer[0],
                 self.server.settings.header_timeout_s)  # fmt: skip
        self.abort()

    def _keepalive(self) -> None:
        """--ping-interval-s: a PING; if the last one is unanswered after --ping-timeout-s, drop."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        s = self.server.settings
        if not s.ping_interval_s:
            return
        if self.ping_due:
            log.info("dropped a connection from %s: no PING ack within %g s", self.peer[0], s.ping_timeout_s)
            self.abort()
            return
        self.timer = self.loop.call_later(s.ping_interval_s, self._ping)

    def _ping(self) -> None:
        self.ping_due = True
        self.write(frame(PING, 0, 0, b"keepaliv"))
        self.timer = self.loop.call_later(self.server.settings.ping_timeout_s, self._keepalive)
