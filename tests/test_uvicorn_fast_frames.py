"""uvicorn's WebSocket protocol parses whole, plain data frames itself (uvicorn_protocols.py,
WebSocketProtocol._take_data_frames) instead of through websockets' parser: the same bytes must
give the same result either way. Each case feeds one byte stream to two real protocols after a real
upgrade, one with the fast path and one without (FAST_FRAMES off: websockets' parser for every
frame), in one read, a read per frame, or cut at seeded random places, and compares everything the
app and the client can see: the frames handed to the app's socket, the messages queued for it, the
bytes written back (pongs, close frames, answers), whether the transport was closed, paused or
aborted, and websockets' state. Everything is seeded, the frames' masks too."""

from __future__ import annotations

import asyncio
import itertools
import random
import struct

import pytest
from uvicorn.config import Config
from uvicorn.server import ServerState

from nemo_serve.server import uvicorn_protocols
from nemo_serve.server.connections import ConnectionLimits

MAX_SIZE = 4096
INSTALLED_FAST_FRAMES = uvicorn_protocols.FAST_FRAMES  # as the import decided, before a test flips it
_MASKS = random.Random(48)  # the clients' masking keys: seeded, so a failure replays
UPGRADE = (b"GET /ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
           b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n")  # fmt: skip


class Limiter:
    metrics = None

    def acquire(self, *args) -> None:
        return None

    def release(self, *args) -> None:
        pass


class Transport:
    def __init__(self) -> None:
        self.log: list = []
        self.closing = False

    def write(self, data: bytes) -> None:
        self.log.append(("write", bytes(data)))

    def get_extra_info(self, key, default=None):
        return {"peername": ("127.0.0.1", 1), "sockname": ("127.0.0.1", 2)}.get(key, default)

    def is_closing(self) -> bool:
        return self.closing

    def pause_reading(self) -> None:
        self.log.append("pause")

    def resume_reading(self) -> None:
        self.log.append("resume")

    def close(self) -> None:
        self.closing = True
        self.log.append("close")

    def abort(self) -> None:
        self.log.append("abort")

    def set_write_buffer_limits(self, *args, **kwargs) -> None:
        pass


async def _app(scope, receive, send) -> None:
    await receive()
    await send({"type": "websocket.accept"})
    await asyncio.sleep(3600)  # frames reach the protocol's take_frame hook and queue, not this task


def frame(payload: bytes, opcode: int = 2, fin: bool = True, rsv: int = 0, masked: bool = True,
          long_length: bool = False) -> bytes:  # fmt: skip
    """One client frame, as a client writes it (masked) unless told otherwise."""
    n = len(payload)
    head = bytes([(0x80 if fin else 0) | rsv | opcode])
    bit = 0x80 if masked else 0
    if long_length or n > 0xFFFF:
        head += bytes([bit | 127]) + struct.pack("!Q", n)
    elif n >= 126:
        head += bytes([bit | 126]) + struct.pack("!H", n)
    else:
        head += bytes([bit | n])
    if not masked:
        return head + payload
    mask = _MASKS.randbytes(4)
    return head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


async def _run(stream: bytes, cuts: list[int], fast: bool, takes) -> dict:
    uvicorn_protocols.FAST_FRAMES = fast
    config = Config(_app, ws_max_size=MAX_SIZE, ws_per_message_deflate=False, log_level="critical")
    config.load()
    _, ws_class = uvicorn_protocols.protocol_classes(ConnectionLimits(Limiter(), 5.0))
    p = ws_class(config, ServerState(), {})
    t = Transport()
    p.connection_made(t)
    p.data_received(UPGRADE)
    await asyncio.sleep(0.01)  # the app accepts
    t.log.clear()
    handed: list = []
    parser_reads = []  # the reads that went to websockets' parser
    receive_data = p.conn.receive_data
    p.conn.receive_data = lambda data: parser_reads.append(len(data)) or receive_data(data)
    p._take_frames(lambda data: handed.append(data) is None and takes(len(handed)))
    for a, b in zip([0, *cuts], [*cuts, len(stream)]):
        p.data_received(stream[a:b])
    queued = []
    while not p.queue.empty():
        queued.append(p.queue.get_nowait())
    seen = {"handed": handed, "queued": queued, "transport": list(t.log), "state": p.conn.state,
            "close_sent": p.close_sent, "lingering": p._lingering, "parser_exc": repr(p.conn.parser_exc),
            "buffered": bytes(p.conn.reader.buffer)}  # fmt: skip
    seen["parser_reads"] = parser_reads
    for task in list(p.tasks):
        task.cancel()
    await asyncio.gather(*p.tasks, return_exceptions=True)
    return seen


def _both(frames: list[bytes], seed: int, takes=lambda i: True) -> dict:
    """Both protocols fed the same reads: the whole stream in one read, a read per frame, or cut
    at random places (a partial frame leaves websockets' parser with bytes buffered: its turn)."""
    stream, rng = b"".join(frames), random.Random(seed)
    if seed % 3 == 0:
        cuts = []
    elif seed % 3 == 1:
        cuts = list(itertools.accumulate(len(f) for f in frames[:-1]))
    else:
        cuts = sorted(rng.sample(range(1, len(stream)), min(len(stream) - 1, rng.randint(1, 4))))
    try:
        slow = asyncio.run(_run(stream, cuts, False, takes))
        fast = asyncio.run(_run(stream, cuts, True, takes))
    finally:
        uvicorn_protocols.FAST_FRAMES = INSTALLED_FAST_FRAMES
    fast_reads = fast.pop("parser_reads") or []
    slow.pop("parser_reads")
    assert fast == slow, (cuts, fast, slow)
    return {**fast, "parser_reads": fast_reads}


def _audio(rng: random.Random, n: int) -> bytes:
    return rng.randbytes(n)


CASES = {
    "binary frames, all sizes up to the limit": lambda r: [
        frame(_audio(r, n)) for n in (0, 1, 125, 126, 127, 640, 1280, 0xFFFF % MAX_SIZE, MAX_SIZE)],
    "text frames": lambda r: [frame(b'{"type":"config"}', 1), frame(b"x" * 300, 1), frame("é".encode(), 1)],
    "a frame over the limit (1009)": lambda r: [frame(_audio(r, 64)), frame(_audio(r, MAX_SIZE + 1)), frame(b"late")],
    "a 64-bit length under the limit": lambda r: [frame(b"a"), frame(b"short", long_length=True), frame(b"b")],
    "invalid UTF-8 in a text frame (1007)": lambda r: [frame(b"ok", 1), frame(b"\xff\xfe", 1), frame(b"after")],
    "a reserved bit set": lambda r: [frame(b"a"), frame(b"b", rsv=0x40), frame(b"c")],
    "an unmasked frame": lambda r: [frame(b"a"), frame(b"b", masked=False), frame(b"c")],
    "an unknown opcode": lambda r: [frame(b"a"), frame(b"b", opcode=3), frame(b"c")],
    "ping and pong among data": lambda r: [frame(b"a"), frame(b"hi", 9), frame(b"b"), frame(b"", 10), frame(b"c")],
    "a fragmented message": lambda r: [frame(b"a"), frame(b"st", 2, fin=False), frame(b"il", 0, fin=False),
                                       frame(b"l", 0), frame(b"b")],
    "fragments over the limit together": lambda r: [frame(_audio(r, 3000), 2, fin=False), frame(_audio(r, 3000), 0)],
    "a continuation with no message": lambda r: [frame(b"a"), frame(b"b", 0), frame(b"c")],
    "a close frame, then data": lambda r: [frame(b"a"), frame(struct.pack("!H", 1000) + b"bye", 8), frame(b"after")],
    "a close with no code": lambda r: [frame(b"a"), frame(b"", 8), frame(b"b")],
    "a partial frame at the end": lambda r: [frame(_audio(r, 1280)), frame(_audio(r, 1280))[:700]],
    # Misread as a masked frame, these four bytes end the read exactly: a check of the mask bit.
    "an unmasked frame, then four bytes": lambda r: [frame(b"abcdefgh", masked=False), frame(b"")[:4]],
    # Cut after its header, its payload's wire bytes read as whole frames: buffered bytes go first.
    "a frame whose payload reads as frames": lambda r: _header_then(frame(b"inner") * 3),
}


def _header_then(wire: bytes) -> list[bytes]:
    """A binary frame in two reads, its header and mask, then its payload as `wire` on the wire."""
    return [bytes([0x82, 0x80 | len(wire)]) + _MASKS.randbytes(4), wire]


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_fast_path_sees_what_websockets_sees(case):
    for seed in range(9):  # three ways to cut the stream into reads, three times each
        rng = random.Random(f"{case}{seed}")
        _both(CASES[case](rng), seed)


def test_declined_frames_queue_and_pause_as_before():
    """The app's socket declines (busy, or the model behind): that frame and the ones behind it queue,
    and reading pauses."""
    rng = random.Random(3)
    seen = _both([frame(_audio(rng, 640)) for _ in range(6)], 0, takes=lambda i: i % 3 != 0)
    assert len(seen["handed"]) == 3 and len(seen["queued"]) == 4 and "pause" in seen["transport"]


def test_the_fast_path_hands_plain_frames_over_whole_and_in_order():
    """What the comparison alone would not catch: both sides broken the same way (no frame at all),
    or the fast path never taken (websockets' parser read every frame: the old cost)."""
    rng = random.Random(5)
    payloads = [_audio(rng, n) for n in (1280, 40, 126, 2000)]
    seen = _both([*map(frame, payloads), frame(b'{"type":"end"}', 1)], 1)
    assert seen["handed"] == [*payloads, '{"type":"end"}'] and seen["queued"] == [] and seen["transport"] == []
    assert seen["parser_reads"] == []
    split = _both([*_header_then(frame(b"inner")), frame(b"next")], 1)  # a read per frame
    assert [len(split["handed"][0]), split["handed"][1]] == [11, b"next"] and split["parser_reads"] == [6, 11]


def test_a_seeded_fuzz_of_frame_streams():
    makers = list(CASES.values())
    for seed in range(40):
        rng = random.Random(seed)
        frames = [f for _ in range(rng.randint(1, 4)) for f in rng.choice(makers)(rng)]
        _both(frames, seed, takes=lambda i: random.Random(seed * 1000 + i).random() < 0.8)


def test_the_installed_websockets_gets_the_fast_path():
    """Outside WEBSOCKETS_FAST_FRAMES the server quietly parses every frame with websockets (the old
    cost): the tests above force the fast path on, so this one says whether the server has it."""
    import importlib.metadata

    from nemo_serve.versions import in_range

    installed = importlib.metadata.version("websockets")
    assert in_range(installed, *uvicorn_protocols.WEBSOCKETS_FAST_FRAMES), installed
    assert INSTALLED_FAST_FRAMES
