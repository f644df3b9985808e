"""Memory over time under a churn of streams on every protocol: does RSS plateau?

    nice -n 5 python -m benchmarks.soak --minutes 6 --out benchmarks/results/soak_cpu.json

starts the real server (the demo model, `--frontends 2`, and a gRPC port when riva.client is
installed), takes a quiet reference of one utterance per protocol, then for `--minutes` keeps a
churn: /ws streams at `--speed` x real time ended or dropped (RST, FIN, close frame), /v1/realtime
sessions committed or closed right after their appends, Riva StreamingRecognize calls, a file
upload now and then. Every ended stream's result must equal its protocol's quiet reference (a
mismatch fails the run). Every `--sample-s` it reads the RSS of the engine core and of each front
end, and /readyz's free slots; at the end every slot must be free again.

The JSON holds the RSS series per process, each one's first- and second-half maxima and its slope
over the second half (MiB per minute), and the streams by protocol and outcome. The hostile suites
check RSS after churns of seconds; this is the run long enough to see a plateau (or not).
`--plant-mismatch` alters the first ended /ws stream's tokens: the check must catch it
(tests/test_soak_bench.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import soak_clients as clients  # noqa: E402
from benchmarks.server_process import free_port, process_tree  # noqa: E402

TOKEN = "soak-token"
UTTERANCE_DIR = Path(__file__).resolve().parent.parent / "nemo_serve" / "assets" / "demo" / "utterances"
WS_KINDS = ("ended", "ended", *clients.DROP_KINDS)  # half the /ws streams end well
REALTIME_KINDS = ("ended", "ended", "closed_after_append")
FILE_EVERY_S = 15.0  # a few uploads: the file API is not what this churns
GAP_S = 0.2  # between one worker's streams
RIVA_GAP_S = 1.0  # riva.client sends a file as fast as it reads it: fewer calls keep the rate modest


# ----------------------------------------------------------------------------- the server


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


class Server:
    def __init__(self, frontends: int, num_slots: int, grpc: bool, heap_trim_period_s: float | None = None) -> None:
        self.port = free_port()
        self.grpc_port = free_port() if grpc else None
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(tempfile.mkstemp(prefix="nemo-serve-soak-", suffix=".log")[1])
        cmd = [sys.executable, "-m", "nemo_serve.cli", "--port", str(self.port), "--frontends", str(frontends),
               "--num-slots", str(num_slots), "--idle-timeout-s", "10", "--log-level", "warning"]  # fmt: skip
        if self.grpc_port:
            cmd += ["--grpc-port", str(self.grpc_port)]
        if heap_trim_period_s is not None:  # None: the server's default
            cmd += ["--heap-trim-period-s", str(heap_trim_period_s)]
        env = {**os.environ, "NEMO_SERVE_AUTH_TOKEN": TOKEN, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def wait_ready(self, timeout_s: float = 600) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"server exited with {self.proc.returncode}: {self.log_path.read_text()[-2000:]}")
            try:
                return get_json(self.url + "/readyz")
            except OSError:
                time.sleep(0.1)
        raise SystemExit(f"server not ready after {timeout_s} s; see {self.log_path}")

    def roles(self, ready: dict) -> dict[str, int]:
        """{"core0": pid, "frontend0": pid, ...}: the cores from /readyz, the front ends the other
        children (the multiprocessing resource tracker left out: it holds nothing of ours)."""
        cores = [c["pid"] for c in ready["cores"]]
        others = [p for p in process_tree(self.proc.pid)
                  if p != self.proc.pid and p not in cores and b"resource_tracker" not in _cmdline(p)]  # fmt: skip
        return {**{f"core{i}": p for i, p in enumerate(cores)}, **{f"frontend{i}": p for i, p in enumerate(sorted(others))}}

    def stop(self) -> int:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        return self.proc.wait()


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def rss_mib(pid: int) -> float | None:
    try:
        import psutil

        return psutil.Process(pid).memory_info().rss / 2**20
    except ImportError:
        pass
    except Exception:  # psutil.NoSuchProcess: the process is gone
        return None
    try:
        line = next(ln for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if ln.startswith("VmRSS"))
    except (OSError, StopIteration):
        return None
    return int(line.split()[1]) / 1024


class Sampler(threading.Thread):
    """Every `period_s`: each role's RSS (MiB) and /readyz's free slots, timed from the start."""

    def __init__(self, url: str, roles: dict[str, int], period_s: float) -> None:
        super().__init__(daemon=True, name="soak-sampler")
        self.url, self.roles, self.period_s = url, roles, period_s
        self.t0 = time.monotonic()
        self.rss: dict[str, list[list[float]]] = {role: [] for role in roles}  # role -> [[t_s, MiB], ...]
        self.free_slots: list[list[float]] = []  # [[t_s, free], ...]
        self.stopped = threading.Event()

    def sample(self) -> None:
        t = round(time.monotonic() - self.t0, 1)
        for role, pid in self.roles.items():
            mib = rss_mib(pid)
            if mib is not None:
                self.rss[role].append([t, round(mib, 2)])
        try:
            self.free_slots.append([t, get_json(self.url + "/readyz")["free_slots"]])
        except (OSError, KeyError, ValueError):
            pass

    def run(self) -> None:
        while not self.stopped.is_set():
            self.sample()
            self.stopped.wait(self.period_s)


def summarize_series(series: list[list[float]]) -> dict:
    """First- and second-half maxima and the least-squares slope over the second half."""
    if len(series) < 4:
        return {"samples": len(series)}
    t = np.array([s[0] for s in series])
    mib = np.array([s[1] for s in series])
    second = t >= (t[0] + t[-1]) / 2
    slope = np.polyfit(t[second] / 60.0, mib[second], 1)[0]
    return {
        "samples": len(series),
        "first_mib": round(float(mib[0]), 1),
        "first_half_max_mib": round(float(mib[~second].max()), 1),
        "second_half_max_mib": round(float(mib[second].max()), 1),
        "second_half_growth_mib": round(float(mib[second].max() - mib[~second].max()), 1),
        "second_half_slope_mib_per_min": round(float(slope), 3),
    }


# ----------------------------------------------------------------------------- the churn


class Churn:
    """The workers' shared record: outcomes by protocol, mismatches, and the quiet references."""

    def __init__(self, server: Server, pcm: np.ndarray, wav: Path, speed: float, plant_mismatch: bool) -> None:
        self.server, self.pcm, self.wav, self.speed = server, pcm, wav, speed
        self.references: dict[str, object] = {}
        self.outcomes: dict[str, Counter] = {}
        self.mismatches: list[dict] = []
        self.errors: list[str] = []
        self.plant_mismatch = plant_mismatch

    async def one(self, protocol: str, how: str) -> tuple[str, object]:
        s = self.server
        if protocol == "ws":
            return await clients.ws_stream(s.port, TOKEN, self.pcm, how, self.speed)
        if protocol == "realtime":
            return await clients.realtime_stream(s.port, TOKEN, self.pcm, how, self.speed)
        if protocol == "riva":
            return await asyncio.to_thread(clients.riva_stream, s.grpc_port, TOKEN, self.wav)
        return await asyncio.to_thread(clients.file_upload, s.port, TOKEN, self.wav)

    async def take_references(self, protocols: list[str]) -> None:
        """One quiet stream per protocol, one at a time, before the churn."""
        for protocol in protocols:
            outcome, result = await self.one(protocol, "ended")
            if outcome != "ended":
                raise SystemExit(f"quiet {protocol} reference failed: {outcome} {result}")
            self.references[protocol] = result

    def record(self, protocol: str, outcome: str, result: object) -> None:
        if outcome == "ended" and protocol == "ws" and self.plant_mismatch:
            result, self.plant_mismatch = [*result, -1], False  # the check must see this one
        if outcome == "ended" and result != self.references[protocol]:
            outcome = "mismatch"
            self.mismatches.append({"protocol": protocol, "got": result, "want": self.references[protocol]})
        if outcome == "error":
            self.errors.append(f"{protocol}: {result}")
        self.outcomes.setdefault(protocol, Counter())[outcome] += 1

    async def worker(self, protocol: str, kinds: tuple[str, ...], deadline: float, seed: int, gap_s: float) -> None:
        rng = random.Random(seed)
        while time.monotonic() < deadline:
            how = rng.choice(kinds)
            outcome, result = await self.one(protocol, how)
            self.record(protocol, outcome, result)
            pause_s = gap_s * (0.5 + rng.random()) if outcome != "refused_busy" else 0.5
            # never past the deadline: the file worker's pause (7.5-22.5 s) kept a short run's churn
            # going for 13 s whatever --minutes said
            await asyncio.sleep(min(pause_s, max(0.0, deadline - time.monotonic())))

    async def run(self, minutes: float, ws_workers: int, realtime_workers: int, riva: bool) -> None:
        deadline = time.monotonic() + minutes * 60
        tasks = [self.worker("ws", WS_KINDS, deadline, i, GAP_S) for i in range(ws_workers)]
        tasks += [self.worker("realtime", REALTIME_KINDS, deadline, 100 + i, GAP_S) for i in range(realtime_workers)]
        if riva:
            tasks.append(self.worker("riva", ("ended",), deadline, 200, RIVA_GAP_S))
        tasks.append(self.worker("file", ("ended",), deadline, 300, FILE_EVERY_S))
        await asyncio.gather(*tasks)


def wait_all_free(url: str, timeout_s: float = 30.0) -> dict:
    """/readyz once every slot is free and no stream open, or the last answer at the timeout (a
    dropped stream's slot comes back between steps, or at the idle timeout for a bare FIN)."""
    deadline = time.monotonic() + timeout_s
    while True:
        ready = get_json(url + "/readyz")
        if (ready["free_slots"] == ready["total_slots"] and ready["open_streams"] == 0) or time.monotonic() > deadline:
            return ready
        time.sleep(0.5)


# ----------------------------------------------------------------------------- the report


def plot(report: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    for ax, roles in zip(axes, (["core0"], [r for r in report["rss_mib"] if r.startswith("frontend")])):
        for role in roles:
            series = report["rss_mib"].get(role, [])
            ax.plot([s[0] / 60 for s in series], [s[1] for s in series], label=role)
        ax.set_xlabel("minutes")
        ax.set_ylabel("RSS (MiB)")
        ax.legend(fontsize=8)
    axes[0].set_title("engine core", fontsize=9)
    axes[1].set_title("front ends", fontsize=9)
    fig.suptitle(f"soak: {report['minutes']} min churn, {sum(report['streams_total'].values())} streams", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def build_report(args, protocols: list[str], roles: dict[str, int], sampler: Sampler, churn: Churn, after: dict,
                 exit_code: int, log_path: Path) -> dict:  # fmt: skip
    from benchmarks.common import run_record

    log_text = log_path.read_text(errors="replace")
    streams_total = Counter()
    for counts in churn.outcomes.values():
        streams_total.update(counts)
    return {
        "run": run_record(),
        "minutes": args.minutes,
        "frontends": args.frontends,
        "num_slots": args.num_slots,
        "speed": args.speed,
        "heap_trim_period_s": args.heap_trim_period_s,
        "protocols": protocols,
        "processes": roles,
        "rss_mib": sampler.rss,
        "rss_summary": {role: summarize_series(series) for role, series in sampler.rss.items()},
        "free_slots": sampler.free_slots,
        "streams": {proto: dict(sorted(c.items())) for proto, c in churn.outcomes.items()},
        "streams_total": dict(sorted(streams_total.items())),
        "num_streams": sum(streams_total.values()),
        "mismatches": churn.mismatches[:5],
        "num_mismatches": len(churn.mismatches),
        "errors": churn.errors[:10],
        "slots_free_at_end": after["free_slots"] == after["total_slots"] and after["open_streams"] == 0,
        "readyz_at_end": {k: after[k] for k in ("free_slots", "total_slots", "open_streams")},
        "server_exit_code": exit_code,
        "log_tracebacks": log_text.count("Traceback"),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=6.0)
    p.add_argument("--frontends", type=int, default=2)
    p.add_argument("--num-slots", type=int, default=8)
    p.add_argument("--ws-workers", type=int, default=3, help="/ws streams at a time")
    p.add_argument("--realtime-workers", type=int, default=2, help="/v1/realtime sessions at a time")
    p.add_argument("--speed", type=float, default=2.0, help="x real time for /ws and /v1/realtime audio")
    p.add_argument("--sample-s", type=float, default=5.0, help="between RSS samples")
    p.add_argument("--heap-trim-period-s", type=float,
                   help="the server's --heap-trim-period-s (0: no malloc_trim; default: the server's default)")
    p.add_argument("--no-riva", action="store_true", help="leave Riva out even when riva.client is installed")
    p.add_argument("--plant-mismatch", action="store_true", help="alter one /ws result: the run must fail")
    p.add_argument("--out", help="write the JSON here (and a PNG beside it when matplotlib is installed)")
    args = p.parse_args(argv)

    from nemo_serve.client import read_file

    wav = UTTERANCE_DIR / "000.wav"
    audio, rate, _ = read_file(wav)
    assert rate == clients.SAMPLE_RATE, rate
    pcm = np.clip(np.round(audio * 32768.0), -32768, 32767).astype("<i2")
    riva = clients.riva_available() and not args.no_riva
    server = Server(args.frontends, args.num_slots, grpc=riva, heap_trim_period_s=args.heap_trim_period_s)
    try:
        ready = server.wait_ready()
        roles = server.roles(ready)
        churn = Churn(server, pcm, wav, args.speed, args.plant_mismatch)
        protocols = ["ws", "realtime", *(["riva"] if riva else []), "file"]
        asyncio.run(churn.take_references(protocols))
        sampler = Sampler(server.url, roles, args.sample_s)
        sampler.start()
        asyncio.run(churn.run(args.minutes, args.ws_workers, args.realtime_workers, riva))
        after = wait_all_free(server.url)
        sampler.stopped.set()
        sampler.join()
        sampler.sample()  # the last reading, after the churn
        exit_code = server.stop()
    finally:
        if server.proc.poll() is None:
            os.killpg(server.proc.pid, signal.SIGKILL)
    report = build_report(args, protocols, roles, sampler, churn, after, exit_code, server.log_path)
    for role, s in report["rss_summary"].items():
        print(f"{role:10s} RSS first half max {s.get('first_half_max_mib')} MiB, second half max "
              f"{s.get('second_half_max_mib')} MiB, slope {s.get('second_half_slope_mib_per_min')} MiB/min")  # fmt: skip
    print(f"streams {report['streams']}; mismatches {len(churn.mismatches)}; errors {len(churn.errors)}; "
          f"slots free at end {report['slots_free_at_end']}; exit {exit_code}")  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
        plot(report, Path(args.out).with_suffix(".png"))
    bad = churn.mismatches or churn.errors or not report["slots_free_at_end"] or exit_code != 0 or report["log_tracebacks"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
