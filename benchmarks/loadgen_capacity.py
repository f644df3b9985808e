"""The load generator's own capacity: CPU per paced packet and send lateness, against a stub server.

    python benchmarks/loadgen_capacity.py --levels 100,200,400 --workers 1 --chunk-ms 80 \
        --clients websockets,picows --out benchmarks/results/loadgen_capacity_clients_w1_cpu.json

Issue 48 wants a generator that drives 5,000 real-time streams at 80 ms from one 16-core host with
p99 send lateness under 10 ms. This measures the generator alone: a stub /ws server (one process,
uvloop) answers `ready` with --chunk-ms, reads every packet, sends one `partial` per packet (as the
engine does per chunk) and a `final` and `done` at `end`, so no model and no engine stand behind the
sockets. Per level: the generator's CPU seconds per packet sent (its workers' user + system time over
the packets, results received included), its send lateness (load_workers), and the cores that
5,000 streams would need at that cost (5,000 x 1000 / chunk_ms packets per second x CPU per packet).
On a small shared machine the stub and the generator share the cores: the per-packet CPU is the
figure to scale, the lateness says where this machine ran out. --clients runs each level once per
client (load_level.CLIENTS), one after the other against the same stub, so the clients' figures
come from one run on one machine state.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import SAMPLE_RATE, run_record, write_json  # noqa: E402
from benchmarks.load_items import make_items  # noqa: E402
from benchmarks.load_workers import lateness_line, measure_level  # noqa: E402
from benchmarks.server_process import free_port  # noqa: E402

TARGET_STREAMS = 5000


async def _stub_session(ws, chunk_ms: float) -> None:
    await ws.recv()  # config
    await ws.send(json.dumps({"type": "ready", "chunk_ms": chunk_ms}))
    samples, t_arrival = 0, time.time()
    async for msg in ws:
        if isinstance(msg, bytes):
            samples += len(msg) // 4
            t_arrival = time.time()
            processed = max(0.0, samples / SAMPLE_RATE - 0.01)
            await ws.send(json.dumps({"type": "partial", "text": "", "audio_processed": processed,
                                      "audio_arrival_time": t_arrival, "sent_time": time.time()}))  # fmt: skip
        elif json.loads(msg).get("type") == "end":
            await ws.send(json.dumps({"type": "final", "text": "", "token_ids": []}))
            await ws.send(json.dumps({"type": "done"}))
            return


def _stub_server(port: int, chunk_ms: float) -> None:
    import uvloop
    from websockets.asyncio.server import serve

    async def main() -> None:
        async with serve(lambda ws: _stub_session(ws, chunk_ms), "127.0.0.1", port, max_size=None, compression=None):
            await asyncio.Future()

    uvloop.run(main())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--levels", default="100,200,400")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--clients", default="websockets,picows", help="each level runs once per client, in this order")
    ap.add_argument("--chunk-ms", type=float, default=80.0)
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--item-seconds", default="6,8")
    ap.add_argument("--max-send-lateness-ms", type=float, default=10.0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    record = run_record()
    port = free_port()
    stub = mp.get_context("fork").Process(target=_stub_server, args=(port, args.chunk_ms), daemon=True)
    stub.start()
    time.sleep(1.0)
    items = make_items("synth", 8, tuple(float(x) for x in args.item_seconds.split(",")))
    levels = []
    try:
        for n in [int(x) for x in args.levels.split(",")]:
            for client in args.clients.split(","):
                levels.append(_measure(port, items, n, client, args))
    finally:
        stub.terminate()
    write_json(args.out, {"benchmark": "loadgen_capacity", **record, "chunk_ms": args.chunk_ms,
                          "workers": args.workers, "clients": args.clients.split(","), "duration_s": args.duration, "levels": levels})  # fmt: skip


def _measure(port: int, items, n: int, client: str, args) -> dict:
    level, _ = measure_level(f"ws://127.0.0.1:{port}/ws", items, n, args.duration, ramp_s=1.0, num_workers=args.workers,
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


if __name__ == "__main__":
    main()
