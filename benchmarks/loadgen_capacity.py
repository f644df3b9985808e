"""The load generator's own capacity: CPU per paced packet and send lateness, against a stub server.

    python benchmarks/loadgen_capacity.py --levels 100,200,400 --workers 1 --chunk-ms 80 \
        --clients websockets,picows --out benchmarks/results/loadgen_capacity_clients_w1_cpu.json
    python benchmarks/loadgen_capacity.py --clients blast --stub picows --sender-fifo --levels 1000,2500,5000 \
        --workers 1,2 --chunk-ms 80 --out benchmarks/results/loadgen_capacity_blast_cpu.json

Issue 48 wants a generator that drives 5,000 real-time streams at 80 ms from one 16-core host with
p99 send lateness under 10 ms. This measures the generator alone: a stub /ws server (one process,
loadgen_stub.py) answers `ready` with --chunk-ms, reads every packet, sends one `partial` per packet
(as the engine does per chunk) and a `final` and `done` at `end`, so no model and no engine stand
behind the sockets. Per level: the generator's CPU seconds per packet sent (its workers' user +
system time over the packets, results received included), its send lateness (load_workers), and
the cores that 5,000 streams would need at that cost (5,000 x 1000 / chunk_ms packets per second x
CPU per packet). On a small shared machine the stub and the generator share the cores: the
per-packet CPU is the figure to scale, the lateness says where this machine ran out. --clients
runs each level once per client (load_level.CLIENTS, or `blast`), one after the other against the
same stub, so the clients' figures come from one run on one machine state.

`blast` (benchmarks/blast.py) sends packets of --chunk-ms (the target's shape: 80 ms, 12.5 packets
a second per stream) from --workers processes, each pacing its share of the streams and judged on
its own lateness (load_workers.judge: any worker's p99 over the bound makes the level invalid). Its
CPU is counted two ways: over the pacing (sends and every result read off the socket) and all in
(plus the ends, the tail's results and parsing every message into the generator's records, which
blast does after the run). The stub's CPU over the pacing window is read from /proc, with the
whole machine's busy cores: a level counts as sustained only if the generator kept its schedule
AND the stub kept up (loadgen_verdict).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import loadgen_stub  # noqa: E402
from benchmarks.common import SAMPLE_RATE, run_record, write_json  # noqa: E402
from benchmarks.load_items import make_items  # noqa: E402
from benchmarks.load_summary import keeps_up  # noqa: E402
from benchmarks.load_workers import lateness_line, measure_level  # noqa: E402
from benchmarks.server_process import free_port  # noqa: E402

TARGET_STREAMS = 5000
STUB_BUSY_MAX = 0.9  # of its one core over the pacing: above it the stub, not the generator, is the limit


def loadgen_verdict(level: dict, stub_busy: float | None, chunk_ms: float, max_drift: float = 20.0) -> dict:
    """The level's three answers: `valid` by the generator's own rule (no worker's p99 send lateness
    over the bound: load_workers.judge's `late_workers`), `stub_kept_up` (the stub under
    STUB_BUSY_MAX of its core, every packet's bytes taken whole, and its partials within the DESIGN's
    keeps-up rule), and `sustained`: both, with every stream completed."""
    valid = not level["late_workers"]
    short = sum(x.get("short_sends", 0) for x in level.get("sender", []))
    stub_kept_up = (stub_busy is None or stub_busy <= STUB_BUSY_MAX) and short == 0 and keeps_up(level, chunk_ms, max_drift)
    sustained = valid and stub_kept_up and level["items_completed"] == level["streams"]
    return {"valid": valid, "stub_kept_up": stub_kept_up, "sustained": sustained}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--levels", default="100,200,400")
    ap.add_argument("--workers", default="1", help="generator processes; a list runs each level once per count")
    ap.add_argument("--clients", default="websockets,picows", help="each level runs once per client, in this order")
    ap.add_argument("--stub", choices=loadgen_stub.STUBS, default="websockets")
    ap.add_argument("--stub-procs", type=int, default=1, help="stub processes on the one port (SO_REUSEPORT)")
    ap.add_argument("--sender-fifo", action="store_true", help="blast: the sender at SCHED_FIFO (a shared machine)")
    ap.add_argument("--chunk-ms", type=float, default=80.0)
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--item-seconds", default="6,8")
    ap.add_argument("--max-send-lateness-ms", type=float, default=10.0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    record = run_record()
    port = free_port()
    levels_n = [int(x) for x in args.levels.split(",")]
    os.environ["LOADGEN_STUB_STREAMS"] = str(max(levels_n))
    stubs = [mp.get_context("fork").Process(target=loadgen_stub.serve, args=(args.stub, port, args.chunk_ms), daemon=True)
             for _ in range(args.stub_procs)]  # fmt: skip
    for stub in stubs:
        stub.start()
    time.sleep(1.0)
    items = make_items("synth", 8, tuple(float(x) for x in args.item_seconds.split(",")))
    levels = []
    try:
        for n in levels_n:
            for workers in [int(x) for x in args.workers.split(",")]:
                for client in args.clients.split(","):
                    measure = _measure_blast if client == "blast" else _measure
                    levels.append(measure(port, items, n, workers, client, args, [s.pid for s in stubs]))
    finally:
        for stub in stubs:
            stub.terminate()
    write_json(args.out, {"benchmark": "loadgen_capacity", **record, "chunk_ms": args.chunk_ms, "stub": args.stub, "stub_procs": args.stub_procs,
                          "workers": args.workers, "clients": args.clients.split(","), "duration_s": args.duration,
                          "stub_busy_max": STUB_BUSY_MAX, "levels": levels})  # fmt: skip


def _measure(port: int, items, n: int, workers: int, client: str, args, stub_pids: list[int]) -> dict:
    level, _ = measure_level(f"ws://127.0.0.1:{port}/ws", items, n, args.duration, ramp_s=1.0, num_workers=workers,
                             max_send_lateness_ms=args.max_send_lateness_ms, client=client)  # fmt: skip
    packets = sum(w["packets"] for w in level["workers"])
    us = 1e6 * level["loadgen_cpu_s"] / max(packets, 1)
    row = {"streams": n, "client": client, "packets": packets, "loadgen_cpu_s": level["loadgen_cpu_s"],
           "cpu_us_per_packet": round(us, 1),
           "sys_us_per_packet": round(1e6 * level["loadgen_sys_s"] / max(packets, 1), 1), "send_lateness_ms": level["send_lateness_ms"],
           "generator_late": level["verdict"] == "generator_late", "errors": level["errors"],
           "items_completed": level["items_completed"], "workers": level["workers"],
           "cores_for_5000_streams": round(TARGET_STREAMS * 1000 / args.chunk_ms * us / 1e6, 2)}  # fmt: skip
    print(f"N={n} {client}: {us:.0f} us CPU per packet ({row['sys_us_per_packet']:.0f} in the kernel) -> {row['cores_for_5000_streams']} cores for 5,000 streams; "
          + lateness_line(level), flush=True)
    return row


class PacingWindow:
    """The stub's CPU and the machine's busy cores over the pacing: sampled at its start and
    `duration_s` later, from a timer in this process (the workers pace; this one waits).
    `stub_busy` is the busiest stub process's share of its core."""

    def __init__(self, stub_pids: list[int], duration_s: float) -> None:
        self.stub_pids, self.duration_s, self.samples = stub_pids, duration_s, []

    def start(self, t0: float) -> None:
        def sample_at(t: float) -> None:
            time.sleep(max(0.0, t - time.time()))
            self.samples.append((time.time(), [loadgen_stub.cpu_s(p) for p in self.stub_pids], _machine_busy_s()))

        self.threads = [threading.Thread(target=sample_at, args=(t,), daemon=True) for t in (t0, t0 + self.duration_s)]
        for th in self.threads:
            th.start()

    def result(self) -> dict:
        for th in self.threads:
            th.join()
        (ta, sa, ma), (tb, sb, mb) = sorted(self.samples)
        per_proc = [b - a for a, b in zip(sa, sb)]
        return {"stub_cpu_s": round(sum(per_proc), 2), "stub_busy": round(max(per_proc) / (tb - ta), 3),
                "machine_busy_cores": round((mb - ma) / (tb - ta), 2)}


def _machine_busy_s() -> float:
    """All cores' non-idle seconds so far (/proc/stat's first line less idle and iowait)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    return (sum(ticks[:8]) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def _measure_blast(port: int, items, n: int, workers: int, client: str, args, stub_pids: list[int]) -> dict:
    from benchmarks import blast

    packet_samples = int(round(args.chunk_ms * SAMPLE_RATE / 1000))
    num_packets = int(round(args.duration * 1000 / args.chunk_ms))
    cut = [_cut(it, num_packets * packet_samples) for it in items]
    window = PacingWindow(stub_pids, num_packets * args.chunk_ms / 1000)
    level, _ = blast.measure_level_blast(port, "ws", cut, n, num_packets, num_workers=workers, realtime=args.sender_fifo,
                                         max_send_lateness_ms=args.max_send_lateness_ms, on_start=window.start,
                                         packet_samples=packet_samples)  # fmt: skip
    stub = window.result()
    stub["stub_us_per_packet"] = round(1e6 * stub["stub_cpu_s"] / (n * window.duration_s * 1000 / args.chunk_ms), 1)
    packets = sum(x["packets"] for x in level["sender"])
    pacing_cpu = sum(x["pacing_cpu_s"] for x in level["sender"])
    all_in_cpu = pacing_cpu + sum(x["after_pacing_cpu_s"] for x in level["sender"])
    us, all_in_us = 1e6 * pacing_cpu / max(packets, 1), 1e6 * all_in_cpu / max(packets, 1)
    row = {"streams": n, "client": client, "num_workers": workers, "packets": packets,
           "packets_per_s": round(n * 1000 / args.chunk_ms), "loadgen_cpu_s": round(pacing_cpu, 2),
           "cpu_us_per_packet": round(us, 1), "sys_us_per_packet": round(1e6 * level["loadgen_sys_s"] / max(packets, 1), 1),
           "cpu_us_per_packet_all_in": round(all_in_us, 1), "send_lateness_ms": level["send_lateness_ms"],
           "late_workers": level["late_workers"], **stub, **loadgen_verdict(level, stub["stub_busy"], args.chunk_ms),
           "server_verdict": level["verdict"], "partial_latency_ms": level["partial_latency_ms"], "drift_ms_per_s": level["drift_ms_per_s"],
           "errors": level["errors"], "items_completed": level["items_completed"], "workers": level["workers"],
           "sender": level["sender"],
           "cores_for_5000_streams": round(TARGET_STREAMS * 1000 / args.chunk_ms * all_in_us / 1e6, 2)}  # fmt: skip
    print(f"N={n} blast x{workers}: {us:.1f} us CPU per packet pacing, {all_in_us:.1f} all in -> {row['cores_for_5000_streams']} "
          f"cores for 5,000 streams; stub {stub['stub_busy']:.0%} of a core, machine {stub['machine_busy_cores']} cores busy; "
          f"valid {row['valid']}, stub kept up {row['stub_kept_up']}, sustained {row['sustained']}; " + lateness_line(level), flush=True)  # fmt: skip
    return row


def _cut(item, num_samples: int):
    """blast sends every stream of an item the same frames: the items cut to one length."""
    import dataclasses

    if len(item.audio) < num_samples:
        raise SystemExit(f"--item-seconds too short for --duration: {len(item.audio)} < {num_samples} samples")
    return dataclasses.replace(item, audio=item.audio[:num_samples])


if __name__ == "__main__":
    main()
