"""One connection of the picows listener (--fast-ws-port) as an ASGI WebSocket connection of the
app (`app(scope, receive, send)`), so the route, the Session, the wire formats, every timeout and
the drain are the code the uvicorn listener runs. What uvicorn's protocol does for a connection,
re-implemented on picows's callbacks:
  - frame and message size: --max-message-bytes per frame (picows closes with 1009) and per message
    reassembled from fragments (closed here with 1009), text that is not UTF-8: 1007;
  - the framing rules picows does not check (reserved bits, continuation order): 1002, and a
    close frame with no status answered with none;
  - slow readers: a send waits while the transport is paused, so the session's --send-timeout-s
    notices a client that stopped reading;
  - backpressure: the socket is not read while MAX_INBOX messages wait for the app (picows itself
    would read and buffer without bound), so the session's MAX_AHEAD_S reaches the client;
  - pings: answered here, and only while the client takes what it is sent (as uvicorn_protocols.py);
  - abort (`scope["extensions"]["nemo_serve.connection"]["abort"]`);
  - keepalive: picows_keepalive.py;
  - a data frame that finds the app's socket idle (its receive task parked, nothing queued) is
    handed to it in the frame callback (the "take_frames" hook, ws_socket.WsSocket.take_frame):
    the same handling with no task wake-up per packet; the rest goes through the inbox.
The upgrade, the caps and the listener are picows_listener.py's.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque

from picows import WSCloseCode, WSListener, WSMsgType

from .picows_keepalive import Keepalive

log = logging.getLogger("nemo_serve.connections")

CLOSE_NO_STATUS = 1005  # what the app hears of a close frame with no status code (as under uvicorn)
CLOSE_PROTOCOL_ERROR = 1002
CLOSE_INVALID_DATA = 1007
CLOSE_TOO_BIG = 1009
CLOSE_WAIT_S = 1.0  # after our close frame, how long the client has to answer before the drop
# picows reads whatever arrives and hands it over at once: past this many messages the app has not
# taken, the socket is not read until it takes them (as uvicorn's protocol pauses while its queue
# is full), so the session's backpressure (MAX_AHEAD_S) reaches the client through TCP.
MAX_INBOX = 16
_DATA_FRAMES = (WSMsgType.BINARY, WSMsgType.TEXT, WSMsgType.CONTINUATION)  # a tuple: identity first, no Enum hash


class AppConnection(Keepalive, WSListener):
    """One picows connection, as an ASGI WebSocket connection of `app`. Owner of its inbox: the
    event loop (picows callbacks and the app's task both run on it)."""

    def __init__(self, listener, scope: dict) -> None:  # listener: picows_listener.FastWsListener
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
        self._init_keepalive()  # the ping chain: picows_keepalive.py

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
            self._on_close_frame(transport, frame)
            return
        if kind not in _DATA_FRAMES:
            if kind == WSMsgType.PING:
                # Not picows's auto-pong (off: picows_listener.py), which answered every ping: a
                # client that sent pings as fast as it could and never read piled the pongs up in
                # the transport's buffer, 1.6 GB in 2 s (test_hardening's ping flood). While writes
                # are paused the pong is dropped (RFC 6455 5.5.3 lets an endpoint answer only the
                # latest ping); reading goes on, so the client's close is still heard at once.
                if self.writable.is_set():
                    transport.send_pong(frame.get_payload_as_bytes())
            elif kind == WSMsgType.PONG:
                self._on_pong(frame.get_payload_as_bytes())
            return
        if self.gone:
            return  # our close is sent: nothing more reaches the app
        # RFC 6455 framing that picows leaves to us: websockets (under uvicorn) closes 1002 with
        # these reasons; picows gave a stray continuation the type of the message before it, and a
        # reserved bit's frame was audio.
        if frame.rsv1 or frame.rsv2 or frame.rsv3:  # no extension is negotiated
            self._fail(CLOSE_PROTOCOL_ERROR, "reserved bits must be 0")
            return
        if kind == WSMsgType.CONTINUATION:
            if self.fragment_opcode is None:
                self._fail(CLOSE_PROTOCOL_ERROR, "unexpected continuation frame")
                return
        elif self.fragment_opcode is not None:
            self._fail(CLOSE_PROTOCOL_ERROR, "expected a continuation frame")
            return
        elif frame.fin:  # a whole message in one frame (picows checked its size)
            self._on_message(kind, frame.get_payload_as_bytes())
            return
        else:
            self.fragment_opcode = kind
        self.fragments.append(frame.get_payload_as_bytes())
        if sum(map(len, self.fragments)) > self.listener.max_message_bytes:
            self._fail(CLOSE_TOO_BIG, "message too big")
            return
        if not frame.fin:
            return
        kind, data = self.fragment_opcode, b"".join(self.fragments)
        self.fragment_opcode, self.fragments = None, []
        self._on_message(kind, data)

    def _on_message(self, kind, data: bytes) -> None:
        if kind == WSMsgType.TEXT:
            try:
                text = data.decode()
            except UnicodeDecodeError:
                self._fail(CLOSE_INVALID_DATA, "invalid UTF-8 in a text frame")
                return
            if not self._handed_over(text):
                self._push({"type": "websocket.receive", "text": text})
        elif not self._handed_over(data):
            self._push({"type": "websocket.receive", "bytes": data})

    def _on_close_frame(self, transport, frame) -> None:
        """The client's close (picows checked its code and reason): the app hears its code, the
        answer echoes it. A close with no status: 1005 to the app and an answer with none, as
        websockets does (picows's NO_INFO is 0, and send_close always writes a code: the answer
        carried 0, which no client accepts)."""
        if frame.payload_size < 2:
            self._push_disconnect(CLOSE_NO_STATUS)
            if not transport.is_close_frame_sent:
                transport.send(WSMsgType.CLOSE, b"")
        else:
            code = frame.get_close_code()
            self._push_disconnect(int(code.value if hasattr(code, "value") else code))
            if not transport.is_close_frame_sent:
                transport.send_close(code)
        self.gone = True  # nothing is sent after the answer
        transport.disconnect()

    def _handed_over(self, data: bytes | str) -> bool:
        """The frame handled now by the app's socket, in this callback (no task switch): only with
        nothing queued ahead of it, so frames keep their order; the socket declines while its
        receive task is busy or waiting for the model (then the frame is queued for the task)."""
        return self.take_frame is not None and not self.inbox and not self.gone and self.take_frame(data)

    def on_ws_disconnected(self, transport) -> None:
        self._push_disconnect(1006)  # the TCP connection's count is UpgradeProtocol's to release
        self.listener.connections.discard(self)
        self._stop_keepalive()

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


def _close_code(code: int):
    try:
        return WSCloseCode(code)
    except ValueError:  # a code picows has no name for (the app's are all standard)
        return WSCloseCode.POLICY_VIOLATION
