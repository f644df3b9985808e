"""Capacity sweep: start nemo-serve, raise the number of concurrent streams until it falls behind.

    python benchmarks/sweep.py --model builtin:fastconformer-l --context-right 13 \
        --levels 2,4,8,12,16,24,32 --duration 60 --threads 1 \
        --out benchmarks/results/sweep_fastconformer-l_r13_cpu.json

Writes the JSON given by --out and a PNG next to it (partial and final latency percentiles and
drift against N; the server's step time against batch size).

Per level it runs benchmarks/loadgen.py's level (N real-time streams for --duration seconds),
samples the server process's CPU time and resident memory (and GPU memory through nvidia-smi
where there is one) every 0.5 s, and reads the server's /metrics before and after, so the step
time by batch size is the server's own histogram over that level. It stops after the first
level that does not keep up (load_summary.keeps_up: p95 partial latency over two chunk periods,
the 90th percentile of per-stream drift over --max-drift ms/s, or any stream refused or failed);
that level's drift is the "next level" figure of the capacity table.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import file_digest, model_file, run_record, write_json  # noqa: E402
from benchmarks.load_items import attach_oracle, make_items  # noqa: E402
from benchmarks.load_summary import format_level  # noqa: E402
from benchmarks.load_workers import DEFAULT_MAX_SEND_LATENESS_MS, lateness_line, measure_level  # noqa: E402
from benchmarks.process_sampler import Sampler  # noqa: E402
from benchmarks.server_process import ServerProcess, free_port, process_tree  # noqa: E402
from benchmarks.step_metrics import step_time_by_batch  # noqa: E402
from benchmarks.sweep_plot import plot  # noqa: E402

SUMMARY_RE = re.compile(r"cache ([\d.]+) MiB/stream x (\d+) slots = ([\d.]+) MiB")


# ----------------------------------------------------------------------------- the server process


class Server(ServerProcess):
    """nemo-serve in a subprocess, with its stdout kept (the start-up summary line) in a log file."""

    readyz_timeout_s = 2.0
    ready_poll_s = 1.0

    def __init__(self, args, nemo_path: Path, num_slots: int, log_path: Path, max_queue_delay_s: float = 0.0) -> None:
        """`max_queue_delay_s`: the server's overload limit; 0 (a sweep finds where the server falls
        behind, so it admits by slots only)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        if getattr(args, "ray", False):
            cmd, env = _ray_command(args, nemo_path, num_slots, self.port, max_queue_delay_s), dict(os.environ)
            self._start(cmd, env, args, log_path)
            return
        cmd = [
            sys.executable, "-m", "nemo_serve.cli",
            "--model", str(nemo_path),
            "--context-right", str(args.context_right),
            "--dtype", args.dtype,
            "--device", args.device,
            "--num-slots", str(num_slots),
            "--port", str(self.port),
            "--log-level", "warning",
            "--idle-timeout-s", "120",
            "--max-queue-delay-s", str(max_queue_delay_s),
            "--max-connections-per-ip", "65536",  # every load-generator stream comes from 127.0.0.1
        ]  # fmt: skip
        if args.frontends is not None:
            cmd += ["--frontends", str(args.frontends)]
        if getattr(args, "devices", None):
            cmd += ["--devices", args.devices]  # one engine core per device; --num-slots is per core
        self._start(cmd, dict(os.environ), args, log_path)

    def _start(self, cmd: list[str], env: dict, args, log_path: Path) -> None:
        """The one place the command is launched (gpu/server_capacity.py adds flags here)."""
        if args.threads:
            env.update(OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
        self.processes: dict = {}
        self._launch(cmd, env, log_path)

    def summary(self) -> dict:
        text = self.log_path.read_text(errors="replace")
        m = SUMMARY_RE.search(text)
        line = next((ln for ln in text.splitlines() if ln.startswith("model ")), "")
        out = {"summary": line}
        if m:
            out["cache_mib_per_stream"] = float(m.group(1))
        return out

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            return r.read().decode()


def _ray_command(args, nemo_path: Path, num_slots: int, port: int, max_queue_delay_s: float) -> list[str]:
    """One Ray Serve replica on a local Ray cluster (nemo_serve/ray_serve.py) with the settings the
    plain server gets as flags, as NEMO_SERVE_* variables (they reach the replica through its
    runtime env): `env NAME=value ... python -m nemo_serve.ray_serve`."""
    settings = {
        "MODEL": str(nemo_path), "CONTEXT_RIGHT": str(args.context_right), "DTYPE": args.dtype,
        "DEVICE": args.device, "LOG_LEVEL": "warning", "IDLE_TIMEOUT_S": "120",
        "MAX_QUEUE_DELAY_S": str(max_queue_delay_s), "MAX_CONNECTIONS_PER_IP": "65536",
    }  # fmt: skip
    if args.threads:  # the engine core's threads, as the plain server's
        settings.update(OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    assignments = [f"{k}={v}" if k.endswith("_THREADS") else f"NEMO_SERVE_{k}={v}" for k, v in settings.items()]
    return ["env", *assignments, sys.executable, "-m", "nemo_serve.ray_serve", "--replicas", "1",
            "--num-slots", str(num_slots), "--port", str(port)]  # fmt: skip


# ----------------------------------------------------------------------------- sweep


def sweep(args) -> dict:
    record = run_record()
    nemo_path, name = model_file(args.model)
    levels = sweep_levels(args)
    items = make_items(args.audio, args.items, tuple(float(x) for x in args.item_seconds.split(",")))
    if not args.no_oracle:
        attach_oracle(items, str(nemo_path), args.context_right, args.dtype, args.device)
    log_path = Path(args.out).with_suffix(".server.log")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    # Slot headroom: a stream that reconnects the moment it gets its final can arrive before the
    # step loop has freed its previous slot; with exactly max(levels) slots the top level then
    # measured 503 refusals (admission), not compute (benchmarks/results/archive/sweep_demo_r{3,13}_cpu_fp32.json, N=48).
    server = Server(args, nemo_path, max(levels) + max(2, max(levels) // 10), log_path)
    results = []
    try:
        ready = server.wait_ready(args.start_timeout)
        server.processes = {
            "top": server.proc.pid,
            "tree": process_tree(server.proc.pid),
            "frontend_answering_readyz": ready.get("pid"),
        }
        sampler = Sampler(server.proc.pid)
        sampler.start()
        idle = _idle_footprint(sampler)
        for n in levels:
            before = server.metrics()
            t0 = time.time()
            ws_url = server.url.replace("http", "ws") + "/ws"
            level, _ = measure_level(ws_url, items, n, args.duration, ramp_s=args.ramp_s, num_workers=args.procs,
                                     max_drift=args.max_drift, max_send_lateness_ms=getattr(args, "max_send_lateness_ms", DEFAULT_MAX_SEND_LATENESS_MS))  # fmt: skip
            t1 = time.time()
            level["step_time_by_batch"] = step_time_by_batch(before, server.metrics())
            level.update(sampler.window(t0, t1))
            results.append(level)
            print(format_level(level), file=sys.stderr, flush=True)
            print(lateness_line(level), file=sys.stderr, flush=True)
            if not level["keeps_up"]:
                break
        sampler.stop()
    finally:
        server.stop()
    return _assemble(args, record, name, nemo_path, server, ready, idle, results)


def sweep_levels(args) -> list[int]:
    """--levels as given, or `auto`: fractions of the capacity the step bench predicts
    (the engine's best stream-steps/s x chunk seconds, over the batch sizes it measured)."""
    if args.levels != "auto":
        return [int(x) for x in args.levels.split(",")]
    if not args.step_bench:
        raise SystemExit("--levels auto needs --step-bench (a step_bench JSON for the same model and mode)")
    import json

    sb = json.loads(Path(args.step_bench).read_text())
    rows = [r for r in sb["results"] if r["system"] == "engine"]
    predicted = max(r["realtime_streams"] for r in rows)
    levels = sorted({max(1, round(predicted * float(f))) for f in args.level_fractions.split(",")})
    print(f"predicted capacity {predicted:.0f} streams -> levels {levels}", file=sys.stderr)
    return levels


def _idle_footprint(sampler: Sampler) -> dict:
    time.sleep(2.0)
    return sampler.window(time.time() - 2.0, time.time())


def _assemble(args, record, name, nemo_path, server, ready, idle, results) -> dict:
    kept = [lv for lv in results if lv["keeps_up"]]
    behind = next((lv for lv in results if lv.get("verdict", "server_behind") == "server_behind"), None)
    invalid = next((lv for lv in results if lv.get("verdict") == "generator_late"), None)
    info = server.summary()
    per_stream = info.get("cache_mib_per_stream")
    best = kept[-1] if kept else None
    capacity = {
        "streams_kept_up": best["streams"] if best else 0,
        "partial_latency_ms_p95_at_max": best["partial_latency_ms"]["p95"] if best else None,
        "final_latency_ms_p95_at_max": best["final_latency_ms"]["p95"] if best else None,
        "next_level": behind["streams"] if behind else None,
        "next_level_drift_ms_per_s": behind["drift_ms_per_s"]["p90"] if behind else None,
        "cache_mib_per_stream": per_stream,
        "cache_mib_total_at_max": round(per_stream * best["streams"], 1) if (best and per_stream) else None,
        "fell_behind_within_levels": behind is not None,
        # a level where the load generator itself was late stops the sweep without a server verdict
        "generator_late_at": invalid["streams"] if invalid else None,
    }
    return {
        "benchmark": "sweep",
        **record,
        "model": name,
        "model_file": str(nemo_path),
        "model_sha256": file_digest(nemo_path),
        "context_right": args.context_right,
        "chunk_ms": ready.get("chunk_ms"),
        "dtype": args.dtype,
        "device": args.device,
        "server_threads": args.threads,
        "server_frontends": args.frontends,
        "server_ray": bool(getattr(args, "ray", False)),
        "server_devices": args.devices,
        "server_processes": server.processes,
        "notes": args.notes,
        "server_command": " ".join(server.command),
        "server_summary": info.get("summary"),
        "duration_s_per_level": args.duration,
        "audio": args.audio,
        "items": args.items,
        "item_seconds": args.item_seconds,
        "loadgen_procs": args.procs,
        "max_drift_ms_per_s": args.max_drift,
        "idle_footprint": idle,
        "capacity": capacity,
        "levels": results,
    }


# ----------------------------------------------------------------------------- plain against Ray Serve


def compare_ray(args) -> None:
    """nemo-serve and a Ray Serve replica swept one after the other at the same settings."""
    import copy

    out = Path(args.out)
    runs = {}
    for name, ray in (("plain", False), ("ray", True)):
        a = copy.copy(args)
        a.ray, a.out = ray, str(out.with_suffix(f".{name}.json"))  # the server logs go beside it
        runs[name] = sweep(a)
        print(f"{name}: kept up at N={runs[name]['capacity']['streams_kept_up']}", file=sys.stderr, flush=True)
    side_by_side = {name: {k: r["capacity"][k] for k in ("streams_kept_up", "partial_latency_ms_p95_at_max",
                                                         "final_latency_ms_p95_at_max", "next_level")}
                    for name, r in runs.items()}  # fmt: skip
    write_json(args.out, {"benchmark": "sweep_ray_vs_plain", "command": runs["plain"]["command"],
                          "side_by_side": side_by_side, **runs})  # fmt: skip
    for name, c in side_by_side.items():
        print(f"{name}: kept up at N={c['streams_kept_up']}, partial p95 {c['partial_latency_ms_p95_at_max']} ms, "
              f"next level {c['next_level']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="builtin:fastconformer-l", help=".nemo path, builtin:NAME, or demo")
    ap.add_argument("--context-right", type=int, required=True)
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1, help="OMP/MKL threads of the server (0: leave as is)")
    ap.add_argument("--levels", default="1,2,4,8,12,16,24,32,48,64", help="comma-separated N, or 'auto' (see --step-bench)")
    ap.add_argument("--level-fractions", default="0.5,0.8,1.0,1.25", help="with --levels auto: fractions of the predicted capacity")
    ap.add_argument("--frontends", type=int, default=None,
                    help="the server's --frontends, at least 1 (default: the server's own default)")
    ap.add_argument("--devices", default=None,
                    help="the server's --devices (one engine core per device, e.g. cpu,cpu; slots are per core)")
    ap.add_argument("--ray", action="store_true",
                    help="serve through one Ray Serve replica on a local Ray cluster (nemo_serve/ray_serve.py) "
                    "instead of nemo-serve itself, at the same settings")
    ap.add_argument("--compare-ray", action="store_true",
                    help="one run, two sweeps at the same settings: nemo-serve, then one Ray Serve replica; "
                    "the JSON holds both and their kept-up streams side by side")
    ap.add_argument("--procs", type=int, default=1, help="load generator worker processes (benchmarks/load_workers.py)")
    ap.add_argument("--max-send-lateness-ms", type=float, default=DEFAULT_MAX_SEND_LATENESS_MS,
                    help="a load generator worker whose p99 send lateness passes this makes the level invalid")
    ap.add_argument("--item-seconds", default="10,20", help="length range of the synthetic test items")
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--ramp-s", type=float, default=2.0)
    ap.add_argument("--audio", default="synth")
    ap.add_argument("--items", type=int, default=16)
    ap.add_argument("--no-oracle", action="store_true", help="skip the token comparison with NeMo's loop")
    ap.add_argument("--max-drift", type=float, default=20.0)
    ap.add_argument("--start-timeout", type=float, default=900.0)
    ap.add_argument("--step-bench", default=None, help="a step_bench JSON: overlaid on the step-time plot; feeds --levels auto")
    ap.add_argument("--notes", default=None, help="free text kept in the JSON (e.g. what else ran on the machine)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.compare_ray:
        compare_ray(args)
        return
    result = sweep(args)
    write_json(args.out, result)
    sb = None
    if args.step_bench:
        import json

        sb = json.loads(Path(args.step_bench).read_text())
    plot(result, Path(args.out).with_suffix(".png"), sb)
    c = result["capacity"]
    print(
        f"kept up at N={c['streams_kept_up']}: partial p95 {c['partial_latency_ms_p95_at_max']} ms, "
        f"final p95 {c['final_latency_ms_p95_at_max']} ms; N={c['next_level']} drift {c['next_level_drift_ms_per_s']} ms/s; "
        f"cache {c['cache_mib_per_stream']} MiB/stream, {c['cache_mib_total_at_max']} MiB at the max"
    )


if __name__ == "__main__":
    main()
