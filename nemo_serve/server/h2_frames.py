"""HTTP/2 for gRPC, the wire's constants and small pieces (RFC 9113; gRPC's PROTOCOL-HTTP2.md):
frame types, flags, error codes and settings, our limits and windows, a frame's 9-byte header,
gRPC's 5-byte message prefix. The connection is grpc_h2.py's, a call's stream grpc_stream.py's."""

from __future__ import annotations

import struct

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR = 0, 1, 2, 3
STREAM_CLOSED, FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL, COMPRESSION_ERROR, ENHANCE_YOUR_CALM = 5, 6, 7, 8, 9, 11
S_HEADER_TABLE_SIZE, S_MAX_CONCURRENT_STREAMS, S_INITIAL_WINDOW_SIZE, S_MAX_FRAME_SIZE = 1, 3, 4, 5

MAX_FRAME = 16384  # ours: the protocol's default; every gRPC client frames to it
MAX_HEADER_BLOCK = 16 * 1024  # a request's headers (grpc's own default metadata cap is 8 KiB)
MAX_STREAMS = 100  # concurrent calls per connection (SETTINGS_MAX_CONCURRENT_STREAMS)
# Streams reset by the client or refused by us, per connection per second, before GOAWAY
# ENHANCE_YOUR_CALM: HTTP/2 rapid reset (CVE-2023-44487) costs a call's start for a few bytes. An
# honest client cancels a call at a time; grpc-java allows 200 per 30 s, we allow 200 a second.
MAX_RESETS_PER_S = 200
# Calls answered with an error at once, no handler run (an unknown method, a request that is not
# gRPC: UNIMPLEMENTED), per connection per second, before GOAWAY ENHANCE_YOUR_CALM: each costs a
# stream's start and an answer for a few bytes, as a reset stream does, and no other budget counts
# it (benchmarks/h2_error_flood.py). Calls a handler answers with an error (INVALID_ARGUMENT) are
# not counted: an honest client's sequential calls end so faster than 200 a second (the fuzz of
# test_hostile_grpc.py did, on a budget that counted them).
MAX_ERROR_STREAMS_PER_S = 200
# Frames that cost us work and carry nothing a call needs (the 2019 HTTP/2 DoS family), per
# connection, before GOAWAY ENHANCE_YOUR_CALM; a client that reads its answers is otherwise
# bounded only by its own bandwidth. grpcio's keepalive (grpc.keepalive_time_ms, at most one
# outstanding) and BDP pings come a few a second at most; SETTINGS a few per connection.
MAX_PINGS_PER_S = 100  # CVE-2019-9512; debug data "too_many_pings", which grpc clients back off on
MAX_SETTINGS_PER_S = 100  # CVE-2019-9515: each is acked
# CVE-2019-9518: empty DATA frames without END_STREAM, empty CONTINUATIONs, header blocks with no
# fields, in a row (a DATA frame with a payload or a header block with fields starts the count
# again); netty's default, 10. No gRPC client sends one but to end its stream.
MAX_EMPTY_FRAMES = 10
MAX_BLOCK_FRAMES = 16  # HEADERS + CONTINUATION frames in one header block (16 KiB fits in 2)
STREAM_WINDOW = 65535  # a stream's receive window: messages its handler has not taken
CONNECTION_WINDOW = 16 << 20  # credited as bytes arrive: stream windows bound what is buffered
MAX_WINDOW = (1 << 31) - 1
FRAME_HEAD = struct.Struct(">HBBBL")  # length (24 bits: 16 + 8), type, flags, R + stream id
MESSAGE_PREFIX = struct.Struct(">BL")  # gRPC: compressed flag, message length


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return FRAME_HEAD.pack(n >> 8, n & 0xFF, kind, flags, stream_id) + payload


def window_update(stream_id: int, n: int) -> bytes:
    return frame(WINDOW_UPDATE, 0, stream_id, n.to_bytes(4, "big"))


class ProtocolViolation(Exception):
    """The client broke HTTP/2: GOAWAY with `code`, then the connection is closed."""

    def __init__(self, code: int, why: str) -> None:
        super().__init__(why)
        self.code = code


def unpad(payload: bytearray) -> bytearray:
    if not payload or payload[0] >= len(payload):
        raise ProtocolViolation(PROTOCOL_ERROR, "padding longer than its frame")
    return payload[1 : len(payload) - payload[0]]


def percent_encode(message: str) -> str:
    """grpc-message's percent-encoding: UTF-8 bytes outside printable ASCII, and '%' itself."""
    return "".join(chr(b) if 0x20 <= b <= 0x7E and b != 0x25 else f"%{b:02X}" for b in message.encode())
