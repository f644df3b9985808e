"""gpu_bench.py phase 5: the engine core's loop as it runs in production, N real-time streams per level,
lateness against 2 chunk periods; once per --capacity-configs path, and again with the overlapped loop."""

from __future__ import annotations

import time

import numpy as np

from benchmarks.gpu.emission import StepRecorder
from benchmarks.gpu.mode_checks import make_engine
from benchmarks.gpu.paths import applied
from benchmarks.gpu.record import Results, free_gpu, left

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
    cap = slots_that_fit(model, args)
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
        free_gpu()


def slots_that_fit(model, args) -> int | None:
    """Slots whose caches fit `--memory-fraction` of the free GPU memory (None on CPU)."""
    import torch

    from nemo_serve.engine.encoder import make_encoder
    from nemo_serve.engine.slots import SlotPool

    if model.device.type != "cuda":
        return None
    per = SlotPool(model, 1, make_encoder(model).channel_shape).bytes_per_slot
    free_gpu()
    free, _ = torch.cuda.mem_get_info()
    return int(args.memory_fraction * free / per)

