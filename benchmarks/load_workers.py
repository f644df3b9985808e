"""The load generator's worker processes: one level's N paced streams split over several processes.

One asyncio process falls behind long before thousands of paced streams (issue 48): its own
scheduling delay then shows up as lower offered load and late packets, and a level would be
counted against the server for the generator's fault. So a level runs in `num_workers` processes
(forked: they inherit the test set), each an event loop (uvloop where installed) driving lanes
p, p + W, p + 2W, ... of the N (load_level.run_level), and each measures its OWN lateness: per
packet, how long after its due time the loop got to it (load_level.send_paced). A level whose
workers were late beyond `max_send_lateness_ms` (99th percentile, any worker) gets the verdict
`generator_late` and is not counted as kept up or as behind: the generator, not the server,
fell behind.

The per-level summary is load_summary.summarise_level over every worker's records (one set of
definitions), plus `workers` (each process's streams, packets, lateness and CPU seconds) and
`send_lateness_ms` over all packets.
"""

from __future__ import annotations

import asyncio
import math
import os
import resource
import time
from dataclasses import dataclass, field


from benchmarks.common import percentiles
from benchmarks.load_items import LoadItem
from benchmarks.load_level import StreamRecord, run_level
from benchmarks.load_summary import keeps_up, summarise_level

FD_MARGIN = 64  # per process beyond one socket per lane: pipes, the log, the event loop's own
DEFAULT_MAX_SEND_LATENESS_MS = 10.0  # issue 48: p99 send lateness under 10 ms


@dataclass
class Stall:
    """Test hook: worker `worker` blocks its event loop for `block_ms` every `every_ms`, as a
    generator process starved of CPU would (tests/test_loadgen.py plants it)."""

    worker: int
    block_ms: float
    every_ms: float


@dataclass
class WorkerReport:
    worker: int
    lanes: list[int]
    records: list[StreamRecord]
    cpu_s: float
    loop: str  # "uvloop" or "asyncio"
    pid: int
    sys_s: float = 0.0  # the kernel's part of cpu_s: on loopback, a send also runs the peer's TCP receive

    def summary(self) -> dict:
        late = [x for r in self.records for x in r.send_lateness]
        return {
            "worker": self.worker,
            "lanes": len(self.lanes),
            "items_started": len(self.records),
            "items_completed": sum(r.error is None for r in self.records),
            "packets": len(late),
            "send_lateness_ms": lateness_ms(late),
            "cpu_s": round(self.cpu_s, 2),
            "sys_s": round(self.sys_s, 2),
            "loop": self.loop,
            "pid": self.pid,
        }


@dataclass
class LevelRun:
    records: list[StreamRecord]
    workers: list[WorkerReport] = field(default_factory=list)

    @property
    def chunk_ms(self) -> float | None:
        return next((r.chunk_ms for r in self.records if r.chunk_ms), None)


def lateness_ms(values_s: list[float]) -> dict:
    p = percentiles(values_s, (50, 99))
    return {k: (None if v is None else round(1000 * v, 2)) for k, v in p.items()} | {
        "max": round(1000 * max(values_s), 2) if values_s else None
    }


def default_workers() -> int:
    """Half the cores (the server and its engine core share the host), at least one."""
    return max(1, (os.cpu_count() or 2) // 2)


def ensure_fd_limit(lanes_per_worker: int) -> dict:
    """Raise this process's open-file limit (soft to hard; forked workers inherit it) and refuse,
    before any stream starts, a level whose sockets would not fit: a worker hitting EMFILE midway
    would count as server errors."""
    needed = lanes_per_worker + FD_MARGIN
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < needed:
        target = hard if hard != resource.RLIM_INFINITY else max(needed, soft)
        if target < needed:
            raise SystemExit(
                f"open-file limit too low: {lanes_per_worker} streams per worker need {needed} descriptors, "
                f"the hard limit is {hard}; raise it (ulimit -Hn) or use more --workers"
            )
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    return {"needed_per_worker": needed, "soft": soft, "hard": hard}


def run_level_workers(
    url: str,
    items: list[LoadItem],
    num_streams: int,
    duration_s: float,
    ramp_s: float = 2.0,
    endpointing: bool = False,
    num_workers: int = 1,
    context_right: int | None = None,
    stall: Stall | None = None,
    protocol: str = "ws",
    client: str = "websockets",
) -> LevelRun:
    """N lanes over `num_workers` processes (lane w runs in process w mod num_workers)."""
    num_workers = max(1, min(num_workers, num_streams))
    ensure_fd_limit(math.ceil(num_streams / num_workers))
    specs = [
        (url, num_streams, duration_s, ramp_s, endpointing, list(range(p, num_streams, num_workers)), p, context_right, stall,
         protocol, client)
        for p in range(num_workers)
    ]  # fmt: skip
    global _SHARED_ITEMS
    _SHARED_ITEMS = items
    if num_workers == 1:
        reports = [_worker(specs[0])]
    else:
        import multiprocessing as mp

        with mp.get_context("fork").Pool(num_workers) as pool:  # fork: the children inherit the test set
            reports = pool.map(_worker, specs, chunksize=1)
    return LevelRun([r for rep in reports for r in rep.records], reports)


_SHARED_ITEMS: list[LoadItem] = []


def _worker(spec) -> WorkerReport:
    url, n, duration_s, ramp_s, endpointing, lanes, index, context_right, stall, protocol, client = spec
    cpu0, sys0 = _cpu_s(), _sys_s()

    async def main() -> list[StreamRecord]:
        hog = asyncio.create_task(_stall(stall)) if stall is not None and stall.worker == index else None
        try:
            return await run_level(url, _SHARED_ITEMS, n, duration_s, ramp_s, endpointing, progress=False,
                                   workers=lanes, context_right=context_right, protocol=protocol, client=client)  # fmt: skip
        finally:
            if hog is not None:
                hog.cancel()

    loop_factory, loop_name = _loop_factory()
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        records = runner.run(main())
    return WorkerReport(index, lanes, records, _cpu_s() - cpu0, loop_name, os.getpid(), _sys_s() - sys0)


def _loop_factory():
    try:
        import uvloop
    except ImportError:
        return None, "asyncio"
    return uvloop.new_event_loop, "uvloop"


async def _stall(stall: Stall) -> None:
    while True:
        await asyncio.sleep(stall.every_ms / 1000)
        time.sleep(stall.block_ms / 1000)  # blocking on purpose: the whole loop stands still


def _sys_s() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_stime


def _cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


# ----------------------------------------------------------------------------- one level's verdict


def summarise_run(run: LevelRun, items: list[LoadItem], num_streams: int, duration_s: float, protocol: str = "ws") -> dict:
    level = summarise_level(run.records, items, num_streams, duration_s)
    level["protocol"] = protocol
    level["workers"] = [w.summary() for w in run.workers]
    level["send_lateness_ms"] = lateness_ms([x for r in run.records for x in r.send_lateness])
    level["loadgen_cpu_s"] = round(sum(w.cpu_s for w in run.workers), 2)
    level["loadgen_sys_s"] = round(sum(w.sys_s for w in run.workers), 2)
    return level


def judge(level: dict, chunk_ms: float | None, max_drift: float, max_send_lateness_ms: float) -> str:
    """Sets level["verdict"], ["keeps_up"] and ["late_workers"]. The generator is judged first:
    when any worker's p99 lateness passed the bound, the level says `generator_late` whatever
    the latencies were, so a generator that fell behind is never counted against (or for) the
    server."""
    late = [w["worker"] for w in level["workers"]
            if w["packets"] and w["send_lateness_ms"]["p99"] > max_send_lateness_ms]  # fmt: skip
    level["late_workers"] = late
    level["max_send_lateness_ms"] = max_send_lateness_ms
    if late:
        verdict = "generator_late"
    elif chunk_ms is not None and _server_keeps_up(level, chunk_ms, max_drift):
        verdict = "keeps_up"
    else:
        verdict = "server_behind"
    level["verdict"] = verdict
    level["keeps_up"] = verdict == "keeps_up"
    return verdict


def _server_keeps_up(level: dict, chunk_ms: float, max_drift: float) -> bool:
    """/ws: the DESIGN's rule (load_summary.keeps_up). /v1/realtime deltas carry no audio position,
    so there is no partial latency or drift: its stand-in is every item completed with no error
    and the p95 of `completed` after the commit (the tail decoded) within two chunk periods."""
    if level.get("protocol") != "realtime":
        return keeps_up(level, chunk_ms, max_drift)
    p95 = level["final_latency_ms"]["p95"]
    return p95 is not None and p95 <= 2 * chunk_ms and not level["errors"] and level["items_completed"] > 0


def measure_level(url: str, items: list[LoadItem], num_streams: int, duration_s: float, *, ramp_s: float = 2.0,
                  endpointing: bool = False, num_workers: int = 1, context_right: int | None = None,
                  max_drift: float = 20.0, max_send_lateness_ms: float = DEFAULT_MAX_SEND_LATENESS_MS,
                  stall: Stall | None = None, protocol: str = "ws",
                  client: str = "websockets") -> tuple[dict, LevelRun]:  # fmt: skip
    """One level run, summarised and judged (loadgen.py and sweep.py)."""
    run = run_level_workers(url, items, num_streams, duration_s, ramp_s, endpointing, num_workers, context_right, stall,
                            protocol, client)  # fmt: skip
    level = summarise_run(run, items, num_streams, duration_s, protocol)
    level["client"] = client
    judge(level, run.chunk_ms, max_drift, max_send_lateness_ms)
    return level, run


def lateness_line(level: dict) -> str:
    s = level["send_lateness_ms"]
    late = level.get("late_workers")
    return (f"generator: {len(level['workers'])} worker(s), send lateness p50/p99/max {s['p50']}/{s['p99']}/{s['max']} ms"
            + (f", LATE workers {late} (p99 over {level['max_send_lateness_ms']} ms): level invalid" if late else ""))
