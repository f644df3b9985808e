"""What a flood of calls to an unknown gRPC method costs --fast-grpc-port's HTTP/2 (grpc_h2.py),
beside what a rapid-reset pair and a PING cost it: one H2Connection in this process, its frames
fed to data_received in one read, its writes to a transport that only counts them, every budget
lifted (so the flood is measured, not cut). Per frame or call: the server's CPU (process time of
data_received, µs), the bytes the client sends and the bytes answered, and the memory left after
(tracemalloc, bytes, after a gc pass) with the streams left open (none: each call is answered and closed at once).

    PYTHONPATH=. python benchmarks/h2_error_flood.py --out benchmarks/results/h2_error_flood_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import time
import tracemalloc
from types import SimpleNamespace

import hpack

from nemo_serve.server import h2_frames as h2
from nemo_serve.server.fast_grpc import FastGrpcServer
from nemo_serve.server.grpc_h2 import H2Connection

KNOWN = "/test.Echo/Stream"


class CountingTransport:
    """asyncio's transport as H2Connection uses it, keeping only the count of bytes written."""

    def __init__(self) -> None:
        self.written = 0

    def write(self, data: bytes) -> None:
        self.written += len(data)

    def is_closing(self) -> bool:
        return False

    def get_extra_info(self, name: str, default=None):
        return ("127.0.0.1", 1) if name == "peername" else default

    def close(self) -> None: ...

    abort = pause_reading = resume_reading = close


async def _echo(_, context) -> None:
    while await context.read() is not None:
        pass


def _headers(encoder: hpack.Encoder, sid: int, path: str) -> bytes:
    block = encoder.encode([(":method", "POST"), (":scheme", "http"), (":path", path), (":authority", "x"),
                            ("content-type", "application/grpc"), ("te", "trailers")])  # fmt: skip
    return h2.frame(h2.HEADERS, h2.END_HEADERS, sid, block)


def _wires(n: int) -> dict[str, tuple[bytes, int]]:
    """name -> (the frames after the preface, the number of calls or frames in them)."""
    unknown, reset = hpack.Encoder(), hpack.Encoder()
    return {
        "unknown_method_call": (b"".join(_headers(unknown, sid, "/test.Echo/Missing") for sid in range(1, 2 * n, 2)), n),
        "rapid_reset_pair": (b"".join(_headers(reset, sid, KNOWN) + h2.frame(h2.RST_STREAM, 0, sid, b"\0\0\0\x08")
                                      for sid in range(1, 2 * n, 2)), n),  # fmt: skip
        "ping": (h2.frame(h2.PING, 0, 0, b"flooding") * n, n),
    }


async def _measure(name: str, wire: bytes, n: int, traced: bool) -> dict:
    """One connection, one read of `wire`; `traced`: memory kept after (tracemalloc slows the read,
    so the CPU is taken from a run without it)."""
    settings = SimpleNamespace(max_message_bytes=1 << 20, header_timeout_s=5.0, ping_interval_s=0, ping_timeout_s=5.0)
    server = FastGrpcServer({KNOWN: (True, _echo, lambda b: b)}, settings)
    conn = H2Connection(server)
    transport = CountingTransport()
    conn.connection_made(transport)
    for budget in (conn.resets, conn.pings, conn.settings_frames, conn.error_streams):
        budget.max_per_s = 1 << 40
    conn.data_received(h2.PREFACE + h2.frame(h2.SETTINGS, 0, 0))
    await asyncio.sleep(0)
    before = transport.written
    if traced:
        tracemalloc.start()
    t0 = time.process_time()
    conn.data_received(wire)
    cpu_s = time.process_time() - t0
    for _ in range(4):  # the handlers of reset calls, cancelled, end; their done callbacks run
        await asyncio.sleep(0)
    gc.collect()  # a cancelled handler's exception and frames are a cycle, garbage, not kept
    kept = tracemalloc.get_traced_memory()[0] if traced else None
    tracemalloc.stop()
    assert not conn.going_away, f"{name}: the flood was cut"
    if conn.timer is not None:
        conn.timer.cancel()
    return {"count": n, "server_cpu_s": round(cpu_s, 4), "us_per": round(cpu_s / n * 1e6, 2),
            "bytes_in_per": round(len(wire) / n, 1), "bytes_out_per": round((transport.written - before) / n, 1),
            "streams_left": len(conn.streams), "memory_kept_bytes": kept}  # fmt: skip


async def _run(n: int, repeats: int) -> dict:
    out = {}
    for name, (wire, count) in _wires(n).items():
        runs = [await _measure(name, wire, count, traced=False) for _ in range(repeats)]
        best = min(runs, key=lambda r: r["us_per"])
        traced = await _measure(name, wire, count, traced=True)
        out[name] = {**best, "us_per_repeats": [r["us_per"] for r in runs], "memory_kept_bytes": traced["memory_kept_bytes"]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=20_000, help="calls (or frames) in the one read")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--notes", default="")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from benchmarks.common import run_record, write_json

    result = {"run": {**run_record(), "notes": args.notes}, "calls": args.calls, "repeats": args.repeats,
              "candidates": asyncio.run(_run(args.calls, args.repeats))}  # fmt: skip
    for name, r in result["candidates"].items():
        print(f"{name:>22}: {r['us_per']:6.2f} µs each (repeats {r['us_per_repeats']}), {r['bytes_in_per']} B in, "
              f"{r['bytes_out_per']} B out, {r['streams_left']} streams left, {r['memory_kept_bytes']} B kept")
    if args.out:
        write_json(args.out, result)


if __name__ == "__main__":
    main()
