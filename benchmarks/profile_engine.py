"""Where the engine's step time goes: a phase breakdown and the top torch operators.

    python benchmarks/profile_engine.py --model builtin:fastconformer-l --context-right 13 --batch 32 \
        --seconds 10 --out benchmarks/results/profile_fastconformer-l_r13_b32.json

Runs the engine as step_bench does (whole utterances pushed up front, iterate() until idle, one
thread) with timing wrappers around its phases, without changing engine code:
  features  FeatureExtractor.compute (log-mel of the group's new frames)
  gather    SlotPool.gather_* (index_select of caches, decoder state, feature history)
  encoder   ConformerEncoder.cache_aware_stream_step
  decoder   the label-looping decoding computer (RNN-T greedy, carried state)
  scatter   SlotPool.scatter_* (index_copy_ back into the slots)
  rest      everything else in iterate(): readiness, grouping, building the batch, the
            device-to-host copy of tokens, results, detokenisation, callbacks
Only steady steps count (each stream's first and last step excluded, as in step_bench).
Times are process CPU time (one thread: what the work costs with a core to itself), so a busy
neighbour on a shared machine does not inflate them; the wall time of the steps is reported too.
With --torch-profile it also runs one steady iteration under torch.profiler and lists the
operators by self CPU time, and with --pipeline the same phase split for NeMo 3.0's pipeline.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import bench_audio, model_file, run_record, write_json  # noqa: E402
from benchmarks.peers import NemoPipeline, loaded_engine  # noqa: E402


class PhaseTimer:
    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.active = False

    def wrap(self, obj, attr: str, phase: str) -> None:
        inner = getattr(obj, attr)
        timer = self

        def timed(*args, **kwargs):
            t0 = time.process_time()
            try:
                return inner(*args, **kwargs)
            finally:
                if timer.active:
                    timer.totals[phase] += time.process_time() - t0

        setattr(obj, attr, timed)


def profile_engine(model, audios, torch_profile: bool, cprofile: bool = False, kv_cache: bool = True) -> dict:
    b = len(audios)
    eng = loaded_engine(model, audios, lambda i, r: None, kv_cache)
    timer = PhaseTimer()
    timer.wrap(eng.features, "compute", "features")
    for name in ("gather_encoder", "gather_decoder", "gather_history"):
        timer.wrap(eng.pool, name, "gather")
    for name in ("scatter_encoder", "scatter_decoder", "scatter_history"):
        timer.wrap(eng.pool, name, "scatter")
    timer.wrap(eng.encoder, "step", "encoder")
    computer = model.decoding_computer  # called as an object: its class's __call__ is what to wrap
    original_call = type(computer).__call__

    def call(self, *args, **kwargs):
        t0 = time.process_time()
        try:
            return original_call(self, *args, **kwargs)
        finally:
            if timer.active:
                timer.totals["decoder"] += time.process_time() - t0

    type(computer).__call__ = call
    try:
        iter_times, wall_times, phase_snapshots, op_table, py_profiles = [], [], [], None, []
        with torch.inference_mode():
            i = 0
            while True:
                timer.active = True
                before = dict(timer.totals)
                prof_ctx = _torch_profiler() if (torch_profile and i == 3) else contextlib.nullcontext()
                py_prof = _cprofile() if (cprofile and i >= 1) else None
                with prof_ctx as prof:
                    if py_prof is not None:
                        py_prof.enable()
                    t0, w0 = time.process_time(), time.perf_counter()
                    progressed = eng.iterate().busy
                    dt, dw = time.process_time() - t0, time.perf_counter() - w0
                    if py_prof is not None:
                        py_prof.disable()
                        py_profiles.append(py_prof)
                if not progressed:
                    break
                if prof is not None:
                    op_table = _op_table(prof)
                iter_times.append(dt)
                wall_times.append(dw)
                phase_snapshots.append({k: timer.totals[k] - before.get(k, 0.0) for k in timer.totals})
                i += 1
    finally:
        type(computer).__call__ = original_call
    report = _report("engine", b, iter_times, wall_times, phase_snapshots, op_table)
    if py_profiles:
        report["python_top"] = _python_table(py_profiles[:-1], report["steady_steps"])  # the last one is the tail step
    return report


def _cprofile():
    import cProfile

    return cProfile.Profile(time.process_time)


def _python_table(profiles, steps: int, top: int = 30) -> list[dict]:
    """Functions by own time (tottime) per steady step, over the profiled iterations."""
    import pstats

    st = pstats.Stats(profiles[0])
    for p in profiles[1:]:
        st.add(p)
    rows = sorted(st.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    out = []
    for (file, line, func), (cc, nc, tt, ct, _) in rows:
        where = f"{Path(file).name}:{line}" if file != "~" else "builtin"
        out.append({"function": f"{func} ({where})", "own_ms_per_step": round(1000 * tt / steps, 2),
                    "cum_ms_per_step": round(1000 * ct / steps, 2), "calls_per_step": round(nc / steps, 1)})
    return out


def _torch_profiler():
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CPU], record_shapes=False)


def _op_table(prof, top: int = 25) -> list[dict]:
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    total = sum(e.self_cpu_time_total for e in prof.key_averages())
    return [
        {"op": e.key, "self_ms": round(e.self_cpu_time_total / 1000, 2), "share": round(e.self_cpu_time_total / total, 4), "calls": e.count}
        for e in rows
    ]


def profile_pipeline(nemo_path, model, audios) -> dict:
    g = model.geometry
    pipe = NemoPipeline(nemo_path, g.context_left, g.context_right, len(audios))
    p = pipe.pipeline
    timer = PhaseTimer()
    timer.wrap(p.bufferer, "update", "features")
    timer.wrap(p.context_manager, "get_context", "gather")
    timer.wrap(p.context_manager, "update_cache", "scatter")
    timer.wrap(p.context_manager, "reset_slots", "scatter")
    enc = p.asr_model.asr_model.encoder
    timer.wrap(enc, "cache_aware_stream_step", "encoder")
    timer.wrap(p.asr_model.asr_model.decoding, "rnnt_decoder_predictions_tensor", "decoder")
    frames = pipe.frames(audios)
    iter_times, wall_times, snaps = [], [], []
    p.open_session()
    with torch.inference_mode():
        for k in range(len(frames[0])):
            timer.active = True
            before = dict(timer.totals)
            t0, w0 = time.process_time(), time.perf_counter()
            p.transcribe_step([f[k] for f in frames])
            iter_times.append(time.process_time() - t0)
            wall_times.append(time.perf_counter() - w0)
            snaps.append({kk: timer.totals[kk] - before.get(kk, 0.0) for kk in timer.totals})
    p.close_session()
    return _report("pipeline", len(audios), iter_times, wall_times, snaps, None)


def encoder_ops(model, b: int, top: int = 16, kv_cache: bool = True) -> dict:
    """One later-chunk encoder call of the engine at full cache (random input: the cost does not
    depend on it) under torch.profiler with input shapes: which matmuls, convolutions and copies it
    spends on."""
    from torch.profiler import ProfilerActivity, profile

    from nemo_serve.engine.encoder import make_encoder
    from nemo_serve.engine.slots import EncoderCache

    g = model.geometry
    enc = make_encoder(model, kv_cache=kv_cache)
    w = g.pre_cache_frames + g.chunk_frames
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(b, model.num_mels, w, generator=gen)
    (n_layers, c, _), (_, d2, k) = model.cache_shapes
    ch = torch.randn(n_layers, b, *enc.channel_shape, generator=gen) * 0.1
    tm = torch.randn(n_layers, b, d2, k, generator=gen) * 0.1
    cache = EncoderCache(ch, tm, torch.full((b,), c, dtype=torch.long))

    def call():
        return enc.step(x, torch.full((b,), w), cache, g.drop_frames, full=True)

    with torch.inference_mode():
        call()
        t0 = time.process_time()
        call()
        cpu_ms = 1000 * (time.process_time() - t0)
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            call()
    events = prof.key_averages(group_by_input_shape=True)
    total = sum(e.self_cpu_time_total for e in events)
    rows = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return {
        "batch": b,
        "encoder": enc.kind,
        "encoder_cpu_ms": round(cpu_ms, 1),
        "ops": [
            {"op": e.key, "input_shapes": str(e.input_shapes), "calls": e.count,
             "share": round(e.self_cpu_time_total / total, 4)}
            for e in rows
        ],
    }  # fmt: skip


def _report(system: str, b: int, iter_times: list, wall_times: list, snapshots: list[dict], op_table) -> dict:
    """CPU time per phase over the steady steps (each stream's first and last step excluded)."""
    steady = slice(1, len(iter_times) - 1)
    total, wall, steps = sum(iter_times[steady]), sum(wall_times[steady]), len(iter_times[steady])
    phases: dict[str, float] = defaultdict(float)
    for snap in snapshots[steady]:
        for k, v in snap.items():
            phases[k] += v
    phases["rest"] = total - sum(phases.values())
    order = ("features", "gather", "encoder", "decoder", "scatter", "rest")
    return {
        "system": system,
        "batch": b,
        "steady_steps": steps,
        "step_cpu_ms": round(1000 * total / steps, 1),
        "step_wall_ms": round(1000 * wall / steps, 1),
        "stream_steps_per_cpu_s": round(b * steps / total, 2),
        "phases_ms_per_step": {k: round(1000 * phases.get(k, 0.0) / steps, 2) for k in order},
        "phases_share": {k: round(phases.get(k, 0.0) / total, 4) for k in order},
        "top_ops": op_table,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="builtin:fastconformer-l")
    ap.add_argument("--context-right", type=int, required=True)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--torch-profile", action="store_true")
    ap.add_argument("--pipeline", action="store_true", help="also split NeMo 3.0's pipeline the same way")
    ap.add_argument("--cprofile", action="store_true", help="also list Python functions by own time (cProfile)")
    ap.add_argument("--encoder-ops", default=None, help="comma-separated batch sizes: the encoder's ops by input shape")
    ap.add_argument("--no-kv-cache", dest="kv_cache", action="store_false",
                    help="profile the engine on NeMo's own layer code (no key/value cache)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from nemo_serve.model import load_model

    record = run_record()
    nemo_path, name = model_file(args.model)
    model = load_model(str(nemo_path), context_right=args.context_right)
    print(model.summary(args.batch), file=sys.stderr)
    audios = bench_audio(args.batch, args.seconds)
    reports = [profile_engine(model, audios, args.torch_profile, args.cprofile, args.kv_cache)]
    if args.pipeline:
        reports.append(profile_pipeline(nemo_path, model, audios))
    for r in reports:
        print(r["system"], f"B={r['batch']}", f"{r['step_cpu_ms']} CPU ms/step ({r['step_wall_ms']} wall)", r["phases_ms_per_step"])
        for row in (r["top_ops"] or [])[:15]:
            print(f"   {row['op'][:60]:60s} {row['self_ms']:9.1f} ms  {100 * row['share']:5.1f}%  x{row['calls']}")
        for row in r.get("python_top", [])[:20]:
            print(f"   {row['function'][:70]:70s} own {row['own_ms_per_step']:8.2f} ms  cum {row['cum_ms_per_step']:8.2f} ms  x{row['calls_per_step']}")
    ops = []
    for b in [int(x) for x in args.encoder_ops.split(",")] if args.encoder_ops else []:
        ops.append(encoder_ops(model, b, kv_cache=args.kv_cache))
        print(f"encoder ({ops[-1]['encoder']}) alone, B={b}: {ops[-1]['encoder_cpu_ms']} CPU ms")
        for row in ops[-1]["ops"][:10]:
            print(f"   {row['op']:24s} {100 * row['share']:5.1f}%  x{row['calls']:3d}  {row['input_shapes'][:90]}")
    write_json(args.out, {"benchmark": "profile_engine", **record, "model": name, "chunk_ms": model.geometry.chunk_ms,
                          "seconds_per_stream": args.seconds, "kv_cache": args.kv_cache, "reports": reports, "encoder_ops": ops})


if __name__ == "__main__":
    main()
