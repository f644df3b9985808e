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

`--client blast` (benchmarks/blast.py) drives the same levels with a sender of a few µs per packet
(no asyncio; frames built once; one 2 ms pacer per process), so the levels the issue names can be
reached on a small machine: all N streams open first (the load generator's own opening steps), then
every stream sends one item of --settle-s + --window-s + 1 s from the same instant, spread over the
20 ms interval, and ends it; each item's tokens are compared with what /ws gave it with one stream
per item before the levels (the row's `quality`). Two more checks make a level valid with either
client: the front end's sockets hold at most MAX_UNREAD_PACKETS_PER_STREAM packets a stream unread
at the window's end (`ss`'s Recv-Q; else `frontend_behind`), and where load_workers.judge says the
server was behind while the front end read on time, the verdict is `core_behind` (the engine core
fell behind: still invalid, since the front end then rendered fewer results). On a machine shared
with other sessions, `--sender-fifo` and `--autogroup-nice` keep the sender on schedule and give
this session's processes the CPU ahead of the other sessions' (see set_autogroup_nice).

    python benchmarks/packet_cost_streams.py --client blast --workers 1 --sender-fifo --autogroup-nice -10 \
        --streams 256,512,1000 --out benchmarks/results/packet_cost_streams_blast_cpu.json

Paths: ws_uvicorn (/ws through --port), ws_picows (/ws through --fast-ws-port), realtime_picows
(/v1/realtime `input_audio_buffer.append`, base64 PCM16 in JSON, through --fast-ws-port; the load
generator's realtime streams are 16 kHz: no resampling, unlike packet_cost.py's 24 kHz path);
with `--client blast` only, realtime24k_uvicorn and realtime24k_picows (/v1/realtime at the OpenAI SDK's
shape: 20 ms appends of base64 PCM16 at 24 kHz, resampled by the server, through --port and
--fast-ws-port; their oracle is what that path gives each item with one stream per item, before the
levels, beside /ws's: blast_items), and grpc_fastgrpc and grpc_aio (Riva StreamingRecognize, 20 ms PCM16 per
request, interim results, through --fast-grpc-port and --grpc-port: benchmarks/blast_grpc.py, one
connection per stream; their oracle is /ws's final text as characters, Riva's results carrying no
token ids).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import blast, load_picows  # noqa: E402
from benchmarks.common import run_record, write_json  # noqa: E402
from benchmarks.frontend_bench import Server  # noqa: E402
from benchmarks.load_items import make_items  # noqa: E402
from benchmarks.load_realtime import on_pcm16_grid  # noqa: E402
from benchmarks.load_workers import lateness_line, measure_level  # noqa: E402
from benchmarks.server_process import cpu_s, free_port  # noqa: E402

PACKET_MS = 20.0
# A front end that keeps up has read nearly every byte at any instant: what arrived since its last
# wake-up. More than this many packets a stream unread at the window's end and it is behind.
MAX_UNREAD_PACKETS_PER_STREAM = 2
# path -> (load generator protocol, listener, route)
PATHS = {
    "ws_uvicorn": ("ws", "uvicorn", "/ws"),
    "ws_picows": ("ws", "picows", "/ws"),
    "realtime_picows": ("realtime", "picows", "/v1/realtime"),
    # /v1/realtime at the SDK's 24 kHz (blast only: the load generator's realtime streams are 16 kHz)
    "realtime24k_uvicorn": ("realtime24k", "uvicorn", "/v1/realtime"),
    "realtime24k_picows": ("realtime24k", "picows", "/v1/realtime"),
    # Riva StreamingRecognize, PCM16 (blast only: benchmarks/blast_grpc.py): our HTTP/2, grpc.aio
    "grpc_fastgrpc": ("grpc", "fastgrpc", "StreamingRecognize"),
    "grpc_aio": ("grpc", "grpcaio", "StreamingRecognize"),
}


def read_window(pids: list[int], port: int, start_at: float, window_s: float, box: dict,
                core_pids: tuple[int, ...] = ()) -> None:  # fmt: skip
    """The front end's CPU over [start_at, start_at + window_s] (a thread beside the generator),
    the engine core's beside it, and the bytes the front end's sockets on `port` held unread at
    each end."""
    time.sleep(max(0.0, start_at - time.time()))
    b0 = unread_bytes(port)
    k0, q0 = sum(cpu_s(p) for p in core_pids), sum(run_delay_s(p) for p in pids)
    c0, w0 = sum(cpu_s(p) for p in pids), time.time()
    time.sleep(window_s)
    box.update(cpu_s=sum(cpu_s(p) for p in pids) - c0, w0=w0, w1=time.time())
    box.update(core_cpu_s=sum(cpu_s(p) for p in core_pids) - k0, wait_s=sum(run_delay_s(p) for p in pids) - q0)
    box.update(unread_bytes_start=b0, unread_bytes_end=unread_bytes(port))


def run_delay_s(pid: int) -> float:
    """How long the process has waited, runnable, for a CPU (/proc/PID/schedstat's second field):
    a front end that falls behind while waiting here was short of CPU, not of work done."""
    return int(Path(f"/proc/{pid}/schedstat").read_text().split()[1]) / 1e9


def unread_bytes(port: int) -> int:
    """The kernel's receive queues of the server's connections on `port` (`ss`'s Recv-Q): the
    bytes the clients sent that the front end has not read yet. On loopback a client's own send
    queue empties as soon as the bytes land there, so this is where a front end that falls
    behind shows first (long before a send returns short)."""
    out = subprocess.run(["ss", "-tnH", "state", "established", f"( sport = :{port} )"], capture_output=True,
                         text=True, timeout=30).stdout  # fmt: skip
    return sum(int(line.split()[0]) for line in out.splitlines() if line.strip())


def measure(server: Server, fe_pids: list[int], idle_cores: float, path: str, n: int, args) -> dict:
    protocol, listener, route = PATHS[path]
    port = {"picows": server.fast_port, "fastgrpc": server.fast_grpc_port, "grpcaio": server.grpc_port}.get(listener, server.port)
    box: dict = {}
    threads: list[threading.Thread] = []

    def start_window(t0: float) -> None:  # t0: when the streams start (blast) or start to open (load_workers)
        threads.append(threading.Thread(target=read_window, args=(fe_pids, port, t0 + args.settle_s, args.window_s, box,
                                                                  getattr(args, "core_pids", ()))))  # fmt: skip
        threads[0].start()

    if args.client == "blast":
        items = args.blast_items
        if protocol == "grpc":  # Riva's finals carry text: the oracle is /ws's final characters (blast_items)
            items = [dataclasses.replace(it, oracle=args.blast_words.get(it.item_id)) for it in items]
        elif protocol in args.blast_oracles:  # resampled by the server: that path's own tokens at 8 streams
            items = [dataclasses.replace(it, oracle=args.blast_oracles[protocol].get(it.item_id)) for it in items]
        level, run = blast.measure_level_blast(port, protocol, items, n, args.blast_packets,
                                               num_workers=args.workers, context_right=args.context_right,
                                               max_send_lateness_ms=args.max_lateness_ms, realtime=args.sender_fifo,
                                               on_start=start_window, chunk_ms=args.chunk_ms)  # fmt: skip
    elif protocol not in ("ws", "realtime"):
        raise ValueError(f"{path} is for --client blast only")
    else:
        duration_s = args.ramp_s + args.settle_s + args.window_s
        items = make_items("synth", 8, seconds=(duration_s + 3, duration_s + 5))  # longer than the run: one item per lane
        start_window(time.time() + args.ramp_s)
        level, run = measure_level(f"ws://127.0.0.1:{port}{route}", items, n, duration_s, ramp_s=args.ramp_s,
                                   num_workers=args.workers, context_right=args.context_right, protocol=protocol,
                                   client="picows", max_send_lateness_ms=args.max_lateness_ms)  # fmt: skip
    threads[0].join()
    w0, w1 = box["w0"], box["w1"]
    packets = sum(w0 <= t < w1 for r in run.records for t in r.send_times)
    partials = sum(w0 <= p[0] < w1 for r in run.records for p in r.partials)
    busy = box["cpu_s"] - idle_cores * (w1 - w0)
    packet_bytes = args.packet_bytes[protocol]
    unread_end_packets = box["unread_bytes_end"] / packet_bytes
    read = packets - (box["unread_bytes_end"] - box["unread_bytes_start"]) / packet_bytes
    verdict = level["verdict"]
    front_end_on_time = unread_end_packets <= MAX_UNREAD_PACKETS_PER_STREAM * n
    if verdict == "keeps_up" and not front_end_on_time:
        verdict = "frontend_behind"
    elif verdict == "server_behind" and front_end_on_time:  # the front end read on time; results came late
        verdict = "core_behind"
    offered = n * (w1 - w0) / (PACKET_MS / 1000)
    row = {
        "path": path, "listener": listener, "streams": n, "packets_in_window": packets,
        "packets_offered_ratio": round(packets / offered, 3), "partials_in_window": partials,
        "frontend_cpu_s": round(box["cpu_s"], 3), "frontend_cpu_s_minus_idle": round(busy, 3),
        "window_s": round(w1 - w0, 3), "us_per_packet_all_in": round(1e6 * busy / max(packets, 1), 1),
        "loadgen_us_per_packet": round(1e6 * level["loadgen_cpu_s"] / max(sum(len(r.send_times) for r in run.records), 1), 1),
        "unread_bytes_start": box["unread_bytes_start"], "unread_bytes_end": box["unread_bytes_end"],
        "unread_packets_per_stream_end": round(unread_end_packets / n, 2), "packets_read_in_window": round(read),
        "us_per_packet_read": round(1e6 * busy / max(read, 1), 1),
        "core_cores_in_window": round(box["core_cpu_s"] / (w1 - w0), 3), "frontend_cores_in_window": round(box["cpu_s"] / (w1 - w0), 3),
        "frontend_waiting_for_cpu_in_window": round(box["wait_s"] / (w1 - w0), 3),
        "verdict": verdict, "valid": verdict == "keeps_up",
        "send_lateness_ms": level["send_lateness_ms"], "workers": level["workers"],
        "partial_latency_ms": level["partial_latency_ms"], "final_latency_ms": level["final_latency_ms"],
        "drift_ms_per_s": level["drift_ms_per_s"], "items_completed": level["items_completed"],
        "items_started": level["items_started"], "errors": level["errors"], "error_examples": level["error_examples"],
        "client": args.client, "quality": level["quality"], "sender": level.get("sender"),
    }  # fmt: skip
    print(f"{path:16s} N={n:5d} {row['us_per_packet_all_in']:6.1f} us/packet ({packets} packets, offered "
          f"{row['packets_offered_ratio']:.2f}, generator {row['loadgen_us_per_packet']} us/packet, unread at the end "
          f"{row['unread_packets_per_stream_end']} packets a stream) -> {row['verdict']}; "
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


def set_autogroup_nice(nice: int | None) -> str | None:
    """Linux shares the CPU between sessions (autogroups) before it looks at a process's nice, so
    on a machine where other sessions run jobs, this run's server and sender get one session's
    share (about 0.4 + 0.3 cores at 256 streams here, both always runnable) whatever their own
    nice. A negative autogroup nice puts this session ahead of the others (root only)."""
    path = Path("/proc/self/autogroup")
    if nice is None or not path.exists():
        return path.read_text().strip() if path.exists() else None
    try:
        path.write_text(str(nice))
    except OSError as e:
        return f"refused: {e!r}"
    return path.read_text().strip()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="builtin:tiny-hybrid")
    p.add_argument("--context-right", type=int, default=13)
    p.add_argument("--streams", default="32,128,256,512", help="streams per front end, comma-separated levels")
    p.add_argument("--paths", default=",".join(PATHS))
    p.add_argument("--client", choices=("picows", "blast"), default="picows",
                   help="picows: the load generator (load_workers.py); blast: benchmarks/blast.py's cheap sender")
    p.add_argument("--sender-fifo", action="store_true", help="blast: the sender at SCHED_FIFO (a shared machine)")
    p.add_argument("--pin", action="store_true", help="front end on CPU 0; engine core and sender on CPU 1")
    p.add_argument("--autogroup-nice", type=int, default=None,
                   help="this session's scheduler autogroup (the server, the sender, this process) at this nice")
    p.add_argument("--workers", type=int, default=2, help="load generator (or blast sender) processes")
    p.add_argument("--ramp-s", type=float, default=3.0)
    p.add_argument("--settle-s", type=float, default=2.0)
    p.add_argument("--window-s", type=float, default=6.0)
    p.add_argument("--max-lateness-ms", type=float, default=10.0, help="generator p99 lateness bound (issue 48)")
    p.add_argument("--tree", default=None, help="run the server from this source tree (a checkout of another "
                   "commit: the before of a before/after pair, run one after the other; default: this one)")
    p.add_argument("--notes", default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    load_picows.WS_PACKET_MS = PACKET_MS  # before the workers fork
    one = np.zeros(blast.PACKET_SAMPLES, np.float32)  # a frame's length: the same for every packet of a protocol
    protocols = {"ws", "realtime"} | {PATHS[p][0] for p in args.paths.split(",")}
    grpc = "grpc" in protocols
    args.packet_bytes = {proto: len(blast.packet_frames(one, proto, 1)[0]) for proto in protocols}
    record = run_record() | {"notes": args.notes, "autogroup": set_autogroup_nice(args.autogroup_nice),
                             "server_tree_commit": _tree_commit(args.tree)}  # at the start: the code that runs, not what is there at the end
    levels = [int(n) for n in args.streams.split(",")]
    fast_port, grpc_ports = free_port(), (free_port(), free_port()) if grpc else (None, None)
    log_path = Path(tempfile.gettempdir()) / "packet_cost_streams.server.log"  # not a result: not beside --out
    if args.tree:  # `python -m` in the tree puts it first on sys.path; its server's processes too
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [args.tree, os.environ.get("PYTHONPATH")]))
    grpc_args = ("--grpc-port", str(grpc_ports[0]), "--fast-grpc-port", str(grpc_ports[1])) if grpc else ()
    server = Server(args.model, args.context_right, 1, max(levels) + 16, log_path,
                    extra_args=("--fast-ws-port", str(fast_port), *grpc_args), cwd=args.tree)  # fmt: skip
    server.fast_port, (server.grpc_port, server.fast_grpc_port) = fast_port, grpc_ports
    rows = []
    try:
        server.wait_ready()
        roles = server.roles()
        fe_pids, args.core_pids = roles["frontends"], tuple(roles["others"])
        if args.pin:  # the front end on one core; the engine core and this process (the sender's parent) on the other
            for pid in fe_pids:
                os.sched_setaffinity(pid, {0})
            for pid in (*args.core_pids, os.getpid()):
                os.sched_setaffinity(pid, {1})
        time.sleep(2)
        idle = idle_rate(fe_pids, 3.0)
        reference = blast_items(server, args) if args.client == "blast" else None
        for n in levels:
            for path in args.paths.split(","):
                rows.append(measure_or_error(server, fe_pids, idle, path, n, args))
                if args.out:  # after every row: a later level that breaks the run loses nothing before it
                    write_json(args.out, {"run": record, "model": args.model, "context_right": args.context_right,
                                          "packet_ms": PACKET_MS, "target_us_per_packet": 25,
                                          "idle_frontend_cores": round(idle, 4), "rows": rows, "reference": reference,
                                          "settings": {k: v for k, v in vars(args).items() if k not in ("notes", "out", "blast_items", "packet_bytes", "blast_words", "blast_oracles")}})  # fmt: skip
                wait_streams_closed(server)
    finally:
        server.stop()


def _tree_commit(tree: str | None) -> str | None:
    """--tree's commit (None: the server runs from this tree, whose commit run_record has)."""
    if tree is None:
        return None
    out = subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or None


def blast_items(server: Server, args) -> dict:
    """The blast sender's items: 8 synth clips cut to one length (the run and a second more), on the
    PCM16 grid so /ws float32 and /v1/realtime PCM16 carry the same samples; each item's tokens
    (its oracle here) are what /ws gives it with 8 streams, one per item, before the levels."""
    seconds = args.settle_s + args.window_s + 1.0
    num_packets = int(round(seconds * 1000 / PACKET_MS))
    items = make_items("synth", 8, seconds=(seconds + 1, seconds + 2))
    for it in items:
        it.audio = on_pcm16_grid(it.audio[: num_packets * blast.PACKET_SAMPLES])
    args.blast_items, args.blast_packets = items, num_packets
    level, run = blast.measure_level_blast(server.fast_port, "ws", items, len(items), num_packets,
                                           context_right=args.context_right, realtime=args.sender_fifo)  # fmt: skip
    by_item = {r.item_id: r.token_ids for r in run.records if r.error is None}
    for it in items:
        it.oracle = by_item.get(it.item_id)
    # gRPC's oracle: the same finals' characters (Riva's results carry text, no token ids: blast_grpc.py); its chunk
    from benchmarks.blast_grpc import characters

    args.blast_words = {r.item_id: characters(" ".join(f["text"] for f in r.finals)) for r in run.records if r.error is None}
    args.chunk_ms = run.chunk_ms
    print(f"reference: {len(by_item)} items, {sum(map(len, by_item.values()))} tokens, {level['verdict']}", flush=True)
    reference = {"streams": len(items), "verdict": level["verdict"], "tokens_per_item": {k: len(v) for k, v in by_item.items()},
                 "seconds_per_item": num_packets * PACKET_MS / 1000}  # fmt: skip
    args.blast_oracles = {}
    if any(PATHS[p][0] == "realtime24k" for p in args.paths.split(",")):
        reference["realtime24k"] = resampled_reference(server, items, num_packets, by_item, args)
    return reference


def resampled_reference(server: Server, items: list, num_packets: int, ws_tokens: dict, args) -> dict:
    """/v1/realtime at 24 kHz's tokens for each item, one stream per item through --fast-ws-port:
    the oracle of its levels (the server's resampler stands between the items and the model, so its
    tokens need not be /ws's at 16 kHz); how many of them equal /ws's is kept beside."""
    level, run = blast.measure_level_blast(server.fast_port, "realtime24k", items, len(items), num_packets,
                                           context_right=args.context_right, realtime=args.sender_fifo)  # fmt: skip
    tokens = {r.item_id: r.token_ids for r in run.records if r.error is None}
    args.blast_oracles["realtime24k"] = tokens
    same = sum(tokens[k] == ws_tokens.get(k) for k in tokens)
    print(f"reference at 24 kHz: {len(tokens)} items, {same} equal to /ws's, {level['verdict']}", flush=True)
    return {"verdict": level["verdict"], "tokens_per_item": {k: len(v) for k, v in tokens.items()},
            "items_equal_to_ws": same}


def measure_or_error(server: Server, fe_pids: list[int], idle_cores: float, path: str, n: int, args) -> dict:
    """A level whose load generator broke is kept as an invalid row with the error, not a crash."""
    try:
        return measure(server, fe_pids, idle_cores, path, n, args)
    except Exception as e:  # noqa: BLE001 - any failure of the generator's processes
        print(f"{path:16s} N={n:5d} failed: {e!r}", flush=True)
        return {"path": path, "streams": n, "verdict": "error", "valid": False, "error": repr(e)[:300]}


if __name__ == "__main__":
    main()
