"""Front-end CPU per paced packet, results included, on every streaming path (issue 48, steps 1-3).

    python benchmarks/packet_cost.py --profile --out benchmarks/results/packet_cost_cpu.json

A real multi-process nemo-serve (`--frontends K --grpc-port`, the demo model by default) and real
sockets. For each path, N streams send packets at real-time pace for --seconds; the front ends'
CPU (utime + stime from /proc, all threads, their idle rate subtracted) over that window divided by
the packets sent is the figure: every result message that came back in the window is inside it.

  ws_s16_100ms / ws_f32_100ms / ws_s16_20ms / ws_f32_20ms   /ws, one binary frame per packet, 16 kHz
  realtime_24k_20ms          /v1/realtime input_audio_buffer.append (JSON + base64 PCM16, 24 kHz:
                             resampled to 16 kHz), server VAD on (the SDK's guide flow)
  realtime_24k_20ms_novad    the same with turn_detection null (NIM's flow)
  grpc_100ms / grpc_20ms     Riva StreamingRecognize, audio_content PCM16 at 16 kHz, interim results
  *_fast                     (--fast-ws) a WebSocket path through --fast-ws-port: picows, not uvicorn
  *_fastgrpc                 (--fast-grpc) a gRPC path through --fast-grpc-port: our HTTP/2, not grpc.aio

With --profile each path runs a second time under py-spy (sampling, --nonblocking: the front end
is never stopped) and the samples are sorted two ways: by phase (which task of the front end was
running: packet in, result out, ring positions, event loop) and by component (the innermost frame
that is ours or a named library: WebSocket frames, ASGI, JSON, base64, decode and resample, ring
write, ZMQ, gRPC, VAD); each share times the measured µs per packet gives µs per packet.

Clients: one asyncio process, frames built and masked once (no per-packet client work but the
write), gRPC through grpc.aio. On a 2-core machine the client, the engine core and the front end
share the cores; the JSON records the client's CPU and how many pacer ticks ran more than a packet
late (those packets arrive in bursts, which are cheaper per packet). --frontends 1,4 runs each path
with K front ends and K x N streams (scaling with cores: only meaningful where there are cores to
spare). --tree LABEL=PATH (twice) runs a before/after pair side by side, alternated path by path;
--tree-env LABEL=NAME=VALUE starts that tree's server with an environment switch (the same tree
twice, one switch apart: e.g. NEMO_SERVE_RING_POSITIONS=messages against shared).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import run_record, write_json  # noqa: E402
from benchmarks.frontend_bench import Server  # noqa: E402
from benchmarks.packet_clients import FAST, FAST_GRPC, PATHS, RATE, open_streams, speech, wire_packets  # noqa: E402
from benchmarks.raw_ws import send_spread  # noqa: E402
from benchmarks.server_process import cpu_s, free_port  # noqa: E402
from benchmarks.packet_profile import categorize, plot  # noqa: E402


async def paced(path: str, ports: tuple[int, int], n: int, seconds: float, packets: list, fe_pids: list[int],
                settle_s: float = 1.0, core_pids: tuple[int, ...] = ()) -> dict:  # fmt: skip
    """N streams of `path` at real-time pace for `seconds`: front-end CPU over the window / packets.
    The streams' packets are spread over each packet interval (raw_ws.send_spread), as
    independent clients' would be: all N in one burst would let the front end take many packets
    per event-loop tick, which real clients do not give it."""
    packet_s = PATHS[path][2]
    conns = await open_streams(path, *ports, n)
    offsets = [i * len(packets) // n for i in range(n)]
    for c, off in zip(conns, offsets):  # opens the engine stream where the first audio does (realtime)
        c.write(packets[off])
    await asyncio.sleep(settle_s)  # the opens' own work out of the window
    c0, w0, me0 = sum(cpu_s(p) for p in fe_pids), time.time(), time.process_time()
    k0 = sum(cpu_s(p) for p in core_pids)  # the engine core's side of the same window
    sent, late = await send_spread(n, seconds, packet_s,
                                   lambda i, tick: conns[i].write(packets[(offsets[i] + 1 + tick) % len(packets)]))  # fmt: skip
    await asyncio.sleep(packet_s)  # the last packets' own work
    c1, w1, me1 = sum(cpu_s(p) for p in fe_pids), time.time(), time.process_time()
    k1 = sum(cpu_s(p) for p in core_pids)
    counts: Counter = Counter()
    for c in conns:
        counts.update(c.counts)
        c.close()
    await asyncio.sleep(0.5)
    return {
        "path": path, "streams": n, "packets": sent, "messages_received": dict(counts),
        "frontend_cpu_s": round(c1 - c0, 4), "core_cpu_s": round(k1 - k0, 4), "wall_s": round(w1 - w0, 3), "client_cpu_s": round(me1 - me0, 3),
        "ticks_late_by_over_one_packet": late, "errors": [c.error for c in conns if c.error][:3],
    }  # fmt: skip


class Target:
    """One server (K front ends) started from source tree `tree`, with --grpc-port."""

    def __init__(self, k: int, label: str, tree: str, args, out_dir: Path) -> None:
        self.label, self.tree, self.grpc_port = label, tree, free_port()
        self.fast_port = free_port() if args.fast_ws else None
        fast_args = ("--fast-ws-port", str(self.fast_port)) if args.fast_ws else ()
        fast_grpc = getattr(args, "fast_grpc", False)  # frontend_gc.py's args have none
        self.fast_grpc_port = free_port() if fast_grpc else None
        fast_args += ("--fast-grpc-port", str(self.fast_grpc_port)) if fast_grpc else ()
        # The server's processes import nemo_serve from `tree` (a copy of another commit: the
        # "before" of a before/after pair, run side by side with this one): `python -m` puts its
        # working directory first on sys.path, so the server runs there, PYTHONPATH as well.
        saved = os.environ.get("PYTHONPATH")
        saved_env = {name: os.environ.get(name) for name in args.env_of.get(label, {})}
        os.environ.update(args.env_of.get(label, {}))  # inherited by the server's processes
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [tree, saved]))  # tree first; packages after
        try:
            self.server = Server(str(Path(args.model).resolve()), args.context_right, k, k * args.streams + 16,
                                 out_dir.resolve() / f"packet_cost_{label}_k{k}.server.log",
                                 extra_args=("--grpc-port", str(self.grpc_port), *fast_args), cwd=tree)  # fmt: skip
        finally:
            for name, value in {**saved_env, "PYTHONPATH": saved}.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value

    def ready(self, idle_s: float) -> None:
        self.server.wait_ready()
        roles = self.server.roles()
        self.fe_pids, self.core_pids = roles["frontends"], tuple(roles["others"])
        time.sleep(2)
        self.idle_cores = idle_rate(self.fe_pids, idle_s)


def measure(path: str, t: Target, args, idle_cores: float, x_by_rate: dict) -> dict:
    packets = wire_packets(path, x_by_rate)
    n = args.streams * len(t.fe_pids)
    port = t.fast_port if path.endswith(FAST) else t.server.port
    grpc_port = t.fast_grpc_port if path.endswith(FAST_GRPC) else t.grpc_port
    r = asyncio.run(paced(path, (port, grpc_port), n, args.seconds, packets, t.fe_pids, core_pids=t.core_pids))
    deadline = time.time() + 60  # the closed streams' slots back before the next run opens its own
    while time.time() < deadline:
        try:
            if not t.server.readyz()["open_streams"]:
                break
        except OSError:  # /readyz slow to answer on a loaded machine: ask again
            pass
        time.sleep(0.2)
    busy = r["frontend_cpu_s"] - idle_cores * r["wall_s"]
    r["frontend_cpu_s_minus_idle"] = round(busy, 4)
    r["results_per_packet"] = round(sum(r["messages_received"].values()) / max(r["packets"], 1), 3)
    r["us_per_packet_all_in"] = round(1e6 * busy / max(r["packets"], 1), 1)
    # The engine core's CPU per packet, not less its idle rate: its polling while audio flows is
    # part of what a way of publishing ring positions costs (core/shared.py).
    r["core_us_per_packet"] = round(1e6 * r["core_cpu_s"] / max(r["packets"], 1), 1)
    print(f"{t.label:8s} {path:26s} {r['packets']:7d} packets {sum(r['messages_received'].values()):6d} messages  "
          f"{r['us_per_packet_all_in']:7.1f} us/packet all in, core {r['core_us_per_packet']:6.1f}  (client {r['client_cpu_s']:.2f} s CPU, "
          f"late ticks {r['ticks_late_by_over_one_packet']})", flush=True)  # fmt: skip
    return r


def profile(path: str, t: Target, args, x_by_rate: dict, raw_dir: Path) -> dict:
    """The same run under py-spy (one front end: the first): samples by phase and by component."""
    raw = raw_dir / f"{t.label}_{path}.pyspy.txt"
    spy = subprocess.Popen(
        [str(Path(sys.executable).with_name("py-spy")), "record", "--pid", str(t.fe_pids[0]), "--rate", "500",
         "--nonblocking", "--format", "raw", "--output", str(raw), "--duration", str(int(args.seconds + 4))],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    time.sleep(0.5)
    try:
        r = measure(path, t, args, t.idle_cores, x_by_rate)
    finally:
        spy.wait(60)
    out = categorize(raw.read_text())
    out["us_per_packet_all_in_under_py_spy"] = r["us_per_packet_all_in"]
    return out


def idle_rate(pids: list[int], seconds: float) -> float:
    c0, w0 = sum(cpu_s(p) for p in pids), time.time()
    time.sleep(seconds)
    return (sum(cpu_s(p) for p in pids) - c0) / (time.time() - w0)


def run_k(k: int, trees: list[tuple[str, str]], args, x_by_rate: dict, out_dir: Path) -> dict:
    """Every path through one server per tree, paths and trees alternated repeat by repeat (this
    machine's load drifts: side by side is the only fair comparison)."""
    targets = [Target(k, label, tree, args, out_dir) for label, tree in trees]
    try:
        for t in targets:
            t.ready(args.idle_s)
        rows: dict = {t.label: {} for t in targets}
        paths = args.paths.split(",")
        for rep in range(args.repeats):  # paths and trees alternated repeat by repeat: side by side
            for path in paths if rep % 2 == 0 else paths[::-1]:
                for t in targets if rep % 2 == 0 else targets[::-1]:
                    rows[t.label].setdefault(path, {"repeats": []})["repeats"].append(
                        measure(path, t, args, t.idle_cores, x_by_rate))
        for path in paths:
            for t in targets:
                row = rows[t.label][path]
                row["us_per_packet_all_in"] = float(np.median([r["us_per_packet_all_in"] for r in row["repeats"]]))
                if args.profile and k == 1:
                    row["profile"] = profile(path, t, args, x_by_rate, out_dir)
                    for table in ("by_phase", "by_component"):
                        row["profile"][table + "_us_per_packet"] = {
                            name: round(share * row["us_per_packet_all_in"], 1)
                            for name, share in row["profile"][table].items()
                        }  # fmt: skip
        return {"frontends": k, "trees": [
            {"tree": t.label, "tree_path": t.tree, "tree_commit": _commit(t.tree), "command": " ".join(t.server.command),
             "environment": args.env_of.get(t.label, {}),
             "idle_frontend_cores": round(t.idle_cores, 4), "paths": rows[t.label]} for t in targets]}  # fmt: skip
    finally:
        for t in targets:
            t.server.stop()


def _commit(tree: str) -> str | None:
    try:
        return subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="nemo_serve/assets/demo/demo.nemo")
    p.add_argument("--context-right", type=int, default=3)
    p.add_argument("--streams", type=int, default=32, help="paced streams per front end")
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--idle-s", type=float, default=3.0)
    p.add_argument("--paths", default=",".join(PATHS))
    p.add_argument("--frontends", default="1", help="K front ends, comma-separated (K x --streams streams each run)")
    p.add_argument("--profile", action="store_true", help="a second run of each path under py-spy (K=1 only)")
    p.add_argument("--audio", default="nemo_serve/assets/demo/utterances/manifest.jsonl")
    p.add_argument("--tree", action="append", default=None, metavar="LABEL=PATH",
                   help="run the server from this source tree (repeat for before/after side by side, alternated "
                        "path by path); default: this checkout")  # fmt: skip
    p.add_argument("--tree-env", action="append", default=[], metavar="LABEL=NAME=VALUE",
                   help="an environment variable for that tree's server (repeatable)")
    p.add_argument("--repeats", type=int, default=1, help="runs of each path on each tree (the median is kept)")
    p.add_argument("--fast-ws", action="store_true", help="start the server with --fast-ws-port (the *_fast paths)")
    p.add_argument("--fast-grpc", action="store_true", help="start the server with --fast-grpc-port (the *_fastgrpc paths)")
    p.add_argument("--notes", default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    args.env_of = {}
    for item in args.tree_env:
        label, name, value = item.split("=", 2)
        args.env_of.setdefault(label, {})[name] = value
    record = run_record()
    record["notes"] = args.notes
    out_dir = Path(args.out).parent if args.out else Path("/tmp")
    out_dir.mkdir(parents=True, exist_ok=True)
    x = speech(args.audio, RATE)
    x_by_rate = {RATE: x, 24000: speech(args.audio, 24000)}
    trees = [t.split("=", 1) for t in args.tree or [f"this={Path(__file__).resolve().parent.parent}"]]
    trees = [(label, str(Path(tree).resolve())) for label, tree in trees]
    runs = [run_k(int(k), trees, args, x_by_rate, out_dir) for k in args.frontends.split(",")]
    result = {"run": record, "model": args.model, "context_right": args.context_right,
              "streams_per_frontend": args.streams, "seconds": args.seconds, "target_us_per_packet": 25,
              "runs": runs}  # fmt: skip
    if args.out:
        write_json(args.out, result)
        plot(result, Path(args.out).with_suffix(".png"))


if __name__ == "__main__":
    main()
