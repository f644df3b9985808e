"""Batched step time against batch size: our engine and three peers, side by side in one run.

    python benchmarks/step_bench.py --model builtin:fastconformer-l --context-right 13 \
        --batch-sizes 1,16,32 --seconds 20 --out benchmarks/results/step_fastconformer-l_r13.json

Systems, all on the same model file, the same audio (stream i gets clip i mod 8) and one thread:
  engine    nemo_serve Engine.iterate(): features + one batched step of every ready stream
  engine-boost1, engine-boostall  the engine with one stream, or every stream, boosting 20 phrases
            (benchmarks/peers.py BENCH_PHRASES; engine/biasing.py): what phrase boosting costs a
            step. Their boosted streams' tokens may differ from the loop's (the loop is unboosted)
  engine-nemo  the same engine with kv_cache=False: NeMo's own layer code (caches layer inputs),
            to show what the key/value cache (engine/encoder.py) buys
  pipeline  NeMo 3.0 CacheAwareRNNTPipeline.transcribe_step() with one Frame per stream per step
  loop      NeMo's per-stream loop (conformer_stream_step, one stream at a time): the oracle
  sherpa    sherpa-onnx OnlineRecognizer.decode_streams() over an ONNX export of the model

What is timed: every model step of every stream except each stream's first and last (the first
chunk has its own shape and warms caches; the last is a short tail each system handles its own
way). All streams are the same length, so every system advances them in lockstep batches of B.
Each (system, B) is warmed up on a 3-chunk run first. Rounds interleave the systems at each B so
a busy neighbour slows them alike; the figure kept per (system, B) is the median over rounds.

Features: the engine and the pipeline compute features inside the step (timed). The loop and
sherpa-onnx compute whole-utterance features up front (NeMo's streaming buffer / sherpa's
accept_waveform); that time is measured and the share of the timed chunks is added.

stream-steps/s = (B x timed steps) / time. Tokens of every system are compared with the loop's
(the oracle); for stream 0 a decomposition (grid, decoding rule, features) says why a peer differs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from functools import partial
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import bench_audio, file_digest, model_file, run_record, write_json  # noqa: E402
from benchmarks.measurement import Measurement  # noqa: E402
from benchmarks.peers import NemoPipeline, Sherpa, run_engine, run_loop  # noqa: E402
from benchmarks.why_differ import why_peers_differ  # noqa: E402
from nemo_serve.scoring import edit_distance  # noqa: E402

SYSTEMS = ("engine", "engine-nemo", "pipeline", "loop", "sherpa")
OPTIONAL_SYSTEMS = ("engine-boost1", "engine-boostall")  # only when named in --systems


def compare_tokens(tokens: list[list[int]], oracle: list[list[int]]) -> dict:
    identical = sum(t == o for t, o in zip(tokens, oracle))
    errors = sum(edit_distance(t, o) for t, o in zip(tokens, oracle))
    ref = sum(len(o) for o in oracle)
    return {
        "streams_identical": identical,
        "streams": len(oracle),
        "token_error_rate_vs_oracle": errors / max(ref, 1),
        "oracle_tokens": ref,
        "tokens": sum(len(t) for t in tokens),
    }


def warmup_audio(model, audio: np.ndarray) -> np.ndarray:
    g = model.geometry
    frames = g.first_frames + 3 * g.chunk_frames + g.pre_cache_frames
    return audio[: frames * g.hop_samples]


def with_mode(model, context_right: int):
    """The loaded model switched to another trained chunk mode (saves a reload per mode on GPU)."""
    import dataclasses

    from nemo_serve import model as served

    [mode] = served._select_modes(model.nemo.encoder, context_right)
    model.nemo.encoder.set_default_att_context_size(mode)
    geometry = served._geometry(model.nemo, mode)
    return dataclasses.replace(model, geometry=geometry, geometries={mode[1]: geometry})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="builtin:fastconformer-l", help=".nemo path, builtin:NAME, or demo")
    ap.add_argument("--context-right", required=True, help="one or more (comma-separated) chunk modes")
    ap.add_argument("--batch-sizes", default="1,16,32")
    ap.add_argument("--seconds", type=float, default=20.0, help="length of every stream")
    ap.add_argument("--audio", default="synth", help="'synth' or a NeMo manifest")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--loop-max-batch", type=int, default=None, help="run the per-stream loop only up to this B")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--onnx-dir", default=None, help="where ONNX exports are cached (default: next to the .nemo)")
    ap.add_argument("--no-why", action="store_true", help="skip the token-difference decomposition")
    ap.add_argument("--out", required=True, help="JSON path; with several modes, '{r}' in it is the mode")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    systems = [s for s in args.systems.split(",") if s]
    unknown = set(systems) - set(SYSTEMS + OPTIONAL_SYSTEMS)
    if unknown:
        raise SystemExit(f"unknown systems {sorted(unknown)}; choose from {SYSTEMS + OPTIONAL_SYSTEMS}")
    modes = [int(r) for r in args.context_right.split(",")]
    if len(modes) > 1 and "{r}" not in args.out:
        raise SystemExit("several --context-right values need '{r}' in --out")

    from nemo_serve.model import load_model

    nemo_path, name = model_file(args.model)
    base = load_model(str(nemo_path), context_right=modes[0], dtype=args.dtype, device=args.device)
    for r in modes:
        model = base if r == modes[0] else with_mode(base, r)
        result = bench_mode(args, systems, model, nemo_path, name)
        out = args.out.replace("{r}", str(r))
        write_json(out, result)
        plot(result, Path(out).with_suffix(".png"))
        print(format_table(result))


def plot(result: dict, png: Path) -> None:
    """Stream-steps/s against batch size, one line per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for system in SYSTEMS:
        rows = sorted((r["batch"], r["stream_steps_per_s"]) for r in result["results"] if r["system"] == system)
        if rows:
            ax.plot(*zip(*rows), "-o", label=system)
    ax.set(xlabel="batch size (streams per step)", ylabel="stream-steps per second", xscale="log")
    ax.set_title(
        f"{result['model']} {result['chunk_ms']:.0f} ms {result['dtype']} on {result['device']}, "
        f"{result['threads']} thread(s)", fontsize=9
    )
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def bench_mode(args, systems: list[str], model, nemo_path: Path, name: str) -> dict:
    record = run_record()
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    print(model.summary(max(sizes)), file=sys.stderr)
    peers = _build_peers(systems, model, nemo_path, args, max(sizes))
    onnx_dir = getattr(peers.get("sherpa"), "onnx_dir", None)
    audios = bench_audio(max(sizes), args.seconds, args.audio)
    runs: dict[tuple[str, int], list[Measurement]] = {}
    plan = [(b, s) for b in sizes for s in systems if not (s == "loop" and args.loop_max_batch and b > args.loop_max_batch)]
    bar = _progress(len(plan) * args.rounds)
    for r in range(args.rounds):
        for b, system in plan:
            runner = _synced(peers[system], model.device)
            if r == 0:
                runner(model, [warmup_audio(model, a) for a in audios[:b]])
            m = runner(model, audios[:b])
            runs.setdefault((system, b), []).append(m)
            bar.update(1)
            bar.set_postfix_str(f"{system} B={b}: {m.stream_steps_per_s:.1f} stream-steps/s")
    bar.close()
    return _summarise(args, record, name, nemo_path, model, sizes, runs, audios, onnx_dir)


def _synced(runner, device: torch.device):
    """Every timed call already ends in a device-to-host copy; synchronise once more after a run."""
    if device.type != "cuda":
        return runner

    def run(model, audios):
        torch.cuda.synchronize()
        m = runner(model, audios)
        torch.cuda.synchronize()
        return m

    return run


def _build_peers(systems, model, nemo_path: Path, args, max_batch: int) -> dict:
    peers = {}
    if "engine" in systems:
        peers["engine"] = run_engine
    if "engine-nemo" in systems:
        peers["engine-nemo"] = partial(run_engine, kv_cache=False)
    if "engine-boost1" in systems:
        peers["engine-boost1"] = partial(run_engine, boosted="one")
    if "engine-boostall" in systems:
        peers["engine-boostall"] = partial(run_engine, boosted="all")
    if "loop" in systems:
        peers["loop"] = run_loop
    if "pipeline" in systems:
        g = model.geometry
        pipe = NemoPipeline(nemo_path, g.context_left, g.context_right, max_batch, args.device, args.dtype)
        peers["pipeline"] = lambda _m, audios: pipe.run(audios)
    if "sherpa" in systems:
        from benchmarks.onnx_export import ensure_export

        if args.device != "cpu":
            raise SystemExit("sherpa-onnx runs here on CPU only (the PyPI wheel has no CUDA provider); drop it from --systems")
        root = Path(args.onnx_dir) if args.onnx_dir else nemo_path.parent / "onnx"
        peers["sherpa"] = Sherpa(ensure_export(nemo_path, model.geometry.context_right, root), model.num_mels)
    return peers


def _progress(total: int):
    try:
        from tqdm import tqdm

        return tqdm(total=total, desc="step_bench", file=sys.stderr)
    except ImportError:  # pragma: no cover
        class _Bar:
            def update(self, n): ...
            def set_postfix_str(self, s): print(s, file=sys.stderr)
            def close(self): ...

        return _Bar()


def _oracle_by_clip(runs: dict) -> list[list[int]] | None:
    """NeMo's loop tokens per audio clip (stream i plays clip i mod 8), from its largest run."""
    loops = sorted(b for (s, b) in runs if s == "loop")
    if not loops:
        return None
    tokens = runs[("loop", loops[-1])][0].tokens
    return tokens[: min(len(tokens), 8)]


def _summarise(args, record, name, nemo_path, model, sizes, runs, audios, onnx_dir=None) -> dict:
    g = model.geometry
    oracle = _oracle_by_clip(runs)
    results = []
    for (system, b), ms in sorted(runs.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        rates = [m.stream_steps_per_s for m in ms]
        cpu_rates = [m.stream_steps_per_cpu_s for m in ms]
        median_run = ms[int(np.argsort(rates)[len(rates) // 2])]
        step_ms = [1000 * t for m in ms for t in m.step_times_s]
        row = {
            "system": system,
            "batch": b,
            "stream_steps_per_s": statistics.median(rates),
            "stream_steps_per_s_rounds": rates,
            "stream_steps_per_cpu_s": statistics.median(cpu_rates),
            "stream_steps_per_cpu_s_rounds": cpu_rates,
            "cpu_share_of_wall": round(statistics.median(m.cpu_seconds / m.seconds for m in ms), 3),
            "step_ms_median": statistics.median(step_ms),
            "step_ms_p95": float(np.percentile(step_ms, 95)),
            "timed_steps": median_run.timed_steps,
            "feature_s_added": median_run.feature_s,
            "realtime_streams": statistics.median(rates) * g.chunk_ms / 1000.0,
        }
        if oracle is not None and len(oracle) >= min(b, 8):
            row["tokens_vs_oracle"] = compare_tokens(median_run.tokens, [oracle[i % len(oracle)] for i in range(b)])
        results.append(row)
    why = None
    if oracle is not None and not args.no_why:
        first = {s: runs[(s, b)][0].tokens[0] for (s, b) in sorted(runs) if s in ("pipeline", "sherpa")}
        why = why_peers_differ(model, audios[0], oracle[0], first.get("pipeline"), first.get("sherpa"), onnx_dir)
    return {
        "benchmark": "step_bench",
        **record,
        "model": name,
        "model_file": str(nemo_path),
        "model_sha256": file_digest(nemo_path),
        "model_parameters": model.num_parameters,
        "dtype": args.dtype,
        "device": args.device,
        "context": [g.context_left, g.context_right],
        "chunk_ms": g.chunk_ms,
        "seconds_per_stream": args.seconds,
        "audio": args.audio,
        "rounds": args.rounds,
        "threads": args.threads,
        "cache_bytes_per_stream": _engine_cache_bytes(model),  # the engine's layout (keys/values)
        "cache_bytes_per_stream_nemo_layout": model.cache_bytes_per_stream,
        "results": results,
        "ratios": _ratios(results, sizes),
        "ratios_cpu_time": _ratios(results, sizes, "stream_steps_per_cpu_s_rounds"),
        "why_tokens_differ_stream0": why,
    }


def _engine_cache_bytes(model) -> int:
    from nemo_serve.engine.encoder import make_encoder
    from nemo_serve.engine.slots import SlotPool

    return SlotPool(model, 1, make_encoder(model).channel_shape).cache_bytes_per_stream


def _ratios(results: list[dict], sizes: list[int], key: str = "stream_steps_per_s_rounds") -> dict:
    """engine / peer stream-steps/s per batch size: the median over rounds of each round's ratio
    (a round measures every system at that B back to back, so a busy neighbour hits both alike)."""
    by = {(r["system"], r["batch"]): r[key] for r in results}
    out = {}
    for b in sizes:
        e = by.get(("engine", b))
        if e is None:
            continue
        out[str(b)] = {
            f"engine_over_{p}": round(statistics.median(x / y for x, y in zip(e, by[(p, b)])), 3)
            for p in ("sherpa", "pipeline", "loop", "engine-nemo", "engine-boost1", "engine-boostall")
            if (p, b) in by
        }
    return out


def format_table(result: dict) -> str:
    sizes = sorted({r["batch"] for r in result["results"]})
    systems = [s for s in SYSTEMS + OPTIONAL_SYSTEMS if any(r["system"] == s for r in result["results"])]
    by = {(r["system"], r["batch"]): r for r in result["results"]}
    lines = [
        f"{result['model']} {result['chunk_ms']:.0f} ms chunks, {result['dtype']}, {result['threads']} thread(s); "
        "stream-steps per wall s / per CPU s (median step ms)",
        "| system | " + " | ".join(f"B={b}" for b in sizes) + " |",
        "|---|" + "---|" * len(sizes),
    ]
    for s in systems:
        cells = []
        for b in sizes:
            r = by.get((s, b))
            cells.append(
                f"{r['stream_steps_per_s']:.1f} / {r['stream_steps_per_cpu_s']:.1f} ({r['step_ms_median']:.0f})" if r else "-"
            )
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    for name, ratios in (("wall", result["ratios"]), ("cpu", result["ratios_cpu_time"])):
        for b, rs in ratios.items():
            lines.append(f"{name} B={b}: " + ", ".join(f"{k} {v:.2f}x" for k, v in rs.items()))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
