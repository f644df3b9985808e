"""The GPU tables of docs/performance.md and README.md's headline table (the H200 run beside the
CPU sweeps), rendered from benchmarks/results/."""

from __future__ import annotations

import json

from benchmarks import page_results
from benchmarks.page_results import fmt, model_label, read, run_info, sweep_groups
from benchmarks.summarize import judge

GPU_RUN = {"file": "gpu_h200_run3.jsonl"}  # its command, commit and date: gpu_run_info()
GPU_STEP_ROWS = 512  # the most rows one step runs (the 4 GiB step cache cap, engine/buckets.py)
GPU_GOALS = {80: 4000, 320: 8000, 1120: 12000}  # real-time streams on one H200 (DESIGN.md)
CPU_SWEEPS = ("sweep_demo_r3_mp_cpu_fp32.json", "sweep_demo_r13_mp_cpu_fp32.json",
              "sweep_demo_r13_devices_cpu_cpu_fp32.json")  # the headline's CPU rows


def gpu_records() -> list[dict]:
    return [json.loads(line) for line in (page_results.RESULTS / GPU_RUN["file"]).read_text().splitlines() if line.strip()]


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
        nxt = f"{behind['streams']:,} ({fmt(behind['lateness_p95_ms'], 0, ' ms')})" if behind else "not reached"
        rows.append(f"| {chunk_ms} ms | **{kept:,}** ({fmt(best and best['lateness_p95_ms'], 0, ' ms')}) | {nxt} "
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
                    f"| **{kept:,}** (goal {GPU_GOALS[chunk_ms]:,}) | {fmt(best and best['lateness_p95_ms'], 0, ' ms')}{_gpu_run_length(best)} "
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
                    f"| {fmt(best and best['partial_latency_ms']['p95'], 0, ' ms')} (partials, WebSocket) | {info['date']}, {info['commit']} |")
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
