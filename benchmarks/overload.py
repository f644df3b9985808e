"""Overload: the same excess of real-time streams against a server with and without --max-queue-delay-s.

    python benchmarks/overload.py --model demo --context-right 3 --streams 96 --duration 60 \
        --out benchmarks/results/overload_demo_r3_cpu.json

One server per run (sweep.Server: one thread, slots for every stream, so only the overload limit can
refuse), the load generator's N workers (load_level.run_level: real-time paced items, each worker
opening its next item when one ends, waiting 1 s after a refusal), started over --ramp-s so that the
load grows past what the server keeps up with. `off` runs with --max-queue-delay-s 0 (admission by
free slots only), `on` with --limit. Per run: streams admitted and refused, partial latency of the
admitted streams (percentiles, and its median per 5 s of the run for the plot), drift, every
admitted stream's tokens against NeMo's own loop, and the server's queue delay (how far behind real
time the model is, engine/queue_delay.py) sampled each second from /readyz. Writes the JSON and a
plot (.png) next to it; `--plot-only` redraws the plot from the JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import model_file, run_record, write_json  # noqa: E402
from benchmarks.load_items import attach_oracle, make_items  # noqa: E402
from benchmarks.load_level import run_level  # noqa: E402
from benchmarks.load_summary import summarise_level  # noqa: E402
from benchmarks.sweep import Server  # noqa: E402


class ReadyzProbe(threading.Thread):
    """/readyz once a second: (seconds since start, queue_delay_s, overloaded, open streams)."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.samples, self._done = url, [], threading.Event()
        self.t0 = time.time()

    def run(self) -> None:
        while not self._done.wait(1.0):
            try:
                with urllib.request.urlopen(self.url + "/readyz", timeout=5) as r:
                    body = json.loads(r.read())
            except urllib.error.HTTPError as e:  # 503: full, overloaded
                body = json.loads(e.read())
            except OSError:
                continue
            self.samples.append((round(time.time() - self.t0, 1), body.get("queue_delay_s"), body.get("overloaded"),
                                 body.get("open_streams")))  # fmt: skip

    def stop(self) -> list:
        self._done.set()
        self.join(5)
        return self.samples


def latency_timeline(records, t0: float, bin_s: float = 5.0) -> list[tuple[float, float, int]]:
    """(bin start s, median partial latency ms, partials) per `bin_s` of the run, by receive time."""
    points = []
    for r in records:
        for recv, processed, _, _ in r.partials:
            sent = r.packet_send_time(processed)  # as StreamRecord.partial_latencies, keeping the receive time
            if sent is not None:
                points.append((recv - t0, recv - sent))
    bins: dict[int, list[float]] = {}
    for t, lat in points:
        bins.setdefault(int(t // bin_s), []).append(lat)
    return [(k * bin_s, round(1000 * float(np.median(v)), 1), len(v)) for k, v in sorted(bins.items())]


def one_run(args, nemo_path: Path, items, limit: float, log_path: Path) -> dict:
    server = Server(args, nemo_path, args.streams + 8, log_path, max_queue_delay_s=limit)
    try:
        ready = server.wait_ready(args.start_timeout)
        probe = ReadyzProbe(server.url)
        probe.start()
        t0 = time.time()
        records = asyncio.run(run_level(server.url.replace("http", "ws") + "/ws", items, args.streams, args.duration,
                                        args.ramp_s, progress=False))  # fmt: skip
        readyz = probe.stop()
        metrics = server.metrics()
    finally:
        server.stop()
    level = summarise_level(records, items, args.streams, args.duration)
    refused = [line for line in metrics.splitlines() if line.startswith("nemo_serve_refusals_total{") and not line.endswith(" 0.0")]
    admitted = [r for r in records if not (r.error and r.error.startswith("refused"))]
    return {
        "max_queue_delay_s": limit,
        "chunk_ms": ready["chunk_ms"],
        "streams_admitted": len(admitted),
        "streams_refused": len(records) - len(admitted),
        "server_refusals": refused,
        "level": level,
        "latency_timeline": latency_timeline(records, t0),
        "readyz": readyz,
    }


def plot(result: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for run in result["runs"]:
        name = "off" if not run["max_queue_delay_s"] else f"--max-queue-delay-s {run['max_queue_delay_s']:g}"
        t, ms, _ = zip(*run["latency_timeline"]) if run["latency_timeline"] else ((), (), ())
        a.plot(t, ms, marker="o", label=f"{name}: {run['streams_admitted']} admitted, {run['streams_refused']} refused")
        rt = [s[0] for s in run["readyz"] if s[1] is not None]
        b.plot(rt, [s[1] for s in run["readyz"] if s[1] is not None], label=name)
    a.set(xlabel="time in run (s)", ylabel="median partial latency (ms), admitted streams", yscale="log",
          title=f"{result['model']} {result['runs'][0]['chunk_ms']:.0f} ms chunks, {result['streams']} workers")
    b.set(xlabel="time in run (s)", ylabel="queue delay (s), from /readyz", title="model behind real time, most in the last 2 s")
    a.legend(fontsize=8)
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--context-right", type=int, default=3)
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--frontends", type=int, default=None)
    ap.add_argument("--streams", type=int, default=96, help="load generator workers (more than the server keeps up with)")
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--ramp-s", type=float, default=30.0, help="worker starts spread over this: the load grows")
    ap.add_argument("--limit", type=float, default=2.0, help="--max-queue-delay-s of the `on` run")
    ap.add_argument("--audio", default="nemo_serve/assets/demo/utterances/manifest.jsonl")
    ap.add_argument("--items", type=int, default=16)
    ap.add_argument("--item-seconds", default="10,20")
    ap.add_argument("--start-timeout", type=float, default=300.0)
    ap.add_argument("--out", required=True)
    ap.add_argument("--plot-only", action="store_true", help="redraw the plot from --out")
    args = ap.parse_args()
    if args.plot_only:
        plot(json.loads(Path(args.out).read_text()), Path(args.out).with_suffix(".png"))
        return
    record = run_record()
    nemo_path, name = model_file(args.model)
    items = make_items(args.audio, args.items, tuple(float(x) for x in args.item_seconds.split(",")))
    attach_oracle(items, str(nemo_path), args.context_right, args.dtype, args.device)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    runs = []
    for limit in (0.0, args.limit):
        run = one_run(args, nemo_path, items, limit, out.with_suffix(f".limit{limit:g}.server.log"))
        lv = run["level"]
        print(f"limit {limit:g}: admitted {run['streams_admitted']}, refused {run['streams_refused']}, partial p50/p95 "
              f"{lv['partial_latency_ms']['p50']}/{lv['partial_latency_ms']['p95']} ms, drift p90 "
              f"{lv['drift_ms_per_s']['p90']}, token-identical {lv['quality'].get('token_identical_streams')}/"
              f"{lv['quality'].get('streams_compared')}", flush=True)  # fmt: skip
        runs.append(run)
    result = {"benchmark": "overload", "run": record, "model": name, "context_right": args.context_right,
              "streams": args.streams, "duration_s": args.duration, "ramp_s": args.ramp_s, "threads": args.threads,
              "runs": runs}  # fmt: skip
    write_json(out, result)
    plot(result, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
