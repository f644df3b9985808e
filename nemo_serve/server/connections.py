"""The TCP connections under the app: caps, a header deadline, a small send buffer, a way to drop one.

uvicorn parses HTTP and WebSocket frames; these subclasses of its two protocol classes add what
it lacks:
  - caps: at most --max-connections open sockets in all and --max-connections-per-ip from one
    address. One over a cap gets HTTP 503 with a JSON reason once its request headers are in
    (or is closed after REFUSE_GRACE_S if they never come). Rejected: uvicorn's
    limit_concurrency, which skips WebSocket upgrades; answering at accept time, before the
    request is read, which lets the client's late request trigger a TCP reset that can
    destroy the answer before it is read.
  - a request deadline: a request (headers and any body) must be in within --header-timeout-s
    of the connection (or of the first byte of a later keep-alive request), else HTTP 408 and
    close. uvicorn has none: a silent socket, or a body sent a byte at a time, stays open forever. (TLS handshakes are bounded by
    asyncio's own 60 s ssl_handshake_timeout, before any of this runs.)
  - a small kernel send buffer (SEND_BUFFER_BYTES) so that a client that stops reading is
    noticed after a few hundred kilobytes of results, not after the kernel's autotuned
    megabytes; the session's send timeout then frees its slot (session.py).
  - `scope["extensions"]["nemo_serve.connection"]["abort"]`: drops the TCP connection at once.
    The session uses it for a client that cannot take even its close frame, where
    transport.close() would wait for the client to read, forever.
  - a denied WebSocket handshake (401/403/503) counts as complete: uvicorn's sans-I/O protocol
    otherwise logs "ASGI callable returned without completing handshake" for every refusal.
  - a lingering close after a frame the transport refuses (invalid UTF-8: 1007, too big: 1009):
    uvicorn closes the socket right after its close frame, and data the client is still
    sending then meets a closed socket, whose TCP reset can destroy the close frame before the
    client reads it (the client sees 1006, not why). We keep reading until the client's close
    reply, or LINGER_S.

Owner of the counts: the event loop (protocol callbacks run on it).
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from dataclasses import dataclass, field

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

log = logging.getLogger("nemo_serve.connections")

SEND_BUFFER_BYTES = 64 * 1024  # SO_SNDBUF per socket (Linux doubles it); results are a few kB/s
REFUSE_GRACE_S = 2.0  # how long a refused connection may take to send the request it is refused
SHUTDOWN_ABORT_S = 1.0  # at uvicorn's shutdown, a socket that has not flushed by then is dropped
LINGER_S = 1.0  # after a 1007/1009 close frame, how long to keep reading before closing
_MAX_REFUSED_REQUEST = 16 * 1024
FILE_RESERVE = 64  # open files kept for everything but client sockets


@dataclass
class ConnectionLimiter:
    """Open sockets, in all and per client address."""

    max_total: int
    max_per_ip: int
    metrics: object | None = None  # ServerMetrics: the connections gauge and the refusal counter
    num_open: int = 0
    ip_to_count: dict[str, int] = field(default_factory=dict)
    _transport_to_ip: dict = field(default_factory=dict)  # transport -> address, while counted

    def acquire(self, transport, ip: str) -> str | None:
        """Count the connection in, or return why not (a reason for the client)."""
        if self.num_open >= self.max_total:
            reason = f"server has too many open connections (limit {self.max_total}); retry later"
        elif self.ip_to_count.get(ip, 0) >= self.max_per_ip:
            reason = f"too many connections from your address (limit {self.max_per_ip}); retry later"
        else:
            self.num_open += 1
            self.ip_to_count[ip] = self.ip_to_count.get(ip, 0) + 1
            self._transport_to_ip[transport] = ip
            self._gauge()
            return None
        if self.metrics is not None:
            self.metrics.refusals.labels(reason="connection_limit").inc()
        log.info("refused a connection from %s: %s", ip, reason)
        return reason

    def release(self, transport) -> None:
        """Idempotent: the HTTP protocol and, after an upgrade, the WebSocket one both call it."""
        ip = self._transport_to_ip.pop(transport, None)
        if ip is None:
            return
        self.num_open -= 1
        left = self.ip_to_count[ip] - 1
        if left:
            self.ip_to_count[ip] = left
        else:
            del self.ip_to_count[ip]
        self._gauge()

    def _gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.connections.set(self.num_open)


@dataclass(frozen=True)
class ConnectionLimits:
    limiter: ConnectionLimiter
    header_timeout_s: float


def _http_response(status: int, phrase: str, reason: str, retry_after: bool) -> bytes:
    body = json.dumps({"type": "error", "id": None, "reason": reason}).encode()
    head = [f"HTTP/1.1 {status} {phrase}", "content-type: application/json", f"content-length: {len(body)}",
            "connection: close"]  # fmt: skip
    if retry_after:
        head.append("retry-after: 1")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


class HttpProtocol(HttpToolsProtocol):
    limits: ConnectionLimits  # set by protocol_classes()

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._refusal: str | None = None
        self._refused_request = b""
        self._headers_done = False  # of the request being read

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._refusal = self.limits.limiter.acquire(transport, self.client[0] if self.client else "")
        if self._refusal is None:
            _bound_send_buffer(transport)
        self._arm(REFUSE_GRACE_S if self._refusal else self.limits.header_timeout_s)

    def connection_lost(self, exc) -> None:
        self._disarm()
        self.limits.limiter.release(self.transport)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refusal is None:
            super().data_received(data)
            return
        self._refused_request += data  # read the request, so that the answer is not reset away
        if b"\r\n\r\n" in self._refused_request or len(self._refused_request) > _MAX_REFUSED_REQUEST:
            self._answer(503, "Service Unavailable", self._refusal)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._headers_done = False
        if self._deadline is None:  # a later keep-alive request: its own deadline
            self._arm(self.limits.header_timeout_s)

    def on_headers_complete(self) -> None:
        self._headers_done = True
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._disarm()
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
        if self.limits.limiter.metrics is not None:
            self.limits.limiter.metrics.refusals.labels(reason="header_timeout").inc()
        log.info("closed a connection from %s: request not complete in %g s", self.client and self.client[0],
                 self.limits.header_timeout_s)  # fmt: skip
        if self._headers_done:  # the app may have answered already; only the body is missing
            self.transport.close()
            return
        self._answer(408, "Request Timeout", f"request not received within {self.limits.header_timeout_s:g} s")

    def _answer(self, status: int, phrase: str, reason: str) -> None:
        if not self.transport.is_closing():
            self.transport.write(_http_response(status, phrase, reason, retry_after=status == 503))
            self.transport.close()


class WebSocketProtocol(WebSocketsSansIOProtocol):
    limits: ConnectionLimits  # set by protocol_classes()
    _lingering = False

    def data_received(self, data: bytes) -> None:
        if not self._lingering:  # else discarded: the close frame is out, the close is timed
            super().data_received(data)

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
            scope["extensions"]["nemo_serve.connection"] = {"abort": self.abort}

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


def max_connections_for(requested: int, file_limit: int | None) -> int:
    """The cap actually applied: under the process's open-file limit, with room for the model,
    the log and the listening socket (FILE_RESERVE), so that the cap refuses clearly before
    accept() fails with EMFILE and takes /healthz down with it."""
    if file_limit is None or file_limit <= 0:
        return requested
    return max(1, min(requested, file_limit - FILE_RESERVE))


def _bound_send_buffer(transport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        except OSError:  # not every transport's socket takes it (unix sockets do, pipes do not)
            pass


def protocol_classes(limits: ConnectionLimits) -> tuple[type, type]:
    """(HTTP, WebSocket) protocol classes for uvicorn.Config(http=..., ws=...), bound to `limits`."""
    http = type("HttpProtocol", (HttpProtocol,), {"limits": limits})
    ws = type("WebSocketProtocol", (WebSocketProtocol,), {"limits": limits})
    return http, ws
