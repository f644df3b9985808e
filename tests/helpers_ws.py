"""WebSocket clients for the hostile-client tests (test_hardening.py against the uvicorn port,
test_picows_listener.py against the picows one): the same connection options, and the client
that never reads, written once so the two ports are held to the same scenario; every message until
the close (the realtime tests' too)."""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import time

import numpy as np

from .helpers_server import TOKEN

# The limits both suites give the server: pings off (so nothing but our own limits frees a stalled
# client), a 2 s send timeout, a 1 s header timeout.
HOSTILE_ENV = {
    "NEMO_SERVE_PING_INTERVAL_S": "0",
    "NEMO_SERVE_SEND_TIMEOUT_S": "2",
    "NEMO_SERVE_HEADER_TIMEOUT_S": "1",
}


def raw_upgrade(port: int, path: str, timeout_s: float = 10.0, rcvbuf: int | None = None) -> socket.socket:
    """A raw socket past a WebSocket upgrade to `path` (its 101 read, nothing after it)."""
    s = socket.socket()
    if rcvbuf is not None:  # before connect: the window the server sees
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(timeout_s)
    s.connect(("127.0.0.1", port))
    s.sendall((f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
               "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
               f"Authorization: Bearer {TOKEN}\r\n\r\n").encode())  # fmt: skip
    head = b""
    while b"\r\n\r\n" not in head:
        head += s.recv(1)
    assert head.startswith(b"HTTP/1.1 101"), head
    return s


def masked_frame(payload: bytes, opcode: int = 1) -> bytes:
    """One client frame (masked, as RFC 6455 requires of clients)."""
    mask = bytes([0x5A, 0xC3, 0x11, 0x7E])
    n = len(payload)
    size = bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + struct.pack(">H", n) if n < 65536 else (
        bytes([0x80 | 127]) + struct.pack(">Q", n))  # fmt: skip
    body = (np.frombuffer(payload, np.uint8) ^ np.resize(np.frombuffer(mask, np.uint8), n)).tobytes()
    return bytes([0x80 | opcode]) + size + mask + body


def raw_handshake(server, path: str, extra_headers: bytes = b"", listener: str = "uvicorn") -> tuple[int, bytes]:
    """A raw WebSocket upgrade (any bytes in the headers): the status and the body."""
    request = (f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
               "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n").encode()  # fmt: skip
    with socket.create_connection(("127.0.0.1", server.ws_port(listener)), timeout=10) as s:
        s.sendall(request + extra_headers + b"\r\n")
        data = b""
        while b"\r\n\r\n" not in data or len(data) < data.find(b"\r\n\r\n") + 4 + 10:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    return int(data.split(b" ", 2)[1]), data


def ws_connect(url: str, **kw):
    """websockets' client with the test token, no proxy, no compression, no size limit, no pings."""
    from websockets.asyncio.client import connect

    kw.setdefault("additional_headers", {"Authorization": f"Bearer {TOKEN}"})
    return connect(url, proxy=None, compression=None, max_size=None, ping_interval=None, **kw)


async def messages_until_close(ws, timeout_s: float | None = None) -> list[dict]:
    """Every JSON message the server sends until it closes the connection, whatever the close code
    (the caller reads ws.close_code), within `timeout_s` (None: no limit; TimeoutError past it)."""
    from websockets.exceptions import ConnectionClosed

    messages = []
    try:
        async with asyncio.timeout(timeout_s):
            async for m in ws:
                messages.append(json.loads(m))
    except ConnectionClosed:  # a close other than 1000 ends the iteration by raising
        pass
    return messages


def speech(n: int, seed: int = 1) -> np.ndarray:
    from . import helpers  # NeMo's import: not in a client process that only streams (drain_clients.py)

    return np.concatenate(helpers.utterances(n, seed=seed)).astype("<f4")


async def never_reading_client(port: int, ws_url: str, seconds_of_audio: int, audio: np.ndarray | None = None):
    """A client with a tiny receive buffer that streams audio as fast as it may and never reads.
    `audio`: what it loops (default speech(6)). Returns (the connection, its sender task)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    s.setblocking(False)
    ws = await ws_connect(ws_url, sock=s)
    ws.transport.pause_reading()
    await ws.send(json.dumps({"type": "config", "endpointing": {"enabled": False}}))
    audio = speech(6) if audio is None else audio

    async def send():
        for i in range(0, seconds_of_audio * 16000, 16000):
            j = i % (len(audio) - 16000)
            await ws.send(audio[j : j + 16000].tobytes())

    return ws, asyncio.create_task(send())


async def seconds_until_slot_freed(server, limit_s: float) -> float:
    """Once a stream is open on `server`, how long until none is (at most about `limit_s`)."""
    while server.readyz()["open_streams"] < 1:
        await asyncio.sleep(0.05)
    t0 = time.monotonic()
    while server.readyz()["open_streams"] > 0 and time.monotonic() - t0 < limit_s:
        await asyncio.sleep(0.2)
    return time.monotonic() - t0


async def seconds_until_closed(ws, sender: asyncio.Task) -> float:
    """Start reading again and wait (15 s at most) for the connection to close; the sender and
    the transport are ended either way."""
    ws.transport.resume_reading()
    t0 = time.monotonic()
    try:
        async with asyncio.timeout(15):
            await ws.wait_closed()
    finally:
        sender.cancel()
        ws.transport.abort()
    return time.monotonic() - t0
