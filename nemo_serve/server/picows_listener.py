"""A second WebSocket listener (--fast-ws-port) on picows, serving the same app's streaming routes
(/ws, /, /v1/realtime, /v1/listen) with less CPU per packet than uvicorn's.

Why (benchmarks/ws_layer_bench.py, ws_layer_cpu.json): per paced 20 ms packet, uvicorn + websockets
sans-I/O cost the server process 34 µs of the same trivial app, picows 16 µs in its frame
callback (as here for a data frame that finds its socket idle) and 22 µs with each frame handed
to a task. Rejected: granian (68 µs) and
uvicorn + wsproto (44 µs); uvloop off (48 µs). The transport is uvloop's (not aiofastnet):
its abort and pause_reading are what the hardening tests were written against.

How: each connection is an ASGI WebSocket connection of the app (picows_connection.py, with its
keepalive in picows_keepalive.py), so the route, the Session, the wire formats, every timeout and
the drain are the code the uvicorn listener runs. This module does what uvicorn_protocols.py does
under uvicorn before a connection is the app's, re-implemented on picows:
  - the upgrade request is answered here, as uvicorn's listener answers it: picows calls the
    listener factory with the request and sends what it returns before the app runs, so the
    app's own handshake check (app.state.handshake_refusal: Origin 403, token 401, a full server
    503) runs in the factory and a refusal is the HTTP status with the app's JSON body, not an
    error message after an upgrade (clients written for other servers read the status:
    websockets' InvalidStatus, the openai SDK's error);
  - caps: ConnectionLimiter counts the TCP connection when it is made (UpgradeProtocol, picows's
    server protocol with the peer's address), handshakes in progress included; one over a cap
    gets HTTP 503 once its request is in, or is closed after REFUSE_GRACE_S;
  - request deadline: an upgrade request not in within --header-timeout-s gets HTTP 408 and a
    close (picows's own handshake timeout, off here, drops the socket without a word);
  - slow readers: the small kernel send buffer (bound_send_buffer);
  - drain: sessions are the app's, so ServerContext.drain ends them; close() stops accepting
    and drops what is left after SHUTDOWN_ABORT_S.
Not here: probes beyond the caps (this port serves only the streaming routes: 404 elsewhere).
UpgradeProtocol subclasses picows's WSProtocol and calls its constructor, which is not picows's
public API (ws_create_server is, but it gives the factory no peer address and no hook at the
TCP connection): hence PICOWS_VERSIONS, checked at import.
"""

from __future__ import annotations

import asyncio
import json
import logging
from urllib.parse import urlsplit

from starlette.requests import HTTPConnection

from ..versions import require
from .auth import SUBPROTOCOL
from .connections import REFUSE_GRACE_S, SHUTDOWN_ABORT_S, ConnectionLimits, bound_send_buffer

PICOWS_VERSIONS = ("2.3.1", "2.4")  # >=, <: tested with 2.3.1 (env/cpu.lock.txt)
require("picows", *PICOWS_VERSIONS, uses="server protocol class (picows.picows.WSProtocol)")

from picows import WSAutoPingStrategy, WSUpgradeResponse, WSUpgradeResponseWithListener  # noqa: E402
from picows.picows import WSProtocol  # noqa: E402

from .picows_connection import AppConnection  # noqa: E402

log = logging.getLogger("nemo_serve.connections")

ROUTES = frozenset({"/ws", "/", "/v1/realtime", "/v1/listen"})


class UpgradeProtocol(WSProtocol):
    """picows's server protocol for one TCP connection, with what uvicorn_protocols.HttpProtocol
    adds before the upgrade: the connection counted against the caps from the moment it is made,
    and the request deadline answered with 408 (or the cap's 503)."""

    def __init__(self, listener: "FastWsListener") -> None:
        s = listener.settings
        super().__init__(None, None, False, self._on_request, logging.getLogger("picows.server"), True,
                         None,  # picows's handshake timeout: the deadline below answers instead
                         False, 20, 20, WSAutoPingStrategy.PING_WHEN_IDLE,  # auto-ping off: AppConnection pings
                         False,  # auto-pong off: AppConnection answers pings while the client reads
                         s.max_message_bytes, None, 16 * 1024)  # fmt: skip
        self.fast, self.limits = listener, listener.limits
        self.tcp = None
        self.client = ("", 0)
        self.refusal: str | None = None  # over a cap: answered 503 once the request is in
        self.deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.tcp = transport
        peer = transport.get_extra_info("peername") or ("", 0)
        self.client = (peer[0], peer[1])
        self.refusal = self.limits.limiter.acquire(transport, self.client[0])
        if self.refusal is None:
            bound_send_buffer(transport)
        wait_s = REFUSE_GRACE_S if self.refusal else self.limits.header_timeout_s
        self.deadline = asyncio.get_running_loop().call_later(wait_s, self._on_deadline)

    def connection_lost(self, exc) -> None:
        self._disarm()
        self.limits.limiter.release(self.tcp)
        super().connection_lost(exc)

    def _on_request(self, request):
        """picows's listener factory: the whole upgrade request is in."""
        self._disarm()
        if self.refusal is not None:
            return _error_response(503, self.refusal)
        return self.fast.route(request, self.client)

    def _on_deadline(self) -> None:
        self.deadline = None
        if self.refusal is not None:
            self._answer(503, self.refusal)
            return
        metrics = self.limits.limiter.metrics
        if metrics is not None:
            metrics.refusals.labels(reason="header_timeout").inc()
        log.info("closed a connection from %s: request not complete in %g s", self.client[0],
                 self.limits.header_timeout_s)  # fmt: skip
        self._answer(408, f"request not received within {self.limits.header_timeout_s:g} s")

    def _answer(self, status: int, reason: str) -> None:
        if not self.tcp.is_closing():
            self.tcp.write(bytes(_error_response(status, reason).response.to_bytes()))
            self.tcp.close()

    def _disarm(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None


class FastWsListener:
    """The picows server of one front end."""

    def __init__(self, app, limits: ConnectionLimits, settings) -> None:
        self.app, self.limits, self.settings = app, limits, settings
        self.max_message_bytes = settings.max_message_bytes
        self.connections: set[AppConnection] = set()
        self.server: asyncio.AbstractServer | None = None

    def route(self, request, client: tuple[str, int]):
        """The answer to an upgrade request under the caps: 404 off the routes, the app's
        handshake refusal as its HTTP status, else the connection (101). A failure here is ours:
        logged with its traceback and answered 500 with a generic reason, as uvicorn answers an
        app that fails before accepting (picows would answer 500 with the exception's text and
        log nothing, which hid a defect from every "no traceback in the log" check)."""
        try:
            return self._route(request, client)
        except Exception:  # noqa: BLE001 - any failure answering the upgrade
            log.exception("fast-ws upgrade request from %s failed", client[0])
            return _error_response(500, "internal server error")

    def _route(self, request, client: tuple[str, int]):
        url = urlsplit(request.path.decode("latin-1"))
        if url.path not in ROUTES:
            return None  # picows answers 404
        scope = self._scope(request, url, client)
        refusal = self.app.state.handshake_refusal(HTTPConnection(scope))
        if refusal is not None:
            status, reason, _ = refusal  # the close code is for a refusal after an upgrade
            return _error_response(status, reason)
        connection = AppConnection(self, scope)
        if url.path == "/v1/realtime" and SUBPROTOCOL in scope["subprotocols"]:
            # what the app's accept(subprotocol=accepted_subprotocol(ws)) would answer (NIM's client)
            response = WSUpgradeResponse.create_101_response({"Sec-WebSocket-Protocol": SUBPROTOCOL})
            return WSUpgradeResponseWithListener(response, connection)
        return connection

    def _scope(self, request, url, client) -> dict:
        # The bytes as they came: picows decodes names as ASCII and values as ASCII with
        # surrogateescape (a byte past 0x7f is a lone surrogate, which latin-1 cannot encode: a
        # forged secret with a '\xb2' in it answered 500 with the codec's message, issue 45's defect 4)
        headers = [(k.lower().encode("ascii"), v.encode("ascii", "surrogateescape")) for k, v in request.headers.items()]
        return {"type": "websocket", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                "scheme": "wss" if self.settings.tls else "ws", "path": url.path, "raw_path": url.path.encode(),
                "query_string": url.query.encode("latin-1"), "root_path": "", "headers": headers,
                "client": client, "server": None, "subprotocols": _subprotocols(request.headers), "state": {}}  # fmt: skip

    async def start(self) -> None:
        """Listen on --fast-ws-port, an SO_REUSEPORT socket as every front end's (the supervisor
        reserved the port: core/supervisor.py). The transport is asyncio's loop's (uvloop), not
        aiofastnet: its abort and pause_reading are what the hardening tests were written against."""
        s = self.settings
        self.server = await asyncio.get_running_loop().create_server(
            lambda: UpgradeProtocol(self), s.host, s.fast_ws_port, reuse_port=True, ssl=_ssl_context(s))

    async def close(self) -> None:
        """Stop accepting; drop the connections still open after SHUTDOWN_ABORT_S."""
        if self.server is not None:
            self.server.close()
        loop = asyncio.get_running_loop()
        for c in list(self.connections):
            loop.call_later(SHUTDOWN_ABORT_S, c.abort)


def _error_response(status: int, reason: str) -> WSUpgradeResponseWithListener:
    """What the app's denial (app._refuse) answers through uvicorn: its JSON error body."""
    body = json.dumps({"type": "error", "id": None, "reason": reason}).encode()
    headers = {"Content-Type": "application/json", **({"Retry-After": "1"} if status == 503 else {})}
    return WSUpgradeResponseWithListener(WSUpgradeResponse.create_error_response(status, body, headers), None)


def _subprotocols(headers) -> list[str]:
    offered = ",".join(headers.getall("sec-websocket-protocol", []))
    return [p.strip() for p in offered.split(",") if p.strip()]


def _ssl_context(settings):
    if settings.ssl_certfile is None:
        return None
    import ssl

    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(str(settings.ssl_certfile), str(settings.ssl_keyfile) if settings.ssl_keyfile else None)
    return ctx
