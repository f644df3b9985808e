"""blast.py's opening of one stream: the load generator's own opening exchange
(load_level.open_ws_stream, load_realtime.configure) on a blocking socket, before the pacing
starts; the socket is then handed to the pacer non-blocking, with the bytes read past the opening.
"""

from __future__ import annotations

import base64
import os
import socket
import time

from benchmarks.blast_wire import RECV_BYTES, server_frame, split_frames, wire_of, wire_rate
from benchmarks.common import SAMPLE_RATE
from benchmarks.load_items import LoadItem
from benchmarks.load_level import StreamRecord, open_ws_stream, stream_config
from benchmarks.load_realtime import configure, realtime_query
from benchmarks.raw_ws import frame

class OpeningSocket:
    """A blocking socket with the `send(str)` and `recv()` the load generator's protocol steps
    use, so the opening exchange is theirs; `run_sync` drives them (they never wait on a loop)."""

    def __init__(self, port: int, path: str, token: str | None = None) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=60)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        key = base64.b64encode(os.urandom(16)).decode()
        auth = f"Authorization: Bearer {token}\r\n" if token else ""
        self.sock.sendall((f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n{auth}"
                           f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode())  # fmt: skip
        data = b""
        while b"\r\n\r\n" not in data:
            data += self._more()
        head, self.pending = data.split(b"\r\n\r\n", 1)
        if b" 101 " not in head.split(b"\r\n", 1)[0]:
            raise ConnectionError(f"handshake refused: {head[:80]!r}")
        self.messages: list[bytes] = []

    def _more(self) -> bytes:
        data = self.sock.recv(RECV_BYTES)
        if not data:
            raise ConnectionError("closed while opening")
        return data

    async def send(self, message: str) -> None:
        self.sock.sendall(frame(message.encode(), 0x1))

    async def recv(self) -> bytes:
        while not self.messages:
            frames, self.pending = split_frames(self.pending)
            self.messages += [p for op, p in frames if op == 0x1]
            if not self.messages:
                self.pending += self._more()
        return self.messages.pop(0)


def run_sync(coro):
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()
    raise RuntimeError("an opening step waited on an event loop")


def open_stream(port: int, protocol: str, worker: int, item: LoadItem, context_right: int | None,
                chunk_ms: float | None = None, token: str | None = None) -> tuple[socket.socket | None, StreamRecord, bytes]:  # fmt: skip
    """One stream opened; (non-blocking socket or None if refused, its record, bytes already
    read past the opening); `chunk_ms`: gRPC only (measure_level_blast's); `token`: the server's bearer
    token, where it asks for one (WebSocket paths)."""
    if protocol == "grpc":
        from benchmarks import blast_grpc

        return blast_grpc.open_stream(port, worker, item, chunk_ms)
    rec = StreamRecord(worker, item.item_id, len(item.audio) / SAMPLE_RATE, opened=time.time())
    try:
        if wire_of(protocol) == "realtime":
            ws = OpeningSocket(port, "/v1/realtime" + realtime_query(context_right), token)
            ok = run_sync(configure(ws, rec, wire_rate(protocol)))
        else:
            ws = OpeningSocket(port, "/ws", token)
            ok = run_sync(open_ws_stream(ws, rec, stream_config(worker, item, False, context_right)))
    except OSError as e:
        rec.error = f"connect: {e!r}"[:120]
        return None, rec, b""
    if not ok:
        ws.sock.close()
        return None, rec, b""
    ws.sock.setblocking(False)
    return ws.sock, rec, b"".join(server_frame(m) for m in ws.messages) + ws.pending
