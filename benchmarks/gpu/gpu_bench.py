"""The GPU run's measurements, engine only (no WebSocket), every result appended to OUT/results.jsonl
the moment it exists, so a run killed at its time limit keeps what it measured.

    python benchmarks/gpu/gpu_bench.py --out OUT [--model nemotron-0.6b] [--device cuda] [--dtype bf16]

1. `model`: the architecture built from configs/ (random init, benchmarks/architecture.py), its
   blank logit bias bisected so greedy decoding emits on about a third of the encoder frames (the
   built-ins' target; uncalibrated random weights emit max_symbols on every frame), cast, moved.
2. `step`: run_step at each batch (up to 8,192; larger than the pool's max_step_rows runs as
   several steps) per mode, later chunks, all rows full: ms per call and us per stream-step,
   the bucket/graph warm-up excluded (prepare_step captures every bucket first, timed apart).
3. `capacity`: per mode, an Engine with its step loop thread and N synthetic real-time streams
   pushed from this thread in one-chunk packets (starts spread over one chunk period). Lateness of
   a result = time it is delivered - arrival of the last sample it needed; p50/p95 over the results
   after a warm-up, against 2 chunk periods. Levels rise until p95 passes that bound.

Every phase checks the budget (--budget-s, from the process start) before it starts.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(REPO))

T0 = time.time()


class Results:
    def __init__(self, out_dir: Path) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        self.path = out_dir / "results.jsonl"

    def write(self, kind: str, **fields) -> None:
        rec = {"kind": kind, "t_s": round(time.time() - T0, 2), **fields}
        with self.path.open("a") as f:
            f.write(json.dumps(rec) + "\n")
            f.flush()
        print(json.dumps(rec), flush=True)


def left(budget_s: float) -> float:
    return budget_s - (time.time() - T0)


def emit_fraction(model, encoder, rows: int = 32, steps: int = 3, seed: int = 0) -> float:
    """Fraction of decoded encoder frames that emitted >= 1 token, over a few later chunks of noise
    features on fresh slots."""
    import torch

    from nemo_serve.engine.slots import SlotPool
    from nemo_serve.engine.step import StepBatch, run_step

    g = model.geometry
    pool = SlotPool(model, rows, encoder.channel_shape)
    for i in range(rows):
        pool.allocate(f"c{i}")
    gen = torch.Generator().manual_seed(seed)
    emitted = frames = 0
    slots = np.arange(rows)
    for k in range(steps + 1):
        first = k == 0
        w = g.first_frames if first else g.chunk_frames
        feats = torch.randn(rows, model.num_mels, w, generator=gen).to(model.device)
        r = run_step(model, encoder, pool, StepBatch(slots, feats, [w] * rows, first, None))
        if not first:
            emitted += sum(len(set(f)) for f in r.token_frames)
            frames += rows * encoder.encoder.streaming_cfg.valid_out_len
    del pool
    return emitted / max(frames, 1)


def calibrate_blank(model, encoder, target: float, iters: int) -> dict:
    """Bisect a bias added to the joint's blank logit until about `target` of the frames emit."""
    import torch

    out = model.nemo.joint.joint_net[-1]
    blank = model.blank_id
    base = out.bias[blank].item()
    lo, hi = -10.0, 60.0
    frac = None
    for _ in range(iters):
        mid = (lo + hi) / 2
        with torch.no_grad():
            out.bias[blank] = base + mid
        frac = emit_fraction(model, encoder)
        if frac > target:
            lo = mid
        else:
            hi = mid
    with torch.no_grad():
        out.bias[blank] = base + (lo + hi) / 2
    frac = emit_fraction(model, encoder)
    return {"blank_bias_added": (lo + hi) / 2, "emit_fraction": frac, "target": target}


def build(args, res: Results):
    from benchmarks.architecture import construct, served

    t = time.time()
    construct(args.model)
    models = {r: served(args.model, r, args.dtype, args.device) for r in args.modes}
    nemo = models[args.modes[0]].nemo
    res.write("model", model=args.model, dtype=args.dtype, device=args.device, build_s=round(time.time() - t, 1),
              parameters=sum(p.numel() for p in nemo.parameters()))
    return models


def step_sweep(args, model, engine, res: Results) -> None:
    """run_step over the engine's own pool (its loop not started yet): batches in rising order."""
    import torch

    from nemo_serve.engine.step import StepBatch, run_step

    g, pool, encoder = model.geometry, engine.pool, engine.encoder
    top = max(args.batches)
    ids = [f"bench{i}" for i in range(top)]
    for sid in ids:
        pool.allocate(sid)
    gen = torch.Generator().manual_seed(1)
    try:
        for b in sorted(args.batches):
            if left(args.budget_s) < args.reserve_s + 2 * args.step_seconds:
                res.write("skipped", what=f"step r={g.context_right} batch {b}", why="budget")
                return
            rows = np.arange(b)
            first = torch.randn(b, model.num_mels, g.first_frames, generator=gen).to(model.device)
            later = torch.randn(b, model.num_mels, g.chunk_frames, generator=gen).to(model.device)
            run_step(model, encoder, pool, StepBatch(rows, first, [g.first_frames] * b, True, None))
            run_step(model, encoder, pool, StepBatch(rows, later, [g.chunk_frames] * b, False, None))
            times = []
            t_end = time.time() + args.step_seconds
            while time.time() < t_end or len(times) < 3:
                t = time.perf_counter()
                run_step(model, encoder, pool, StepBatch(rows, later, [g.chunk_frames] * b, False, None))
                times.append(time.perf_counter() - t)
                if len(times) >= 50:
                    break
            ms = 1000 * float(np.median(times))
            res.write("step", chunk_ms=round(g.chunk_ms), context_right=g.context_right, dtype=args.dtype, batch=b,
                      calls=len(times), ms_median=round(ms, 3), ms_min=round(1000 * min(times), 3),
                      us_per_stream_step=round(1000 * ms / b, 2), steps_per_call=-(-b // pool.max_step_rows),
                      realtime_streams_bound=int(b * g.chunk_ms / ms))
    finally:
        for sid in ids:
            pool.free(sid)


def capacity_level(args, model, engine, n: int, audio: np.ndarray, seconds: float) -> dict:
    """n real-time streams for `seconds`; lateness of every result after the warm-up."""
    g = model.geometry
    period = g.chunk_ms / 1000
    sr = g.sample_rate
    packet = int(round(period * sr))
    lat: list[float] = []
    lock = threading.Lock()
    warm_until = time.time() + min(3.0, seconds / 3) + period

    def on_result(r) -> None:
        now = time.time()
        if now > warm_until:
            with lock:
                lat.append(now - r.audio_arrival_time)

    rng = np.random.default_rng(n)
    offsets = np.sort(rng.uniform(0, period, n))
    start = time.time() + 0.2
    streams = [engine.open_stream(on_result) for _ in range(n)]
    pos = np.zeros(n, np.int64)
    sent = np.zeros(n, np.int64)  # packets pushed
    src = rng.integers(0, len(audio) - packet, n)
    end = start + seconds
    behind = 0.0
    while True:
        now = time.time()
        if now >= end:
            break
        due = np.floor((now - start - offsets) / period).astype(np.int64) + 1  # packets due by now
        idx = np.flatnonzero(due > sent)
        for i in idx.tolist():
            k = int(due[i] - sent[i])
            s0 = (src[i] + pos[i]) % (len(audio) - packet * k)
            engine.push(streams[i], audio[s0 : s0 + packet * k])
            pos[i] += packet * k
            sent[i] = due[i]
        behind = max(behind, time.time() - now)
        time.sleep(max(0.0, min(0.005, end - time.time())))
    for s in streams:
        engine.finish(s)
    deadline = time.time() + 30
    while engine.num_open_streams and time.time() < deadline:
        time.sleep(0.05)
    with lock:
        a = np.asarray(lat)
    bound = 2 * period
    return {
        "streams": n,
        "chunk_ms": round(g.chunk_ms),
        "seconds": seconds,
        "results": int(a.size),
        "lateness_p50_ms": round(1000 * float(np.percentile(a, 50)), 1) if a.size else None,
        "lateness_p95_ms": round(1000 * float(np.percentile(a, 95)), 1) if a.size else None,
        "lateness_max_ms": round(1000 * float(a.max()), 1) if a.size else None,
        "bound_ms": round(1000 * bound, 1),
        "keeps_up": bool(a.size and np.percentile(a, 95) <= bound),
        "driver_max_push_pass_ms": round(1000 * behind, 1),
        "open_after_drain": engine.num_open_streams,
    }


def run_mode(args, model, res: Results, levels: list[int]) -> None:
    """One engine per mode (slots for the largest batch or level): the step sweep on its pool, then
    the capacity levels with its loop thread."""
    import gc

    import torch

    from benchmarks.architecture import set_mode
    from nemo_serve.engine.endpoint import EndpointConfig
    from nemo_serve.engine.loop import Engine
    from nemo_serve.engine.step import prepare_step

    set_mode(model)
    g = model.geometry
    slots = max(max(args.batches), max(levels, default=1))
    t = time.time()
    engine = Engine(model, num_slots=slots, endpoint=EndpointConfig.off())
    stepper = prepare_step(model, engine.encoder, engine.pool)[0]
    res.write("engine", chunk_ms=round(g.chunk_ms), context_right=g.context_right, slots=slots,
              buckets=stepper.sizes, max_step_rows=engine.pool.max_step_rows, graphs=stepper.graphs is not None,
              prepare_s=round(time.time() - t, 1), memory=engine.pool.memory_summary())
    try:
        step_sweep(args, model, engine, res)
        rng = np.random.default_rng(0)
        audio = (0.05 * rng.standard_normal(g.sample_rate * 30)).astype(np.float32)
        engine.start()
        for n in sorted(levels):
            if left(args.budget_s) < args.level_seconds + 10 + args.reserve_s:
                res.write("skipped", what=f"capacity {round(g.chunk_ms)} ms {n} streams", why="budget")
                break
            out = capacity_level(args, model, engine, n, audio, args.level_seconds)
            res.write("capacity", context_right=g.context_right, dtype=args.dtype, **out)
            if engine.error is not None:
                res.write("error", what="step loop", error=repr(engine.error))
                break
            if not out["keeps_up"]:
                break
    finally:
        engine.stop()
        del engine, stepper
        gc.collect()
        if model.device.type == "cuda":
            torch.cuda.empty_cache()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="nemotron-0.6b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--modes", default="3,0,13", help="right contexts, in priority order")
    ap.add_argument("--batches", default="1,8,64,256,1024,4096,8192")
    ap.add_argument("--step-seconds", type=float, default=2.0)
    ap.add_argument("--levels", default="0:500,1000,2000,4000;3:1000,2000,4000,8000;13:2000,4000,8000",
                    help="per mode r: stream counts")
    ap.add_argument("--level-seconds", type=float, default=15.0)
    ap.add_argument("--calibrate-iters", type=int, default=8)
    ap.add_argument("--emit-target", type=float, default=0.34)
    ap.add_argument("--budget-s", type=float, default=540.0)
    ap.add_argument("--reserve-s", type=float, default=10.0)
    ap.add_argument("--threads", type=int, default=4)
    args = ap.parse_args(argv)
    args.modes = [int(x) for x in args.modes.split(",")]
    args.batches = [int(x) for x in args.batches.split(",")]
    levels = {int(k): [int(x) for x in v.split(",")] for k, v in (p.split(":") for p in args.levels.split(";"))}

    import torch

    torch.set_num_threads(args.threads)
    with torch.no_grad():  # not set_grad_enabled(False): main() also runs inside the tests' process
        _run(args, levels, Results(Path(args.out)))


def _run(args, levels, res) -> None:
    import torch

    res.write("env", python=platform.python_version(), torch=torch.__version__, cuda=torch.version.cuda,
              device=torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", argv=sys.argv[1:])
    from benchmarks.architecture import set_mode
    from nemo_serve.engine.encoder import make_encoder

    models = build(args, res)
    m0 = models[args.modes[0]]
    set_mode(m0)
    t = time.time()
    cal = calibrate_blank(m0, make_encoder(m0), args.emit_target, args.calibrate_iters)
    res.write("calibration", seconds=round(time.time() - t, 1), **cal)
    for r in args.modes:
        if left(args.budget_s) < args.reserve_s + 5:
            res.write("skipped", what=f"mode r={r}", why="budget")
            continue
        try:
            run_mode(args, models[r], res, levels.get(r, []))
        except Exception as e:  # noqa: BLE001 - keep the other modes' results
            import traceback

            res.write("error", what=f"mode r={r}", error=f"{type(e).__name__}: {e}"[:2000],
                      where=traceback.format_exc()[-3000:])
    res.write("done", seconds=round(time.time() - T0, 1))


if __name__ == "__main__":
    main()
