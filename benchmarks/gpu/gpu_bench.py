"""The GPU run: checks itself, then measures the production loop. Every result is a line of
OUT/results.jsonl written the moment it exists, so a run killed at its limit keeps what it measured.

    python benchmarks/gpu/gpu_bench.py --out OUT [--model nemotron-0.6b] [--device cuda] [--dtype bf16]

Phases, each started only if it fits the budget (--budget-s, from the process start):
1. `env`, `preflight` (at most ~30 s; stops the run with exit 4 and a plain message if anything
   is wrong): package versions, NeMo's import, CUDA, NeMo's conditional-node check (full-graph
   decoding needs it), and one bucket of a tiny prompt model captured and stepped on the device.
2. `selftest`: `--selftest` parity with NeMo's own loop on the device, every trained mode in one
   engine, in fp32 and bf16: the shipped demo model (real speech) and the tiny prompt built-in,
   once per --selftest-configs entry of KV layout, attention, decoder and epilogues (the ring layout
   with our label loop, the window reference with NeMo's computer, ring with SDPA attention, ring
   with the fused epilogues' Triton kernels); each record names the kernels and the decoder that
   ran (the selftest's `kernels:`, `paths:` and summary lines).
3. `model`, `calibration` per mode: the architecture built from configs/ (random init), a trained
   model's decoder load (benchmarks/gpu/emission.py): the decoder's max_symbols capped at
   --max-symbols (3), then a bias on its blank logit bracketed and bisected (>= 14 steps, one
   reused pool) until greedy decoding emits --tokens-target tokens per encoder frame (the demo
   model's 0.425) within --tokens-tol; each mode's phases run with its own bias. Why the cap: with
   random weights a frame that emits at all emits until max_symbols forces the next frame (the
   joint cannot tell a second symbol on a frame from the first on the next: both see the same
   predictor state), so the cap is what makes multi-token frames as rare as a trained model's
   tail. At 3 the label loop's trip counts come nearest the trained rows' (simulated from the
   demo model's row-steps at 128 and 512 rows: outer 3 / 10 / 20 against 4.7 / 7 / 18 at 80 /
   320 / 1120 ms; max_symbols 10 as before: 10 / 40 / 106; benchmarks/results/decoder_load_trips_sim.json).
4. per mode: `engine` (slots, buckets, every graph captured at start-up, timed, memory),
   `validate` (graph keys captured and failed with the exception, each bucket decoder's graph
   mode; tokens of K steps through the graph path equal to the eager path at three buckets on two
   identical pools; device waits per steady-state engine iteration), then `step`: run_step at
   each batch, ms per call from the host and GPU ms from CUDA events, with the calls' tokens per
   encoder frame and label-loop trip counts (outer and inner iterations per device step, counted
   from the tokens: emission.label_loop_trips; capacity levels report them too).
5. per mode, after every mode's step sweep: `capacity`, the engine core's loop as it runs in
   production (streams opened with updates=True, audio handed over with take_audio, iterate()
   on one thread, no other threads): N real-time streams whose starts spread over one chunk;
   lateness of every update after a warm-up (its delivery - the arrival of the last sample it
   needed) against 2 chunk periods; GPU ms per step, the loop's busy fraction. Levels rise
   until one does not keep up; slots are sized to the levels (and to GPU memory). Once per
   --capacity-configs pair (the window layout with NeMo's computer, the reference, then the ring
   layout with our label loop), each record naming its layout, decoder and rows per step.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
import traceback
import warnings
from importlib import metadata
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.gpu.emission import TRAINED, StepRecorder  # noqa: E402
from benchmarks.gpu.paths import CAPACITY_ORDER, SELFTEST_ORDER, applied, parse_paths, parse_phase_ends  # noqa: E402

T0 = time.time()
PACKAGES = ("torch", "nemo-toolkit", "lightning", "pytorch-lightning", "numpy", "cuda-bindings", "cuda-python",
            "omegaconf", "hydra-core", "transformers", "huggingface-hub", "sentencepiece")  # fmt: skip


class Results:
    def __init__(self, out_dir: Path) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        self.path = out_dir / "results.jsonl"
        self.records: list[dict] = []  # this run's, as written (a later phase reads an earlier one's)

    def write(self, kind: str, **fields) -> None:
        rec = {"kind": kind, "t_s": round(time.time() - T0, 2), **fields}
        self.records.append(rec)
        with self.path.open("a") as f:
            f.write(json.dumps(rec) + "\n")
            f.flush()
        print(json.dumps(rec)[:3000], flush=True)


def left(budget_s: float) -> float:
    return budget_s - (time.time() - T0)


def versions() -> dict:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:1000]


def _free_gpu() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- 1 preflight
def preflight(args, res: Results) -> bool:
    """Everything the run needs, checked in seconds on the smallest model; False: stop."""
    import torch

    t = time.time()
    problems: list[str] = []
    warnings_: list[str] = []
    rec: dict = {"versions": versions()}
    try:
        t_imp = time.time()
        import nemo.collections.asr  # noqa: F401

        rec["nemo_import_s"] = round(time.time() - t_imp, 1)
    except Exception as e:  # noqa: BLE001 - the message is the record
        problems.append(f"import nemo.collections.asr failed: {_err(e)}")
        rec["nemo_import_traceback"] = traceback.format_exc()[-3000:]
        res.write("preflight", ok=False, seconds=round(time.time() - t, 1), problems=problems, **rec)
        return False
    if args.device == "cuda":
        if not torch.cuda.is_available():
            problems.append("CUDA is not available to torch")
        else:
            p = torch.cuda.get_device_properties(0)
            rec["gpu"] = {"name": p.name, "memory_gib": round(p.total_memory / 2**30, 1),
                          "capability": f"{p.major}.{p.minor}", "multiprocessors": p.multi_processor_count}  # fmt: skip
        try:
            from nemo.core.utils.cuda_python_utils import check_cuda_python_cuda_graphs_conditional_nodes_supported

            check_cuda_python_cuda_graphs_conditional_nodes_supported()
            rec["conditional_nodes"] = "supported"
        except Exception as e:  # noqa: BLE001 - NeMo then decodes in no-while-loops mode (a wait per label)
            rec["conditional_nodes"] = _err(e)
            warnings_.append(f"no conditional nodes: NeMo's decoder runs without while loops ({_err(e)})")
    if not problems:
        try:
            rec["one_bucket"] = _one_bucket(args)
            rep = rec["one_bucket"]["report"]
            if rep["encoder_failed"]:
                problems.append(f"encoder graph capture failed: {rep['encoder_failed']}")
            if args.device == "cuda" and any(m == "no_graphs" for m in rep["decoder_modes"].values()):
                problems.append(f"NeMo's decoder could not be captured in any graph mode: {rep['decoder_failures']}")
        except Exception as e:  # noqa: BLE001
            problems.append(f"one bucket on the device failed: {_err(e)}")
            rec["one_bucket_traceback"] = traceback.format_exc()[-3000:]
    ok = not problems
    res.write("preflight", ok=ok, seconds=round(time.time() - t, 1), problems=problems, warnings=warnings_, **rec)
    if not ok:
        print("PREFLIGHT FAILED: " + "; ".join(problems), flush=True)
    return ok


def _one_bucket(args) -> dict:
    """The tiny prompt architecture on the device: bucket 2 prepared (captured on CUDA), then a
    first and a later chunk of two real rows."""
    import torch

    from benchmarks.architecture import served
    from nemo_serve.engine.encoder import make_encoder
    from nemo_serve.engine.slots import SlotPool
    from nemo_serve.engine.step import StepBatch, Stepper

    model = served("tiny-prompt", 3, args.dtype, args.device)
    encoder = make_encoder(model)
    pool = SlotPool(model, 4, encoder.channel_shape)
    stepper = Stepper(model, encoder, pool, context_right=3)
    if args.force_capture_failure:
        stepper.fail_next_decoder_capture = True
        if stepper.graphs is not None:
            stepper.graphs.fail_next_capture = True
    t = time.time()
    stepper.prepare([2])
    prepare_s = time.time() - t
    g = model.geometry
    rows = np.array([0, 1])
    pool.open_row(0), pool.open_row(1)
    tokens = 0
    for first in (True, False):
        w = g.first_frames if first else g.chunk_frames
        feats = torch.randn(2, model.num_mels, w).to(model.device)
        with torch.inference_mode():
            r = stepper.run(StepBatch(rows, feats, [w, w], first, None))
        tokens += sum(map(len, r.token_ids))
    return {"prepare_s": round(prepare_s, 2), "tokens": tokens, "report": stepper.report()}


# ----------------------------------------------------------------------------- 2 selftest
def selftest(args, res: Results) -> None:
    """`nemo-serve --selftest N --context-right all` on the device, as a user runs it: one process per
    (model, dtype), all at once (each loads its model once; a second restore of the same .nemo in
    one CUDA process failed on the H200 with an empty pos_bias in the restored state dict)."""
    import subprocess

    if left(args.budget_s) < args.reserve_s + 60:
        res.write("skipped", what="selftest", why="budget")
        return
    t = time.time()
    procs = {}
    for model in args.selftest_models:
        for dtype in args.selftest_dtypes:
            # engine/ring_cache.py, attention.py, label_loop.py, epilogues.py (Triton kernels on CUDA), loop.py
            for path in args.selftest_configs:
                cmd = [sys.executable, "-m", "nemo_serve.cli", "--selftest", str(args.selftest_n), "--context-right",
                       "all", "--dtype", dtype, "--device", args.device] + (["--model", model] if model else [])  # fmt: skip
                procs[(model or "demo", dtype, path)] = subprocess.Popen(
                    cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                    env={**os.environ, **path.env})  # fmt: skip
    for (model, dtype, path), p in procs.items():
        timed_out = False
        try:
            out, _ = p.communicate(timeout=max(10.0, min(180.0, left(args.budget_s) - args.reserve_s)))
        except subprocess.TimeoutExpired:  # its box ended: not measured, which is not a failure (decide.py)
            p.kill()
            out, _ = p.communicate()
            timed_out = True
        lines = [ln for ln in out.splitlines() if not ln.startswith(("[NeMo", "    "))]
        summary = next((ln for ln in reversed(lines) if "token-identical" in ln and "/" in ln.split()[0]), None)
        res.write("selftest", model=model, dtype=dtype, device=args.device, n=args.selftest_n, passed=p.returncode == 0,
                  timed_out=timed_out,
                  **path.fields, kernels=next((ln for ln in lines if ln.startswith("kernels: ")), None),
                  paths=next((ln for ln in lines if ln.startswith("paths: ")), None),
                  rc=p.returncode, summary=summary, per_mode=[ln for ln in lines if ln.startswith("context-right")],
                  diffs=[ln for ln in lines if ln.startswith("[DIFF]")],
                  tail=None if p.returncode == 0 else "\n".join(lines[-15:])[-3000:],
                  seconds=round(time.time() - t, 1))  # fmt: skip


# ----------------------------------------------------------------------------- 3 model, calibration
def build(args, res: Results):
    from benchmarks.architecture import construct, served

    t = time.time()
    construct(args.model)
    models = {r: served(args.model, r, args.dtype, args.device) for r in args.modes}
    nemo = models[args.modes[0]].nemo
    computer = models[args.modes[0]].decoding_computer  # the modes share the NeMo model, hence its decoder
    max_symbols_trained = int(computer.max_symbols)
    computer.max_symbols = args.max_symbols  # before any stepper exists: steppers size their outputs by it
    res.write("model", model=args.model, dtype=args.dtype, device=args.device, build_s=round(time.time() - t, 1),
              parameters=sum(p.numel() for p in nemo.parameters()), max_symbols=args.max_symbols,
              max_symbols_configured=max_symbols_trained)  # fmt: skip
    return models


class EmissionProbe:
    """Tokens per decoded encoder frame, over `steps` later chunks of fixed noise features on `rows`
    fresh slots of one reused pool (freed and re-allocated per probe); `last`: the probe's spread
    and trip counts (emission.StepRecorder)."""

    def __init__(self, model, encoder, rows: int = 64, steps: int = 3, seed: int = 0) -> None:
        import torch

        from nemo_serve.engine.slots import SlotPool
        from nemo_serve.engine.step import Stepper

        self.model, self.rows, self.steps = model, rows, steps
        self.pool = SlotPool(model, rows, encoder.channel_shape)
        self.stepper = Stepper(model, encoder, self.pool, graphs=False)
        self.last: dict = {}
        g = model.geometry
        gen = torch.Generator().manual_seed(seed)
        self.first = torch.randn(rows, model.num_mels, g.first_frames, generator=gen).to(model.device)
        self.later = [torch.randn(rows, model.num_mels, g.chunk_frames, generator=gen).to(model.device)
                      for _ in range(steps)]  # fmt: skip

    def __call__(self) -> float:
        import torch

        from nemo_serve.engine.step import StepBatch

        from benchmarks.gpu.emission import StepRecorder

        g = self.model.geometry
        rows = np.arange(self.rows)
        for row in rows.tolist():
            self.pool.open_row(row)
        rec = StepRecorder(self.stepper)
        try:
            with torch.inference_mode():
                self.stepper.run(StepBatch(rows, self.first, [g.first_frames] * self.rows, True, None))
                for feats in self.later:
                    self.stepper.run(StepBatch(rows, feats, [g.chunk_frames] * self.rows, False, None))
        finally:
            rec.close()
        for row in rows.tolist():
            self.pool.close_row(row)
        self.last = rec.summary()
        return self.last["tokens_per_frame"]


def calibrate_blank(model, probe, target: float, tol: float, iters: int) -> dict:
    """Emission falls as the blank bias rises (steeply with random weights: 1.0 to 0.0 within
    ~0.2). Bracket the target by doubling steps out from 0, then bisect at least `iters` times,
    stopping early once within `tol`; the bias with the closest fraction is kept."""
    import torch

    out = model.nemo.joint.joint_net[-1]
    blank = model.blank_id
    base = out.bias[blank].item()
    seen: dict[float, float] = {}

    def frac(b: float) -> float:
        if b not in seen:
            with torch.no_grad():
                out.bias[blank] = base + b
            seen[b] = probe()
        return seen[b]

    lo, hi, step = 0.0, 0.0, 0.25  # lo: emits more than target; hi: emits less
    if frac(0.0) > target:
        hi = step
        while frac(hi) > target and hi < 1e4:
            lo, hi, step = hi, hi + 2 * step, 2 * step
    else:
        lo = -step
        while frac(lo) <= target and lo > -1e4:
            hi, lo, step = lo, lo - 2 * step, 2 * step
    bracket = (lo, hi)
    for _ in range(iters):
        mid = (lo + hi) / 2
        if frac(mid) > target:
            lo = mid
        else:
            hi = mid
        if abs(seen[mid] - target) <= tol:
            break
    best = min(seen, key=lambda b: abs(seen[b] - target))
    frac(best)  # leaves the bias at best
    with torch.no_grad():
        out.bias[blank] = base + best
    return {"blank_bias_added": best, "measured": seen[best], "target": target, "tolerance": tol,
            "within_tolerance": abs(seen[best] - target) <= tol, "bracket": list(bracket),
            "probes": len(seen)}  # fmt: skip


def calibrate(args, models, res: Results) -> dict[int, float]:
    """Each mode its own blank bias (the joint is shared by the modes' models; one bias would emit on
    29% of the frames at 80 ms and 71% at 1120 ms when it gives 34% at 320 ms: measured on the H200),
    so every mode's decoder does comparable work. Returns the bias per mode (`set_blank_bias`)."""
    from benchmarks.architecture import set_mode
    from nemo_serve.engine.encoder import make_encoder

    base = _blank_bias(models[args.modes[0]])
    biases = {}
    for r, m in models.items():
        t = time.time()
        set_mode(m)
        set_blank_bias(m, base)
        probe = EmissionProbe(m, make_encoder(m))
        cal = calibrate_blank(m, probe, args.tokens_target, args.tokens_tol, args.calibrate_iters)
        probe()  # at the kept bias: its spread and trips for the record
        cal["load"] = probe.last
        del probe
        biases[r] = base + cal["blank_bias_added"]
        res.write("calibration", chunk_ms=round(m.geometry.chunk_ms), context_right=r, seconds=round(time.time() - t, 1),
                  **cal)  # fmt: skip
        _free_gpu()
    return biases


def _blank_bias(model) -> float:
    return model.nemo.joint.joint_net[-1].bias[model.blank_id].item()


def set_blank_bias(model, value: float) -> None:
    """In place: captured graphs read the parameter's memory, so they see it at their next replay."""
    import torch

    with torch.no_grad():
        model.nemo.joint.joint_net[-1].bias[model.blank_id] = value


# ----------------------------------------------------------------------------- 4 engine, validate, step
def make_engine(model, slots: int, res: Results | None = None, what: str = "engine", diarizer=None):
    """An Engine as the server builds it, every graph captured at start-up (Engine.prepare, as every
    server calls it; a no-op on CPU), timed."""
    import torch

    from benchmarks.architecture import set_mode
    from nemo_serve.engine.endpoint import EndpointConfig
    from nemo_serve.engine.loop import Engine
    from nemo_serve.engine.step import stepper_for

    set_mode(model)
    g = model.geometry
    t = time.time()
    engine = Engine(model, num_slots=slots, endpoint=EndpointConfig.off(), diarizer=diarizer)
    t_prep = time.time()
    line = engine.prepare()
    stepper = stepper_for(model, engine.encoder, engine.pool)
    prep = time.time() - t_prep
    mem = {}
    if model.device.type == "cuda":
        mem = {"allocated_gib": round(torch.cuda.memory_allocated() / 2**30, 2),
               "reserved_gib": round(torch.cuda.memory_reserved() / 2**30, 2)}  # fmt: skip
    if res is not None:
        rep = stepper.report()
        res.write(what, chunk_ms=round(g.chunk_ms), context_right=g.context_right, slots=slots,
                  buckets=stepper.sizes, max_step_rows=engine.pool.max_step_rows, graphs=rep["graphs"],
                  encoder_graphs=len(rep["encoder_captured"]), encoder_failed=rep["encoder_failed"],
                  decoder=rep["settings"]["decoder"], decoder_modes=rep["decoder_modes"], build_s=round(t_prep - t, 1), capture_s=round(prep, 1),
                  memory=engine.pool.memory_summary(), gpu_memory=mem, startup_line=line,
                  kv_layout=engine.pool.layout, kernels=engine.encoder.describe(engine.pool))  # fmt: skip
    return engine, stepper


def graph_vs_eager(args, model, engine, stepper, steps: int = 4) -> dict:
    """The same K chunks through the engine's graph stepper on its pool and through an eager
    stepper (no encoder graphs, NeMo's torch_impl decoder) on a second pool: tokens must be
    identical at every step, at three batch sizes (one padded)."""
    import torch

    from nemo_serve.engine.ring_cache import make_slot_pool
    from nemo_serve.engine.step import StepBatch, Stepper

    g = model.geometry
    sizes = sorted({1, min(5, engine.pool.max_step_rows), min(64, engine.pool.max_step_rows)})
    top = max(sizes)
    eager_pool = make_slot_pool(model, engine.encoder, top)  # the engine's layout
    eager = Stepper(model, engine.encoder, eager_pool, graphs=False, context_right=g.context_right)
    gen = torch.Generator().manual_seed(7)
    out = {"batches": sizes, "steps": steps, "identical": True, "tokens": 0, "first_difference": None,
           "max_abs_cache_diff": 0.0}  # fmt: skip
    for n in sizes:
        rows_a = rows_b = np.arange(n)  # no stream open: the rows are the benchmark's
        for row in range(n):
            engine.pool.open_row(row), eager_pool.open_row(row)
        try:
            for k in range(steps):
                first = k == 0
                w = g.first_frames if first else g.chunk_frames
                feats = torch.randn(n, model.num_mels, w, generator=gen).to(model.device)
                with torch.inference_mode():
                    a = stepper.run(StepBatch(rows_a, feats, [w] * n, first, None))
                    b = eager.run(StepBatch(rows_b, feats, [w] * n, first, None))
                out["tokens"] += sum(map(len, a.token_ids))
                if a.token_ids != b.token_ids or a.decoded_frames != b.decoded_frames:
                    out["identical"] = False
                    out["first_difference"] = out["first_difference"] or {"batch": n, "step": k}
            c = getattr(engine.encoder, "cache_len", None)  # state positions (the KV layouts' scratch is not state)
            ca = engine.pool.read_encoder(torch.as_tensor(rows_a, device=model.device), c)
            cb = eager_pool.read_encoder(torch.as_tensor(rows_b, device=model.device), c)
            for x, y in ((ca.cache_last_channel, cb.cache_last_channel), (ca.cache_last_time, cb.cache_last_time)):
                d = (x.float() - y.float()).abs().max().item() if x.numel() else 0.0
                out["max_abs_cache_diff"] = max(out["max_abs_cache_diff"], d)
        finally:
            for row in range(n):
                engine.pool.close_row(row), eager_pool.close_row(row)
    out["eager_report"] = {k: v for k, v in eager.report().items() if k in ("decoder_modes", "decoder_failures")}
    del eager, eager_pool
    return out


def syncs_per_iteration(model, engine, streams: int = 8, iterations: int = 4) -> dict:
    """Device waits of whole engine iterations in steady state (later chunks, graphs captured):
    torch.cuda.set_sync_debug_mode warns at every synchronizing call; counted per iteration that
    stepped. CPU: not measurable here (tests/test_step_sync.py counts them by tracing)."""
    import torch

    if model.device.type != "cuda":
        return {"measured": False}
    g = model.geometry
    packet = int(round(g.chunk_ms / 1000 * g.sample_rate))
    rng = np.random.default_rng(3)
    ss = [engine.admit(slot=i, stream_id=f"sync-{i}") for i in range(streams)]  # as the core admits them
    counts, stepped = [], []
    try:
        for k in range(2 + iterations):
            for s in ss:
                engine.take_audio(s, ((0.05 * rng.standard_normal(packet)).astype(np.float32),), time.time())
            if k < 2:  # first chunks and the first later chunk: not steady state
                while engine.iterate().busy:
                    pass
                continue
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    did = engine.iterate().busy
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            n = sum("synchroniz" in str(x.message) for x in w)
            counts.append(n)
            stepped.append(bool(did))
            while engine.iterate().busy:
                pass
    finally:
        for s in ss:
            engine.abort(s)
        engine.iterate()
    return {"measured": True, "streams": streams, "waits_per_iteration": counts, "stepped": stepped, "goal": 1}


def step_sweep(args, model, engine, stepper, res: Results) -> None:
    """run_step over the engine's own pool (its loop not started): batches in rising order."""
    import torch

    from nemo_serve.engine.step import StepBatch, run_step

    g, pool, encoder = model.geometry, engine.pool, engine.encoder
    batches = [b for b in args.batches if b <= pool.num_slots]
    ids = range(max(batches))  # rows: no stream is open
    for row in ids:
        pool.open_row(row)
    gen = torch.Generator().manual_seed(1)
    try:
        for b in batches:
            if left(args.budget_s) < args.reserve_s + 2 * args.step_seconds + 5:
                res.write("skipped", what=f"step r={g.context_right} batch {b}", why="budget")
                return
            rows = np.arange(b)
            first = torch.randn(b, model.num_mels, g.first_frames, generator=gen).to(model.device)
            later = torch.randn(b, model.num_mels, g.chunk_frames, generator=gen).to(model.device)
            run_step(model, encoder, pool, StepBatch(rows, first, [g.first_frames] * b, True, None))
            run_step(model, encoder, pool, StepBatch(rows, later, [g.chunk_frames] * b, False, None))
            times, stepper.gpu_times = [], []
            t_end = time.time() + args.step_seconds
            rec = StepRecorder(stepper)
            try:
                while time.time() < t_end or len(times) < 3:
                    t = time.perf_counter()
                    run_step(model, encoder, pool, StepBatch(rows, later, [g.chunk_frames] * b, False, None))
                    times.append(time.perf_counter() - t)
                    if len(times) >= 30:
                        break
            finally:
                rec.close()
            gpu = _gpu_ms(stepper)
            ms = 1000 * float(np.median(times))
            parts = -(-b // pool.max_step_rows)
            res.write("step", chunk_ms=round(g.chunk_ms), context_right=g.context_right, dtype=args.dtype, batch=b,
                      calls=len(times), ms_median=round(ms, 3), ms_min=round(1000 * min(times), 3),
                      gpu_ms_median=round(gpu * parts, 3) if gpu is not None else None,
                      us_per_stream_step=round(1000 * ms / b, 2), steps_per_call=parts,
                      realtime_streams_bound=int(b * g.chunk_ms / ms), label_loop=rec.summary())  # fmt: skip
    finally:
        stepper.gpu_times = None
        for row in ids:
            pool.close_row(row)


def _gpu_ms(stepper) -> float | None:
    """Median GPU ms of the device steps recorded since gpu_times was set (events completed: each
    step's final copy waited for them)."""
    pairs = stepper.gpu_times or []
    if not pairs:
        return None
    return float(np.median([a.elapsed_time(b) for a, b in pairs]))


def mode_checks(args, model, res: Results) -> None:
    """Per mode: engine (captures), validate, step sweep; the engine is dropped afterwards."""
    g = model.geometry
    slots = max(args.batches)
    engine, stepper = make_engine(model, slots, res)
    try:
        t = time.time()
        rec: dict = {"chunk_ms": round(g.chunk_ms), "context_right": g.context_right}
        rec["graph_vs_eager"] = graph_vs_eager(args, model, engine, stepper)
        rec["syncs"] = syncs_per_iteration(model, engine)
        rec["stepper"] = stepper.report()
        rec["ok"] = (rec["graph_vs_eager"]["identical"] and not rec["stepper"]["encoder_failed"]
                     and all(m != "no_graphs" for m in rec["stepper"]["decoder_modes"].values()) or model.device.type != "cuda")  # fmt: skip
        res.write("validate", seconds=round(time.time() - t, 1), **rec)
        step_sweep(args, model, engine, stepper, res)
    finally:
        del engine, stepper
        _free_gpu()


# ----------------------------------------------------------------------------- 5 capacity
def capacity_level(args, model, engine, stepper, n: int, audio: np.ndarray, seconds: float, admit: dict | None = None,
                   extra_bound_s: float = 0.0) -> dict:
    """The engine core's loop with n synthetic real-time streams: take_audio of every packet that
    is due, then iterate(), on this one thread. A packet arrives (its `arrived` time) when its last
    sample would have; lateness of an update = delivery - arrival of the last sample it needed.
    `admit`: each stream's options (diarization); `extra_bound_s`: added to the 2-chunk bound (what
    a diarized update waits for its speakers by design: diar_phase.py)."""
    g = model.geometry
    period = g.chunk_ms / 1000
    packet = int(round(period * g.sample_rate))
    lat: list[float] = []
    pending: list[float] = []  # arrival times of this iteration's updates, delivered when it returns
    warm_until = time.time() + min(args.warmup_s, seconds / 3) + period

    rng = np.random.default_rng(n)
    offsets = np.sort(rng.uniform(0, period, n))
    streams = [engine.admit(slot=i, stream_id=f"capacity-{i}", **(admit or {})) for i in range(n)]  # as the core does
    start = time.time() + 0.2
    end = start + seconds
    sent = np.zeros(n, np.int64)
    src = rng.integers(0, len(audio) - 8 * packet, n)
    pos = np.zeros(n, np.int64)
    steps0, rows0 = engine.stats.steps, engine.stats.stream_steps
    stepper.gpu_times = []
    rec = StepRecorder(stepper)
    busy = 0.0
    t_begin = time.time()
    while True:
        now = time.time()
        if now >= end:
            break
        due = np.floor((now - start - offsets) / period).astype(np.int64) + 1
        idx = np.flatnonzero(due > sent)
        for i in idx.tolist():
            k = int(due[i] - sent[i])
            s0 = (src[i] + pos[i]) % (len(audio) - 8 * packet)
            k = min(k, 8)
            engine.take_audio(streams[i], (audio[s0 : s0 + packet * k],), start + offsets[i] + (due[i] - 1) * period)
            pos[i] += packet * k
            sent[i] = due[i]
        t = time.perf_counter()
        out = engine.iterate()
        busy += time.perf_counter() - t
        stepped = out.busy
        pending.extend(u.audio_arrival_time for u in out.updates)
        if pending:
            done = time.time()
            if done > warm_until:
                lat.extend(done - a for a in pending)
            pending.clear()
        if not stepped:
            time.sleep(0.0005)
    wall = time.time() - t_begin
    gpu = [a.elapsed_time(b) for a, b in stepper.gpu_times or []]
    stepper.gpu_times = None
    rec.close()
    steps, rows = engine.stats.steps - steps0, engine.stats.stream_steps - rows0
    for s in streams:  # the drain's updates go to `pending`, never read again: not counted
        engine.finish(s)
    deadline = time.time() + min(30.0, max(5.0, left(args.budget_s) - args.reserve_s))
    while engine.num_open_streams and time.time() < deadline:
        if not engine.iterate().busy:
            time.sleep(0.001)
    a = np.asarray(lat)
    bound = 2 * period + extra_bound_s
    return {
        "streams": n,
        "chunk_ms": round(g.chunk_ms),
        "seconds": seconds,
        "updates": int(a.size),
        "lateness_p50_ms": round(1000 * float(np.percentile(a, 50)), 1) if a.size else None,
        "lateness_p95_ms": round(1000 * float(np.percentile(a, 95)), 1) if a.size else None,
        "lateness_max_ms": round(1000 * float(a.max()), 1) if a.size else None,
        "bound_ms": round(1000 * bound, 1),
        "keeps_up": bool(a.size and np.percentile(a, 95) <= bound),
        "steps": steps,
        "rows_per_step": round(rows / max(steps, 1), 1),
        "gpu_ms_per_step_median": round(float(np.median(gpu)), 3) if gpu else None,
        "gpu_busy_fraction": round(sum(gpu) / 1000 / wall, 3) if gpu else None,
        "loop_busy_fraction": round(busy / wall, 3),
        "host_us_per_stream_step": round(1e6 * (busy - sum(gpu) / 1000) / max(rows, 1), 1) if gpu else round(1e6 * busy / max(rows, 1), 1),
        "open_after_drain": engine.num_open_streams,
        "label_loop": rec.summary(),
    }


def capacity(args, model, res: Results, levels: list[int], paths=None) -> None:
    """The levels once per engine path (--capacity-configs: the reference, window with NeMo's computer,
    first; then the new defaults), each on an engine of its own, side by side in one run. The path's
    switches are read by the pool, encoder, Stepper and Engine as they are made (paths.py)."""
    for path in args.capacity_configs if paths is None else paths:
        with applied(path):
            _capacity_levels(args, model, res, levels, path)


def overlap(args, model, res: Results, levels: list[int]) -> None:
    """The last --capacity-configs path again with the overlapped loop (NEMO_SERVE_OVERLAP=1): on
    and off side by side in one run (issue 46 step 5)."""
    capacity(args, model, res, levels, [args.capacity_configs[-1].with_overlap()])


def _capacity_levels(args, model, res: Results, levels: list[int], path) -> None:
    g = model.geometry
    if not levels:
        return
    slots = max(levels)
    cap = _slots_that_fit(model, args)
    if cap is not None and cap < slots:
        res.write("skipped", what=f"capacity {round(g.chunk_ms)} ms levels above {cap} streams", why="GPU memory",
                  levels=[x for x in levels if x > cap])  # fmt: skip
        levels = [x for x in levels if x <= cap] or [cap]
        slots = max(levels)
    engine, stepper = make_engine(model, slots, res, what="capacity_engine")
    try:
        rng = np.random.default_rng(0)
        audio = (0.05 * rng.standard_normal(g.sample_rate * 60)).astype(np.float32)
        for n in sorted(levels):
            if left(args.budget_s) < args.level_seconds + 10 + args.reserve_s:
                res.write("skipped", what=f"capacity {round(g.chunk_ms)} ms {n} streams", why="budget")
                break
            out = capacity_level(args, model, engine, stepper, n, audio, args.level_seconds)
            res.write("capacity", context_right=g.context_right, dtype=args.dtype, **path.fields,
                      overlap_engine=engine.overlap, max_step_rows=engine.pool.max_step_rows, **out)  # fmt: skip
            if not out["keeps_up"] or out["open_after_drain"]:
                break
    finally:
        del engine, stepper
        _free_gpu()


def _slots_that_fit(model, args) -> int | None:
    """Slots whose caches fit `--memory-fraction` of the free GPU memory (None on CPU)."""
    import torch

    from nemo_serve.engine.encoder import make_encoder
    from nemo_serve.engine.slots import SlotPool

    if model.device.type != "cuda":
        return None
    per = SlotPool(model, 1, make_encoder(model).channel_shape).bytes_per_slot
    _free_gpu()
    free, _ = torch.cuda.mem_get_info()
    return int(args.memory_fraction * free / per)


# ----------------------------------------------------------------------------- main
def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="nemotron-0.6b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--modes", default="3,0,13", help="right contexts, in priority order")
    ap.add_argument("--batches", default="1,16,128,512,2048")
    ap.add_argument("--step-seconds", type=float, default=1.0)
    ap.add_argument("--levels", default="0:1000,2000,4000;3:2000,4000,8000;13:2000,4000,8000,12000",
                    help="per mode r: stream counts, rising; a level that does not keep up ends the mode")
    ap.add_argument("--level-seconds", type=float, default=6.0)
    ap.add_argument("--warmup-s", type=float, default=2.0)
    ap.add_argument("--calibrate-iters", type=int, default=16)
    ap.add_argument("--tokens-target", type=float, default=TRAINED["tokens_per_frame"],
                    help="tokens per encoder frame the blank bias is calibrated to (default: the demo model's)")
    ap.add_argument("--tokens-tol", type=float, default=0.03)
    ap.add_argument("--max-symbols", type=int, default=3, help="the decoder's cap on tokens per frame (docstring)")
    ap.add_argument("--selftest-models", default="demo,builtin:tiny-prompt",
                    help="comma-separated; 'demo' is the shipped model; empty: no selftest")
    ap.add_argument("--selftest-dtypes", default="fp32,bf16")
    ap.add_argument("--selftest-configs",
                    default="ring:matmul:label_loop,window:matmul:nemo,ring:sdpa:label_loop,ring:matmul:label_loop:fused,"
                            "ring:matmul:label_loop:fused:1",
                    help="layout:attention:decoder[:kernels[:overlap]] the selftest runs with (paths.py: "
                         "NEMO_SERVE_KV_LAYOUT, _ATTENTION, _DECODER, _KERNELS, _OVERLAP; nemo and 0 unless given)")
    ap.add_argument("--capacity-configs", default="window:nemo,ring:label_loop:matmul:fused",
                    help="layout:decoder[:attention[:kernels[:overlap]]] paths whose capacity is measured, in order: "
                         "the reference first, the candidate defaults last (the overlap phase runs the last with overlap)")
    ap.add_argument("--overlap-modes", default="0", help="modes the overlap phase measures (empty: none)")
    ap.add_argument("--diar-levels", default="0:250,500,1000",
                    help="streams per GPU with diarization on (diar_phase.py): r:levels;... (empty: none)")
    ap.add_argument("--diarizer", default="builtin:tiny-sortformer")
    ap.add_argument("--phase-ends", default="selftest:0.33,checks:0.47,capacity:0.8,overlap:0.9,diarization:1",
                    help="phase:fraction of --budget-s by which each phase has ended (paths.py)")
    ap.add_argument("--selftest-n", type=int, default=4)
    ap.add_argument("--memory-fraction", type=float, default=0.7)
    ap.add_argument("--force-capture-failure", action="store_true",
                    help="preflight: the first encoder capture and decoder capture fail (checks the fallback)")
    ap.add_argument("--budget-s", type=float, default=420.0)
    ap.add_argument("--reserve-s", type=float, default=10.0)
    ap.add_argument("--threads", type=int, default=4)
    args = ap.parse_args(argv)
    args.modes = [int(x) for x in args.modes.split(",")]
    args.batches = sorted(int(x) for x in args.batches.split(","))
    args.levels_by_mode = {int(k): [int(x) for x in v.split(",")] for k, v in (p.split(":") for p in args.levels.split(";"))}
    args.selftest_models = [None if m == "demo" else m for m in args.selftest_models.split(",") if m]
    args.selftest_dtypes = [d for d in args.selftest_dtypes.split(",") if d]
    try:
        args.selftest_configs = parse_paths(args.selftest_configs, SELFTEST_ORDER, 3)
        args.capacity_configs = parse_paths(args.capacity_configs, CAPACITY_ORDER, 2)
        args.phase_ends = parse_phase_ends(args.phase_ends)
    except ValueError as e:
        ap.error(str(e))
    args.overlap_modes = [int(x) for x in args.overlap_modes.split(",") if x]
    args.diar_levels = {int(k): [int(x) for x in v.split(",")] for k, v in (p.split(":") for p in args.diar_levels.split(";") if p)}
    return args


def main(argv=None) -> int:
    global T0
    T0 = time.time()  # the budget counts from the run, not from the import
    args = parse(argv)
    import torch

    torch.set_num_threads(args.threads)
    with torch.no_grad():  # not set_grad_enabled(False): main() also runs inside the tests' process
        return _run(args, Results(Path(args.out)))


def phases(args, res: Results) -> list:
    """After the selftest and the model: (phase, fn(model, r), modes) in the order of their value."""
    from benchmarks.gpu.diar_phase import diarization

    def levels(r: int) -> list[int]:
        return args.levels_by_mode.get(r, [])

    def overlap_levels(r: int) -> list[int]:
        """From the highest level the path without overlap kept up at r (this run's records) upward."""
        off = args.capacity_configs[-1].fields
        kept = [c["streams"] for c in res.records if c["kind"] == "capacity" and c["context_right"] == r
                and c["keeps_up"] and all(c.get(k) == v for k, v in off.items())]  # fmt: skip
        return [n for n in levels(r) if not kept or n >= max(kept)]

    return [
        ("checks", lambda m, r: mode_checks(args, m, res), args.modes),
        ("capacity", lambda m, r: capacity(args, m, res, levels(r)), args.modes),
        ("overlap", lambda m, r: overlap(args, m, res, overlap_levels(r)), [r for r in args.overlap_modes if r in args.modes]),
        ("diarization", lambda m, r: diarization(args, m, res, args.diar_levels[r]), [r for r in args.diar_levels if r in args.modes]),
    ]  # fmt: skip


def _run(args, res: Results) -> int:
    import torch

    res.write("env", python=platform.python_version(), torch=torch.__version__, cuda=torch.version.cuda,
              device=torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", argv=sys.argv[1:],
              # run_gpu.sh exports both; run by hand, the bench's own command and no commit
              command=os.environ.get("NEMO_SERVE_RUN_COMMAND", " ".join(["python", *sys.argv])),
              git_commit=os.environ.get("NEMO_SERVE_GIT_COMMIT", "?"),
              budget_s=args.budget_s,
              graph_settings={k: v for k, v in os.environ.items() if k.startswith("NEMO_SERVE_") and "GRAPH" in k
                              or k in ("NEMO_SERVE_DECODER_MAX_TIME", "NEMO_SERVE_DECODER", "NEMO_SERVE_LABEL_LOOP_ROWS",
                                        "NEMO_SERVE_KERNELS")})  # fmt: skip
    if not preflight(args, res):
        res.write("done", ok=False, seconds=round(time.time() - T0, 1), why="preflight")
        return 4
    _free_gpu()
    total = args.budget_s
    args.budget_s = total * args.phase_ends["selftest"]
    selftest(args, res)
    args.budget_s = total * args.phase_ends["checks"]
    models = build(args, res)
    biases = calibrate(args, models, res)
    from benchmarks.architecture import set_mode

    for phase, fn, modes in phases(args, res):
        args.budget_s = total * args.phase_ends[phase]  # this phase's time box (--phase-ends)
        for r in modes:
            if left(args.budget_s) < args.reserve_s + 5:
                res.write("skipped", what=f"{phase} r={r}", why="budget")
                continue
            set_mode(models[r])
            set_blank_bias(models[r], biases[r])
            try:
                fn(models[r], r)
            except Exception as e:  # noqa: BLE001 - keep the other modes' results
                res.write("error", what=f"{phase} r={r}", error=_err(e), where=traceback.format_exc()[-3000:])
                _free_gpu()
    args.budget_s = total
    res.write("done", ok=True, seconds=round(time.time() - T0, 1))
    return 0


if __name__ == "__main__":
    code = main()
    # No interpreter teardown: after a device fault (an illegal memory access) freeing CUDA tensors
    # at exit aborts the process, and the wrapper would see 134 instead of this exit code.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
