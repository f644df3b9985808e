"""Front-end CPU per paced 20 ms packet against streams per front end (issue 48, item 2).

    python benchmarks/packet_cost_streams.py --streams 32,128,256,512 --out benchmarks/results/packet_cost_streams_cpu.json

Why a second benchmark beside packet_cost.py: issue 48's 25 µs target is stated at 1,000 or more
paced streams per front end, where one epoll wake-up of the front end returns many ready sockets;
at 32 streams nearly every packet is its own wake-up. packet_cost.py's client is one asyncio
process that falls behind long before that (its 160-stream run did). Here the load generator is
the project's own (load_workers.py: forked worker processes, one pacer each, the picows client),
which reports each packet's lateness against the real-time schedule.

One real server (one front end, `--fast-ws-port`; builtin:tiny-hybrid at its 1120 ms mode by
default, so the engine core keeps up for little CPU and the figure is the front end's). Per level
and path, N streams each send ONE item longer than the run, 20 ms per packet: they open over
--ramp-s, then after --settle-s the front end's CPU (utime + stime from /proc, its idle rate
subtracted) is read over --window-s and divided by the packets the generator sent inside that
window (its own send times); every result message of the window is inside the CPU. No stream opens
or closes in the window.

A level is counted only when it is valid: the generator's p99 lateness within --max-lateness-ms in
every worker (else `generator_late`), and the server kept up by the load generator's own rule
(load_workers.judge: p95 partial latency within two chunks, no drift, every item completed, no
error; /v1/realtime: every `completed` within two chunks of its commit). Anything else is kept in
the JSON with its verdict and left out of the figures.

Paths: ws_uvicorn (/ws through --port), ws_picows (/ws through --fast-ws-port), realtime_picows
(/v1/realtime `input_audio_buffer.append`, base64 PCM16 in JSON, through --fast-ws-port; the load
generator's realtime streams are 16 kHz: no resampling, unlike packet_cost.py's 24 kHz path).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import load_picows  # noqa: E402
from benchmarks.common import run_record, write_json  # noqa: E402
from benchmarks.frontend_bench import Server  # noqa: E402
from benchmarks.load_items import make_items  # noqa: E402
from benchmarks.load_workers import lateness_line, measure_level  # noqa: E402
from benchmarks.server_process import cpu_s, free_port  # noqa: E402

PACKET_MS = 20.0
# path -> (load generator protocol, listener, route)
PATHS = {
    "ws_uvicorn": ("ws", "uvicorn", "/ws"),
    "ws_picows": ("ws", "picows", "/ws"),
    "realtime_picows": ("realtime", "picows", "/v1/realtime"),
}


def read_window(pids: list[int], start_at: float, window_s: float, box: dict) -> None:
    """The front end's CPU over [start_at, start_at + window_s] (a thread beside the generator)."""
    time.sleep(max(0.0, start_at - time.time()))
    c0, w0 = sum(cpu_s(p) for p in pids), time.time()
    time.sleep(window_s)
    box.update(cpu_s=sum(cpu_s(p) for p in pids) - c0, w0=w0, w1=time.time())


def measure(server: Server, fe_pids: list[int], idle_cores: float, path: str, n: int, args) -> dict:
    protocol, listener, route = PATHS[path]
    port = server.fast_port if listener == "picows" else server.port
    duration_s = args.ramp_s + args.settle_s + args.window_s
    items = make_items("synth", 8, seconds=(duration_s + 3, duration_s + 5))  # longer than the run: one item per lane
    box: dict = {}
    reader = threading.Thread(target=read_window,
                              args=(fe_pids, time.time() + args.ramp_s + args.settle_s, args.window_s, box))  # fmt: skip
    reader.start()
    level, run = measure_level(f"ws://127.0.0.1:{port}{route}", items, n, duration_s, ramp_s=args.ramp_s,
                               num_workers=args.workers, context_right=args.context_right, protocol=protocol,
                               client="picows", max_send_lateness_ms=args.max_lateness_ms)  # fmt: skip
    reader.join()
    w0, w1 = box["w0"], box["w1"]
    packets = sum(w0 <= t < w1 for r in run.records for t in r.send_times)
    partials = sum(w0 <= p[0] < w1 for r in run.records for p in r.partials)
    busy = box["cpu_s"] - idle_cores * (w1 - w0)
    offered = n * (w1 - w0) / (PACKET_MS / 1000)
    row = {
        "path": path, "listener": listener, "streams": n, "packets_in_window": packets,
        "packets_offered_ratio": round(packets / offered, 3), "partials_in_window": partials,
        "frontend_cpu_s": round(box["cpu_s"], 3), "frontend_cpu_s_minus_idle": round(busy, 3),
        "window_s": round(w1 - w0, 3), "us_per_packet_all_in": round(1e6 * busy / max(packets, 1), 1),
        "loadgen_us_per_packet": round(1e6 * level["loadgen_cpu_s"] / max(sum(len(r.send_times) for r in run.records), 1), 1),
        "verdict": level["verdict"], "valid": level["verdict"] == "keeps_up",
        "send_lateness_ms": level["send_lateness_ms"], "workers": level["workers"],
        "partial_latency_ms": level["partial_latency_ms"], "final_latency_ms": level["final_latency_ms"],
        "drift_ms_per_s": level["drift_ms_per_s"], "items_completed": level["items_completed"],
        "items_started": level["items_started"], "errors": level["errors"], "error_examples": level["error_examples"],
    }  # fmt: skip
    print(f"{path:16s} N={n:5d} {row['us_per_packet_all_in']:6.1f} us/packet ({packets} packets, offered "
          f"{row['packets_offered_ratio']:.2f}, generator {row['loadgen_us_per_packet']} us/packet) -> {row['verdict']}; "
          f"{lateness_line(level)}", flush=True)  # fmt: skip
    return row


def wait_streams_closed(server: Server, timeout_s: float = 60.0) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            if not server.readyz()["open_streams"]:
                return
        except OSError:  # /readyz slow on a loaded machine: ask again
            pass
        time.sleep(0.2)


def idle_rate(pids: list[int], seconds: float) -> float:
    c0, w0 = sum(cpu_s(p) for p in pids), time.time()
    time.sleep(seconds)
    return (sum(cpu_s(p) for p in pids) - c0) / (time.time() - w0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="builtin:tiny-hybrid")
    p.add_argument("--context-right", type=int, default=13)
    p.add_argument("--streams", default="32,128,256,512", help="streams per front end, comma-separated levels")
    p.add_argument("--paths", default=",".join(PATHS))
    p.add_argument("--workers", type=int, default=2, help="load generator processes")
    p.add_argument("--ramp-s", type=float, default=3.0)
    p.add_argument("--settle-s", type=float, default=2.0)
    p.add_argument("--window-s", type=float, default=6.0)
    p.add_argument("--max-lateness-ms", type=float, default=10.0, help="generator p99 lateness bound (issue 48)")
    p.add_argument("--notes", default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    load_picows.WS_PACKET_MS = PACKET_MS  # before the workers fork
    record = run_record() | {"notes": args.notes}  # at the start: the code that runs, not what is there at the end
    levels = [int(n) for n in args.streams.split(",")]
    fast_port = free_port()
    log_path = Path(tempfile.gettempdir()) / "packet_cost_streams.server.log"  # not a result: not beside --out
    server = Server(args.model, args.context_right, 1, max(levels) + 16, log_path,
                    extra_args=("--fast-ws-port", str(fast_port)))  # fmt: skip
    server.fast_port = fast_port
    rows = []
    try:
        server.wait_ready()
        fe_pids = server.roles()["frontends"]
        time.sleep(2)
        idle = idle_rate(fe_pids, 3.0)
        for n in levels:
            for path in args.paths.split(","):
                rows.append(measure_or_error(server, fe_pids, idle, path, n, args))
                if args.out:  # after every row: a later level that breaks the run loses nothing before it
                    write_json(args.out, {"run": record, "model": args.model, "context_right": args.context_right,
                                          "packet_ms": PACKET_MS, "target_us_per_packet": 25,
                                          "idle_frontend_cores": round(idle, 4), "rows": rows,
                                          "settings": {k: v for k, v in vars(args).items() if k not in ("notes", "out")}})  # fmt: skip
                wait_streams_closed(server)
    finally:
        server.stop()


def measure_or_error(server: Server, fe_pids: list[int], idle_cores: float, path: str, n: int, args) -> dict:
    """A level whose load generator broke is kept as an invalid row with the error, not a crash."""
    try:
        return measure(server, fe_pids, idle_cores, path, n, args)
    except Exception as e:  # noqa: BLE001 - any failure of the generator's processes
        print(f"{path:16s} N={n:5d} failed: {e!r}", flush=True)
        return {"path": path, "streams": n, "verdict": "error", "valid": False, "error": repr(e)[:300]}


if __name__ == "__main__":
    main()
