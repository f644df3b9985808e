"""docs/performance.md's CPU tables: the step against its peers, the host and front-end CPU, the
packet cost, the ring, and the load sweeps, rendered from benchmarks/results/."""

from __future__ import annotations

import statistics
from pathlib import Path

from benchmarks.page_results import fmt, model_label, read, run_info, source, sweep_groups
from benchmarks.summarize import judge

STEP_TARGETS = {"sherpa": 1.2, "pipeline": 1.5}  # engine over peer at B=32
HOST_TARGET_US = 10.0  # host CPU per stream-step
HOST_TARGET_OVERLAPPED_US = 17.0  # issue 46: at 80 ms, the overlapped loop
# One before/after pair of trees, its 80 ms and 1120 ms levels run apart (benchmarks/host_bench_ab.py).
HOST_AB_FILES = ["host_bench_ab_issue46_arena_cpu.json", "host_bench_ab_issue46_arena_1120_cpu.json"]
FRONTEND_TARGET_US, TWO_FRONTENDS_TARGET = 50.0, 1.8
STEP_FILES = ("step_fastconformer-l_r1_cpu_fp32.json", "step_fastconformer-l_r13_cpu_fp32.json",
              "step_demo_r3_cpu_fp32.json", "step_demo_r13_cpu_fp32.json")
PEERS = (("engine", "engine"), ("engine-nemo", "engine on NeMo's layers"), ("pipeline", "NeMo pipeline"),
         ("loop", "per-stream loop"), ("sherpa", "sherpa-onnx"))


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
            cells = [fmt(by[(s, b)]["stream_steps_per_s"], 1) if (s, b) in by else "-" for s, _ in PEERS]
            rows.append(f"| {model_label(d)} | {d['chunk_ms']:.0f} ms | {b} | " + " | ".join(cells)
                        + f" | {fmt(ratios.get('engine_over_pipeline'), 2, 'x')} | {fmt(ratios.get('engine_over_sherpa'), 2, 'x')} |")
        top = str(max(r["batch"] for r in d["results"]))
        for peer, target in STEP_TARGETS.items():
            got = d["ratios"][top].get(f"engine_over_{peer}")
            ok = _step_verdict(got, target, by.get(("engine", int(top))), by.get((peer, int(top))))
            notes.append(f"{model_label(d)} {d['chunk_ms']:.0f} ms, B={top}: engine / {peer} {fmt(got, 2, 'x')} (target {target}x: {ok})")
        same = by.get(("engine", int(top)), {}).get("tokens_vs_oracle")
        if same:
            notes.append(f"{model_label(d)} {d['chunk_ms']:.0f} ms: the engine token-identical to NeMo's loop on "
                         f"{same['streams_identical']}/{same['streams']} streams")
    return "\n".join(rows) + "\n\n" + "\n".join(f"- {n}" for n in notes) + source(list(STEP_FILES), infos)


def table_host() -> str:
    """Before and after issue 46's host work, side by side in one run (benchmarks/host_bench_ab.py)."""
    files = [read(name) for name in HOST_AB_FILES]
    d = {"summary": [r for f in files for r in f["summary"]], "runs": [r for f in files for r in f["runs"]]}
    by = {(r["chunk_ms"], r["streams"], r["ready_fraction"]): r for r in d["summary"]}
    run = files[0]["run"]
    rows = [f"| chunk | streams | engine core: ready 1.0 / 0.1, before ({run['old_commit']}) -> after ({run['new_commit']}) "
            "| in-process engine: ready 1.0 / 0.1, before -> after | budget (chunk / streams) | target |",
            "|---|---|---|---|---|---|"]
    for chunk, streams in sorted({(c, s) for c, s, _ in by}):
        full, tenth = by[(chunk, streams, 1.0)], by[(chunk, streams, 0.1)]

        def cell(key: str) -> str:
            return (f"{full[key + '_old']:.1f} / {tenth[key + '_old']:.1f} -> "
                    f"**{full[key + '_new']:.1f} / {tenth[key + '_new']:.1f} µs**")

        worst = max(full["core_cpu_us_per_stream_step_new"], tenth["core_cpu_us_per_stream_step_new"])
        verdict = f"{HOST_TARGET_US:.0f} µs: {'met' if worst <= HOST_TARGET_US else '**missed**'}"
        if chunk == 80:
            verdict += f"; {HOST_TARGET_OVERLAPPED_US:.0f} µs overlapped (issue 46): {'met' if worst <= HOST_TARGET_OVERLAPPED_US else '**missed**'}"
        rows.append(f"| {chunk:.0f} ms | {streams:,} | {cell('core_cpu_us_per_stream_step')} | {cell('inprocess_cpu_us_per_stream_step')} "
                    f"| {full['budget_us_per_stream_step']:,.0f} µs | {verdict} |")
    new = [r for r in d["runs"] if r["kind"] == "new"]
    sizes = []
    for chunk in sorted({c for c, _, _ in by}):
        per = [r["core_results_bytes_per_update"] for r in new if r["chunk_ms"] == chunk]
        sizes.append(f"{min(per):.0f}-{max(per):.0f}{' bytes per stream update' if not sizes else ''} at {chunk:.0f} ms")
    rate = sorted({r["core_stub_tokens_per_frame"] for r in new})
    rows.append(f"\nA results message carries {' and '.join(sizes)} (every level above). The stub step emitted "
                f"{rate[0]:.2f}-{rate[-1]:.2f} tokens per encoder frame, drawn from the trained demo model's measured "
                "per-frame counts (`emission_demo_cpu_fp32.json`).")
    return "\n".join(rows) + source(HOST_AB_FILES, [run_info(f) for f in files])


def table_ring() -> str:
    """The ring positions in messages and in shared memory (the server's way on x86-64) against bare
    plain stores, per packets per event-loop tick."""
    d = read("ring_publication_cpu.json")
    ways = (("plain_stores", "plain stores"), ("messages", "messages"), ("shared", "shared (the server's, x86-64)"))
    rows = ["| packets per tick | " + " | ".join(f"{name}: µs per packet (core's loop thread)" for _, name in ways) + " |",
            "|---|" + "---|" * len(ways)]  # fmt: skip
    for r in sorted(d["cost"], key=lambda r: -r["per_tick"]):
        rows.append(f"| {r['per_tick']} | " + " | ".join(
            f"{r[key + '_us_per_packet']:.1f} ({r[key + '_core_us_per_packet']:.1f})" for key, _ in ways) + " |")  # fmt: skip
    h = read("host_core_ring_messages_cpu.json")["summary_us_per_stream_step"]
    rows.append(f"\nAt the scale the core is sized for, its CPU per stream-step (`benchmarks/host_bench.py`, 1,000 streams, "
                f"plain stores and messages alternated in one run) moved within noise: median {h['before_80ms']['median']:.2f} -> "
                f"{h['after_80ms']['median']:.2f} µs at 80 ms, {h['before_1120ms']['median']:.1f} -> {h['after_1120ms']['median']:.1f} µs "
                f"at 1120 ms (runs spread {min(h['before_1120ms']['runs'] + h['after_1120ms']['runs']):.0f}-"
                f"{max(h['before_1120ms']['runs'] + h['after_1120ms']['runs']):.0f}).")
    names = ["ring_publication_cpu.json", "host_core_ring_messages_cpu.json"]
    return "\n".join(rows) + source(names, [run_info(d), run_info(read(names[1]))])


def table_frontend() -> str:
    d = read("host_core_cpu.json")
    pp, tp = d["frontend"]["per_packet"], d["frontend"]["throughput"]
    rate = {k: statistics.mean(r["packets_per_s"] for r in tp["runs"] if r["frontends"] == k) for k in (1, 2)}
    one = [r for r in tp["runs"] if r["frontends"] == 1]
    saturated = [r["frontend_cpu_us_per_packet"] for r in one]
    # Openings refused (503, no free slot) in the window cost front-end CPU that the figure divides by packets.
    refused = " / ".join(f"{r['error_count']:,} refused to {r['streams_opened_in_window']:,} opened" for r in one)
    gain = rate[2] / rate[1]
    rows = ["| | measured | target |", "|---|---|---|",
            f"| one front end, CPU per 100 ms PCM16 packet, {pp['runs']['interim_results']['streams']} real-time streams "
            f"({Path(pp['model']).stem}, {pp['chunk_ms']:.0f} ms) | {pp['frontend_cpu_us_per_packet']:.0f} µs per packet + "
            f"{pp['frontend_cpu_us_per_result']:.0f} µs per result message ({pp['frontend_cpu_us_per_packet_all_in']:.0f} µs all in) "
            f"| {pp['target_us_per_packet']} µs: {'met' if pp['frontend_cpu_us_per_packet'] <= FRONTEND_TARGET_US else '**missed**'} |",
            f"| one front end at saturation ({tp['runs'][0]['connections']} connections as fast as TCP allows, {tp['model']}) "
            f"| {' / '.join(f'{x:.1f}' for x in saturated)} µs per packet (repeats; stream openings {refused}: "
            f"their handshakes' CPU is in the figure) | {FRONTEND_TARGET_US:.0f} µs |",
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


PACKET_FILES = ("packet_cost_fastws_cpu.json", "packet_cost_fastws_160_cpu.json")  # (profiled, more streams)
PACKET_ROWS = ("ws_s16_20ms", "realtime_24k_20ms_novad", "grpc_20ms")
FAST_SUFFIX = "_fast"  # packet_cost.py's paths through --fast-ws-port (picows)


def table_packet_cost() -> str:
    """benchmarks/packet_cost.py --fast-ws: per path, uvicorn's port and picows's side by side in one
    server, at two stream counts, and where picows's microseconds go (py-spy components)."""
    runs = [read(name) for name in PACKET_FILES]
    paths = [r["runs"][0]["trees"][0]["paths"] for r in runs]
    target = runs[0]["target_us_per_packet"]
    counts = [r["streams_per_frontend"] for r in runs]
    cols = " | ".join(f"{n} streams: uvicorn | {n} streams: picows" for n in counts)
    rows = [f"| path (paced, 1 front end) | {cols} | result messages per packet | largest parts, picows, {counts[0]} "
            f"streams (µs per packet, py-spy) | target |", "|---|" + "---|---|" * len(runs) + "---|---|---|"]  # fmt: skip
    for path in PACKET_ROWS:
        cells, lowest = [], []  # per file: the lower of the path's two listeners
        for got in paths:
            for name in (path, path + FAST_SUFFIX):
                us = got.get(name, {}).get("us_per_packet_all_in")
                cells.append(f"{us:.0f} µs" if us is not None else "-")
            lowest.append(min((got[n]["us_per_packet_all_in"] for n in (path, path + FAST_SUFFIX) if n in got),
                              default=None))  # fmt: skip
        profiled = paths[0].get(path + FAST_SUFFIX) or paths[0][path]
        parts = list(profiled.get("profile", {}).get("by_component_us_per_packet", {}).items())[:3]
        per_result = statistics.median(r["results_per_packet"] for r in paths[0][path]["repeats"])
        # Judged at the first file's count: the run with more streams fell behind (the page says why).
        verdict = f"met at {counts[0]}" if lowest[0] <= target else f"**missed** at {counts[0]}"
        if len(lowest) > 1 and lowest[1] is not None and lowest[1] <= target:
            verdict += f"; under it at {counts[1]} in a run that fell behind"
        rows.append(f"| {PACKET_PATHS.get(path, path)} | {' | '.join(cells)} | {per_result:.2f} "
                    f"| {', '.join(f'{k} {v:.0f}' for k, v in parts)} | {target} µs: {verdict} |")  # fmt: skip
    return "\n".join(rows) + source(list(PACKET_FILES), [run_info(r) for r in runs])


RING_POSITIONS_FILES = ("packet_cost_ring_positions_core_cpu.json", "packet_cost_ring_positions_cpu.json")  # (core CPU, py-spy)
RING_POSITIONS_TREES = (("before", "before"), ("messages", "messages"), ("shared", "shared"))


def table_packet_cost_ring() -> str:
    """benchmarks/packet_cost.py --tree-env: the branch point, and this tree with the ring positions
    in messages and in shared memory (NEMO_SERVE_RING_POSITIONS), side by side in one run; the
    engine core's CPU from the same run, the py-spy parts from a second run of the same three."""
    d, profiled = (read(name) for name in RING_POSITIONS_FILES)
    trees = {t["tree"]: t["paths"] for t in d["runs"][0]["trees"]}
    spied = {t["tree"]: t["paths"] for t in profiled["runs"][0]["trees"]}
    target = d["target_us_per_packet"]
    names = " / ".join(name for _, name in RING_POSITIONS_TREES)
    rows = [f"| path ({d['streams_per_frontend']} paced streams, 1 front end) | front end, µs per packet: {names} "
            f"(repeats) | engine core, µs per packet: {names} | largest parts, shared (µs per packet, py-spy) | target |",
            "|---|---|---|---|---|"]  # fmt: skip
    for path in PACKET_ROWS:
        fronts, cores = [], []
        for label, _ in RING_POSITIONS_TREES:
            row = trees[label][path]
            each = ", ".join(f"{r['us_per_packet_all_in']:.0f}" for r in row["repeats"])
            fronts.append(f"{row['us_per_packet_all_in']:.0f} ({each})")
            cores.append(f"{statistics.median(r['core_us_per_packet'] for r in row['repeats']):.0f}")
        parts = list(spied["shared"][path].get("profile", {}).get("by_component_us_per_packet", {}).items())[:3]
        verdict = "met" if trees["shared"][path]["us_per_packet_all_in"] <= target else "**missed**"
        rows.append(f"| {PACKET_PATHS.get(path, path)} | {' / '.join(fronts)} | {' / '.join(cores)} "
                    f"| {', '.join(f'{k} {v:.0f}' for k, v in parts)} | {target} µs: {verdict} |")  # fmt: skip
    return "\n".join(rows) + source(list(RING_POSITIONS_FILES), [run_info(r) for r in (d, profiled)])


def table_ws_layer() -> str:
    """benchmarks/ws_layer_bench.py: the WebSocket layer alone, candidate by candidate in one run."""
    d = read("ws_layer_cpu.json")
    rows = [f"| WebSocket server ({d['streams']} paced streams, {d['packet_ms']:g} ms packets, same trivial app) "
            "| µs per packet (median) | repeats |", "|---|---|---|"]  # fmt: skip
    for name, c in sorted(d["candidates"].items(), key=lambda kv: kv[1]["us_per_packet_median"]):
        each = ", ".join(f"{r['us_per_packet']:.1f}" for r in c["repeats"])
        rows.append(f"| {WS_LAYER_NAMES.get(name, name)} | {c['us_per_packet_median']:.1f} | {each} |")
    for name, us in d.get("realtime_append_decode_us", {}).items():
        rows.append(f"| /v1/realtime append decode (in process): {name} | {us:.1f} | |")
    return "\n".join(rows) + source(["ws_layer_cpu.json"], [run_info(d)])


WS_LAYER_NAMES = {
    "uvicorn_sansio_uvloop": "uvicorn + websockets sans-I/O + uvloop (--port today)",
    "uvicorn_sansio_asyncio": "uvicorn + websockets sans-I/O, asyncio's loop (uvloop off)",
    "uvicorn_wsproto_uvloop": "uvicorn + wsproto + uvloop", "granian_uvloop": "granian (ASGI), one worker",
    "picows_uvloop": "picows, frames handled in its callback",
    "picows_queue_uvloop": "picows, frames handed to a task (as --fast-ws-port did before the hand-over)",
    "picows_asyncio": "picows, asyncio's loop",
}  # fmt: skip


def _server(d: dict) -> str:
    devices = str(d.get("server_devices") or "")
    cores = len(devices.split(",")) if devices else 1
    return f"{cores} engine core{'s' if cores > 1 else ''} + {d['server_frontends']} front end"


def table_sweeps() -> str:
    rows = ["| model | chunk | server | streams kept up | partial / final p95 there | next level: why behind | server CPU there | token-identical there |",
            "|---|---|---|---|---|---|---|---|"]
    names, infos = [], []
    for files, d in sweep_groups():
        best, behind = judge(d)
        names.extend(files)  # each file's own command: a run's `_top` levels were a later run
        infos.extend(run_info(read(f)) for f in files)
        why = (f"N={behind['streams']}: p95 {fmt(behind['partial_latency_ms']['p95'], 0, ' ms')}, "
               f"p90 drift {fmt(behind['drift_ms_per_s']['p90'], 0, ' ms/s')}") if behind else "not reached"
        q = (best or {}).get("quality", {})
        same = f"{q['token_identical_streams']}/{q['streams_compared']}" if "token_identical_streams" in q else "-"
        rows.append(f"| {model_label(d)} | {d['chunk_ms']:.0f} ms | {_server(d)} | **{best['streams'] if best else 0}** "
                    f"| {fmt(best and best['partial_latency_ms']['p95'], 0)} / {fmt(best and best['final_latency_ms']['p95'], 0, ' ms')} "
                    f"| {why} | {fmt((best or {}).get('server_cpu_cores'), 2)} | {same} |")
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
