"""host_bench.py's two drivers: the in-process Engine (`measure`) and the engine core over ZMQ and
shared memory (`measure_core`), fed at the same pace, with the model stubbed (host_bench_stub.py)."""

from __future__ import annotations

import gc
import time
from pathlib import Path

import numpy as np

from benchmarks.host_bench_profile import GC_SECONDS, _timed, _timed_off
from benchmarks.host_bench_stub import _collect_stub, _StubPreprocessor, _stub_step

OVERLAP = [False]  # --overlap: the engine launches step N+1 before collecting step N (engine/loop.py)


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
        GC_SECONDS[0] = 0.0
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
        "inprocess_gc_us_per_stream_step": round(1e6 * GC_SECONDS[0] / max(stream_steps, 1), 2),
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
    from nemo_serve.core import core_proc
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
    tune_collector = getattr(core_proc, "tune_collector_for_serving", None)  # as run_core_process, where the tree has it
    thresholds = gc.get_threshold()
    if tune_collector is not None:
        tune_collector()
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
        GC_SECONDS[0] = 0.0
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
        gc.unfreeze()  # the next level starts from the same collector (no-ops where nothing was tuned)
        gc.set_threshold(*thresholds)
    total = cpu + io_cpu
    return {
        "core_io": "threads" if io_threads else "inline",
        "core_iterations": iterations,
        "core_stream_steps": stream_steps,
        "core_cpu_us_per_stream_step": round(1e6 * total / max(stream_steps, 1), 2),
        "core_loop_thread_us_per_stream_step": round(1e6 * cpu / max(stream_steps, 1), 2),
        "core_zmq_io_us_per_stream_step": round(1e6 * io_cpu / max(stream_steps, 1), 2),
        "core_gc_us_per_stream_step": round(1e6 * GC_SECONDS[0] / max(stream_steps, 1), 2),  # the loop thread's collector passes, in its figure
        "core_cpu_ms_per_iteration": round(1e3 * total / max(iterations, 1), 2),
        "core_results_messages": received["messages"],
        "core_results_updates": received["updates"],
        "core_results_bytes_per_update": round(received["bytes"] / max(received["updates"], 1), 1),
        "core_stub_tokens_per_frame": round(emitted["tokens"] / max(emitted["frames"], 1), 4),
    }

