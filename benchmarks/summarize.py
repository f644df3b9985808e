"""Markdown tables from the JSON files in a results folder (what docs/capacity.md quotes).

    python benchmarks/summarize.py benchmarks/results > /tmp/tables.md
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.load_summary import keeps_up  # noqa: E402
from benchmarks.step_metrics import mean_step_ms_by_bin  # noqa: E402

SYSTEMS = ("engine", "engine-nemo", "pipeline", "loop", "sherpa")


def load(folder: Path, kind: str) -> list[tuple[Path, dict]]:
    out = []
    for p in sorted(folder.glob("*.json")):
        d = json.loads(p.read_text())
        if d.get("benchmark") == kind:
            out.append((p, d))
    return out


def _f(x, nd=0, unit=""):
    if x is None:
        return "-"
    return f"{x:.{nd}f}{unit}"


def judge(sweep: dict) -> tuple[dict | None, dict | None]:
    """(highest level kept up with every lower level kept up too, first level not kept up), by
    today's rule (load_summary.keeps_up), whatever rule the sweep was run with."""
    best = None
    for lv in sweep["levels"]:
        if not keeps_up(lv, sweep["chunk_ms"], sweep.get("max_drift_ms_per_s", 20.0)):
            return best, lv
        best = lv
    return best, None


def capacity_table(sweeps: list[tuple[Path, dict]]) -> str:
    rows = [
        "| model | chunk | dtype, device, threads | streams kept up | partial p95 at max | final p95 at max "
        "| next level: p90 drift | cache per stream / at max | server CPU cores at max | quality at max | load avg at start |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for _, d in sweeps:
        c = dict(d["capacity"])
        best, behind = judge(d)
        c["streams_kept_up"] = best["streams"] if best else 0
        c["partial_latency_ms_p95_at_max"] = best["partial_latency_ms"]["p95"] if best else None
        c["final_latency_ms_p95_at_max"] = best["final_latency_ms"]["p95"] if best else None
        c["next_level"] = behind["streams"] if behind else None
        c["next_level_drift_ms_per_s"] = behind["drift_ms_per_s"]["p90"] if behind else None
        per_stream = c.get("cache_mib_per_stream")
        c["cache_mib_total_at_max"] = round(per_stream * best["streams"], 1) if (best and per_stream) else None
        q = (best or {}).get("quality", {})
        quality = []
        if "token_identical_streams" in q:
            quality.append(f"{q['token_identical_streams']}/{q['streams_compared']} oracle-identical")
        if "wer" in q:
            quality.append(f"WER {100 * q['wer']:.1f}%")
        nxt = f"N={c['next_level']}: {_f(c['next_level_drift_ms_per_s'], 0)} ms/s" if c["next_level"] else "not reached"
        rows.append(
            f"| {d['model']} | {d['chunk_ms']:.0f} ms | {d['dtype']}, {d['device']}, {d['server_threads']} "
            f"| **{c['streams_kept_up']}** | {_f(c['partial_latency_ms_p95_at_max'], 0, ' ms')} "
            f"| {_f(c['final_latency_ms_p95_at_max'], 0, ' ms')} | {nxt} "
            f"| {_f(c['cache_mib_per_stream'], 2)} / {_f(c['cache_mib_total_at_max'], 1)} MiB "
            f"| {_f((best or {}).get('server_cpu_cores'), 2)} | {', '.join(quality) or '-'} | {d['load_average_at_start'][0]} |"
        )
    return "\n".join(rows)


def step_table(benches: list[tuple[Path, dict]]) -> str:
    sizes = sorted({r["batch"] for _, d in benches for r in d["results"]})
    head = "| model | chunk | system | " + " | ".join(f"B={b}" for b in sizes) + " |"
    rows = [head, "|---|---|---|" + "---|" * len(sizes)]
    for _, d in benches:
        by = {(r["system"], r["batch"]): r for r in d["results"]}
        for s in SYSTEMS:
            if not any(k[0] == s for k in by):
                continue
            cells = []
            for b in sizes:
                r = by.get((s, b))
                if r is None:
                    cells.append("-")
                elif "stream_steps_per_cpu_s" in r:
                    cells.append(f"{r['stream_steps_per_cpu_s']:.1f} ({r['stream_steps_per_s']:.1f})")
                else:
                    cells.append(f"({r['stream_steps_per_s']:.1f})")
            rows.append(f"| {d['model']} | {d['chunk_ms']:.0f} ms | {s} | " + " | ".join(cells) + " |")
        cpu_ratios = d.get("ratios_cpu_time", {})
        for p in ("sherpa", "pipeline", "loop", "engine-nemo"):
            key = f"engine_over_{p}"
            if any(key in d["ratios"].get(str(b), {}) for b in sizes):
                cells = [
                    f"{_ratio(cpu_ratios.get(str(b), {}).get(key))} ({_ratio(d['ratios'].get(str(b), {}).get(key))})"
                    if str(b) in d["ratios"] else "-"
                    for b in sizes
                ]
                rows.append(f"| {d['model']} | {d['chunk_ms']:.0f} ms | **engine / {p}** | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _ratio(x) -> str:
    return f"{x:.2f}x" if x is not None else "-"


def parity_table(benches: list[tuple[Path, dict]]) -> str:
    rows = ["| model | chunk | system | streams token-identical to NeMo's loop | token error rate vs the loop |", "|---|---|---|---|---|"]
    for _, d in benches:
        bmax = max(r["batch"] for r in d["results"])
        for r in d["results"]:
            if r["batch"] != bmax or "tokens_vs_oracle" not in r:
                continue
            t = r["tokens_vs_oracle"]
            rows.append(
                f"| {d['model']} | {d['chunk_ms']:.0f} ms | {r['system']} (B={bmax}) | {t['streams_identical']}/{t['streams']} "
                f"| {100 * t['token_error_rate_vs_oracle']:.1f}% |"
            )
    return "\n".join(rows)


def why_table(benches: list[tuple[Path, dict]]) -> str:
    keys = [
        ("pad_and_drop_grid_nemo_features", "NeMo loop on the pad-and-drop grid (vs oracle)"),
        ("pipeline", "NeMo 3.0 pipeline (vs oracle)"),
        ("pipeline_vs_pad_and_drop_grid", "pipeline vs the pad-and-drop loop (same grid)"),
        ("sherpa_grid_nemo_features_max10", "sherpa grid, NeMo features, <=10 symbols/frame (vs oracle)"),
        ("sherpa_grid_nemo_features_1_per_frame", "sherpa grid, NeMo features, 1 symbol/frame (vs oracle)"),
        ("onnx_sherpa_grid_nemo_features_vs_torch_emulation", "ONNX graphs vs torch on that grid (numerics)"),
        ("sherpa_vs_onnx_sherpa_grid_nemo_features", "sherpa-onnx vs the same ONNX graphs fed NeMo features"),
        ("sherpa", "sherpa-onnx (vs oracle)"),
    ]
    cols = [d for _, d in benches if d.get("why_tokens_differ_stream0")]
    if not cols:
        return ""
    head = "| token error rate, stream 0 | " + " | ".join(f"{d['model']} {d['chunk_ms']:.0f} ms" for d in cols) + " |"
    rows = [head, "|---|" + "---|" * len(cols)]
    for k, label in keys:
        cells = [_pct(d["why_tokens_differ_stream0"].get(k)) for d in cols]
        if any(c != "-" for c in cells):
            rows.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _pct(x) -> str:
    return f"{100 * x:.0f}%" if x is not None else "-"


def server_steps_table(sweeps: list[tuple[Path, dict]]) -> str:
    rows = ["| model | chunk | server step time by batch size (mean ms, all levels) |", "|---|---|---|"]
    for _, d in sweeps:
        cells = ", ".join(f"B {k}: {v:.0f}" for k, v in mean_step_ms_by_bin(d["levels"]).items())
        rows.append(f"| {d['model']} | {d['chunk_ms']:.0f} ms | {cells} |")
    return "\n".join(rows)


def main() -> None:
    folder = Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results")
    sweeps, benches = load(folder, "sweep"), load(folder, "step_bench")
    print("### Capacity (sweeps)\n")
    print(capacity_table(sweeps))
    print("\n### Step bench: stream-steps per CPU second (per wall second), one thread\n")
    print(step_table(benches))
    print("\n### Token parity at the largest batch\n")
    print(parity_table(benches))
    why = why_table(benches)
    if why:
        print("\n### Why the peers' tokens differ (stream 0)\n")
        print(why)
    if sweeps:
        print("\n### Step time by batch size inside the server\n")
        print(server_steps_table(sweeps))


if __name__ == "__main__":
    main()
