"""gpu_bench.py phase 4, per mode: the engine as the server builds it (captures timed), its validation
(graph path against eager, device waits per iteration) and the step sweep by batch size."""

from __future__ import annotations

import time
import warnings

import numpy as np

from benchmarks.gpu.emission import StepRecorder
from benchmarks.gpu.record import Results, free_gpu, left

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
        free_gpu()

