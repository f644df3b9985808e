"""A raw WebSocket client for the front-end benchmarks: frames built and masked once and sent
many times, a handshake on a bare socket, and a connection that counts the server's messages by
type without parsing them, so the client costs far less CPU than the server it measures."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import struct
from collections import Counter
from collections.abc import Callable

import numpy as np

SAMPLE_RATE = 16000
PACKET_S = 0.1
MASK = b"\x37\xfa\x21\x3d"
SPREAD_S = 0.002  # the pacer writes a share of the streams every this often


def frame(payload: bytes, opcode: int) -> bytes:
    """A masked client frame (RFC 6455), built once and sent many times."""
    n = len(payload)
    head = bytes([0x80 | opcode])
    if n < 126:
        head += bytes([0x80 | n])
    elif n < 65536:
        head += bytes([0x80 | 126]) + struct.pack("!H", n)
    else:
        head += bytes([0x80 | 127]) + struct.pack("!Q", n)
    mask = np.resize(np.frombuffer(MASK, np.uint8), n)
    return head + MASK + (np.frombuffer(payload, np.uint8) ^ mask).tobytes()


def text_frame(obj) -> bytes:
    return frame(json.dumps(obj).encode(), 0x1)


async def ws_upgrade(port: int, path: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A WebSocket handshake on a raw socket (no client library between the benchmark and TCP)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    key = base64.b64encode(os.urandom(16)).decode()
    writer.write(
        (f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
         f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode()
    )  # fmt: skip
    head = await reader.readuntil(b"\r\n\r\n")
    if b" 101 " not in head.split(b"\r\n", 1)[0]:
        raise RuntimeError(f"handshake refused: {head[:80]!r}")
    return reader, writer


async def read_frame(r: asyncio.StreamReader) -> tuple[int, bytes]:
    """One unmasked server frame: (opcode, payload)."""
    b0, b1 = await r.readexactly(2)
    n = b1 & 0x7F
    if n >= 126:
        n = int.from_bytes(await r.readexactly(2 if n == 126 else 8), "big")
    return b0 & 0x0F, await r.readexactly(n)


def message_type(payload: bytes) -> str:
    """A JSON message's `type`, found without parsing the message (the client stays cheap)."""
    i = payload.find(b'"type":"')
    return payload[i + 8 : payload.index(b'"', i + 8)].decode() if i >= 0 else "?"


class Conn:
    """One raw WebSocket connection: pre-built frames out, every server message in, counted by
    type. `ready`: the first `ready_type` message, an error, or the connection's end; `done`:
    a `done` message, an error, a close frame, or the connection's end."""

    def __init__(self) -> None:
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.counts: Counter = Counter()
        self.packets = 0
        self.done = asyncio.Event()
        self.ready = asyncio.Event()
        self.error: str | None = None
        self.ready_type = "ready"
        self._task: asyncio.Task | None = None

    async def open(self, port: int, path: str, first: bytes, ready_type: str = "ready") -> None:
        """Handshake on `path`, then `first` (a prebuilt frame; b"": none)."""
        self.reader, self.writer = await ws_upgrade(port, path)
        self.ready_type = ready_type
        if first:
            self.writer.write(first)
        self._task = asyncio.create_task(self._read())

    def write(self, data: bytes) -> None:
        self.writer.write(data)

    async def _read(self) -> None:
        try:
            while True:
                op, payload = await read_frame(self.reader)
                if op == 0x8:  # close
                    self.done.set()
                    return
                if op != 0x1:
                    continue
                kind = message_type(payload)
                self.counts[kind] += 1
                if kind == self.ready_type:
                    self.ready.set()
                elif kind == "done":
                    self.done.set()
                elif kind == "error":
                    self.error = payload[:200].decode(errors="replace")
                    self.ready.set()
                    self.done.set()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            self.done.set()
            self.ready.set()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self._task is not None:
            self._task.cancel()


CONFIG = {"type": "config", "encoding": "pcm_s16le", "sample_rate": SAMPLE_RATE}


async def open_all(port: int, n: int, config: dict = CONFIG) -> list[Conn]:
    conns = [Conn() for _ in range(n)]
    for c in conns:
        await c.open(port, "/ws", text_frame(config))
    await asyncio.wait_for(asyncio.gather(*(c.ready.wait() for c in conns)), 60)
    bad = [c.error for c in conns if c.error and not c.counts.get("ready")]
    if bad:
        raise RuntimeError(f"{len(bad)} streams refused: {bad[0]}")
    return conns


def packets_of(audio_i16: np.ndarray) -> list[bytes]:
    k = int(SAMPLE_RATE * PACKET_S)
    return [frame(audio_i16[i : i + k].tobytes(), 0x2) for i in range(0, len(audio_i16) - k + 1, k)]


async def send_spread(n: int, seconds: float, packet_s: float, write: Callable[[int, int], None]) -> tuple[int, int]:
    """Real-time pace for `seconds`: every `packet_s`, one packet per stream, the N streams spread
    over the interval (a burst every SPREAD_S), as independent clients' would be; all N in one
    burst would let the front end take many packets per event-loop tick. `write(i, tick)` writes
    stream i's packet of that tick. Returns (packets written, bursts more than a packet late)."""
    groups = max(1, min(n, round(packet_s / SPREAD_S)))
    loop = asyncio.get_running_loop()
    late = sent = 0
    t0 = loop.time()
    for k in range(int(seconds / packet_s) * groups):
        delay = t0 + k * packet_s / groups - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        elif delay < -packet_s:
            late += 1
        tick, group = divmod(k, groups)
        for i in range(group, n, groups):
            write(i, tick)
            sent += 1
    return sent, late
