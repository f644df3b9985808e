"""The tables of docs/performance.md, README.md's headline table and docs/demo_model.md's WER table,
regenerated from the result files in benchmarks/results/.

    python benchmarks/performance_page.py           # rewrite the tables in place
    python benchmarks/performance_page.py --check   # exit 1 when a page differs from its results,
                                                    # or a figure in README.md or docs/ is unbacked

A table sits between `<!-- table: NAME -->` and `<!-- /table -->`; everything outside those
markers is written by hand. Under each table a line names the files it came from and the
command, commit and date that made each one. A figure written by hand elsewhere in README.md or
docs/*.md must sit under `<!-- figures: FILE -->` and equal a number of that result file
(benchmarks/page_figures.py says what counts as a figure). Nothing here measures: the commands that do are in
benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.page_figures import unbacked  # noqa: E402
from benchmarks.summarize import judge  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
SHIPPED_DEMO = ROOT / "nemo_serve" / "assets" / "demo" / "demo.nemo"
PAGES = ("README.md", "docs/performance.md", "docs/demo_model.md")  # the pages with generated tables


def checked_pages() -> list[str]:
    """Every page whose figures must be backed: README.md and docs/*.md."""
    return ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]

GPU_RUN = {"file": "gpu_h200_run3.jsonl"}  # its command, commit and date: gpu_run_info()
GPU_STEP_ROWS = 512  # the most rows one step runs (the 4 GiB step cache cap, engine/buckets.py)
GPU_GOALS = {80: 4000, 320: 8000, 1120: 12000}  # real-time streams on one H200 (DESIGN.md)
STEP_TARGETS = {"sherpa": 1.2, "pipeline": 1.5}  # engine over peer at B=32
HOST_TARGET_US = 10.0  # host CPU per stream-step
FRONTEND_TARGET_US, TWO_FRONTENDS_TARGET = 50.0, 1.8
CPU_SWEEPS = ("sweep_demo_r3_mp_cpu_fp32.json", "sweep_demo_r13_mp_cpu_fp32.json",
              "sweep_demo_r13_devices_cpu_cpu_fp32.json")  # the headline's CPU rows
STEP_FILES = ("step_fastconformer-l_r1_cpu_fp32.json", "step_fastconformer-l_r13_cpu_fp32.json",
              "step_demo_r3_cpu_fp32.json", "step_demo_r13_cpu_fp32.json")
PEERS = (("engine", "engine"), ("engine-nemo", "engine on NeMo's layers"), ("pipeline", "NeMo pipeline"),
         ("loop", "per-stream loop"), ("sherpa", "sherpa-onnx"))


# ----------------------------------------------------------------------------- reading results


def read(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def run_info(d: dict) -> dict:
    """command, commit, date and CPU of a result, wherever its script put them."""
    r = d.get("run", d)
    # a run stamped dirty ran code that was not all committed (before 2026-12-05 the results
    # folder itself counted, so older files may say so for that alone)
    commit = r.get("git_commit") or "no commit recorded"
    commit += " (dirty)" if r.get("git_dirty") else ""
    return {"command": r.get("command", "?"), "commit": commit,
            "date": str(r.get("date", "?"))[:10], "cpu": r.get("cpu", "?"), "cpu_count": r.get("cpu_count")}


def source(names: list[str], infos: list[dict]) -> str:
    lines = [f"- `{n}`: `{_short(i['command'])}` at {i['commit']}, {i['date']}" for n, i in zip(names, infos)]
    return "\n\nFrom " + ("these files:\n\n" if len(lines) > 1 else "") + ("\n".join(lines) if len(lines) > 1 else lines[0][2:])


def _short(command: str) -> str:
    """The command without its free-text --notes (the file keeps them)."""
    return re.sub(r" --notes ('([^']|'\"'\"')*'|\S+)", " --notes ...", command)


def shipped_sha() -> str:
    return hashlib.sha256(SHIPPED_DEMO.read_bytes()).hexdigest()


def model_label(d: dict) -> str:
    """The demo model is retrained now and then: say when a number is not the shipped weights'."""
    # model_sha256 is a prefix of the digest where the script shortened it (step_bench: 12 characters)
    if d.get("model") == "demo" and d.get("model_sha256") and not shipped_sha().startswith(d["model_sha256"]):
        return f"demo (earlier weights, {d['model_sha256'][:7]})"
    return str(d.get("model"))


def _f(x, nd=0, unit="") -> str:
    return "-" if x is None else f"{x:,.{nd}f}{unit}"


# ----------------------------------------------------------------------------- GPU


def gpu_records() -> list[dict]:
    return [json.loads(line) for line in (RESULTS / GPU_RUN["file"]).read_text().splitlines() if line.strip()]


def gpu_run_info(recs: list[dict]) -> dict:
    """Command, commit and date of the GPU run, from its `run` record (added to run 3 from git
    history) or the `env` record gpu_bench.py writes now."""
    run = next((r for r in recs if r["kind"] == "run"), None) or next(r for r in recs if r["kind"] == "env")
    return {"command": run.get("command", "?"), "commit": run.get("git_commit", "?"), "date": str(run.get("date", "?"))[:10]}


def gpu_levels(recs: list[dict], chunk_ms: int) -> tuple[dict | None, dict | None]:
    """(highest level kept up with every lower one kept up, first level not kept up)."""
    best = None
    for r in sorted((r for r in recs if r["kind"] == "capacity" and r["chunk_ms"] == chunk_ms), key=lambda r: r["streams"]):
        if not r["keeps_up"]:
            return best, r
        best = r
    return best, None


def gpu_rows(recs: list[dict]) -> list[tuple[int, dict | None, dict | None, dict]]:
    out = []
    for chunk_ms in sorted(GPU_GOALS):
        best, behind = gpu_levels(recs, chunk_ms)
        steps = {r["batch"]: r for r in recs if r["kind"] == "step" and r["chunk_ms"] == chunk_ms}
        out.append((chunk_ms, best, behind, steps.get(GPU_STEP_ROWS) or steps[max(steps)]))
    return out


def verdict(kept: int, goal: int) -> str:
    return "met" if kept >= goal else f"**missed, {goal / max(kept, 1):.0f}x short**"


def table_gpu() -> str:
    recs = gpu_records()
    env = next(r for r in recs if r["kind"] == "env")
    rows = ["| chunk | kept up (p95 lateness) | next level (p95 lateness) | one step of 512 rows: GPU ms, µs per stream-step "
            "| one step's real-time bound | goal | |", "|---|---|---|---|---|---|---|"]
    for chunk_ms, best, behind, step in gpu_rows(recs):
        kept = best["streams"] if best else 0
        nxt = f"{behind['streams']:,} ({_f(behind['lateness_p95_ms'], 0, ' ms')})" if behind else "not reached"
        rows.append(f"| {chunk_ms} ms | **{kept:,}** ({_f(best and best['lateness_p95_ms'], 0, ' ms')}) | {nxt} "
                    f"| {step['gpu_ms_median']:.1f}, {step['us_per_stream_step']:.0f} "
                    f"| {step['realtime_streams_bound']:,} | {GPU_GOALS[chunk_ms]:,} | {verdict(kept, GPU_GOALS[chunk_ms])} |")
    where = f"{env['device']}, torch {env['torch']}, CUDA {env['cuda']}; Nemotron 3.5 ASR architecture (random weights), bf16"
    run = gpu_run_info(recs)
    return "\n".join(rows) + f"\n\n{where}. From `{GPU_RUN['file']}`: `{run['command']}` at {run['commit']}, {run['date']}"


def table_gpu_load() -> str:
    """Tokens per encoder frame the GPU rows carried: run 3's graph-against-eager checks (tokens over
    rows x steps x frames per chunk, the decoder's max time being the chunk's encoder frames)."""
    per_mode = {}
    for r in gpu_records():
        if r["kind"] == "validate" and r.get("graph_vs_eager"):
            ge = r["graph_vs_eager"]
            frames = sum(ge["batches"]) * ge["steps"] * r["stepper"]["settings"]["decoder_max_time"]
            per_mode[r["chunk_ms"]] = ge["tokens"] / frames
    modes = sorted(per_mode)
    return (f"Tokens per encoder frame in run 3's graph-against-eager checks: "
            f"{' / '.join(f'{per_mode[m]:.2f}' for m in modes)} at {' / '.join(str(m) for m in modes)} ms.")


def _gpu_run_length(level: dict | None) -> str:
    """The GPU levels ran a few seconds each: too few chunks to measure drift, so the row says so."""
    if not level:
        return ""
    chunks = level["seconds"] * 1000 / level["chunk_ms"]
    return f" of {level['bound_ms']:,.0f} ms allowed; {level['seconds']:.0f} s run ({chunks:.0f} chunks), drift not measured"


def table_headline() -> str:
    rows = ["| hardware | model, precision | chunk | real-time streams kept up | p95 latency at that level | date, commit |",
            "|---|---|---|---|---|---|"]
    recs = gpu_records()
    run = gpu_run_info(recs)
    for chunk_ms, best, _, _ in gpu_rows(recs):
        kept = best["streams"] if best else 0
        rows.append(f"| one NVIDIA H200 (engine core only) | Nemotron 3.5 ASR 0.6B architecture, bf16 | {chunk_ms} ms "
                    f"| **{kept:,}** (goal {GPU_GOALS[chunk_ms]:,}) | {_f(best and best['lateness_p95_ms'], 0, ' ms')}{_gpu_run_length(best)} "
                    f"| {run['date']}, {run['commit']} |")
    joined = {files[0]: (files, d) for files, d in sweep_groups()}  # a run's `_top` levels with it
    files = [GPU_RUN["file"]]
    for name in CPU_SWEEPS:
        names, d = joined[name]
        files += names
        best, behind = judge(d)
        more = "" if behind or not best else " (the highest level run)"
        info = run_info(d)
        cores = len(str(d.get("server_devices") or "cpu").split(","))
        server = f"{cores} engine cores" if cores > 1 else "1 engine core"
        rows.append(f"| {info['cpu_count']}-core {info['cpu'].replace('(R)', '').replace(' Processor', '')} VM, {server} + {d.get('server_frontends')} front end "
                    f"| {model_label(d)}, fp32 | {d['chunk_ms']:.0f} ms | **{best['streams'] if best else 0}**{more} "
                    f"| {_f(best and best['partial_latency_ms']['p95'], 0, ' ms')} (partials, WebSocket) | {info['date']}, {info['commit']} |")
    return "\n".join(rows) + "\n\nFrom `benchmarks/results/`: " + ", ".join(f"`{f}`" for f in files)


def table_gpu_memory() -> str:
    d = read("memory_nemotron.json")
    gib, mib = 2**30, 2**20
    rows = ["| mode | dtype | per stream | rows per step | fixed | at {0:,} slots | most slots in {1:.0f} GiB |".format(
        d["rows"][0]["slots"], d["rows"][0]["device_gib"]), "|---|---|---|---|---|---|---|"]
    for r in d["rows"]:
        rows.append(f"| {r['mode_ms']} ms | {r['dtype']} | {r['bytes_per_stream'] / mib:.2f} MiB | {r['max_step_rows']} "
                    f"| {r['fixed_bytes'] / gib:.2f} GiB | {r['total_bytes_at_slots'] / gib:.1f} GiB | {r['most_slots_that_fit']:,} |")
    return "\n".join(rows) + f"\n\nFrom `memory_nemotron.json`: `{d['command']}` (computed on CPU)"


# ----------------------------------------------------------------------------- CPU


def _step_verdict(median: float | None, target: float, engine: dict | None, peer: dict | None) -> str:
    """`met` only when every round met it: the medians of two noisy series can pass where a round does not."""
    if median is None or median < target:
        return "**missed**"
    rounds = [e / p for e, p in zip((engine or {}).get("stream_steps_per_s_rounds", []), (peer or {}).get("stream_steps_per_s_rounds", []))]
    below = [r for r in rounds if r < target]
    if not below:
        return f"met in each of {len(rounds)} rounds" if rounds else "met"
    return f"met at the median, **missed** in {len(below)} of {len(rounds)} rounds (lowest {min(below):.2f}x)"


def table_step() -> str:
    head = "| model | chunk | batch | " + " | ".join(label for _, label in PEERS) + " | engine / pipeline | engine / sherpa-onnx |"
    rows = [head, "|---|---|---|" + "---|" * (len(PEERS) + 2)]
    notes, infos = [], []
    for name in STEP_FILES:
        d = read(name)
        infos.append(run_info(d))
        by = {(r["system"], r["batch"]): r for r in d["results"]}
        for b in sorted({r["batch"] for r in d["results"]}):
            ratios = d["ratios"].get(str(b), {})
            cells = [_f(by[(s, b)]["stream_steps_per_s"], 1) if (s, b) in by else "-" for s, _ in PEERS]
            rows.append(f"| {model_label(d)} | {d['chunk_ms']:.0f} ms | {b} | " + " | ".join(cells)
                        + f" | {_f(ratios.get('engine_over_pipeline'), 2, 'x')} | {_f(ratios.get('engine_over_sherpa'), 2, 'x')} |")
        top = str(max(r["batch"] for r in d["results"]))
        for peer, target in STEP_TARGETS.items():
            got = d["ratios"][top].get(f"engine_over_{peer}")
            ok = _step_verdict(got, target, by.get(("engine", int(top))), by.get((peer, int(top))))
            notes.append(f"{model_label(d)} {d['chunk_ms']:.0f} ms, B={top}: engine / {peer} {_f(got, 2, 'x')} (target {target}x: {ok})")
        same = by.get(("engine", int(top)), {}).get("tokens_vs_oracle")
        if same:
            notes.append(f"{model_label(d)} {d['chunk_ms']:.0f} ms: the engine token-identical to NeMo's loop on "
                         f"{same['streams_identical']}/{same['streams']} streams")
    return "\n".join(rows) + "\n\n" + "\n".join(f"- {n}" for n in notes) + source(list(STEP_FILES), infos)


def table_host() -> str:
    d = read("host_core_cpu.json")
    by = {(r["chunk_ms"], r["streams"], r["ready_fraction"]): r for r in d["core"]}
    rows = ["| chunk | streams | engine core: ready 1.0 / 0.1 | in-process engine: ready 1.0 / 0.1 | budget (chunk / streams) | target |",
            "|---|---|---|---|---|---|"]
    for chunk, streams in sorted({(c, s) for c, s, _ in by}):
        full, tenth = by[(chunk, streams, 1.0)], by[(chunk, streams, 0.1)]
        worst = max(full["core_cpu_us_per_stream_step"], tenth["core_cpu_us_per_stream_step"])
        rows.append(f"| {chunk:.0f} ms | {streams:,} | {full['core_cpu_us_per_stream_step']:.1f} / {tenth['core_cpu_us_per_stream_step']:.1f} µs "
                    f"| {full['inprocess_cpu_us_per_stream_step']:.1f} / {tenth['inprocess_cpu_us_per_stream_step']:.1f} µs "
                    f"| {full['budget_us_per_stream_step']:,.0f} µs | {HOST_TARGET_US:.0f} µs: {'met' if worst <= HOST_TARGET_US else '**missed**'} |")
    sizes = []
    for chunk in sorted({c for c, _, _ in by}):
        per = [r["core_results_bytes_per_update"] for (c, _, _), r in by.items() if c == chunk]
        sizes.append(f"{min(per):.0f}-{max(per):.0f}{' bytes per stream update' if not sizes else ''} at {chunk:.0f} ms")
    rows.append(f"\nA results message carries {' and '.join(sizes)} (every level above).")
    return "\n".join(rows) + source(["host_core_cpu.json"], [run_info(d)])


def _overload_runs(name: str) -> tuple[dict, dict]:
    runs = {r["max_queue_delay_s"]: r for r in read(name)["runs"]}
    return runs[0.0], next(r for d, r in runs.items() if d > 0)


def table_overload() -> str:
    """The overload table: off, on, and on without the re-admission cap (an older run)."""
    (off, on), (nocap_off, nocap) = _overload_runs("overload_demo_r13_cpu.json"), _overload_runs("overload_demo_r13_nocap_cpu.json")

    def lat(r, key):
        ms = r["level"][key]
        return f"{ms['p50'] / 1e3:.1f} / {ms['p95'] / 1e3:.1f} s"

    def cells(label, fn, with_off=""):
        third = fn(nocap) + (f" ({with_off}{fn(nocap_off)})" if with_off else "")
        return f"| {label} | {fn(off)} | {fn(on)} | {third} |"

    q = lambda r: r["level"]["quality"]  # noqa: E731
    rows = [f"| | off (`--max-queue-delay-s 0`) | on ({on['max_queue_delay_s']:g} s, gradual re-admission) | on, without the cap (`_nocap`) |",
            "|---|---|---|---|",
            cells("items admitted / attempts refused", lambda r: f"{r['streams_admitted']:,} / {r['streams_refused']:,}"),
            cells("model behind real time, at most", lambda r: f"{max(x[1] for x in r['readyz'] if x[1] is not None):.1f} s"),
            cells("partial latency p50 / p95", lambda r: lat(r, "partial_latency_ms"), "off in that run: "),
            cells("final latency p50 / p95", lambda r: lat(r, "final_latency_ms"), "off: "),
            cells("audio completed in the run", lambda r: f"{r['level']['audio_s_completed']:,.0f} s", "off: "),
            cells("token-identical to NeMo's loop", lambda r: f"{q(r)['token_identical_streams']}/{q(r)['streams_compared']}", "off: ")]
    names = ["overload_demo_r13_cpu.json", "overload_demo_r13_nocap_cpu.json"]
    return "\n".join(rows) + source(names, [run_info(read(n)) for n in names])


def table_ring() -> str:
    """The ring positions in messages against plain stores, per packets per event-loop tick."""
    d = read("ring_publication_cpu.json")
    rows = ["| packets per tick | plain stores: µs per packet (core's loop thread) | messages: µs per packet (core's loop thread) |",
            "|---|---|---|"]
    for r in sorted(d["cost"], key=lambda r: -r["per_tick"]):
        rows.append(f"| {r['per_tick']} | {r['plain_stores_us_per_packet']:.1f} ({r['plain_stores_core_us_per_packet']:.1f}) "
                    f"| {r['messages_us_per_packet']:.1f} ({r['messages_core_us_per_packet']:.1f}) |")
    h = read("host_core_ring_messages_cpu.json")["summary_us_per_stream_step"]
    rows.append(f"\nAt the scale the core is sized for, its CPU per stream-step (`benchmarks/host_bench.py`, 1,000 streams, "
                f"plain stores and messages alternated in one run) moved within noise: median {h['before_80ms']['median']:.2f} -> "
                f"{h['after_80ms']['median']:.2f} µs at 80 ms, {h['before_1120ms']['median']:.1f} -> {h['after_1120ms']['median']:.1f} µs "
                f"at 1120 ms (runs spread {min(h['before_1120ms']['runs'] + h['after_1120ms']['runs']):.0f}-"
                f"{max(h['before_1120ms']['runs'] + h['after_1120ms']['runs']):.0f}).")
    names = ["ring_publication_cpu.json", "host_core_ring_messages_cpu.json"]
    return "\n".join(rows) + source(names, [run_info(d), run_info(read(names[1]))])


FUZZ_FILES = ("fuzz_server_tiny-hybrid.json", "fuzz_server_demo_r3.json")


def table_fuzz() -> str:
    """docs/performance.md's hostile-input runs of benchmarks/fuzz_server.py against the real server."""
    rows = ["| date, commit, model | fuzzed messages (cases), bytes | crashes | abnormal closes, hangs | connect/abort cycles "
            "| slots leaked | RSS before -> after | drain | log |", "|---|---|---|---|---|---|---|---|---|"]
    closes = []
    for name in FUZZ_FILES:
        d, info = read(name), run_info(read(name))
        f, dr = d["fuzz"], d["drain"]
        ends = sum(1 for e in dr["stream_ends"] if e[:2] == ["done", "draining"])
        rows.append(f"| {info['date']}, {info['commit']}, {d['model']} | {f['messages']:,} ({f['cases']:,}), {f['bytes_sent'] / 1e9:.2f} GB "
                    f"| {f['crashes']} | {f['abnormal']}, {f['hangs']} | {d['abort_cycles']:,} | {d['slots_leaked']} "
                    f"| {d['rss_mb_before']:.0f} -> {d['rss_mb_after']:.0f} MB | {dr['drain_s']:.2f} s, exit {dr['exit_code']}, "
                    f"{ends}/{dr['streams']} `done` `draining` | {d['log_lines']:,} lines, {d['log_bytes'] / 1e3:.0f} kB, "
                    f"{d['log_tracebacks']} tracebacks |")
        by_code = ", ".join(f"{n:,} x {c}" for c, n in sorted(f["closes"].items(), key=lambda kv: -kv[1]))
        closes.append(f"{d['model']}: closes {by_code}; {sum(f['refused'].values()):,} handshakes refused (503, slots taken)")
    rows.append("\n" + "; ".join(closes) + ".")
    seg = read("fuzz_server_demo_r3.json")["long_segment"]
    rows.append(f"\nA {seg['seconds'] / 60:.0f}-minute segment (demo model, endpointing off) sent {seg['bytes_sent'] / 1e6:.2f} MB "
                f"in {seg['partials']:,} partials (largest {seg['largest_partial_bytes'] / 1e3:.1f} kB), where whole-segment partials "
                f"would have come to {seg['bytes_with_whole_segment_partials'] / 1e6:.1f} MB: past 256 tokens a partial carries only what is new.")
    return "\n".join(rows) + source(list(FUZZ_FILES), [run_info(read(n)) for n in FUZZ_FILES])


def table_frontend() -> str:
    d = read("host_core_cpu.json")
    pp, tp = d["frontend"]["per_packet"], d["frontend"]["throughput"]
    rate = {k: statistics.mean(r["packets_per_s"] for r in tp["runs"] if r["frontends"] == k) for k in (1, 2)}
    saturated = [r["frontend_cpu_us_per_packet"] for r in tp["runs"] if r["frontends"] == 1]
    gain = rate[2] / rate[1]
    rows = ["| | measured | target |", "|---|---|---|",
            f"| one front end, CPU per 100 ms PCM16 packet, {pp['runs']['interim_results']['streams']} real-time streams "
            f"({Path(pp['model']).stem}, {pp['chunk_ms']:.0f} ms) | {pp['frontend_cpu_us_per_packet']:.0f} µs per packet + "
            f"{pp['frontend_cpu_us_per_result']:.0f} µs per result message ({pp['frontend_cpu_us_per_packet_all_in']:.0f} µs all in) "
            f"| {pp['target_us_per_packet']} µs: {'met' if pp['frontend_cpu_us_per_packet'] <= FRONTEND_TARGET_US else '**missed**'} |",
            f"| one front end at saturation ({tp['runs'][0]['connections']} connections as fast as TCP allows, {tp['model']}) "
            f"| {' / '.join(f'{x:.1f}' for x in saturated)} µs per packet (repeats) | {FRONTEND_TARGET_US:.0f} µs |",
            f"| packets per second, 1 / 2 front ends (mean of repeats) | {rate[1]:,.0f} / {rate[2]:,.0f}: {gain:.2f}x "
            f"| {TWO_FRONTENDS_TARGET}x: {'met' if gain >= TWO_FRONTENDS_TARGET else '**missed**'} |"]
    return "\n".join(rows) + source(["host_core_cpu.json"], [run_info(d)])


PACKET_PATHS = {
    "ws_s16_100ms": "/ws, 100 ms PCM16 binary frames", "ws_f32_100ms": "/ws, 100 ms float32 binary frames",
    "ws_s16_20ms": "/ws, 20 ms PCM16", "ws_f32_20ms": "/ws, 20 ms float32",
    "realtime_24k_20ms": "/v1/realtime append, 20 ms at 24 kHz, server VAD",
    "realtime_24k_20ms_novad": "/v1/realtime append, 20 ms at 24 kHz, turn_detection null",
    "grpc_100ms": "Riva StreamingRecognize, 100 ms", "grpc_20ms": "Riva StreamingRecognize, 20 ms",
}  # fmt: skip


def table_packet_cost() -> str:
    """benchmarks/packet_cost.py: per path, before and after side by side, and where the after's
    microseconds go (py-spy components)."""
    d = read("packet_cost_cpu.json")
    run = d["runs"][0]
    before, after = run["trees"][0], run["trees"][-1]
    target = d["target_us_per_packet"]
    rows = [f"| path ({d['streams_per_frontend']} paced streams, 1 front end) | {before['tree']} | {after['tree']} "
            f"| result messages per packet | largest parts after (µs per packet, py-spy) | target |",
            "|---|---|---|---|---|---|"]  # fmt: skip
    for path, a in after["paths"].items():
        b = before["paths"][path]["us_per_packet_all_in"]
        parts = list(a.get("profile", {}).get("by_component_us_per_packet", {}).items())[:3]
        per_result = statistics.median(r["results_per_packet"] for r in a["repeats"])
        rows.append(f"| {PACKET_PATHS.get(path, path)} | {b:.0f} µs | {a['us_per_packet_all_in']:.0f} µs "
                    f"| {per_result:.2f} | {', '.join(f'{k} {v:.0f}' for k, v in parts)} "
                    f"| {target} µs: {'met' if a['us_per_packet_all_in'] <= target else '**missed**'} |")  # fmt: skip
    return "\n".join(rows) + source(["packet_cost_cpu.json"], [run_info(d)])


def _server(d: dict) -> str:
    devices = str(d.get("server_devices") or "")
    cores = len(devices.split(",")) if devices else 1
    return f"{cores} engine core{'s' if cores > 1 else ''} + {d['server_frontends']} front end"


def sweep_groups() -> list[tuple[list[str], dict]]:
    """Sweep files, a run split in two (`_high` then `_top`, straight after) joined into one."""
    groups: dict[str, tuple[list[str], dict]] = {}
    for p in sorted(RESULTS.glob("sweep_*.json")):
        d = json.loads(p.read_text())
        key = re.sub(r"_(high|top)_", "_", p.name)
        if key in groups:
            groups[key][0].append(p.name)
            groups[key][1]["levels"] = sorted(groups[key][1]["levels"] + d["levels"], key=lambda lv: lv["streams"])
        else:
            groups[key] = ([p.name], d)
    return list(groups.values())


def table_sweeps() -> str:
    rows = ["| model | chunk | server | streams kept up | partial / final p95 there | next level: why behind | server CPU there | token-identical there |",
            "|---|---|---|---|---|---|---|---|"]
    names, infos = [], []
    for files, d in sweep_groups():
        best, behind = judge(d)
        names.append(" + ".join(files))
        infos.append(run_info(d))
        why = (f"N={behind['streams']}: p95 {_f(behind['partial_latency_ms']['p95'], 0, ' ms')}, "
               f"p90 drift {_f(behind['drift_ms_per_s']['p90'], 0, ' ms/s')}") if behind else "not reached"
        q = (best or {}).get("quality", {})
        same = f"{q['token_identical_streams']}/{q['streams_compared']}" if "token_identical_streams" in q else "-"
        rows.append(f"| {model_label(d)} | {d['chunk_ms']:.0f} ms | {_server(d)} | **{best['streams'] if best else 0}** "
                    f"| {_f(best and best['partial_latency_ms']['p95'], 0)} / {_f(best and best['final_latency_ms']['p95'], 0, ' ms')} "
                    f"| {why} | {_f((best or {}).get('server_cpu_cores'), 2)} | {same} |")
    return "\n".join(rows) + source(names, infos)


def table_mode_mix() -> str:
    rows = ["| engine cores | one server serving 80 + 1120 ms | two single-mode servers |", "|---|---|---|"]
    names, infos = [], []
    for name, label in (("mode_mix_demo_r0_r13_cpu_fp32.json", "one engine core"),
                        ("mode_mix_demo_r0_r13_2cores_cpu_fp32.json", "two engine cores (`--devices cpu,cpu`)")):
        d = read(name)
        names.append(name)
        infos.append(run_info(d))
        split = d.get("split_kept_up_streams")
        rows.append(f"| {label} | **{d['mixed_kept_up_streams']}** streams kept up | {split if split is not None else '-'} |")
    return "\n".join(rows) + source(names, infos)


def table_demo_wer() -> str:
    d = read("demo_wer_accented_avg3_cpu.json")
    same = "the shipped `demo.nemo`" if d.get("model_sha256") == shipped_sha() else f"weights {d.get('model_sha256', '?')[:7]}"
    missed = "".join(f"\n- missed: {m}" for m in d.get("missed", []))
    return (d["table"] + f"\n\nWER of NeMo's cache-aware loop, first {d['limit']} utterances per set, {same}; bold: within "
            f"the {100 * d['target']['wer']:.0f}% target.{missed}" + source(["demo_wer_accented_avg3_cpu.json"], [run_info(d)]))


def table_boost_benefit() -> str:
    name = "phrase_boost_benefit_demo_r13_cpu.json"
    d = read(name)
    rows = ["| boost | term error rate | WER, utterances with a term | false alarms | WER, utterances without |",
            "|---|---|---|---|---|"]
    for r in d["results"]:
        boost = "no phrases" if r["boost"] is None else f"{r['boost']:g}"
        rows.append(f"| {boost} | {r['term_error_rate']:.3f} | {r['wer_positive']:.3f} | {r['false_alarm_rate']:.3f} "
                    f"({len(r['false_alarms'])}/{r['negatives']}) | {r['wer_negative']:.3f} |")
    first = d["results"][0]
    note = (f"\n\n{first['terms_spoken']} utterances of {len(d['terms'])} terms ({', '.join(d['voices'])}), "
            f"{first['negatives']} without; every stream sends all {d['phrases_per_stream']} terms as its phrases.")
    return "\n".join(rows) + note + source([name], [run_info(d)])


def table_boost_cost() -> str:
    name = "step_demo_r13_boost_cpu_fp32.json"
    d = read(name)
    by = {(r["system"], r["batch"]): r for r in d["results"]}
    rows = ["| batch | engine | one stream boosted | every stream boosted | cost, one / every |", "|---|---|---|---|---|"]
    for b in sorted({r["batch"] for r in d["results"]}):
        ratios = d["ratios_cpu_time"][str(b)]
        cells = [_f(by[(s, b)]["stream_steps_per_cpu_s"], 1) for s in ("engine", "engine-boost1", "engine-boostall")]
        cost = [f"{100 * (ratios[f'engine_over_{s}'] - 1):+.0f}%" for s in ("engine-boost1", "engine-boostall")]
        rows.append(f"| {b} | " + " | ".join(cells) + f" | {cost[0]} / {cost[1]} |")
    note = (f"\n\nStream-steps per CPU second, {model_label(d)} {d['chunk_ms']:.0f} ms, {d['dtype']}, one thread, "
            f"median of {d['rounds']} interleaved rounds; cost: the median per-round ratio engine / boosted, minus 1.")
    return "\n".join(rows) + note + source([name], [run_info(d)])


TABLES = {
    "headline": table_headline, "boost-benefit": table_boost_benefit, "boost-cost": table_boost_cost, "gpu": table_gpu, "gpu-load": table_gpu_load, "gpu-memory": table_gpu_memory, "step": table_step,
    "host": table_host, "frontend": table_frontend, "sweeps": table_sweeps, "mode-mix": table_mode_mix,
    "demo-wer": table_demo_wer, "overload": table_overload, "fuzz": table_fuzz, "ring": table_ring,
}
TABLES["packet-cost"] = table_packet_cost
MARKED = re.compile(r"(<!-- table: ([\w-]+) -->\n)(.*?)(<!-- /table -->)", re.S)


def render(text: str, cache: dict[str, str]) -> str:
    def fill(m: re.Match) -> str:
        name = m.group(2)
        if name not in TABLES:
            raise SystemExit(f"unknown table {name!r}; known: {', '.join(TABLES)}")
        if name not in cache:
            cache[name] = TABLES[name]()
        return f"{m.group(1)}{cache[name]}\n{m.group(4)}"

    return MARKED.sub(fill, text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 when a page is out of date")
    args = ap.parse_args(argv)
    cache: dict[str, str] = {}
    stale = []
    for rel in PAGES:
        path = ROOT / rel
        old = path.read_text()
        new = render(old, cache)
        if new != old:
            stale.append(rel)
            if not args.check:
                path.write_text(new)
    verb = "out of date" if args.check else "rewritten"
    print(f"{verb}: {', '.join(stale)}" if stale else "every page matches its results")
    loose = unbacked(ROOT, RESULTS, checked_pages())
    for problem in loose:
        print(f"unbacked figure: {problem}")
    return 1 if args.check and (stale or loose) else 0


if __name__ == "__main__":
    sys.exit(main())
