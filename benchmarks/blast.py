"""A paced sender that costs a few µs per packet (`packet_cost_streams.py --client blast`, issue 48).

Why: the project's load generator (load_workers.py, the picows client) costs about 60 µs of CPU per
paced packet on this 2-core machine, so above 64-128 streams it fell behind and the front end's
figure at the level issue 48 names (1,000 streams per front end) could not be shown. Here, per
worker process and with no asyncio:
  - every stream's frames are built and masked once (raw_ws.frame): the items are cut to one
    length, so the streams of one item send the very same bytes objects;
  - one pacer: the streams are spread over the 20 ms packet interval in ticks of 2 ms (as
    independent clients would be: raw_ws.send_spread's spread); a tick writes its due packets with
    plain non-blocking `sock.send`, no Python object per packet;
  - between ticks one epoll wait both sleeps and drains the server's messages: each `recv` is kept
    as (time, stream, bytes) and parsed only after the run, into the load generator's own
    StreamRecords (load_level.read_ws_message, load_realtime.read_realtime_message), so the
    verdict is load_workers.judge's;
  - its lateness is per tick, taken after the tick's last send (each packet of the tick is given
    that, the worst of them); a send the kernel did not take whole (the server not reading) makes
    its stream queue its bytes from then on, and is counted in `short_sends`.
The opening exchange is the load generator's own (load_level.open_ws_stream,
load_realtime.configure), run on a blocking socket before the pacing starts.
Protocols: "ws" (float32 frames), "realtime" (/v1/realtime appends of PCM16 at the items' 16 kHz),
"realtime24k" (the same at 24 kHz, OpenAI's rate: the shape the OpenAI SDK, pipecat and livekit
send, 20 ms of base64 PCM16 an append, which the server resamples; the items are resampled once,
here, before the frames are built), "grpc" (blast_grpc.py). The plan and the records count audio
in the items' 16 kHz samples whatever the wire's rate.
Rejected: asyncio with prebuilt frames (a loop iteration and a callback per ready socket: what
load_picows.py does, about 60 µs a packet) and parsing each message as it arrives (the same work,
inside the pacer's time).
"""

from __future__ import annotations

import base64
import multiprocessing as mp
import os
import resource
import select
import socket
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from benchmarks.common import SAMPLE_RATE
from benchmarks.load_items import LoadItem
from benchmarks.load_level import END_MESSAGE, StreamRecord, open_ws_stream, read_ws_message, stream_config
from benchmarks.load_realtime import (APPEND_SAMPLES, COMMIT_MESSAGE, append_message, as_pcm16, configure,
                                      read_realtime_message, realtime_query)  # fmt: skip
from benchmarks.load_workers import LevelRun, WorkerReport, ensure_fd_limit, judge, summarise_run
from benchmarks.raw_ws import SPREAD_S, frame

PACKET_SAMPLES = APPEND_SAMPLES  # 20 ms at 16 kHz, both protocols
RECV_BYTES = 1 << 16
DONE_MARKERS = {"ws": b'"type":"done"', "realtime": b"transcription.completed"}  # early exit only; parsed after
SDK_RATE = 24000  # /v1/realtime's audio/pcm rate in OpenAI's API: what its SDK, pipecat and livekit send
# protocol -> the wire whose opening, end and server messages it has (the rate is the only difference)
WIRES = {"realtime24k": "realtime"}


def wire_of(protocol: str) -> str:
    return WIRES.get(protocol, protocol)


def wire_rate(protocol: str) -> int:
    return SDK_RATE if protocol == "realtime24k" else SAMPLE_RATE


@dataclass
class Plan:
    """Which packet each tick sends: stream i is in group i % groups and sends its packet j at tick
    j * groups + i % groups, due tick * tick_s after the start (tick_s = packet_s / groups: SPREAD_S
    once there are streams enough for every tick). No per-packet state."""

    num_streams: int
    num_packets: int
    groups: int
    tick_s: float
    packet_samples: int = PACKET_SAMPLES

    def due_s(self, tick: np.ndarray | int) -> np.ndarray | float:
        return tick * self.tick_s

    def tick_of(self, stream: int, packet: np.ndarray | int) -> np.ndarray | int:
        return packet * self.groups + stream % self.groups

    def num_ticks(self) -> int:
        return self.num_packets * self.groups

    def streams_of(self, tick: int) -> range:
        return range(tick % self.groups, self.num_streams, self.groups)


def make_plan(num_streams: int, num_packets: int, packet_samples: int = PACKET_SAMPLES) -> Plan:
    packet_s = packet_samples / SAMPLE_RATE
    groups = max(1, min(num_streams, round(packet_s / SPREAD_S)))
    return Plan(num_streams, num_packets, groups, packet_s / groups, packet_samples)


def packet_frames(audio: np.ndarray, protocol: str, num_packets: int, packet_samples: int = PACKET_SAMPLES) -> list[bytes]:
    """One item's masked client frames of `packet_samples` each: float32 binary on /ws (the load
    generator's encoding), the `input_audio_buffer.append` JSON (base64 PCM16) on /v1/realtime."""
    if protocol == "grpc":  # Riva StreamingRecognize: HTTP/2 DATA frames (blast_grpc.py)
        from benchmarks import blast_grpc

        return blast_grpc.packet_frames(audio, num_packets, packet_samples)
    if protocol == "realtime24k":
        audio, packet_samples = at_sdk_rate(audio, num_packets * packet_samples), packet_samples * SDK_RATE // SAMPLE_RATE
    parts = [audio[k * packet_samples : (k + 1) * packet_samples] for k in range(num_packets)]
    if wire_of(protocol) == "realtime":
        return [frame(append_message(as_pcm16(p)).encode(), 0x1) for p in parts]
    return [frame(p.astype(np.float32).tobytes(), 0x2) for p in parts]


def at_sdk_rate(audio: np.ndarray, num_samples: int) -> np.ndarray:
    """The first `num_samples` of 16 kHz `audio` at 24 kHz (soxr, as packet_clients.speech does),
    zero-padded to whole packets where the resampler's output falls a sample short."""
    import soxr

    n = num_samples * SDK_RATE // SAMPLE_RATE
    out = soxr.resample(audio[:num_samples].astype(np.float32), SAMPLE_RATE, SDK_RATE).astype(np.float32)[:n]
    return np.pad(out, (0, n - len(out)))


def split_frames(buf: bytes) -> tuple[list[tuple[int, bytes]], bytes]:
    """Unmasked server frames in `buf`: ([(opcode, payload)], the bytes of an unfinished frame)."""
    out, i = [], 0
    while len(buf) - i >= 2:
        n, head = buf[i + 1] & 0x7F, 2
        if n >= 126:
            head = 4 if n == 126 else 10
            if len(buf) - i < head:
                break
            n = int.from_bytes(buf[i + 2 : i + head], "big")
        if len(buf) - i < head + n:
            break
        out.append((buf[i] & 0x0F, buf[i + head : i + head + n]))
        i += head + n
    return out, buf[i:]


# ----------------------------------------------------------------------------- opening


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


def server_frame(payload: bytes) -> bytes:
    """An unmasked text frame: a message read past the opening, put back for the parser."""
    n = len(payload)
    size = bytes([n]) if n < 126 else bytes([126]) + n.to_bytes(2, "big") if n < 65536 else bytes([127]) + n.to_bytes(8, "big")
    return b"\x81" + size + payload


def open_stream(port: int, protocol: str, worker: int, item: LoadItem,
                context_right: int | None) -> tuple[socket.socket | None, StreamRecord, bytes]:  # fmt: skip
    """One stream opened; (non-blocking socket or None if refused, its record, bytes already
    read past the opening)."""
    if protocol == "grpc":
        from benchmarks import blast_grpc

        return blast_grpc.open_stream(port, worker, item, _SHARED.get("chunk_ms"))
    rec = StreamRecord(worker, item.item_id, len(item.audio) / SAMPLE_RATE, opened=time.time())
    token = _SHARED.get("token")
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


# ----------------------------------------------------------------------------- the pacer


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


def end_frame(protocol: str) -> bytes:
    """A stream's end of input: /ws `end`, /v1/realtime one commit, gRPC the client's END_STREAM."""
    if protocol == "grpc":
        from benchmarks import blast_grpc

        return blast_grpc.END_FRAME
    return frame((COMMIT_MESSAGE if wire_of(protocol) == "realtime" else END_MESSAGE).encode(), 0x1)


def done_marker(protocol: str) -> bytes:
    if protocol == "grpc":
        from benchmarks import blast_grpc

        return blast_grpc.DONE_MARKER
    return DONE_MARKERS[wire_of(protocol)]


# ----------------------------------------------------------------------------- one level


def fill_records(recs: list[StreamRecord], sent: Sent, plan: Plan, t0: float, protocol: str,
                 leftovers: list[bytes]) -> None:  # fmt: skip
    """The pacer's ticks and bytes into each stream's record, as the load generator fills them:
    per packet its send time and lateness (its tick's), then every server message read by the
    generator's own readers at the time its last byte came."""
    ends = (plan.packet_samples * np.arange(1, plan.num_packets + 1)).tolist()
    packets = np.arange(plan.num_packets)
    for i, rec in enumerate(recs):
        if i not in sent.end_sent:  # refused at opening: its record has the error
            continue
        ticks = plan.tick_of(i, packets)
        times = sent.tick_end[ticks]
        rec.send_ends, rec.send_times = ends, times.tolist()
        rec.send_lateness = (times - (t0 + plan.due_s(ticks))).tolist()
        rec.end_sent = sent.end_sent[i]
    chunks: dict[int, list[tuple[float, bytes]]] = {i: [(t0, b)] for i, b in enumerate(leftovers) if b}
    for t, i, data in sent.received:
        chunks.setdefault(i, []).append((t, data))
    if protocol == "grpc":
        from benchmarks import blast_grpc

        for i, parts in chunks.items():
            blast_grpc.read_stream(recs[i], parts)
        chunks = {}
    read = read_realtime_message if wire_of(protocol) == "realtime" else read_ws_message
    for i, parts in chunks.items():
        buf = b""
        for t, data in parts:
            frames, buf = split_frames(buf + data)
            for op, payload in frames:
                if op == 0x1:
                    read(recs[i], t, payload)
    for i, rec in enumerate(recs):
        if rec.error is None and not rec.done:
            rec.error = "timeout: no done" if i not in sent.finished else "closed before done"


def realtime_priority() -> str:
    """SCHED_FIFO for this process where allowed: on a machine shared with other jobs, a
    normal-priority sender waits its turn behind them and its schedule slips (p99 lateness of
    50-100 ms at 32 streams under a load average of 7, where it costs 20 µs a packet). The
    sender sleeps in epoll between ticks, and the kernel's real-time throttling bounds it."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
        return "SCHED_FIFO 10"
    except (PermissionError, AttributeError, OSError):
        return "normal (SCHED_FIFO refused)"


_SHARED: dict = {}  # set before the fork: items, the start barrier and time


def _worker(*args) -> None:
    """A worker that fails says so on the queue and breaks the start barrier (the parent then
    raises instead of waiting)."""
    try:
        _pace_lanes(*args)
    except BaseException as e:
        _SHARED["barrier"].abort()
        args[-1].put(e)
        raise


def _pace_lanes(index: int, lanes: list[int], port: int, protocol: str, num_packets: int, context_right: int | None,
                tail_s: float, out: mp.SimpleQueue) -> None:  # fmt: skip
    items, barrier, start = _SHARED["items"], _SHARED["barrier"], _SHARED["start"]
    packet_samples = _SHARED["packet_samples"]
    priority = realtime_priority() if _SHARED["realtime"] else "normal"
    # the lane, as load_level passes it: the /ws config's id is unique per stream
    opened = [open_stream(port, protocol, lane, items[lane % len(items)], context_right) for lane in lanes]
    socks, recs, leftovers = (list(x) for x in zip(*opened)) if opened else ([], [], [])
    item_of = [lane % len(items) for lane in lanes]
    frames = [packet_frames(it.audio, protocol, num_packets, packet_samples) for it in items]
    plan = make_plan(len(lanes), num_packets, packet_samples)
    pacer = Pacer(socks, item_of, frames, plan, protocol)
    barrier.wait()  # every worker opened its streams
    barrier.wait()  # the parent set the start time
    t0 = start.value
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    sent = pacer.run(t0)
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    pacer.finish(tail_s)
    fill_records(recs, sent, plan, t0, protocol, leftovers)
    ru2 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = ru1.ru_utime + ru1.ru_stime - ru0.ru_utime - ru0.ru_stime
    # after the pacing: the last results read, the ends sent, then every message parsed (fill_records)
    after_cpu = ru2.ru_utime + ru2.ru_stime - ru1.ru_utime - ru1.ru_stime
    report = WorkerReport(index, lanes, recs, cpu, "blast", os.getpid(), ru1.ru_stime - ru0.ru_stime)
    packets = sum(len(r.send_times) for r in recs)
    out.put((report, {"short_sends": sent.short_sends, "slow_streams": len(sent.slow_streams), "packets": packets,
                      "priority": priority, "pacing_cpu_s": round(cpu, 3), "pacing_us_per_packet": round(1e6 * cpu / max(packets, 1), 2),
                      "after_pacing_cpu_s": round(after_cpu, 3)}))


def measure_level_blast(port: int, protocol: str, items: list[LoadItem], num_streams: int, num_packets: int, *,
                        num_workers: int = 1, context_right: int | None = None, max_drift: float = 20.0,
                        max_send_lateness_ms: float = 10.0, tail_s: float = 30.0,
                        realtime: bool = False, on_start=lambda t0: None,
                        chunk_ms: float | None = None, packet_samples: int = PACKET_SAMPLES,
                        token: str | None = None) -> tuple[dict, LevelRun]:  # fmt: skip
    """One level through the blast sender, summarised and judged as load_workers.measure_level
    does; `on_start(t0)` is called in this process with the pacing's start time; `chunk_ms`: the
    served mode's chunk (gRPC only: Riva's calls are not told it, /ws's `ready` says it); `packet_samples`:
    each packet's audio (20 ms by default, the voice agents' size, in the items' 16 kHz samples);
    `token`: the server's bearer token, where it asks for one. A send the kernel
    did not take whole makes a level that passed `server_behind`: the front end stopped reading."""
    num_workers = max(1, min(num_workers, num_streams))
    ensure_fd_limit(-(-num_streams // num_workers))
    ctx = mp.get_context("fork")  # the children inherit the items and the frames' inputs
    _SHARED.update(items=items, realtime=realtime, chunk_ms=chunk_ms, packet_samples=packet_samples, token=token,
                   barrier=ctx.Barrier(num_workers + 1, timeout=600), start=ctx.Value("d", 0.0))  # fmt: skip
    out = ctx.SimpleQueue()
    procs = [ctx.Process(target=_worker, args=(w, list(range(w, num_streams, num_workers)), port, protocol,
                                               num_packets, context_right, tail_s, out))
             for w in range(num_workers)]  # fmt: skip
    for p in procs:
        p.start()
    try:
        _SHARED["barrier"].wait()
        _SHARED["start"].value = t0 = time.time() + 0.2
        _SHARED["barrier"].wait()
        on_start(t0)
    except threading.BrokenBarrierError:
        pass  # a worker failed: its exception is on the queue
    results = [out.get() for _ in procs]
    for p in procs:
        p.join()
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:
        raise RuntimeError(f"blast worker failed: {failed[0]!r}")
    reports = sorted((r for r, _ in results), key=lambda r: r.worker)
    run = LevelRun([r for rep in reports for r in rep.records], reports)
    level = summarise_run(run, items, num_streams, num_packets * packet_samples / SAMPLE_RATE, wire_of(protocol))
    level["client"], level["wire_rate"] = "blast", wire_rate(protocol)
    judge(level, run.chunk_ms, max_drift, max_send_lateness_ms)
    extras = [x for _, x in sorted(results, key=lambda rx: rx[0].worker)]
    level["sender"] = extras
    if level["verdict"] == "keeps_up" and any(x["short_sends"] for x in extras):
        level["verdict"], level["keeps_up"] = "server_behind", False
    return level, run
