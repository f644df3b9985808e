"""What the layer benchmarks share (grpc_layer_bench.py, ws_layer_bench.py): each candidate server
in its own process, started once for all repeats, its idle CPU rate measured first; a paced window
whose server CPU (its idle rate subtracted) over the packets sent is the figure; the candidates
alternated repeat by repeat (this machine's load drifts: side by side is the only fair comparison);
the command line, the packages each candidate needs, and the versions recorded.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Awaitable, Callable

import numpy as np

from benchmarks.raw_ws import send_spread
from benchmarks.server_process import free_port

PACKET_S = 0.02
RESULT_EVERY = 16  # as the real server sends a partial about every 16 packets of 20 ms


def arguments(doc: str, candidates: tuple[str, ...]) -> argparse.ArgumentParser:
    """The options every layer benchmark takes (`--serve NAME --port N`: the child's own)."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--serve", default=None, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--candidates", default=",".join(candidates))
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--idle-s", type=float, default=2.0)
    return p


def importable(names: str, needs: Callable[[str], str]) -> tuple[list[str], dict[str, str]]:
    """The candidates in `names` (comma-separated) whose package `needs(name)` imports, and the
    others with why not."""
    found, missing = [], {}
    for name in names.split(","):
        try:
            __import__(needs(name))
            found.append(name)
        except ImportError as e:
            missing[name] = str(e)
    return found, missing


async def paced_window(server_cpu_s: Callable[[], float], n: int, seconds: float, write: Callable[[int, int], None],
                       received: Callable[[], int]) -> dict:  # fmt: skip
    """`n` streams paced over `seconds` (send_spread: `write(stream, tick)` per packet), and what
    the server process spent meanwhile; `received()`: the messages the clients got."""
    c0, w0, me0 = server_cpu_s(), time.time(), time.process_time()
    sent, late = await send_spread(n, seconds, PACKET_S, write)
    await asyncio.sleep(PACKET_S)
    c1, w1, me1 = server_cpu_s(), time.time(), time.process_time()
    return {"packets": sent, "messages_received": received(), "server_cpu_s": round(c1 - c0, 4),
            "wall_s": round(w1 - w0, 3), "client_cpu_s": round(me1 - me0, 3), "ticks_late_by_over_one_packet": late}  # fmt: skip


class Candidate:
    """One candidate's server process (`script --serve name --port N`), started once for all
    repeats. `paced(port, streams, seconds, pid)`: one window's figures (paced_window's);
    `cpu_s(pid)`: the server's CPU so far."""

    def __init__(self, name: str, idle_s: float, script: str, paced: Callable[..., Awaitable[dict]],
                 cpu_s: Callable[[int], float], width: int) -> None:  # fmt: skip
        self.name, self.port, self.paced, self.cpu_s, self.width = name, free_port(), paced, cpu_s, width
        self.proc = subprocess.Popen([sys.executable, script, "--serve", name, "--port", str(self.port)],
                                     cwd=Path(__file__).resolve().parent.parent)  # fmt: skip
        self._wait_port()
        time.sleep(1)
        c0, w0 = cpu_s(self.proc.pid), time.time()
        time.sleep(idle_s)
        self.idle_cores = (cpu_s(self.proc.pid) - c0) / (time.time() - w0)

    def _wait_port(self) -> None:
        deadline = time.time() + 30
        while time.time() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(f"{self.name} did not listen on {self.port}")

    def measure(self, streams: int, seconds: float) -> dict:
        r = asyncio.run(self.paced(self.port, streams, seconds, self.proc.pid))
        busy = r["server_cpu_s"] - self.idle_cores * r["wall_s"]
        r["us_per_packet"] = round(1e6 * busy / max(r["packets"], 1), 1)
        errors = f" {r['errors']}" if "errors" in r else ""
        print(f"{self.name:{self.width}s} {r['packets']:7d} packets {r['messages_received']:5d} messages "
              f"{r['us_per_packet']:7.1f} us/packet (client {r['client_cpu_s']:.2f} s, late ticks "
              f"{r['ticks_late_by_over_one_packet']}){errors}", flush=True)  # fmt: skip
        return r

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def alternate(start: Callable[[str], Candidate], names: list[str], args) -> dict:
    """Each candidate started, measured `args.repeats` times in alternating order, stopped:
    {name: {idle_cores, repeats, us_per_packet_median}}."""
    cands = [start(n) for n in names]
    rows: dict = {c.name: {"idle_cores": round(c.idle_cores, 4), "repeats": []} for c in cands}
    try:
        for rep in range(args.repeats):
            for c in cands if rep % 2 == 0 else cands[::-1]:
                rows[c.name]["repeats"].append(c.measure(args.streams, args.seconds))
    finally:
        for c in cands:
            c.stop()
    for row in rows.values():
        row["us_per_packet_median"] = float(np.median([r["us_per_packet"] for r in row["repeats"]]))
    return rows


def installed_versions(packages: tuple[str, ...]) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in packages:
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return out

