"""One gRPC call's HTTP/2 stream (--fast-grpc-port): its incoming messages, assembled from DATA
frames by gRPC's 5-byte prefix and checked against --max-message-bytes before any is buffered,
and its outgoing bytes, sent as the peer's windows allow. The connection (grpc_h2.py) feeds and
flushes it; the call's handler (fast_grpc.py) reads and writes through it."""

from __future__ import annotations

import asyncio
from collections import deque

from .h2_frames import MESSAGE_PREFIX, STREAM_WINDOW, window_update


class H2Stream:
    """One call's HTTP/2 stream: its incoming messages and outgoing bytes. Owner: the connection;
    the call's handler reads (`read`) and writes (`send`) through it."""

    def __init__(self, conn, stream_id: int, headers: list[tuple[str, str]]) -> None:  # conn: grpc_h2.H2Connection
        self.conn, self.id, self.headers = conn, stream_id, headers
        self.inbox: deque = deque()  # whole messages (bytes) the handler has not taken
        self.waiter: asyncio.Future | None = None  # the handler's read, waiting for the inbox
        self.partial = bytearray()  # a message's bytes so far, prefix included
        self.need = 0  # the message's length once its prefix is in (0: no prefix yet)
        self.in_ended = False  # the client's END_STREAM (or the stream reset)
        self.recv_window = STREAM_WINDOW
        self.owed = 0  # bytes received and not credited back yet
        self.send_window = conn.peer_initial_window
        self.out = bytearray()  # DATA bytes waiting for a window
        self.drained: asyncio.Future | None = None
        self.headers_sent = False
        self.closed = False  # trailers or RST_STREAM sent: nothing more goes out
        self.task: asyncio.Task | None = None  # the handler (fast_grpc.py)
        self.refusal: tuple[int, str] | None = None  # (grpc status, message): the call is ended for this
        # A message that finds the handler parked in `read` (the inbox empty) goes to take(message)
        # first, in data_received: True, handled (no task wake-up); False, to the inbox as before.
        self.take = None

    # ------------------------------------------------------------------ in (the connection calls)
    def data(self, payload, n: int, end: bool) -> None:
        """A DATA frame's payload (`n`: its length with padding, what the window counts)."""
        self.owed += n
        if self.refusal is not None or self.closed:
            return  # credited to the connection already; the stream's window no longer matters
        limit = self.conn.max_message_bytes
        if not self.need and not self.partial and len(payload) >= 5:  # one whole message: no copies to a buffer
            compressed, size = MESSAGE_PREFIX.unpack_from(payload)
            if not compressed and size <= limit and len(payload) == 5 + size:
                self._deliver(bytes(payload[5:]))
                if end:
                    self.end_input()
                elif not self.inbox:
                    self._credit()
                return
        view = memoryview(payload)
        while view:
            if not self.need:
                take = min(5 - len(self.partial), len(view))
                self.partial += view[:take]
                view = view[take:]
                if len(self.partial) < 5:
                    break
                compressed, size = MESSAGE_PREFIX.unpack_from(self.partial)
                if compressed:
                    self.refuse(12, "compressed messages are not served (no grpc-encoding)")  # UNIMPLEMENTED
                    return
                if size > limit:  # refused before a byte of it is buffered
                    self.refuse(8, f"Received message larger than max ({size} vs. {limit})")  # RESOURCE_EXHAUSTED
                    return
                self.need = 5 + size
            take = min(self.need - len(self.partial), len(view))
            self.partial += view[:take]
            view = view[take:]
            if len(self.partial) == self.need:
                self._deliver(bytes(self.partial[5:]))
                self.partial.clear()
                self.need = 0
        if end:
            self.end_input()
        elif not self.inbox:  # a message's part: credited now (it cannot be taken before it is whole)
            self._credit()

    def _deliver(self, message: bytes) -> None:
        waiter = self.waiter
        if self.take is not None and waiter is not None and not waiter.done() and not self.inbox and self.take(message):
            return
        self.inbox.append(message)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def end_input(self) -> None:
        self.in_ended = True
        if self.partial:  # the stream ended inside a message
            self.refuse(13, "the request stream ended inside a message")  # INTERNAL, as grpc
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def refuse(self, code: int, message: str) -> None:
        """End the call with a status: its handler is cancelled, the status sent in its place."""
        if self.refusal is None and not self.closed:
            self.refusal = (code, message)
            self.partial.clear()
            if self.task is not None:
                self.task.cancel()
            else:
                self.conn.finish(self, code, message)

    # ------------------------------------------------------------------ the handler's side
    async def read(self) -> bytes | None:
        """The next whole message, None at the end of the client's stream."""
        while not self.inbox:
            if self.in_ended:
                return None
            self.waiter = self.conn.loop.create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        message = self.inbox.popleft()
        if not self.inbox:
            self._credit()
        return message

    def _credit(self) -> None:
        """The bytes received, back to the client's window once the handler has taken every whole
        message (a handler that stopped reading stops its client), in batches of a quarter window."""
        if self.owed >= STREAM_WINDOW // 4 and not self.in_ended:
            self.conn.write(window_update(self.id, self.owed))
            self.recv_window += self.owed
            self.owed = 0

    async def send(self, message: bytes) -> None:
        """One gRPC message out; returns once it is with the transport and the transport takes
        more (the session's send timeout bounds a client that stopped reading or crediting)."""
        if self.closed:
            raise ConnectionResetError("the stream is closed")
        self.conn.send_headers(self)
        self.out += MESSAGE_PREFIX.pack(0, len(message))
        self.out += message
        self.conn.flush(self)
        while (self.out or not self.conn.writable) and not self.closed:
            self.drained = self.conn.loop.create_future()
            try:
                await self.drained
            finally:
                self.drained = None

    def wake(self) -> None:
        if self.drained is not None and not self.drained.done():
            self.drained.set_result(None)
