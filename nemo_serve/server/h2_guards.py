"""The HTTP/2 connection's guards against clients that flood or stall it (--fast-grpc-port), and
how a connection ends:

  rapid reset    streams reset by the client or refused by us, over MAX_RESETS_PER_S of either a
                 second: GOAWAY ENHANCE_YOUR_CALM (CVE-2023-44487)
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

from .h2_frames import ENHANCE_YOUR_CALM, GOAWAY, MAX_RESETS_PER_S, NO_ERROR, PING, ProtocolViolation, frame

log = logging.getLogger("nemo_serve.riva")


class ConnectionGuards:
    """Rapid-reset counting, the preface deadline, keepalive pings and GOAWAY, for H2Connection."""

    def _init_guards(self) -> None:
        self.resets = 0  # streams reset by the client or refused by us since `resets_since`
        self.resets_since = 0.0
        self.going_away = False
        self.timer: asyncio.TimerHandle | None = None  # the preface deadline, then keepalive pings
        self.ping_due = False

    def _count_reset(self) -> None:
        """A stream reset by the client or refused by us; over MAX_RESETS_PER_S: GOAWAY."""
        now = self.loop.time()
        if now - self.resets_since >= 1.0:
            self.resets, self.resets_since = 0, now
        self.resets += 1
        if self.resets > MAX_RESETS_PER_S:
            raise ProtocolViolation(ENHANCE_YOUR_CALM, f"over {MAX_RESETS_PER_S} streams reset in a second")

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
