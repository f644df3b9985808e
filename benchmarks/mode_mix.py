"""Mixed latency modes: one server serving two chunk modes against two single-mode servers on the same cores.

    python benchmarks/mode_mix.py --model demo --audio nemo_serve/assets/demo/utterances/manifest.jsonl \
        --modes 0,13 --fraction 0.3 --levels 16,24,32,48 --duration 30 \
        --out benchmarks/results/mode_mix_demo_r0_r13_cpu_fp32.json

At each level N, a fraction (--fraction) of the N real-time streams asks for the first mode (80 ms
chunks at 0) and the rest for the second (1120 ms at 13), two ways, one after the other:
  mixed: one `nemo-serve --context-right 0,13` server, every stream choosing its mode in its config;
  split: two servers, `--context-right 0` and `--context-right 13`, each serving its share,
         started side by side on the same cores (what an operator does today: load the model twice).
Per mode it reports what benchmarks/sweep.py reports per level (partial and final latency
percentiles, drift, token identity with NeMo's loop at that mode) and whether that mode keeps up
(load_summary.keeps_up, against its own chunk period); per way, the server processes' CPU and
resident memory (summed over each process tree). A way keeps up at N when both modes do. Both ways
run with the same --frontends and --threads; the load generator runs in this process.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import model_file, run_record, write_json  # noqa: E402
from benchmarks.load_items import attach_oracle, make_items  # noqa: E402
from benchmarks.load_level import run_level  # noqa: E402
from benchmarks.load_summary import format_level, keeps_up, summarise_level  # noqa: E402
from benchmarks.process_sampler import Sampler  # noqa: E402
from benchmarks.sweep import Server  # noqa: E402


def _server(args, nemo_path: Path, modes: str, slots: int, log: Path, devices: str | None = None) -> Server:
    a = SimpleNamespace(context_right=modes, dtype="fp32", device="cpu", frontends=args.frontends, threads=args.threads,
                        devices=devices)  # fmt: skip
    return Server(a, nemo_path, slots, log)


async def _level(targets, duration_s: float, ramp_s: float) -> list[list]:
    """targets: [(ws url, items, streams, context_right)], all at once."""
    return await asyncio.gather(*(
        run_level(url, items, n, duration_s, ramp_s, progress=False, context_right=r) for url, items, n, r in targets if n
    ))


def run_way(way: str, args, nemo_path: Path, items: dict[int, list], levels: list[int], prefix: Path) -> list[dict]:
    modes = args.modes
    slots = max(levels) + 8
    if way == "mixed":
        servers = {None: _server(args, nemo_path, ",".join(map(str, modes)), slots, Path(f"{prefix}.mixed.server.log"),
                                 args.mixed_devices)}  # fmt: skip
    else:
        servers = {r: _server(args, nemo_path, str(r), slots, Path(f"{prefix}.split_r{r}.server.log")) for r in modes}
    results = []
    try:
        ready = {k: s.wait_ready(args.start_timeout) for k, s in servers.items()}
        chunk_ms = {r: 80.0 * (r + 1) for r in modes}
        samplers = {k: Sampler(s.proc.pid) for k, s in servers.items()}
        for sm in samplers.values():
            sm.start()
        time.sleep(2.0)
        idle_rss = sum(sm.window(time.time() - 2.0, time.time()).get("server_rss_mib_max", 0.0) for sm in samplers.values())
        for n in levels:
            counts = {modes[0]: round(args.fraction * n), modes[1]: n - round(args.fraction * n)}
            targets = []
            for r in modes:
                server = servers[None] if way == "mixed" else servers[r]
                targets.append((server.url.replace("http", "ws") + "/ws", items[r], counts[r], r))
            t0 = time.time()
            recs = asyncio.run(_level(targets, args.duration, args.ramp_s))
            t1 = time.time()
            level = {"streams": n, "way": way, "modes": {}}
            for (_, its, k, r), rs in zip([t for t in targets if t[2]], recs):
                lv = summarise_level(rs, its, k, args.duration)
                lv["keeps_up"] = keeps_up(lv, chunk_ms[r], args.max_drift)
                lv["chunk_ms"] = chunk_ms[r]
                level["modes"][str(r)] = lv
                print(f"{way} N={n} mode {r} ({chunk_ms[r]:.0f} ms): " + format_level(lv), file=sys.stderr, flush=True)
            windows = [sm.window(t0, t1) for sm in samplers.values()]
            level["server_cpu_cores"] = round(sum(w.get("server_cpu_cores", 0.0) for w in windows), 2)
            level["server_rss_mib_max"] = round(sum(w.get("server_rss_mib_max", 0.0) for w in windows), 1)
            level["keeps_up"] = all(m["keeps_up"] for m in level["modes"].values())
            results.append(level)
            if not level["keeps_up"]:
                break
        for sm in samplers.values():
            sm.stop()
        for level in results:
            level["server_rss_mib_idle"] = round(idle_rss, 1)
        summaries = {str(k): s.summary().get("summary") for k, s in servers.items()}
        for level in results:
            level["server_summaries"] = summaries
            level["readyz_modes"] = {str(k): r.get("modes") for k, r in ready.items()}
    finally:
        for s in servers.values():
            s.stop()
    return results


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(data["modes"]), figsize=(5 * len(data["modes"]), 4))
    for ax, r in zip(axes, data["modes"]):
        for way, style in (("mixed", "o-"), ("split", "s--")):
            pts = [(lv["streams"], lv["modes"][str(r)]["partial_latency_ms"]["p95"]) for lv in data["levels"]
                   if lv["way"] == way and str(r) in lv["modes"]]
            if pts:
                ax.plot(*zip(*pts), style, label=f"{way} ({'one server' if way == 'mixed' else 'two servers'})")
        ax.axhline(2 * 80 * (r + 1), color="grey", lw=0.8, ls=":", label="keep-up bound (2 chunks)")
        ax.set_title(f"{80 * (r + 1)} ms streams (context_right {r})")
        ax.set_xlabel(f"total streams ({int(100 * data['fraction'])}% at {80 * (data['modes'][0] + 1)} ms)")
        ax.set_ylabel("partial latency p95 (ms)")
        ax.set_yscale("log")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--audio", default="nemo_serve/assets/demo/utterances/manifest.jsonl")
    ap.add_argument("--items", type=int, default=16)
    ap.add_argument("--item-seconds", default="10,20")
    ap.add_argument("--modes", default="0,13", help="two right contexts: the short-chunk mode first")
    ap.add_argument("--fraction", type=float, default=0.3, help="share of the streams at the first mode")
    ap.add_argument("--levels", default="16,24,32,48")
    ap.add_argument("--duration", type=float, default=30.0)
    ap.add_argument("--ramp-s", type=float, default=2.0)
    ap.add_argument("--max-drift", type=float, default=20.0)
    ap.add_argument("--frontends", type=int, default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--start-timeout", type=float, default=180.0)
    ap.add_argument("--ways", default="mixed,split", help="which ways to run: mixed, split or both")
    ap.add_argument("--mixed-devices", default=None,
                    help="the mixed server's --devices (e.g. cpu,cpu: two engine cores, as many engine threads as the split)")
    ap.add_argument("--notes", default="")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    args.modes = [int(x) for x in args.modes.split(",")]
    if len(args.modes) != 2:
        raise SystemExit("--modes takes two right contexts")
    levels = [int(x) for x in args.levels.split(",")]
    record = run_record()
    nemo_path, name = model_file(None if args.model == "demo" else args.model)
    base = make_items(args.audio, args.items, tuple(float(x) for x in args.item_seconds.split(",")))
    items = {}
    for r in args.modes:  # NeMo's loop tokens differ per mode: one copy of the test set per mode
        items[r] = copy.deepcopy(base)
        attach_oracle(items[r], str(nemo_path), r)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    data = {**record, "notes": args.notes, "model": name, "modes": args.modes, "fraction": args.fraction,
            "mixed_devices": args.mixed_devices, "levels": []}  # fmt: skip
    ways = args.ways.split(",")
    for way in ways:
        data["levels"] += run_way(way, args, nemo_path, items, levels, out.with_suffix(""))
        write_json(out, data)  # after each way: a cut-off run keeps what it measured
    for way in ways:
        kept = [lv["streams"] for lv in data["levels"] if lv["way"] == way and lv["keeps_up"]]
        data[f"{way}_kept_up_streams"] = max(kept, default=0)
    write_json(out, data)
    plot(data, out.with_suffix(".png"))
    print("kept up: " + ", ".join(f"{w} {data[f'{w}_kept_up_streams']}" for w in ways) + " streams", file=sys.stderr)


if __name__ == "__main__":
    main()
