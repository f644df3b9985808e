"""host_bench.py --profile: the measured iterations under cProfile, and their self time by part of
the engine loop."""

from __future__ import annotations

import cProfile
import gc
import time
from pathlib import Path

PROFILER: list[cProfile.Profile | None] = [None]  # --profile: on around the measured iterations only


GC_SECONDS = [0.0]  # thread CPU in the cyclic collector's passes during the measured iterations
_gc_started = [0.0]


def _on_gc(phase: str, info: dict) -> None:
    """gc.callbacks: the collector's passes timed apart. cProfile charges a pass to whatever
    function allocated when it began, so the profile's parts hid them (issue 46's third pass)."""
    if phase == "start":
        _gc_started[0] = time.thread_time()
    else:
        GC_SECONDS[0] += time.thread_time() - _gc_started[0]


def _timed(call) -> float:
    """Thread CPU seconds of `call()`, under the profiler when one is on; its collector passes
    added to GC_SECONDS."""
    profiler = PROFILER[0]
    gc.callbacks.append(_on_gc)
    t0 = time.thread_time()
    if profiler is not None:
        profiler.enable()
    try:
        call()
    finally:
        if profiler is not None:
            profiler.disable()
        gc.callbacks.remove(_on_gc)
    return time.thread_time() - t0


def _timed_off(call) -> float:
    """`call()` off the profiler (warm-up iterations)."""
    t0 = time.thread_time()
    call()
    return time.thread_time() - t0


# Where a stream-step's time goes: (part, file suffix, function names or None for every function).
# A built-in (numpy, list, dict methods) is charged to its caller's part.
PARTS = [
    ("audio intake: ring -> stream buffer (EngineCore._take_audio, Engine.take_audio, AudioBuffer.extend)",
     ("core/engine_core.py", "engine/admission.py", "engine/frontend.py", "core/shared.py", "engine/scheduler.py",
      "engine/collect.py"),
     {"_take_audio", "take_audio", "take_audio_many", "extend", "_make_room", "discard_before", "took", "views", "set_audio",
      "take_input"}),
    ("features: samples -> staging (FeatureExtractor.compute, AudioBuffer.copy_segment; preprocessor stubbed)",
     ("engine/frontend.py", "host_bench_stub.py"), {"compute", "compute_group", "copy_segment", "take", "forward", "_features"}),
    ("plan and launch (Scheduler.plan/advance, Engine._schedule/_launch, StepBatch)",
     ("engine/scheduler.py", "engine/loop.py", "engine/runner.py", "engine/in_flight.py", "engine/step.py"),
     {"plan", "advance", "frames_available", "_schedule", "_launch", "launch", "launched", "__init__", "take"}),
    ("step stub: the step's host-side result handling (packed tokens -> per-row lists)", ("host_bench_stub.py",), {"step", "<listcomp>"}),
    ("collect per row (Engine._collect/_advance: buffer trim, arrival, endpoint, StreamUpdate)",
     ("engine/loop.py", "engine/collect.py", "engine/publish.py", "engine/admission.py", "engine/accounting.py", "engine/stream.py",
      "engine/endpoint.py", "engine/frontend.py", "engine/in_flight.py", "engine/slot_table.py", "engine/results.py",
      "engine/queue_delay.py", "engine/eou.py", "engine/runner.py"), None),
    ("publish: route, results message (msgpack), ZMQ send (EngineCore.step, core_proc)",
     ("core/engine_core.py", "core/core_proc.py", "core/messages.py", "zmq/sugar/socket.py", "core/core_io.py"), None),
]
OTHER = "other (control intake, iterate's frame)"


def _part_of(func: tuple[str, int, str]) -> str | None:
    path, _, name = func
    for part, files, names in PARTS:
        if path.endswith(files) and (names is None or name in names):
            return part
    return None if path == "~" or "site-packages" in path and "zmq" not in path else OTHER


def profile_summary(profiler: cProfile.Profile, stream_steps: int) -> dict:
    """Self time of the profiled iterations by part of the loop (shares: cProfile's overhead inflates
    every call alike, so the shares, not its microseconds, are what to read), and the top functions."""
    profiler.create_stats()
    stats = profiler.stats
    if not stats:
        return {"profiled_s": 0.0, "stream_steps": stream_steps, "note": "no iteration measured (too few --seconds)"}
    by_part: dict[str, float] = {}
    for func, (_, _, tottime, _, callers) in stats.items():
        part = _part_of(func)
        if part is not None:
            by_part[part] = by_part.get(part, 0.0) + tottime
            continue
        edges = {c: e[2] for c, e in callers.items()}  # a built-in's self time, by caller
        total = sum(edges.values()) or 1.0
        for caller, t in edges.items() if edges else [(None, 1.0)]:
            owner = (_part_of(caller) or OTHER) if caller else OTHER
            by_part[owner] = by_part.get(owner, 0.0) + tottime * t / total
    whole = sum(by_part.values()) or 1.0
    top = sorted(stats.items(), key=lambda kv: -kv[1][2])[:20]
    return {
        "profiled_s": round(whole, 4),
        "stream_steps": stream_steps,
        "share_by_part": {k: round(v / whole, 3) for k, v in sorted(by_part.items(), key=lambda kv: -kv[1])},
        "top_self_time": [{"function": f"{Path(f[0]).name}:{f[1]}({f[2]})", "calls": v[1], "share": round(v[2] / whole, 3)}
                          for f, v in top],  # fmt: skip
    }

