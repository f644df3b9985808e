"""blast.py's pacer: one worker's sockets, every packet written at its tick with plain non-blocking
`sock.send`, and between ticks one epoll wait that both sleeps and keeps the server's bytes for
after the run (blast.fill_records parses them).
"""

from __future__ import annotations

import select
import socket
import time
from dataclasses import dataclass, field

import numpy as np

from benchmarks.blast_wire import RECV_BYTES, Plan, done_marker, end_frame

@dataclass
class Sent:
    """What the pacer saw: when each tick's last send returned, the server's bytes as they came,
    the sends the kernel did not take whole, and when each stream's end went out."""

    tick_end: np.ndarray  # [ticks] time.time() after the tick's last send
    received: list[tuple[float, int, bytes]] = field(default_factory=list)  # (time, stream, bytes)
    short_sends: int = 0
    slow_streams: set[int] = field(default_factory=set)
    end_sent: dict[int, float] = field(default_factory=dict)
    finished: set[int] = field(default_factory=set)  # done/completed seen, or the connection closed


class Pacer:
    """Owns one worker's sockets; only its own methods write to them. Streams that are None
    (refused at opening) are skipped."""

    def __init__(self, socks: list[socket.socket | None], item_of: list[int], frames: list[list[bytes]],
                 plan: Plan, protocol: str) -> None:  # fmt: skip
        self.socks, self.plan, self.frames, self.item_of, self.protocol = socks, plan, frames, item_of, protocol
        self.ep = select.epoll()
        self.stream_of_fd = {s.fileno(): i for i, s in enumerate(socks) if s is not None}
        for fd in self.stream_of_fd:
            self.ep.register(fd, select.EPOLLIN)
        self.by_group = []  # [group] -> [(an item's frames, [send of each of its open streams in the group])]
        for g in range(plan.groups):
            mine = [i for i in range(g, plan.num_streams, plan.groups) if socks[i] is not None]
            self.by_group.append([(frames[m], [socks[i].send for i in mine if item_of[i] == m])
                                  for m in sorted({item_of[i] for i in mine})])  # fmt: skip
        self.stream_of_send = {s.send: i for i, s in enumerate(socks) if s is not None}
        self.slow: dict[int, bytearray] = {}  # stream -> bytes the kernel has not taken yet
        self.sent = Sent(np.zeros(plan.num_ticks()))

    def run(self, t0: float) -> Sent:
        """Every packet at its tick, then each stream's end; returns once every stream finished
        or `tail_s` after the last packet."""
        tick_end, groups = self.sent.tick_end, self.plan.groups
        for tick in range(self.plan.num_ticks()):
            due = t0 + self.plan.due_s(tick)
            while (left := due - time.time()) > 0:
                self._drain(left)
            j, g = divmod(tick, groups)
            for frames, sends in self.by_group[g]:
                f = frames[j]
                for send in sends:
                    try:
                        n = send(f)
                    except BlockingIOError:
                        n = 0
                    if n != len(f):
                        self._short(send, f[n:])
            if self.slow:
                self._flush_slow(g, j)
            tick_end[tick] = time.time()
        return self.sent

    def finish(self, tail_s: float) -> Sent:
        """Each stream's end message (/ws `end`, /v1/realtime one commit), then its messages until
        it is done (the server's `done` or `completed`), at most `tail_s`."""
        end = end_frame(self.protocol)
        for i, s in enumerate(self.socks):
            if s is not None:
                self.slow.setdefault(i, bytearray()).extend(end)
        self._flush_slow(-1, -1)
        now = time.time()
        self.sent.end_sent = {i: now for i, s in enumerate(self.socks) if s is not None}
        marker, deadline = done_marker(self.protocol), time.time() + tail_s
        open_ = {i for i, s in enumerate(self.socks) if s is not None}
        seen = 0
        while open_ - self.sent.finished and time.time() < deadline:
            self._drain(0.05)
            if self.slow:
                self._flush_slow(-1, -1)
            for _, i, data in self.sent.received[seen:]:
                if not data or marker in data:
                    self.sent.finished.add(i)
            seen = len(self.sent.received)
        for s in self.socks:
            if s is not None:
                s.close()
        return self.sent

    def _drain(self, timeout_s: float) -> None:
        received, socks = self.sent.received, self.socks
        for fd, _ in self.ep.poll(timeout_s):
            i = self.stream_of_fd[fd]
            try:
                data = socks[i].recv(RECV_BYTES)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                data = b""
            if not data:
                self.ep.unregister(fd)
            received.append((time.time(), i, data))

    def _short(self, send, rest: bytes) -> None:
        """The kernel did not take a frame whole: its stream leaves the fast lists and queues."""
        i = self.stream_of_send[send]
        self.sent.short_sends += 1
        self.sent.slow_streams.add(i)
        for _, sends in self.by_group[i % self.plan.groups]:
            if send in sends:
                sends.remove(send)
        self.slow[i] = bytearray(rest)

    def _flush_slow(self, group: int, packet: int) -> None:
        """The queued streams: this tick's packet appended (for those in `group`), then whatever
        the kernel takes."""
        for i, queued in self.slow.items():
            if i % self.plan.groups == group and i in self.sent.slow_streams:
                queued.extend(self.frames[self.item_of[i]][packet])
            if queued:
                try:
                    n = self.socks[i].send(queued)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    queued.clear()
                    continue
                del queued[:n]
