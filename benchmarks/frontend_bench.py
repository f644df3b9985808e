"""Front-end host cost (issue 12, point 4 b and c): a real multi-process nemo-serve, driven by a
raw WebSocket client.

    python benchmarks/frontend_bench.py --out benchmarks/results/host_frontend_cpu.json
    (or through host_bench.py --frontend, which puts the figures next to the core's)

(b) CPU per audio packet and per result message of ONE front-end process: `nemo-serve
    --frontends 1`, N streams paced at real time, 100 ms pcm_s16le packets (3,200 bytes) over
    /ws. The front end's CPU time comes from /proc/<pid>/stat (utime + stime, all its threads);
    its pid is the one /readyz reports (the answering process). Its idle rate, measured first with
    no client, is subtracted. Two runs, one with speech (results flow) and one with digital
    silence (few results), give C = a * packets + b * results; `a` and `b` are solved from the two.
    The all-in figure (front-end CPU / packets, results included) is reported too.
(c) packets per second through 1 and 2 front-end processes: the same number of connections,
    each writing 100 ms packets as fast as TCP lets it (no pacing; 10 packets per write, waits for
    the socket to drain). The rate is taken over the middle of the run from the client's count of
    packets written: with full socket buffers, what is written is what the server reads. The
    model is builtin:tiny-hybrid (random weights, 2 x 64) at its 1120 ms mode, so the engine core
    keeps up with the audio for little CPU: the figure is the front ends'.

The client is one Python process with pre-built, pre-masked frames (no per-packet encoding or
masking work), so it needs far less CPU than the server does for the same packets; it reads and
counts every message the server sends. On this 2-core machine the client, the engine core and
the front ends share the cores (no pinning unless --taskset-* is given): the JSON records each
process's CPU over the measured window, so the sharing is visible.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import run_record, write_json  # noqa: E402
from benchmarks.raw_ws import CONFIG, PACKET_S, SAMPLE_RATE, Conn, open_all, packets_of, text_frame  # noqa: E402
from benchmarks.server_process import ServerProcess, children, cpu_s, free_port  # noqa: E402


# ----------------------------------------------------------------------------- the server


class Server(ServerProcess):
    stop_grace_s = 60.0

    def __init__(self, model: str, context_right: int, frontends: int, num_slots: int, log_path: Path,
                 taskset: str | None = None, extra_args: tuple[str, ...] = (), cwd: str | None = None) -> None:  # fmt: skip
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [
            sys.executable, "-m", "nemo_serve.cli", "--model", model, "--context-right", str(context_right),
            "--frontends", str(frontends), "--num-slots", str(num_slots), "--port", str(self.port),
            "--log-level", "warning", "--idle-timeout-s", "120", "--max-connections-per-ip", "1024",
            "--max-queue-delay-s", "0",  # the core may fall behind on 2 CPUs; streams must still reopen
            *extra_args,
        ]  # fmt: skip
        if taskset:
            command = ["taskset", "-c", taskset, *command]
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE")
        # cwd: `python -m` puts it first on sys.path, so it decides which nemo_serve runs
        self._launch(command, env, log_path, cwd=cwd)
        self.frontends = frontends

    def roles(self) -> dict:
        """Front-end pids (as /readyz reports them: new connections land on each in turn) and
        the core's (the supervisor's other child)."""
        fes: set[int] = set()
        for _ in range(200):
            fes.add(int(self.readyz()["pid"]))
            if len(fes) == self.frontends:
                break
        kids = children(self.proc.pid)
        core = [p for p in kids if p not in fes]
        return {"supervisor": self.proc.pid, "frontends": sorted(fes), "others": core}


# ----------------------------------------------------------------------------- (b) paced


async def paced(port: int, n: int, seconds: float, packets: list[bytes], fe_pid: int, interim: bool = True) -> dict:
    conns = await open_all(port, n, dict(CONFIG, interim_results=interim))
    steps = int(seconds / PACKET_S)
    offsets = [i * len(packets) // n for i in range(n)]
    end = text_frame({"type": "end"})
    loop = asyncio.get_running_loop()
    c0, w0, me0 = cpu_s(fe_pid), time.time(), time.process_time()
    t0 = loop.time()
    late = 0
    for k in range(steps):
        delay = t0 + k * PACKET_S - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        else:
            late += 1
        for c, off in zip(conns, offsets):
            c.writer.write(packets[(off + k) % len(packets)])
            c.packets += 1
    for c in conns:
        c.writer.write(end)
    await asyncio.wait_for(asyncio.gather(*(c.done.wait() for c in conns)), 120)
    c1, w1, me1 = cpu_s(fe_pid), time.time(), time.process_time()
    counts: dict[str, int] = {}
    for c in conns:
        for kind, v in c.counts.items():
            counts[kind] = counts.get(kind, 0) + v
        c.close()
    return {
        "streams": n,
        "packets": sum(c.packets for c in conns),
        "messages": counts,
        "results": counts.get("partial", 0) + counts.get("final", 0),
        "frontend_cpu_s": round(c1 - c0, 3),
        "wall_s": round(w1 - w0, 3),
        "client_cpu_s": round(me1 - me0, 3),
        "late_ticks": late,
        "errors": [c.error for c in conns if c.error][:3],
    }


def part_b(args, record_server) -> dict:
    from benchmarks.load_items import make_items

    items = make_items(args.audio, 16, (10.0, 20.0))
    speech = np.concatenate([it.audio for it in items])
    speech = np.clip(speech * 32767, -32768, 32767).astype("<i2")
    packets = packets_of(speech)
    log = Path(args.out).with_suffix(".b.server.log") if args.out else Path("/tmp/frontend_b.server.log")
    server = Server(args.model_b, args.context_right_b, 1, args.streams_b + 8, log, args.taskset_server)
    record_server.append(" ".join(server.command))
    try:
        ready = server.wait_ready()
        roles = server.roles()
        fe = roles["frontends"][0]
        time.sleep(2)
        c0, w0 = cpu_s(fe), time.time()
        time.sleep(args.idle_s)
        idle_cores = (cpu_s(fe) - c0) / (time.time() - w0)
        runs = {}
        for name, interim in (("interim_results", True), ("finals_only", False)):
            runs[name] = asyncio.run(paced(server.port, args.streams_b, args.seconds_b, packets, fe, interim))
            r = runs[name]
            r["frontend_cpu_s_minus_idle"] = round(r["frontend_cpu_s"] - idle_cores * r["wall_s"], 3)
            r["frontend_us_per_packet_all_in"] = round(1e6 * r["frontend_cpu_s_minus_idle"] / r["packets"], 1)
            print(f"(b) {name}: {r['packets']} packets, {r['results']} results, front end {r['frontend_cpu_s']:.2f} s CPU "
                  f"in {r['wall_s']:.1f} s (idle {idle_cores * r['wall_s']:.2f} s): "
                  f"{r['frontend_us_per_packet_all_in']} us/packet all in", flush=True)
            time.sleep(2)
    finally:
        server.stop()
    s, z = runs["interim_results"], runs["finals_only"]
    a = np.array([[s["packets"], s["results"]], [z["packets"], z["results"]]], float)
    y = np.array([s["frontend_cpu_s_minus_idle"], z["frontend_cpu_s_minus_idle"]])
    try:
        per_packet, per_result = np.linalg.solve(a, y)
    except np.linalg.LinAlgError:
        per_packet = per_result = float("nan")
    return {
        "model": args.model_b,
        "context_right": args.context_right_b,
        "chunk_ms": ready["chunk_ms"],
        "frontend_pid": fe,
        "processes": roles,
        "packet": "100 ms pcm_s16le (3,200 bytes), one binary WebSocket frame",
        "idle_frontend_cpu_cores": round(idle_cores, 4),
        "runs": runs,
        "frontend_cpu_us_per_packet": round(1e6 * float(per_packet), 1),
        "frontend_cpu_us_per_result": round(1e6 * float(per_result), 1),
        "frontend_cpu_us_per_packet_all_in": s["frontend_us_per_packet_all_in"],
        "target_us_per_packet": 50,
        "solved_from": ("C - idle = a * packets + b * results over two runs of the same speech: partials and finals "
                        "sent (interim_results true), finals only (interim_results false). The core's updates still "
                        "reach the front end and are assembled in both, so that work is in `a`; `b` is a result "
                        "message's JSON + WebSocket send"),
    }


# ----------------------------------------------------------------------------- (c) unpaced


async def unpaced(port: int, n: int, seconds: float, warmup_s: float, packets: list[bytes], pids: dict,
                   stream_packets: int) -> dict:  # fmt: skip
    """n connections, each a stream of `stream_packets` packets written as fast as TCP takes them
    (10 per write), then dropped (the server aborts it: no backlog left for the model) and
    opened again: the session's backpressure (MAX_AHEAD_S of audio ahead of the model) never
    starts, so the engine's model speed does not set the rate."""
    per_write = 10
    blocks = [b"".join(packets[i : i + per_write]) for i in range(0, len(packets) - per_write + 1, per_write)]
    stop = False
    sent = [0]
    opened = [0]
    errors: list[str] = []
    counts: dict[str, int] = {}

    async def client(off: int) -> None:
        k = off
        while not stop:
            c = Conn()
            try:
                await c.open(port, "/ws", text_frame(CONFIG))
                await asyncio.wait_for(c.ready.wait(), 30)
                if c.error:
                    errors.append(c.error[:160])
                    await asyncio.sleep(0.1)
                    continue
                opened[0] += 1
                for _ in range(stream_packets // per_write):
                    if stop or c.done.is_set():
                        break
                    c.writer.write(blocks[k % len(blocks)])
                    k += 1
                    await c.writer.drain()
                    sent[0] += per_write
            except (ConnectionError, asyncio.TimeoutError, RuntimeError) as e:
                errors.append(repr(e)[:160])
                await asyncio.sleep(0.1)
            finally:
                for kind, v in c.counts.items():
                    counts[kind] = counts.get(kind, 0) + v
                c.close()

    tasks = [asyncio.create_task(client(i * 7)) for i in range(n)]
    await asyncio.sleep(warmup_s)
    all_pids = dict(pids)

    def snap():
        return sent[0], opened[0], time.time(), {k: cpu_s(p) for k, p in all_pids.items()}, time.process_time()

    p0, o0, w0, cpu0, me0 = snap()
    await asyncio.sleep(seconds)
    p1, o1, w1, cpu1, me1 = snap()
    stop = True
    await asyncio.sleep(0.5)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    wall = w1 - w0
    cores = {k: round((cpu1[k] - cpu0[k]) / wall, 2) for k in all_pids} | {"client": round((me1 - me0) / wall, 2)}
    fe_cores = sum(v for k, v in cores.items() if k.startswith("frontend"))
    return {
        "connections": n,
        "packets_per_stream": stream_packets,
        "packets_in_window": p1 - p0,
        "streams_opened_in_window": o1 - o0,
        "window_s": round(wall, 2),
        "packets_per_s": round((p1 - p0) / wall, 1),
        "audio_s_per_s": round((p1 - p0) * PACKET_S / wall, 1),
        "cpu_cores_in_window": cores,
        "frontend_cpu_us_per_packet": round(1e6 * fe_cores / max((p1 - p0) / wall, 1e-9), 1),
        "messages_received": counts,
        "errors": errors[:3],
        "error_count": len(errors),
    }


def part_c(args, record_server) -> dict:
    rng = np.random.default_rng(0)
    audio = (rng.standard_normal(SAMPLE_RATE * 30) * 3000).astype("<i2")  # noise: results keep flowing
    packets = packets_of(audio)
    out = {"model": args.model_c, "context_right": args.context_right_c, "runs": []}
    for rep in range(args.repeats_c):
        for k in (1, 2):
            log = Path(args.out).with_suffix(f".c{k}.server.log") if args.out else Path(f"/tmp/frontend_c{k}.server.log")
            # slots: a dropped stream's slot is freed by the core a little later; 4x headroom
            server = Server(args.model_c, args.context_right_c, k, 4 * args.connections_c + 8, log, args.taskset_server)
            record_server.append(" ".join(server.command))
            try:
                server.wait_ready()
                roles = server.roles()
                pids = {f"frontend{i}": p for i, p in enumerate(roles["frontends"])}
                pids |= {f"child{p}": p for p in roles["others"]}  # the engine core (and the resource tracker)
                pids["supervisor"] = roles["supervisor"]
                r = asyncio.run(unpaced(server.port, args.connections_c, args.seconds_c, args.warmup_c, packets, pids,
                                        args.stream_packets_c))  # fmt: skip
            finally:
                server.stop()
            r["frontends"] = k
            r["repeat"] = rep
            out["runs"].append(r)
            print(f"(c) {k} front end(s): {r['packets_per_s']} packets/s  cores {r['cpu_cores_in_window']}", flush=True)
    one = [r["packets_per_s"] for r in out["runs"] if r["frontends"] == 1]
    two = [r["packets_per_s"] for r in out["runs"] if r["frontends"] == 2]
    out["packets_per_s_1_frontend"] = round(float(np.median(one)), 1)
    out["packets_per_s_2_frontends"] = round(float(np.median(two)), 1)
    out["ratio_2_over_1"] = round(out["packets_per_s_2_frontends"] / out["packets_per_s_1_frontend"], 2)
    out["target_ratio"] = 1.8
    return out


def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("front end (b, c)")
    g.add_argument("--model-b", default="nemo_serve/assets/demo/demo.nemo", help="(b) model (default: the demo model)")
    g.add_argument("--context-right-b", type=int, default=3)
    g.add_argument("--streams-b", type=int, default=32)
    g.add_argument("--seconds-b", type=float, default=20.0)
    g.add_argument("--idle-s", type=float, default=5.0)
    g.add_argument("--audio", default="nemo_serve/assets/demo/utterances/manifest.jsonl")
    g.add_argument("--model-c", default="builtin:tiny-hybrid")
    g.add_argument("--context-right-c", type=int, default=13)
    g.add_argument("--connections-c", type=int, default=32)
    g.add_argument("--seconds-c", type=float, default=10.0)
    g.add_argument("--stream-packets-c", type=int, default=150, help="(c) packets per stream before it is dropped and reopened")
    g.add_argument("--warmup-c", type=float, default=3.0)
    g.add_argument("--repeats-c", type=int, default=2, help="1 and 2 front ends alternated this many times")
    g.add_argument("--taskset-server", default=None, help="CPU list for the server (taskset -c); default unpinned")
    g.add_argument("--parts", default="b,c")


def run_frontend_parts(args) -> dict:
    servers: list[str] = []
    out = {}
    if "b" in args.parts:
        out["per_packet"] = part_b(args, servers)
    if "c" in args.parts:
        out["throughput"] = part_c(args, servers)
    out["server_commands"] = servers
    out["cores"] = ("2-core VM; server (supervisor, engine core, front ends) and the client process unpinned"
                    if not args.taskset_server else f"server pinned to CPUs {args.taskset_server}, client unpinned")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_args(p)
    p.add_argument("--notes", default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    record = run_record()
    record["notes"] = args.notes
    out = {"run": record, "frontend": run_frontend_parts(args)}
    if args.out:
        write_json(args.out, out)


if __name__ == "__main__":
    main()
