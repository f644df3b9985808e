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

Here a level: the worker processes forked, their results filled into the records and judged; the
frames and the tick plan are blast_wire.py's, the opening blast_opening.py's, the pacer
blast_pacer.py's, gRPC's streams blast_grpc.py's.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import resource
import threading
import time

import numpy as np

from benchmarks.blast_opening import open_stream
from benchmarks.blast_pacer import Pacer, Sent
from benchmarks.blast_wire import (PACKET_SAMPLES, Plan, at_sdk_rate, end_frame, make_plan, packet_frames, server_frame,
                                   split_frames, wire_of, wire_rate)
from benchmarks.common import SAMPLE_RATE
from benchmarks.load_items import LoadItem
from benchmarks.load_level import StreamRecord, read_ws_message
from benchmarks.load_realtime import read_realtime_message
from benchmarks.load_workers import LevelRun, WorkerReport, ensure_fd_limit, judge, summarise_run

# what tests and the load tools use of the sender, from its modules (blast_wire, blast_pacer)
__all__ = ["PACKET_SAMPLES", "Pacer", "at_sdk_rate", "end_frame", "make_plan", "measure_level_blast", "packet_frames",
           "server_frame", "split_frames", "wire_of"]

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
    opened = [open_stream(port, protocol, lane, items[lane % len(items)], context_right, _SHARED.get("chunk_ms"),
                          _SHARED.get("token"))
              for lane in lanes]  # fmt: skip
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
