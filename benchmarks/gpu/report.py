"""Tables and a plot of one GPU run's results.jsonl (benchmarks/gpu/gpu_bench.py).

    .venv/bin/python benchmarks/gpu/report.py benchmarks/results/gpu_h200_run3.jsonl \
        --plot benchmarks/results/gpu_h200_run3.png

Prints the markdown tables the README and benchmarks/gpu/README.md show: the self-checks, the step
sweep (ms per call from the host, GPU ms from CUDA events, the real-time streams one step of that
batch could serve), and the capacity levels (lateness against 2 chunks). The plot has the step
sweep's real-time bound per batch and each level's p95 lateness against its bound.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def load(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def tables(recs: list[dict]) -> str:
    out = []
    env = next((r for r in recs if r["kind"] == "env"), {})
    pre = next((r for r in reversed(recs) if r["kind"] == "preflight"), {})
    out.append(f"{env.get('device')}, torch {env.get('torch')}, CUDA {env.get('cuda')}, Python {env.get('python')}; "
               f"NeMo {pre.get('versions', {}).get('nemo-toolkit')}, conditional nodes: {pre.get('conditional_nodes')}")
    out.append("")
    out.append("| check | result |")
    out.append("|---|---|")
    for r in recs:
        if r["kind"] == "selftest":
            out.append(f"| `--selftest {r['n']} --context-right all`, {r['model']}, {r['dtype']} | {r['summary'] or r.get('error') or 'failed'} |")
    for r in recs:
        if r["kind"] == "validate":
            ge, sy = r["graph_vs_eager"], r["syncs"]
            modes = sorted(set(r["stepper"]["decoder_modes"].values()))
            out.append(f"| {r['chunk_ms']} ms: graphs against eager, batches {ge['batches']} x {ge['steps']} chunks | "
                       f"{'identical' if ge['identical'] else 'DIFFERENT'} ({ge['tokens']} tokens, cache max diff "
                       f"{ge['max_abs_cache_diff']}); {len(r['stepper']['encoder_captured'])} encoder graphs, "
                       f"{len(r['stepper']['encoder_failed'])} failed; decoders {', '.join(modes)}; device waits per "
                       f"iteration {sy.get('waits_per_iteration')} (goal {sy.get('goal')}) |")
    for cal in (r for r in recs if r["kind"] == "calibration"):
        out.append(calibration_row(cal))
    out.append("")
    out.append("| chunk | batch | ms per step (host) | GPU ms | µs per stream-step | real-time streams bound | "
               "tokens per frame | label loop outer / inner per device step |")
    out.append("|---|---|---|---|---|---|---|---|")
    for r in recs:
        if r["kind"] == "step":
            out.append(f"| {r['chunk_ms']} ms | {r['batch']} | {r['ms_median']:.1f} | {r['gpu_ms_median']} | "
                       f"{r['us_per_stream_step']:.1f} | {r['realtime_streams_bound']:,} | {loop_cells(r)} |")
    out.append("")
    out.append("| chunk | streams | keeps up | lateness p50 / p95 / max | bound | rows per step | GPU ms per step | loop busy | "
               "GPU busy | host µs per stream-step | tokens per frame | label loop outer / inner per device step |")
    out.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in recs:
        if r["kind"] == "capacity":
            out.append(f"| {r['chunk_ms']} ms | {r['streams']:,} | {'yes' if r['keeps_up'] else 'no'} | "
                       f"{r['lateness_p50_ms']:.0f} / {r['lateness_p95_ms']:.0f} / {r['lateness_max_ms']:.0f} ms | "
                       f"{r['bound_ms']:.0f} ms | {r['rows_per_step']:.0f} | {r['gpu_ms_per_step_median']} | "
                       f"{r['loop_busy_fraction']:.2f} | {r['gpu_busy_fraction']} | {r['host_us_per_stream_step']} | "
                       f"{loop_cells(r)} |")
    return "\n".join(out)


def loop_cells(r: dict) -> str:
    """Tokens per frame and label-loop trips (median, max) of a step or capacity record; runs before
    the calibrated load (up to run 3) did not record them."""
    x = r.get("label_loop")
    if not x or not x.get("device_steps"):
        return "n/a | n/a"
    return (f"{x['tokens_per_frame']:.2f} | {x['outer_median']:g} / {x['inner_median']:g} "
            f"(max {x['outer_max']} / {x['inner_max']})")


def calibration_row(cal: dict) -> str:
    if "emit_fraction" in cal:  # runs up to 3: the share of emitting frames, max_symbols 10
        where = f"{cal['chunk_ms']} ms" if "chunk_ms" in cal else "first mode"
        also = f"; with that bias per mode {cal['per_mode_emit_fraction']}" if "per_mode_emit_fraction" in cal else ""
        return (f"| calibration at {where} (random weights: share of encoder frames that emit) | "
                f"{cal['emit_fraction']:.3f} against {cal['target']} in {cal['probes']} probes{also} |")
    load = cal.get("load", {})
    return (f"| calibration at {cal['chunk_ms']} ms (random weights: tokens per encoder frame) | {cal['measured']:.3f} "
            f"against {cal['target']} in {cal['probes']} probes; label loop outer / inner median "
            f"{load.get('outer_median')} / {load.get('inner_median')} at {load.get('device_steps')} probe steps |")


def plot(recs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    steps = [r for r in recs if r["kind"] == "step"]
    for ms in sorted({r["chunk_ms"] for r in steps}):
        rs = [r for r in steps if r["chunk_ms"] == ms]
        a.plot([r["batch"] for r in rs], [r["realtime_streams_bound"] for r in rs], "o-", label=f"{ms} ms")
    a.set_xscale("log", base=2)
    a.set_xlabel("rows in one call")
    a.set_ylabel("real-time streams one step could serve")
    a.set_title("step sweep (batch x chunk / step time)")
    a.legend()
    caps = [r for r in recs if r["kind"] == "capacity"]
    for ms in sorted({r["chunk_ms"] for r in caps}):
        rs = [r for r in caps if r["chunk_ms"] == ms]
        line = b.plot([r["streams"] for r in rs], [r["lateness_p95_ms"] for r in rs], "o-", label=f"{ms} ms p95")[0]
        b.axhline(rs[0]["bound_ms"], color=line.get_color(), ls=":", lw=1)
    b.set_xscale("log", base=2)
    b.set_yscale("log")
    b.set_xlabel("real-time streams")
    b.set_ylabel("lateness p95, ms (dotted: 2 chunks)")
    b.set_title("capacity, the engine core's loop")
    b.legend()
    env = next((r for r in recs if r["kind"] == "env"), {})
    fig.suptitle(f"{env.get('device')}, nemotron-0.6b architecture (random weights), bf16")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results")
    ap.add_argument("--plot")
    args = ap.parse_args(argv)
    recs = load(Path(args.results))
    run = [r for r in recs if r["kind"] != "diagnose"]
    print(tables(run))
    if args.plot:
        plot(run, Path(args.plot))


if __name__ == "__main__":
    main()
