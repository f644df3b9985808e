"""Keepalive for the picows listener's connections (--fast-ws-port; --ping-interval-s,
--ping-timeout-s), as uvicorn's websockets-sansio protocol does it: a ping every interval whether
or not the client sends, and no pong within the timeout: close 1011 "keepalive ping timeout".

picows's own auto-ping is off: it pings only after an interval with nothing received
(PING_WHEN_IDLE; a client that keeps sending is never asked) or every interval plus the timeout
(PING_PERIODICALLY), closes with 1001 and its own reason, runs a task per connection and refuses a
timeout longer than the interval. Here one TimerHandle per connection, a call_later chain (next
ping, then the pong's deadline), and nothing per data frame: a pong is looked at in the branch for
control frames (picows_connection.AppConnection.on_ws_frame). A mixin of AppConnection, which owns
this state (declared in _init_keepalive) on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import random
import struct

log = logging.getLogger("nemo_serve.connections")


class Keepalive:
    """The ping chain of one AppConnection."""

    def _init_keepalive(self) -> None:
        # the next ping, or (ping_payload set) the deadline of the pong to it
        self.ping_timer: asyncio.TimerHandle | None = None
        self.ping_payload: bytes | None = None
        self.ping_sent_at = 0.0
        self.ping_rtt_s = 0.0

    def _schedule_ping(self) -> None:
        # as uvicorn's schedule_ping: the interval counts from the ping before, less its round trip
        delay_s = max(0.0, self.listener.settings.ping_interval_s - self.ping_rtt_s)
        self.ping_timer = asyncio.get_running_loop().call_later(delay_s, self._send_ping)

    def _send_ping(self) -> None:
        self.ping_timer = None
        if self.gone:  # closing: the close handshake's own deadline (CLOSE_WAIT_S) ends it
            return
        loop = asyncio.get_running_loop()
        # A random payload, as uvicorn's and websockets': a stale or unsolicited pong is not an answer.
        self.ping_payload = struct.pack("!I", random.getrandbits(32))
        self.ping_sent_at = loop.time()
        self.transport.send_ping(self.ping_payload)
        self.ping_timer = loop.call_later(self.listener.settings.ping_timeout_s, self._on_ping_timeout)

    def _on_pong(self, payload: bytes) -> None:
        if self.ping_payload is None or payload != self.ping_payload:
            return
        self.ping_payload = None
        self.ping_rtt_s = asyncio.get_running_loop().time() - self.ping_sent_at
        if self.ping_timer is not None:
            self.ping_timer.cancel()
        self._schedule_ping()

    def _on_ping_timeout(self) -> None:
        self.ping_timer, self.ping_payload = None, None
        if self.gone:
            return
        log.info("closed a fast-ws connection from %s: no pong within %g s", self.scope["client"][0],
                 self.listener.settings.ping_timeout_s)  # fmt: skip
        self._fail(1011, "keepalive ping timeout")  # uvicorn's (websockets') code and reason

    def _stop_keepalive(self) -> None:
        if self.ping_timer is not None:
            self.ping_timer.cancel()
            self.ping_timer = None
