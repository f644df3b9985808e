"""The TCP connections under the app: caps, a header deadline, a small send buffer, a way to drop one.

uvicorn parses HTTP and WebSocket frames; subclasses of its two protocol classes
(uvicorn_protocols.py, the one module that reaches into uvicorn's internals) add what it lacks,
with the policy and the counts kept here:
  - caps: at most --max-connections open sockets in all and --max-connections-per-ip from one
    address. One over a cap gets HTTP 503 with a JSON reason once its request headers are in
    (or is closed after REFUSE_GRACE_S if they never come). Rejected: uvicorn's
    limit_concurrency, which skips WebSocket upgrades; answering at accept time, before the
    request is read, which lets the client's late request trigger a TCP reset that can
    destroy the answer before it is read.
  - probes beyond the caps: a connection over a cap whose request is `GET /healthz`, `/readyz`
    or `/metrics` is served anyway, within its own bound of MAX_PROBE_CONNECTIONS open at once
    (kept alive for probes only, until uvicorn's keep-alive timeout), so that a kubelet's
    liveness probe does not restart a pod whose streams are fine while a flood holds every
    connection. Past that bound, probes get the 503 like everything else, so a probe flood
    cannot exhaust file descriptors (the bound is inside FILE_RESERVE). Rejected: a separate
    probe port (every deployment would change); closing a probe after one answer (Kubernetes'
    probes close anyway, and a scraper's keep-alive would cost a connection per scrape).
  - a request deadline: a request (headers and any body) must be in within --header-timeout-s
    of the connection (or of the first byte of a later keep-alive request), else HTTP 408 and
    close. uvicorn has none: a silent socket, or a body sent a byte at a time, stays open forever. (TLS handshakes are bounded by
    asyncio's own 60 s ssl_handshake_timeout, before any of this runs.)
  - a small kernel send buffer (SEND_BUFFER_BYTES) so that a client that stops reading is
    noticed after a few hundred kilobytes of results, not after the kernel's autotuned
    megabytes; the session's send timeout then frees its slot (stream_session.py).
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

import json
import logging
import socket
from dataclasses import dataclass, field

log = logging.getLogger("nemo_serve.connections")

SEND_BUFFER_BYTES = 64 * 1024  # SO_SNDBUF per socket (Linux doubles it); results are a few kB/s
REFUSE_GRACE_S = 2.0  # how long a refused connection may take to send the request it is refused
SHUTDOWN_ABORT_S = 1.0  # at uvicorn's shutdown, a socket that has not flushed by then is dropped
LINGER_S = 1.0  # after a 1007/1009 close frame, how long to keep reading before closing
MAX_REFUSED_REQUEST_BYTES = 16 * 1024
FILE_RESERVE = 64  # open files kept for everything but client sockets
MAX_PROBE_CONNECTIONS = 8  # probes served beyond the caps at once; inside FILE_RESERVE
PROBE_PATHS = (b"/healthz", b"/readyz", b"/metrics")


@dataclass
class ConnectionLimiter:
    """Open sockets, in all and per client address."""

    max_total: int
    max_per_ip: int
    metrics: object | None = None  # ServerMetrics: the connections gauge and the refusal counter
    num_open: int = 0
    num_probes: int = 0  # probes served beyond the caps, not counted in num_open
    ip_to_count: dict[str, int] = field(default_factory=dict)
    _transport_to_ip: dict = field(default_factory=dict)  # transport -> address, while counted
    _probe_transports: set = field(default_factory=set)

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

    def acquire_probe(self, transport) -> bool:
        """Count a probe in beyond the caps, or False when MAX_PROBE_CONNECTIONS are open."""
        if self.num_probes >= MAX_PROBE_CONNECTIONS:
            return False
        self.num_probes += 1
        self._probe_transports.add(transport)
        return True

    def release(self, transport) -> None:
        """Idempotent: the HTTP protocol and, after an upgrade, the WebSocket one both call it."""
        if transport in self._probe_transports:
            self._probe_transports.discard(transport)
            self.num_probes -= 1
            return
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


def is_probe(request: bytes) -> bool:
    """Whether a whole request head is a GET of a probe path (query allowed)."""
    method, _, rest = request.partition(b" ")
    target = rest.split(b" ", 1)[0].split(b"?", 1)[0]
    return method == b"GET" and target in PROBE_PATHS


def http_response(status: int, phrase: str, reason: str, retry_after: bool) -> bytes:
    body = json.dumps({"type": "error", "id": None, "reason": reason}).encode()
    head = [f"HTTP/1.1 {status} {phrase}", "content-type: application/json", f"content-length: {len(body)}",
            "connection: close"]  # fmt: skip
    if retry_after:
        head.append("retry-after: 1")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def max_connections_for(requested: int, file_limit: int | None) -> int:
    """The cap actually applied: under the process's open-file limit, with room for the model,
    the log and the listening socket (FILE_RESERVE), so that the cap refuses clearly before
    accept() fails with EMFILE and takes /healthz down with it."""
    if file_limit is None or file_limit <= 0:
        return requested
    return max(1, min(requested, file_limit - FILE_RESERVE))


def bound_send_buffer(transport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        except OSError:  # not every transport's socket takes it (unix sockets do, pipes do not)
            pass
