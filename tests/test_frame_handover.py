"""The two transports' hand-over of a data frame to the app's socket (ws_socket.WsSocket.take_frame)
in their frame callbacks: uvicorn's protocol (server/uvicorn_protocols.py) and picows's connection
(server/picows_connection.py), driven directly with frames, no socket. What each promises: a frame
goes to the handler only with nothing queued ahead of it (order kept), a declined frame is queued
as before, invalid UTF-8 never reaches the handler, and no handler means the queue as before."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest
from websockets.frames import Frame, Opcode

from nemo_serve.server.uvicorn_protocols import WebSocketProtocol


class Transport:
    def __init__(self) -> None:
        self.paused = 0

    def pause_reading(self) -> None:
        self.paused += 1


class Handler:
    def __init__(self, takes: bool = True) -> None:
        self.takes, self.got = takes, []

    def __call__(self, data) -> bool:
        self.got.append(data)
        return self.takes


def _uvicorn(handler) -> WebSocketProtocol:
    """The protocol's receive-side state, as its __init__ and handshake leave it."""
    p = WebSocketProtocol.__new__(WebSocketProtocol)
    p.queue, p.frames, p.curr_msg_data_type = asyncio.Queue(), [], "bytes"
    p.close_sent, p.read_paused, p.transport = False, False, Transport()
    if handler is not None:
        p._take_frames(handler)
    return p


def test_uvicorn_hands_frames_over_in_order_and_queues_what_is_declined():
    take = Handler()
    p = _uvicorn(take)
    p.handle_bytes(Frame(Opcode.BINARY, b"\x01\x02"))
    p.handle_text(Frame(Opcode.TEXT, '{"type":"end"}'.encode()))
    assert take.got == [b"\x01\x02", '{"type":"end"}'] and p.queue.empty() and p.transport.paused == 0
    take.takes = False  # the socket is busy or the model is behind
    p.handle_bytes(Frame(Opcode.BINARY, b"\x03"))
    assert p.queue.get_nowait() == {"type": "websocket.receive", "bytes": b"\x03"} and p.transport.paused == 1
    take.takes = True
    p.queue.put_nowait({"type": "websocket.receive", "bytes": b"queued"})
    p.handle_bytes(Frame(Opcode.BINARY, b"\x04"))  # behind a queued message: queued too
    assert take.got[-1] == b"\x03" and [p.queue.get_nowait()["bytes"] for _ in range(2)] == [b"queued", b"\x04"]
    p.close_sent = True  # the app closed: a late frame is dropped, as uvicorn drops it (neither handed nor queued)
    p.handle_bytes(Frame(Opcode.BINARY, b"\x05"))
    assert take.got[-1] == b"\x03" and p.queue.empty()


def test_uvicorn_without_a_handler_or_with_invalid_utf8_queues_as_before():
    p = _uvicorn(None)
    p.handle_bytes(Frame(Opcode.BINARY, b"\x01"))
    assert p.queue.get_nowait()["bytes"] == b"\x01"
    take = Handler()
    p = _uvicorn(take)
    p.conn, p.logger = SimpleNamespace(send_close=lambda code: None), logging.getLogger("test")
    p.handle_parser_exception = lambda: setattr(p, "failed", True)  # uvicorn's 1007 path
    p.handle_text(Frame(Opcode.TEXT, b"\xff\xfe"))
    assert take.got == [] and p.failed


class PicowsFrame:
    def __init__(self, kind, payload: bytes) -> None:
        self.msg_type, self.payload, self.fin = kind, payload, True
        self.rsv1 = self.rsv2 = self.rsv3 = 0  # picows_connection checks them (no extension: 1002)

    def get_payload_as_bytes(self) -> bytes:
        return self.payload


def test_picows_hands_frames_over_only_with_an_empty_inbox():
    pytest.importorskip("picows")
    from picows import WSMsgType

    from nemo_serve.server.picows_listener import AppConnection

    async def body():
        listener = SimpleNamespace(max_message_bytes=1 << 20)
        c = AppConnection(listener, {})
        take = Handler()
        c.take_frames(take)
        c.on_ws_frame(None, PicowsFrame(WSMsgType.BINARY, b"\x01"))  # the connect message is queued
        assert take.got == [] and c.inbox[-1] == {"type": "websocket.receive", "bytes": b"\x01"}
        c.inbox.clear()
        c.on_ws_frame(None, PicowsFrame(WSMsgType.BINARY, b"\x02"))
        c.on_ws_frame(None, PicowsFrame(WSMsgType.TEXT, b'{"type":"end"}'))
        assert take.got == [b"\x02", '{"type":"end"}'] and not c.inbox
        take.takes = False
        c.on_ws_frame(None, PicowsFrame(WSMsgType.BINARY, b"\x03"))
        assert c.inbox[-1]["bytes"] == b"\x03"
        c.inbox.clear()
        c.take_frames(None)
        c.on_ws_frame(None, PicowsFrame(WSMsgType.BINARY, b"\x04"))
        assert take.got[-1] == b"\x03" and c.inbox[-1]["bytes"] == b"\x04"

    asyncio.run(body())
