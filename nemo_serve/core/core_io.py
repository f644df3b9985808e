"""The engine core's socket I/O on two threads of its own, so the stepping thread only steps.

  receiver thread: the control PULL socket -> msgpack decode -> `inbox` (a batch per wake-up);
                   a Stop is passed on and ends it
  stepping thread: takes the inbox between steps (take / wait), hands each step's results to
                   `outbox` (send) and a gone front end's socket to close (close_frontend)
  sender thread:   `outbox` -> msgpack encode -> the front end's PUSH socket, in order

One delivery order, as without the threads: the core frees a released stream's slot in step(),
before it hands the step's results to the outbox, so a front end still hears `done` only after the
slot is free; one sender keeps each front end's messages in the order the steps made them. Each
socket is used by one thread only (ZMQ sockets are not thread-safe): the control socket by the
receiver, the results sockets by the sender, which creates them.

Shutdown (stop): the receiver ends at its next poll (at most RECEIVE_POLL_MS), the sender after
sending everything handed to it before (no final is lost) or after `timeout_s`, whichever first.
A failure on either thread is kept and raised on the stepping thread at its next take (the core
then reports FAILED, as for a failure of its own).
"""

from __future__ import annotations

import logging
import queue
import threading

import zmq

from . import messages as m
from .addresses import results_address

log = logging.getLogger("nemo_serve.core")

RECEIVE_POLL_MS = 100  # how soon the receiver notices stop() when no message comes
# At stop, how long a results socket may keep sending what is queued on it (the core process
# terminates its context before it exits, which waits for this): the last finals reach their front ends.
STOP_LINGER_MS = 1000
_END = object()  # outbox: the sender's last item


class CoreIO:
    def __init__(self, control: zmq.Socket, zmq_context: zmq.Context, ipc_dir: str) -> None:
        self.control = control
        self._zmq = zmq_context
        self.ipc_dir = ipc_dir
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # lists of decoded control messages
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()  # (front end, Results | None: close) | _END
        self._stopping = threading.Event()
        self._error: BaseException | None = None
        self._threads = [threading.Thread(target=self._guarded, args=(f,), name=f"core-{f.__name__[1:]}", daemon=True)
                         for f in (self._receive, self._send_results)]  # fmt: skip

    def start(self) -> "CoreIO":
        for t in self._threads:
            t.start()
        return self

    # ------------------------------------------------------------------ stepping thread
    def take(self, wait_s: float = 0.0) -> list:
        """Every control message received so far, in order; waits up to `wait_s` for the first."""
        if self._error is not None:
            raise RuntimeError("engine core socket I/O failed") from self._error
        got = []
        try:
            got.extend(self._inbox.get(timeout=wait_s) if wait_s > 0 else self._inbox.get_nowait())
            while True:
                got.extend(self._inbox.get_nowait())
        except queue.Empty:
            return got

    def send(self, frontend: int, results: m.Results) -> None:
        self._outbox.put((frontend, results))

    def close_frontend(self, frontend: int) -> None:
        """Its socket closed after what was handed to it before (a front end that died)."""
        self._outbox.put((frontend, None))

    def stop(self, timeout_s: float = 2.0) -> bool:
        """Stop both threads; True when everything handed to the sender was sent."""
        self._stopping.set()
        self._outbox.put(_END)
        for t in self._threads:
            if t.is_alive():
                t.join(timeout_s)
        return not any(t.is_alive() for t in self._threads)

    # ------------------------------------------------------------------ the I/O threads
    def _guarded(self, body) -> None:
        try:
            body()
        except BaseException as e:  # noqa: BLE001 - raised again on the stepping thread (take)
            log.exception("engine core socket I/O failed")
            self._error = e
            self._inbox.put([])  # wakes a stepping thread waiting in take()

    def _receive(self) -> None:
        # A blocking receive with a timeout, not poll() then receive: pyzmq's poll() builds a
        # Poller each call, a large share of a wake-up's CPU here.
        self.control.setsockopt(zmq.RCVTIMEO, RECEIVE_POLL_MS)
        while not self._stopping.is_set():
            try:
                raws = [self.control.recv()]
            except zmq.Again:
                continue
            while True:  # and whatever else has come
                try:
                    raws.append(self.control.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
            batch = self._decode(raws)
            self._inbox.put(batch)
            if batch and isinstance(batch[-1], m.Stop):
                return

    @staticmethod
    def _decode(raws: list) -> list:
        """The messages up to a Stop (the core ends there); a malformed one is dropped."""
        batch = []
        for raw in raws:
            try:
                batch.append(m.control_decoder.decode(raw))
            except m.msgspec.DecodeError:
                log.error("malformed control message dropped (%d bytes)", len(raw))
                continue
            if isinstance(batch[-1], m.Stop):
                break
        return batch

    def _send_results(self) -> None:
        encoder = m.msgspec.msgpack.Encoder()
        sockets: dict[int, zmq.Socket] = {}
        try:
            while (item := self._outbox.get()) is not _END:
                frontend, results = item
                if results is None:
                    if (sock := sockets.pop(frontend, None)) is not None:
                        sock.close(0)
                    continue
                sock = sockets.get(frontend) or self._connect(frontend, sockets)
                sock.send(encoder.encode(results), copy=False)
        finally:
            for sock in sockets.values():
                sock.close(STOP_LINGER_MS)

    def _connect(self, frontend: int, sockets: dict) -> zmq.Socket:
        sock = self._zmq.socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, 0)  # never block or drop: a dead front end's socket is closed instead
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(results_address(self.ipc_dir, frontend))
        sockets[frontend] = sock
        return sock
