"""Host CPU per stream-step of the engine's step loop, with the model replaced by a stub.

    python benchmarks/host_bench.py --streams 1000,4000,16000 --context-right 0,13 \
        --out benchmarks/results/host_core_cpu.json

What one stream-step costs the loop thread besides the model: taking the audio in, readiness, grouping, assembling feature input, building the step batch, turning the step's tokens
into results (text, endpointing) and handing them to the consumer. The model's own work is stubbed:
the preprocessor returns a zero tensor of the right shape, and the step returns one token per
three encoder frames without touching the slots, through the same host-side result handling as
run_step (one packed array turned into per-row lists). So the figure is what a GPU cannot take off the
host; the GPU goals need it far below the chunk period divided by the streams (80 ms / 1,000 =
80 us at 80 ms chunks, everything included).

The driver is synchronous on one thread: every stream receives exactly one chunk of audio, then
`iterate()` runs once, so every iteration steps every stream (the most work per iteration). Only
the CPU time of `iterate()` is counted (time.thread_time), after a warm-up that covers first chunks.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import run_record, write_json  # noqa: E402


class _StubPreprocessor(torch.nn.Module):
    """Log-mel of the right shape, no arithmetic: a view of one zero tensor (on a GPU the output
    would be device memory, written by the device: no host cost)."""

    def __init__(self, num_mels: int, hop: int) -> None:
        super().__init__()
        self.num_mels, self.hop = num_mels, hop
        self.out = torch.zeros(0, num_mels, 0)

    def forward(self, input_signal: torch.Tensor, length: torch.Tensor):
        b, frames = input_signal.shape[0], input_signal.shape[1] // self.hop + 1
        if self.out.shape[0] < b or self.out.shape[2] < frames:
            self.out = torch.zeros(max(b, self.out.shape[0]), self.num_mels, max(frames, self.out.shape[2]))
        return self.out[:b, :, :frames], length


OVERLAP = [False]  # --overlap: the engine launches step N+1 before collecting step N (engine/loop.py)
PROFILER: list[cProfile.Profile | None] = [None]  # --profile: on around the measured iterations only


def _timed(call) -> float:
    """Thread CPU seconds of `call()`, under the profiler when one is on."""
    profiler = PROFILER[0]
    t0 = time.thread_time()
    if profiler is not None:
        profiler.enable()
    call()
    if profiler is not None:
        profiler.disable()
    return time.thread_time() - t0


def _timed_off(call) -> float:
    """`call()` off the profiler (warm-up iterations)."""
    t0 = time.thread_time()
    call()
    return time.thread_time() - t0


def _iterations(g, num_streams: int, per_turn: int, seconds: float) -> tuple[int, int]:
    """(warm-up iterations, all iterations): the warm-up steps every stream's first later chunk
    (twice as many iterations overlapped: a stream in flight waits one), then `seconds` of audio
    per stream are measured, at least two iterations."""
    warm = -(-num_streams // per_turn) * (2 if OVERLAP[0] else 1)
    return warm, warm + max(2, int(seconds * 1000 / g.chunk_ms * num_streams / per_turn))


def _hungry(picked: list[int], flying: np.ndarray, slot_of) -> list[int]:
    """The streams of `picked` whose last chunk is not in flight. The overlapped loop leaves a
    stream in flight out of planning until the next iteration collects it: feeding it a chunk every
    iteration anyway would pile up audio it cannot step (growing buffers the real loop never has,
    where a chunk comes once per chunk period). The sequential loop has nothing in flight here."""
    return [k for k in picked if not flying[slot_of(k)]]


def _collect_stub(result):
    """The stub's launch returns its results already: collecting is taking them."""
    return result


EMISSION = Path(__file__).resolve().parent / "results" / "emission_demo_cpu_fp32.json"


def trained_emission(context_right: int) -> dict[int, float]:
    """The trained demo model's tokens per encoder frame at this chunk mode, as a distribution
    {tokens on one frame: share of frames} (benchmarks/gpu/emission.py measured it over the bundled
    utterances: 0.42 tokens per frame at every mode, 62-66% of frames without a token, up to 4)."""
    modes = {m["context_right"]: m for m in json.loads(EMISSION.read_text())["modes"]}
    counts = {int(k): v for k, v in modes[context_right]["frames_by_tokens"].items()}
    total = sum(counts.values())
    return {k: v / total for k, v in sorted(counts.items())}


def _emission_table(distribution: dict[int, float], length: int = 1 << 17) -> np.ndarray:
    """Cumulative tokens over `length` encoder frames drawn (seeded) from `distribution`: a row
    stepping frames [a, b) emits table[b] - table[a] tokens (each slot reads it at its own offset),
    so the stub costs O(rows) per step and carries the trained model's spread, not only its mean."""
    rng = np.random.default_rng(46)
    per_frame = rng.choice(list(distribution), size=length, p=list(distribution.values()))
    return np.concatenate([[0], np.cumsum(per_frame)])


def _stub_step(tokens_per_frame: float | dict[int, float], num_slots: int, emitted: dict):
    """The step's host side without the model: run_step's result handling (one packed [B, 2 + 2W]
    array turned into lists, sliced per row) over tokens made up at `tokens_per_frame` (a rate,
    spread evenly, or a distribution of tokens per frame: `trained_emission`). `emitted` counts
    the tokens and encoder frames it produced (the load it really carried)."""
    from nemo_serve.engine.step import StepResult

    decoded = np.zeros(num_slots, np.int64)  # encoder frames decoded per slot
    table = _emission_table(tokens_per_frame) if isinstance(tokens_per_frame, dict) else None
    offset = np.arange(num_slots, dtype=np.int64) * 7919 % (1 << 16)  # each slot its own stretch of the table

    def step(model, encoder, pool, batch) -> StepResult:
        rows = np.asarray(batch.rows)  # an array (a tensor in older versions)
        sub = model.geometry.subsampling
        start = decoded[rows]
        end = start + (np.asarray(batch.num_frames) + sub - 1) // sub
        decoded[rows] = end
        if table is None:
            lens = (end * tokens_per_frame).astype(np.int64) - (start * tokens_per_frame).astype(np.int64)
        else:
            lens = table[end + offset[rows]] - table[start + offset[rows]]
        emitted["tokens"] += int(lens.sum())
        emitted["frames"] += int((end - start).sum())
        width = max(int(lens.max()), 1)
        frames = start[:, None] + np.arange(width)[None, :]  # [B, W]
        packed = np.concatenate([lens[:, None], end[:, None], 1 + frames % 50, frames], axis=1)
        k, d = packed[:, 0].tolist(), packed[:, 1].tolist()
        ids, fr = packed[:, 2 : 2 + width].tolist(), packed[:, 2 + width :].tolist()
        return StepResult([r[:n] for r, n in zip(ids, k)], [r[:n] for r, n in zip(fr, k)], d)

    return step


def measure(model, num_streams: int, seconds: float, tokens_per_frame: float, ready_fraction: float = 1.0) -> dict:
    """Core CPU us per stream-step for `num_streams` streams, `ready_fraction` of them (in turn)
    fed one chunk before each iteration: 1.0 steps every stream every time; a real server's
    iterations come every few milliseconds, when only some streams have a new chunk."""
    from nemo_serve.engine import loop, runner
    from nemo_serve.engine.endpoint import EndpointConfig
    from nemo_serve.core.inproc import LocalEngine

    g = model.geometry
    engine = LocalEngine(loop.Engine(model, num_slots=num_streams, max_batch=num_streams, endpoint=EndpointConfig(), overlap=OVERLAP[0]))
    engine.engine.features.pre = _StubPreprocessor(model.num_mels, g.hop_samples)
    real_step = runner.launch_step, runner.collect_step
    emitted = {"tokens": 0, "frames": 0}
    runner.launch_step, runner.collect_step = _stub_step(tokens_per_frame, num_streams, emitted), _collect_stub
    try:
        streams = [engine.open_stream(lambda r: None) for _ in range(num_streams)]
        chunk_samples = g.chunk_frames * g.hop_samples
        first_samples = g.first_frames * g.hop_samples + 2 * g.hop_samples
        audio = (np.random.default_rng(0).standard_normal(first_samples + chunk_samples) * 0.01).astype(np.float32)
        for s in streams:
            engine.push(s, audio[:first_samples])
        engine.iterate()  # opens, first chunks
        per_turn = max(1, round(num_streams * ready_fraction))
        warm, steps = _iterations(g, num_streams, per_turn, seconds)
        cpu, stream_steps, iterations = 0.0, 0, 0
        gc.collect()
        flying = engine.engine.in_flight.flying
        emitted.update(tokens=0, frames=0)
        for i in range(steps):
            picked = [k % num_streams for k in range(i * per_turn, (i + 1) * per_turn)]
            for k in _hungry(picked, flying, lambda k: streams[k].slot):
                engine.push(streams[k], audio[first_samples:])
            before = engine.stats.stream_steps
            counted = i >= warm  # after every stream's first later chunk
            dt = _timed(engine.iterate) if counted else _timed_off(engine.iterate)
            if counted:
                cpu += dt
                stream_steps += engine.stats.stream_steps - before
                iterations += 1
        for s in streams:
            engine.abort(s)
        engine.iterate()
    finally:
        runner.launch_step, runner.collect_step = real_step
    return {
        "streams": num_streams,
        "context_right": g.context_right,
        "chunk_ms": g.chunk_ms,
        "ready_fraction": ready_fraction,
        "iterations": iterations,
        "stream_steps": stream_steps,
        "inprocess_cpu_us_per_stream_step": round(1e6 * cpu / max(stream_steps, 1), 2),
        "inprocess_cpu_ms_per_iteration": round(1e3 * cpu / max(iterations, 1), 2),
        "stub_tokens_per_frame": round(emitted["tokens"] / max(emitted["frames"], 1), 4),
        "budget_us_per_stream_step": round(1e3 * g.chunk_ms / num_streams, 2),
    }


def _thread_cpu_s(tids: list[int]) -> float:
    """CPU seconds of some of this process's threads (their schedstat, ns)."""
    total = 0
    for tid in tids:
        try:
            total += int(Path(f"/proc/self/task/{tid}/schedstat").read_text().split()[0])
        except (OSError, IndexError, ValueError):
            pass
    return total / 1e9


def _tids() -> set[int]:
    return {int(t.name) for t in Path("/proc/self/task").iterdir()}


def measure_core(model, num_streams: int, seconds: float, tokens_per_frame: float, ready_fraction: float = 1.0,
                 io_threads: bool = False) -> dict:  # fmt: skip
    """The same work through the engine core (nemo_serve/core/core_proc.py): the streams are
    opened with Open control messages over ZMQ, the bench writes each stream's audio into its
    shared-memory ring as a front end would (off the clock), and the clock covers
    EngineCoreProc.iterate_once(): control intake, ring intake (one array comparison over the slots,
    a copy out of each moved ring), Engine.iterate() and the encoding of one msgpack results
    message for the front end plus its hand-off to ZMQ. The results socket's peer (the front end's
    PULL) is bound here and drained off the clock. Counted: the iterating thread's CPU
    (time.thread_time) plus the CPU of the core's ZMQ I/O thread over the measured iterations
    (it writes the results message to the socket: the core process pays for it), reported
    apart as `core_zmq_io_us_per_stream_step` and included in `core_cpu_us_per_stream_step`.
    `io_threads`: the core's sockets on their own threads (core/core_io.py, as run() has them):
    the clock then covers the stepping thread's iteration (controls taken from the receiver,
    results handed to the sender), and the receiver's and sender's CPU (decode, encode, send) is
    counted with the ZMQ I/O threads'. Those threads' CPU is read from before the front end's
    write to after the results arrived, so it covers the receiving of the Wrote in both modes."""
    import tempfile

    import zmq

    from nemo_serve.core import messages as m
    from nemo_serve.core.addresses import control_address, results_address
    from nemo_serve.core.core_proc import EngineCoreProc
    from nemo_serve.core.shared import FileLock, SharedLayout, SharedSlots
    from nemo_serve.engine import loop, runner
    from nemo_serve.engine.endpoint import EndpointConfig

    g = model.geometry
    chunk_samples = g.chunk_frames * g.hop_samples
    first_samples = g.first_frames * g.hop_samples + 2 * g.hop_samples
    ipc_dir = tempfile.mkdtemp(prefix="host-bench-")
    shared = SharedSlots.create(SharedLayout(num_streams, max(first_samples, chunk_samples)), FileLock(f"{ipc_dir}/slots.lock"))
    engine = loop.Engine(model, num_slots=num_streams, max_batch=num_streams, endpoint=EndpointConfig(), overlap=OVERLAP[0])
    engine.features.pre = _StubPreprocessor(model.num_mels, g.hop_samples)
    real_step = runner.launch_step, runner.collect_step
    emitted = {"tokens": 0, "frames": 0}
    runner.launch_step, runner.collect_step = _stub_step(tokens_per_frame, num_streams, emitted), _collect_stub
    before_tids = _tids()
    core_ctx = zmq.Context()
    core = EngineCoreProc(engine, shared, ipc_dir, core_ctx)
    if io_threads:
        core.start_io()
    io_tids = sorted(_tids() - before_tids)  # the core context's I/O (and reaper) threads, and core_io's
    fe_ctx = zmq.Context()  # the front end's side, its own I/O thread (not counted)
    results = fe_ctx.socket(zmq.PULL)
    results.setsockopt(zmq.RCVHWM, 0)
    results.bind(results_address(ipc_dir, 0))
    control = fe_ctx.socket(zmq.PUSH)
    control.setsockopt(zmq.SNDHWM, 0)  # as the front end's (core/client.py): 16,000 opens queue before the core reads
    control.connect(control_address(ipc_dir))
    received = {"messages": 0, "bytes": 0, "updates": 0}

    def drain(block_ms: int = 0) -> None:
        while results.poll(block_ms):
            raw = results.recv(copy=False)
            received["messages"] += 1
            received["bytes"] += len(raw.buffer)
            received["updates"] += len(m.results_decoder.decode(raw.buffer).updates)
            block_ms = 0

    try:
        slots = []
        for i in range(num_streams):
            slot, gen = shared.allocate(0)
            slots.append((slot, gen))
            control.send(m.control_encoder.encode(m.Open(slot, gen, 0, f"s{i}", 0, {})))
        deadline = time.time() + 60
        while core.engine.num_open_streams < num_streams:  # the opens travel through ZMQ
            core.iterate_once()
            if time.time() > deadline:
                raise RuntimeError(f"only {core.engine.num_open_streams} of {num_streams} streams opened")
        audio = (np.random.default_rng(0).standard_normal(first_samples + chunk_samples) * 0.01).astype(np.float32)
        written = np.zeros(num_streams, np.int64)

        def write(streams: range, samples: np.ndarray, now: float) -> None:
            """The front end's side (core/client.py): ring writes, then one Wrote message; waits
            until it has reached the core's socket, as a front end's would have between iterations."""
            picked = _hungry([k % num_streams for k in streams], engine.in_flight.flying, lambda k: slots[k][0])
            if not picked:
                return
            for k in picked:
                shared.write(slots[k][0], int(written[k]), samples)
            written[picked] += len(samples)
            ring = np.array([slots[k] for k in picked], np.int64).reshape(-1, 2)
            control.send(m.control_encoder.encode(m.Wrote(
                ring[:, 0].astype(m.SLOT).tobytes(), ring[:, 1].astype(m.GEN).tobytes(),
                written[picked].astype(m.POS).tobytes(), np.full(len(picked), now, m.TIME).tobytes())))  # fmt: skip
            core.wait_control(1.0)

        write(range(num_streams), audio[:first_samples], time.time())
        core.iterate_once()  # first chunks
        drain(1000)
        per_turn = max(1, round(num_streams * ready_fraction))
        warm, steps = _iterations(g, num_streams, per_turn, seconds)
        cpu, io_cpu, stream_steps, iterations = 0.0, 0.0, 0, 0
        gc.collect()
        emitted.update(tokens=0, frames=0)
        for i in range(steps):
            now = time.time()
            io0 = _thread_cpu_s(io_tids)
            write(range(i * per_turn, (i + 1) * per_turn), audio[first_samples:], now)  # off the loop's clock
            before = engine.stats.stream_steps
            counted = i >= warm
            dt = _timed(core.iterate_once) if counted else _timed_off(core.iterate_once)
            drain(100 if engine.in_flight.flying.any() else 1000)  # off the clock; waits for the message, so the I/O thread is done with it
            dio = _thread_cpu_s(io_tids) - io0
            if counted:
                cpu += dt
                io_cpu += dio
                stream_steps += engine.stats.stream_steps - before
                iterations += 1
        for slot, gen in slots:
            control.send(m.control_encoder.encode(m.Abort(slot, gen, "bench over")))
        time.sleep(0.2)
        core.iterate_once()
        drain(200)
    finally:
        runner.launch_step, runner.collect_step = real_step
        core.close()
        results.close(0)
        control.close(0)
        fe_ctx.term()
        core_ctx.term()
        shared.close()
    total = cpu + io_cpu
    return {
        "core_io": "threads" if io_threads else "inline",
        "core_iterations": iterations,
        "core_stream_steps": stream_steps,
        "core_cpu_us_per_stream_step": round(1e6 * total / max(stream_steps, 1), 2),
        "core_loop_thread_us_per_stream_step": round(1e6 * cpu / max(stream_steps, 1), 2),
        "core_zmq_io_us_per_stream_step": round(1e6 * io_cpu / max(stream_steps, 1), 2),
        "core_cpu_ms_per_iteration": round(1e3 * total / max(iterations, 1), 2),
        "core_results_messages": received["messages"],
        "core_results_updates": received["updates"],
        "core_results_bytes_per_update": round(received["bytes"] / max(received["updates"], 1), 1),
        "core_stub_tokens_per_frame": round(emitted["tokens"] / max(emitted["frames"], 1), 4),
    }


# Where a stream-step's time goes: (part, file suffix, function names or None for every function).
# A built-in (numpy, list, dict methods) is charged to its caller's part.
PARTS = [
    ("audio intake: ring -> stream buffer (EngineCore._take_audio, Engine.take_audio, AudioBuffer.extend)",
     ("core/engine_core.py", "engine/admission.py", "engine/frontend.py", "core/shared.py", "engine/scheduler.py",
      "engine/collect.py"),
     {"_take_audio", "take_audio", "take_audio_many", "extend", "_make_room", "discard_before", "took", "views", "set_audio",
      "take_input"}),
    ("features: samples -> staging (FeatureExtractor.compute, AudioBuffer.copy_segment; preprocessor stubbed)",
     ("engine/frontend.py", "host_bench.py"), {"compute", "compute_group", "copy_segment", "take", "forward", "_features"}),
    ("plan and launch (Scheduler.plan/advance, Engine._schedule/_launch, StepBatch)",
     ("engine/scheduler.py", "engine/loop.py", "engine/runner.py", "engine/in_flight.py", "engine/step.py"),
     {"plan", "advance", "frames_available", "_schedule", "_launch", "launch", "launched", "__init__", "take"}),
    ("step stub: the step's host-side result handling (packed tokens -> per-row lists)", ("host_bench.py",), {"step", "<listcomp>"}),
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model spec (default: the embedded demo model)")
    p.add_argument("--streams", default="1000,4000,16000")
    p.add_argument("--context-right", default="0,13")
    p.add_argument("--seconds", type=float, default=4.0, help="audio per stream per measurement")
    p.add_argument("--ready-fraction", default="1.0", help="comma list: share of the streams stepped per iteration")
    p.add_argument("--tokens-per-frame", default="trained", help="stub emission: 'trained' (the demo model's measured "
                   "tokens per frame and their spread at each mode, benchmarks/results/emission_demo_cpu_fp32.json: 0.42) "
                   "or a rate spread evenly (the old default was 0.33)")
    p.add_argument("--profile", action="store_true", help="cProfile the engine core's measured iterations: the JSON "
                   "says per level where the time went (shares by part of the loop, top functions)")
    p.add_argument("--core-only", action="store_true", help="skip the in-process Engine measurement")
    p.add_argument("--frontend", action="store_true", help="also parts (b) and (c): a real server's front ends (benchmarks/frontend_bench.py)")
    p.add_argument("--core-io", default="inline", help="comma list of inline / threads, repeats allowed (inline,threads,inline,threads: an A/B run, "
                   "interleaved): the core's socket I/O on the stepping thread, or on its own threads (core/core_io.py)")
    p.add_argument("--overlap", action="store_true", help="the overlapped loop (launch N+1, then collect N), as on CUDA")
    p.add_argument("--notes", default=None, help="free text kept in the JSON (what else ran on the machine)")
    p.add_argument("--out", default=None, help="JSON file")
    from benchmarks.frontend_bench import add_args

    add_args(p)
    args = p.parse_args()
    OVERLAP[0] = args.overlap
    record_overlap = args.overlap
    torch.set_num_threads(1)
    from nemo_serve.model import load_model

    record = run_record()
    record["notes"] = args.notes
    record["overlap"] = record_overlap
    record["tokens_per_frame"] = args.tokens_per_frame
    entries = []
    for r in [int(x) for x in args.context_right.split(",")]:
        model = load_model(args.model, context_right=r)
        emission = trained_emission(r) if args.tokens_per_frame == "trained" else float(args.tokens_per_frame)
        for n, f in [(int(x), float(y)) for x in args.streams.split(",") for y in args.ready_fraction.split(",")]:
            e = measure(model, n, args.seconds, emission, f) if not args.core_only else {
                "streams": n, "context_right": r, "chunk_ms": model.geometry.chunk_ms, "ready_fraction": f,
                "budget_us_per_stream_step": round(1e3 * model.geometry.chunk_ms / n, 2)}  # fmt: skip
            for io in args.core_io.split(","):
                gc.collect()
                PROFILER[0] = cProfile.Profile() if args.profile else None
                e = dict(e, **measure_core(model, n, args.seconds, emission, f, io_threads=io == "threads"))
                if PROFILER[0] is not None:
                    e["profile"] = profile_summary(PROFILER[0], e["core_stream_steps"])
                    PROFILER[0] = None
                gc.collect()
                entries.append(e)
                print(f"streams {n:6d} ready {f:4.2f}  {e['chunk_ms']:5.0f} ms  io {io:7s}  core {e['core_cpu_us_per_stream_step']:7.2f} "
                      f"us/stream-step (loop {e['core_loop_thread_us_per_stream_step']:.2f} + io threads "
                      f"{e['core_zmq_io_us_per_stream_step']:.2f})  in-process engine "
                      f"{e.get('inprocess_cpu_us_per_stream_step', float('nan')):7.2f}  (budget {e['budget_us_per_stream_step']:.1f} us)"
                      f"  {e['core_cpu_ms_per_iteration']:.1f} ms/iteration", flush=True)
    out = {"run": record, "core": entries}
    if args.frontend:
        from benchmarks.frontend_bench import run_frontend_parts

        out["frontend"] = run_frontend_parts(args)
    if args.out:
        write_json(args.out, out)


if __name__ == "__main__":
    main()
