"""A second WebSocket listener (--fast-ws-port) on picows, serving the same app's streaming routes
(/ws, /, /v1/realtime) with less CPU per packet than uvicorn's.

Why (benchmarks/ws_layer_bench.py, ws_layer_cpu.json): per paced 20 ms packet, uvicorn + websockets
sans-I/O cost the server process 34 µs of the same trivial app, picows 16 µs in its frame
callback (as here for a data frame that finds its socket idle) and 22 µs with each frame handed
to a task. Rejected: granian (68 µs) and
uvicorn + wsproto (44 µs); uvloop off (48 µs). The transport is uvloop's (not aiofastnet):
its abort and pause_reading are what the hardening tests were written against.

How: each connection is an ASGI WebSocket connection of the app (`app(scope, receive, send)`),
so the route, the Session, the wire formats, every timeout and the drain are the code the uvicorn
listener runs. This module does only what uvicorn_protocols.py does under uvicorn, re-implemented
on picows:
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
  - frame and message size: --max-message-bytes per frame (picows closes with 1009) and per message
    reassembled from fragments (closed here with 1009), text that is not UTF-8: 1007;
  - slow readers: the small kernel send buffer (bound_send_buffer); a send waits while the transport
    is paused, so the session's --send-timeout-s notices a client that stopped reading;
  - backpressure: the socket is not read while MAX_INBOX messages wait for the app (picows itself
    would read and buffer without bound), so the session's MAX_AHEAD_S reaches the client;
  - abort (`scope["extensions"]["nemo_serve.connection"]["abort"]`);
  - keepalive (--ping-interval-s, --ping-timeout-s) as uvicorn's websockets-sansio protocol does it:
    a ping every interval whether or not the client sends, and no pong within the timeout: close
    1011 "keepalive ping timeout". picows's own auto-ping is off: it pings only after an interval
    with nothing received (PING_WHEN_IDLE; a client that keeps sending is never asked) or every
    interval plus the timeout (PING_PERIODICALLY), closes with 1001 and its own reason, runs a task
    per connection and refuses a timeout longer than the interval. Here one TimerHandle per
    connection, a call_later chain (next ping, then the pong's deadline), and nothing per data
    frame: a pong is looked at in the branch for control frames;
  - a data frame that finds the app's socket idle (its receive task parked, nothing queued) is
    handed to it in the frame callback (the "take_frames" hook, ws_socket.WsSocket.take_frame):
    the same handling with no task wake-up per packet; the rest goes through the inbox;
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
import random
import struct
from collections import deque
from urllib.parse import urlsplit

from starlette.requests import HTTPConnection

from ..versions import require
from .auth import SUBPROTOCOL
from .connections import REFUSE_GRACE_S, SHUTDOWN_ABORT_S, ConnectionLimits, bound_send_buffer

PICOWS_VERSIONS = ("2.3.1", "2.4")  # >=, <: tested with 2.3.1 (env/cpu.lock.txt)
require("picows", *PICOWS_VERSIONS, uses="server protocol class (picows.picows.WSProtocol)")

from picows import (  # noqa: E402
    WSAutoPingStrategy,
    WSCloseCode,
    WSListener,
    WSMsgType,
    WSUpgradeResponse,
    WSUpgradeResponseWithListener,
)
from picows.picows import WSProtocol  # noqa: E402

log = logging.getLogger("nemo_serve.connections")

ROUTES = frozenset({"/ws", "/", "/v1/realtime"})
CLOSE_INVALID_DATA = 1007
CLOSE_TOO_BIG = 1009
CLOSE_WAIT_S = 1.0  # after our close frame, how long the client has to answer before the drop
# picows reads whatever arrives and hands it over at once: past this many messages the app has not
# taken, the socket is not read until it takes them (as uvicorn's protocol pauses while its queue
# is full), so the session's backpressure (MAX_AHEAD_S) reaches the client through TCP.
MAX_INBOX = 16


class AppConnection(WSListener):
    """One picows connection, as an ASGI WebSocket connection of `app`. Owner of its inbox: the
    event loop (picows callbacks and the app's task both run on it)."""

    def __init__(self, listener: "FastWsListener", scope: dict) -> None:
        super().__init__()
        self.listener, self.scope = listener, scope
        scope["extensions"] = {"nemo_serve.connection": {"abort": self.abort, "take_frames": self.take_frames}}
        self.transport = None
        self.inbox: deque = deque([{"type": "websocket.connect"}])
        self.arrived: asyncio.Future | None = None  # the app's receive, waiting for the inbox
        self.writable = asyncio.Event()
        self.writable.set()
        self.read_paused = False
        self.fragments: list[bytes] = []
        self.fragment_opcode = None
        self.gone = False
        self.task: asyncio.Task | None = None
        # The app's socket's synchronous frame handler (ws_socket.WsSocket.take_frame), or None.
        self.take_frame = None
        # keepalive: the next ping, or (ping_payload set) the deadline of the pong to it
        self.ping_timer: asyncio.TimerHandle | None = None
        self.ping_payload: bytes | None = None
        self.ping_sent_at = 0.0
        self.ping_rtt_s = 0.0

    # ------------------------------------------------------------------ picows callbacks
    def on_ws_connected(self, transport) -> None:
        self.transport = transport
        self.listener.connections.add(self)
        self.task = asyncio.get_running_loop().create_task(self._run_app())
        if self.listener.settings.ping_interval_s:
            self._schedule_ping()

    def on_ws_frame(self, transport, frame) -> None:
        kind = frame.msg_type
        if kind == WSMsgType.CLOSE:
            code = frame.get_close_code()
            self._push_disconnect(int(code.value if hasattr(code, "value") else code))
            if not transport.is_close_frame_sent:
                transport.send_close(code)
            transport.disconnect()
            return
        if kind not in (WSMsgType.BINARY, WSMsgType.TEXT, WSMsgType.CONTINUATION):
            if kind == WSMsgType.PONG:  # pings are answered by picows
                self._on_pong(frame.get_payload_as_bytes())
            return
        if kind != WSMsgType.CONTINUATION:
            self.fragment_opcode, self.fragments = kind, []
        self.fragments.append(frame.get_payload_as_bytes())
        if sum(map(len, self.fragments)) > self.listener.max_message_bytes:
            self._fail(CLOSE_TOO_BIG, "message too big")
            return
        if not frame.fin:
            return
        data = self.fragments[0] if len(self.fragments) == 1 else b"".join(self.fragments)
        self.fragments = []
        if self.fragment_opcode == WSMsgType.TEXT:
            try:
                text = data.decode()
            except UnicodeDecodeError:
                self._fail(CLOSE_INVALID_DATA, "invalid UTF-8 in a text frame")
                return
            if not self._handed_over(text):
                self._push({"type": "websocket.receive", "text": text})
        elif not self._handed_over(data):
            self._push({"type": "websocket.receive", "bytes": data})

    def _handed_over(self, data: bytes | str) -> bool:
        """The frame handled now by the app's socket, in this callback (no task switch): only with
        nothing queued ahead of it, so frames keep their order; the socket declines while its
        receive task is busy or waiting for the model (then the frame is queued for the task)."""
        return self.take_frame is not None and not self.inbox and not self.gone and self.take_frame(data)

    def on_ws_disconnected(self, transport) -> None:
        self._push_disconnect(1006)  # the TCP connection's count is UpgradeProtocol's to release
        self.listener.connections.discard(self)
        if self.ping_timer is not None:
            self.ping_timer.cancel()
            self.ping_timer = None

    def pause_writing(self) -> None:
        self.writable.clear()

    def resume_writing(self) -> None:
        self.writable.set()

    def take_frames(self, handler) -> None:
        """The app's hook (scope extension "take_frames"): data frames go to `handler(data) -> bool`
        first; None: every frame to the inbox again."""
        self.take_frame = handler

    # ------------------------------------------------------------------ ASGI receive / send
    async def receive(self) -> dict:
        while not self.inbox:
            self.arrived = asyncio.get_running_loop().create_future()
            await self.arrived
        if self.read_paused and len(self.inbox) <= MAX_INBOX // 2 and not self.gone:
            self.read_paused = False
            self.transport.underlying_transport.resume_reading()
        return self.inbox.popleft()

    async def send(self, message: dict) -> None:
        kind = message["type"]
        if self.gone or kind == "websocket.accept":  # the upgrade was answered already
            return
        if kind == "websocket.send":
            await self.writable.wait()  # a client that stopped reading: the caller's send timeout
            if message.get("bytes") is not None:
                self.transport.send(WSMsgType.BINARY, message["bytes"])
            else:
                self.transport.send(WSMsgType.TEXT, message["text"].encode())
        elif kind == "websocket.close":
            reason = (message.get("reason") or "").encode()[:123]
            self.transport.send_close(_close_code(message.get("code", 1000)), reason)
            asyncio.get_running_loop().call_later(CLOSE_WAIT_S, self.abort)
            self.gone = True

    # ------------------------------------------------------------------ keepalive
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

    # ------------------------------------------------------------------ internals
    async def _run_app(self) -> None:
        try:
            await self.listener.app(self.scope, self.receive, self.send)
        except Exception:  # noqa: BLE001 - as uvicorn: logged, the connection closed with 1011
            log.exception("fast-ws connection failed in the app")
            if not self.gone:
                self._fail(1011, "internal server error")
        finally:
            if not self.gone and self.transport is not None:
                self._fail(1000, "")

    def _push(self, message: dict) -> None:
        self.inbox.append(message)
        if len(self.inbox) >= MAX_INBOX and not self.read_paused and self.transport is not None:
            self.read_paused = True
            self.transport.underlying_transport.pause_reading()
        if self.arrived is not None and not self.arrived.done():
            self.arrived.set_result(None)

    def _push_disconnect(self, code: int) -> None:
        if not any(m["type"] == "websocket.disconnect" for m in self.inbox):
            self._push({"type": "websocket.disconnect", "code": code})

    def _fail(self, code: int, reason: str) -> None:
        """Close with `code` (the app hears a disconnect with it), drop after CLOSE_WAIT_S."""
        self._push_disconnect(code)
        if not self.transport.is_close_frame_sent:
            self.transport.send_close(_close_code(code), reason.encode())
        self.gone = True
        asyncio.get_running_loop().call_later(CLOSE_WAIT_S, self.abort)

    def abort(self) -> None:
        """Drop the TCP connection now, whatever is still buffered for it."""
        if self.transport is not None:
            self.transport.underlying_transport.abort()


class UpgradeProtocol(WSProtocol):
    """picows's server protocol for one TCP connection, with what uvicorn_protocols.HttpProtocol
    adds before the upgrade: the connection counted against the caps from the moment it is made,
    and the request deadline answered with 408 (or the cap's 503)."""

    def __init__(self, listener: "FastWsListener") -> None:
        s = listener.settings
        super().__init__(None, None, False, self._on_request, logging.getLogger("picows.server"), True,
                         None,  # picows's handshake timeout: the deadline below answers instead
                         False, 20, 20, WSAutoPingStrategy.PING_WHEN_IDLE,  # auto-ping off: AppConnection pings
                         True, s.max_message_bytes, None, 16 * 1024)  # fmt: skip
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
        handshake refusal as its HTTP status, else the connection (101)."""
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
        headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in request.headers.items()]
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


def _close_code(code: int):
    try:
        return WSCloseCode(code)
    except ValueError:  # a code picows has no name for (the app's are all standard)
        return WSCloseCode.POLICY_VIOLATION


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
