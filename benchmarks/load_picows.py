"""The load generator's cheaper client (`--client picows`, the default where picows is installed):
the same streams as load_level.stream_item and load_realtime.stream_item_realtime, on picows.

Why (loadgen_capacity.py, loadgen_capacity_clients_*.json): websockets' asyncio client cost the
generator most of its CPU per paced packet (a Python frame writer and reader, a task per read,
a timer and a task wake-up per packet). Here:
  - a packet is one synchronous call into picows's C frame writer, made by this event loop's
    pacer (load_pacer.py: one clock for every stream, no timer or wake-up per packet);
  - a server message is handled in picows's frame callback, no task or queue in between;
  - payloads are built once per item and packet size in each worker process (float32 slices for
    /ws, the JSON append with its base64 for /v1/realtime: the bytes the websockets client
    encodes per packet), not per send.
The transport is uvloop's: picows's aiofastnet measured no different in a few uncommitted runs
of loadgen_capacity.py at 300 streams (within this machine's noise), and the server's listener
runs on uvloop's too.
Rejected: websockets with pre-encoded frames written to its transport (its reader stays a task
per message) and benchmarks/raw_ws.py's bare client (no close handshake, no handshake errors).

The protocol steps (load_level.open_ws_stream, load_realtime.configure), the message handling
(load_level.read_ws_message, load_realtime.read_realtime_message), the lateness definition and
the error words (load_level.failures_recorded) are the websockets client's, so both clients
produce the same records and every check the summary makes reads them the same way.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

import numpy as np
from picows import WSCloseCode, WSInvalidStatusError, WSListener, WSMsgType, WSTransport, ws_connect

from benchmarks.common import SAMPLE_RATE
from benchmarks.load_items import LoadItem
from benchmarks.load_level import (END_MESSAGE, HandshakeRefused, StreamClosed, StreamRecord, failures_recorded,
                                   open_ws_stream, read_ws_message, stream_config)  # fmt: skip
from benchmarks.load_pacer import PacedStream, pacer
from benchmarks.load_realtime import (APPEND_SAMPLES, COMMIT_MESSAGE, append_message, as_pcm16, configure,
                                      read_realtime_message, realtime_query)  # fmt: skip

MAX_FRAME_BYTES = 64 * 1024 * 1024  # the websockets client runs with max_size=None
# Per worker process: (item_id, protocol, packet samples) -> [(samples sent after it, payload)].
# Forked workers start empty; an item's first stream fills its entry (under a millisecond at /ws).
_PACKETS: dict[tuple[str, str, int], list[tuple[int, bytes]]] = {}
# /ws packet length: None sends one server chunk per packet (the capacity sweeps); packet_cost_streams.py
# sets 20 ms, the voice agents' packet, before it forks the workers (they inherit it).
WS_PACKET_MS: float | None = None


class _Listener(WSListener):
    """One connection's receiving side. Until `on_message` is set (the protocol's opening
    exchange), text messages wait in `early` for recv(); after it, each is handed straight to
    `on_message(now, payload)`, whose True ends the stream (`finished`)."""

    def __init__(self) -> None:
        self.early: deque[bytes] = deque()
        self.arrived = asyncio.Event()
        self.on_message: Callable[[float, bytes], bool] | None = None
        self.finished = asyncio.get_running_loop().create_future()
        self.close_code: int | None = None
        self.writable = asyncio.Event()
        self.writable.set()
        self.on_writable: Callable[[], None] | None = None

    def on_ws_frame(self, transport: WSTransport, frame) -> None:
        kind = frame.msg_type
        if kind == WSMsgType.CLOSE:
            self.close_code = frame.get_close_code()
            transport.send_close(self.close_code)
            transport.disconnect()
        elif kind == WSMsgType.TEXT:
            payload = frame.get_payload_as_bytes()
            if self.on_message is None:
                self.early.append(payload)
                self.arrived.set()
            elif self.on_message(time.time(), payload) and not self.finished.done():
                self.finished.set_result(None)

    def on_ws_disconnected(self, transport: WSTransport) -> None:
        self.arrived.set()
        self.resume_writing()  # a stream parked by backpressure goes back to the pacer, to find the close
        if not self.finished.done():
            self.finished.set_result(None)

    def pause_writing(self) -> None:  # the server stopped reading: send waits, as websockets' drain does
        self.writable.clear()

    def resume_writing(self) -> None:
        self.writable.set()
        if self.on_writable is not None:
            self.on_writable()


class PicowsStream:
    """The websockets-client surface the shared protocol steps use (send(str), recv()), plus the
    paced sends of prebuilt payloads."""

    def __init__(self, transport: WSTransport, listener: _Listener) -> None:
        self.transport, self.listener = transport, listener

    def _check_open(self) -> None:
        if self.transport.is_disconnected:
            raise StreamClosed(self.listener.close_code)

    async def send(self, message: str) -> None:
        await self.send_frame(message.encode(), WSMsgType.TEXT)

    async def send_frame(self, payload: bytes, kind: WSMsgType) -> None:
        self._check_open()
        self.transport.send(kind, payload)
        if not self.listener.writable.is_set():
            await self.listener.writable.wait()

    def write(self, payload: bytes, kind: WSMsgType) -> None:
        self._check_open()
        self.transport.send(kind, payload)

    async def send_paced(self, packets: list[tuple[int, bytes]], kind: WSMsgType, rec: StreamRecord, end: str) -> None:
        """Every packet at its due time through this loop's pacer (load_pacer.py), then `end`."""
        stream = PacedStream(packets, rec, lambda p: self.write(p, kind), self.listener.writable.is_set,
                             lambda: self.write(end.encode(), WSMsgType.TEXT))  # fmt: skip
        self.listener.on_writable = lambda: pacer().resume(stream)
        await pacer().send_all(stream)

    async def recv(self) -> bytes:
        while not self.listener.early:
            self._check_open()
            self.listener.arrived.clear()
            await self.listener.arrived.wait()
        return self.listener.early.popleft()

    def hand_messages_to(self, on_message: Callable[[float, bytes], bool]) -> None:
        """From now on each message goes to `on_message` in the frame callback."""
        self.listener.on_message = on_message
        while self.listener.early:  # nothing is expected here, but nothing is dropped either
            if on_message(time.time(), self.listener.early.popleft()) and not self.listener.finished.done():
                self.listener.finished.set_result(None)

    async def finish(self, rec: StreamRecord) -> None:
        """Wait for the stream's end; a connection that closed with an error code first is one."""
        await self.listener.finished
        code = self.listener.close_code
        if not rec.done and rec.error is None and code not in (WSCloseCode.OK, WSCloseCode.GOING_AWAY):
            raise StreamClosed(code)


async def _connect(url: str) -> PicowsStream:
    try:
        transport, listener = await ws_connect(_Listener, url, websocket_handshake_timeout=30, use_aiofastnet=False,
                                               max_frame_size=MAX_FRAME_BYTES)  # fmt: skip
    except WSInvalidStatusError as e:
        raise HandshakeRefused(_status_of(e)) from e
    if listener is None:  # seen at 512 streams on 2 cores: the connection went before the listener was made
        raise StreamClosed(None)
    return PicowsStream(transport, listener)


def _status_of(e: WSInvalidStatusError) -> int | str:
    response = getattr(e, "response", None)
    status = getattr(response, "status", None)
    if status is not None:
        return int(status)
    words = [w for w in str(e).split() if w.isdigit() and len(w) == 3]
    return int(words[0]) if words else "?"


def _close(sock: PicowsStream) -> None:
    if not sock.transport.is_disconnected:
        sock.transport.send_close(WSCloseCode.OK)
        sock.transport.disconnect()


def prebuilt_packets(item: LoadItem, protocol: str, packet: int) -> list[tuple[int, bytes]]:
    key = (item.item_id, protocol, packet)
    if key not in _PACKETS:
        if protocol == "realtime":
            pcm = as_pcm16(item.audio)
            parts = [(pcm[s : s + packet], append_message) for s in range(0, len(pcm), packet)]
        else:
            f32 = item.audio.astype(np.float32)
            parts = [(f32[s : s + packet], np.ndarray.tobytes) for s in range(0, len(f32), packet)]
        ends = np.cumsum([len(p) for p, _ in parts])
        _PACKETS[key] = [(int(end), _as_bytes(encode(p))) for end, (p, encode) in zip(ends, parts)]
    return _PACKETS[key]


def _as_bytes(x: str | bytes) -> bytes:
    return x.encode() if isinstance(x, str) else x


async def stream_item_picows(url: str, worker: int, item: LoadItem, endpointing: bool, timeout_s: float,
                             context_right: int | None = None) -> StreamRecord:  # fmt: skip
    """/ws, as load_level.stream_item."""
    rec = StreamRecord(worker, item.item_id, len(item.audio) / SAMPLE_RATE, opened=time.time())
    with failures_recorded(rec):
        async with asyncio.timeout(timeout_s):
            sock = await _connect(url)
            try:
                if not await open_ws_stream(sock, rec, stream_config(worker, item, endpointing, context_right)):
                    return rec
                sock.hand_messages_to(lambda now, raw: read_ws_message(rec, now, raw))
                chunk = int(round((WS_PACKET_MS or rec.chunk_ms) * SAMPLE_RATE / 1000))  # default: one server chunk
                await sock.send_paced(prebuilt_packets(item, "ws", chunk), WSMsgType.BINARY, rec, END_MESSAGE)
                await sock.finish(rec)
            finally:
                _close(sock)
    return rec


async def stream_item_realtime_picows(url: str, worker: int, item: LoadItem, timeout_s: float,
                                      context_right: int | None = None) -> StreamRecord:  # fmt: skip
    """/v1/realtime, as load_realtime.stream_item_realtime."""
    rec = StreamRecord(worker, item.item_id, len(item.audio) / SAMPLE_RATE, opened=time.time())
    with failures_recorded(rec):
        async with asyncio.timeout(timeout_s):
            sock = await _connect(url + realtime_query(context_right))
            try:
                if not await configure(sock, rec):
                    return rec
                sock.hand_messages_to(lambda now, raw: _realtime_message(rec, now, raw))
                await sock.send_paced(prebuilt_packets(item, "realtime", APPEND_SAMPLES), WSMsgType.TEXT, rec,
                                      COMMIT_MESSAGE)  # one commit: the whole item
                await sock.finish(rec)
            finally:
                _close(sock)
    return rec


def _realtime_message(rec: StreamRecord, now: float, raw: bytes) -> bool:
    # Only `completed` and `error` change the record: the many deltas skip the JSON parse. A message
    # lacking both words cannot be either; one that has them by chance is parsed and read as before.
    if b"completed" not in raw and b"error" not in raw:
        return False
    return read_realtime_message(rec, now, raw)
