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
import gc
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


def _collect_stub(result):
    """The stub's launch returns its results already: collecting is taking them."""
    return result


def _stub_step(tokens_per_frame: float, num_slots: int):
    """The step's host side without the model: run_step's result handling (one packed [B, 2 + 2W]
    array turned into lists, sliced per row) over tokens made up at `tokens_per_frame`."""
    from nemo_serve.engine.step import StepResult

    decoded = np.zeros(num_slots, np.int64)  # encoder frames decoded per slot

    def step(model, encoder, pool, batch) -> StepResult:
        rows = np.asarray(batch.rows)  # an array (a tensor in older versions)
        sub = model.geometry.subsampling
        start = decoded[rows]
        end = start + (np.asarray(batch.num_frames) + sub - 1) // sub
        decoded[rows] = end
        lens = (end * tokens_per_frame).astype(np.int64) - (start * tokens_per_frame).astype(np.int64)
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
    runner.launch_step, runner.collect_step = _stub_step(tokens_per_frame, num_streams), _collect_stub
    try:
        streams = [engine.open_stream(lambda r: None) for _ in range(num_streams)]
        chunk_samples = g.chunk_frames * g.hop_samples
        first_samples = g.first_frames * g.hop_samples + 2 * g.hop_samples
        audio = (np.random.default_rng(0).standard_normal(first_samples + chunk_samples) * 0.01).astype(np.float32)
        for s in streams:
            engine.push(s, audio[:first_samples])
        engine.iterate()  # opens, first chunks
        per_turn = max(1, round(num_streams * ready_fraction))
        steps = max(3, int(seconds * 1000 / g.chunk_ms * num_streams / per_turn))
        cpu, stream_steps, iterations = 0.0, 0, 0
        gc.collect()
        for i in range(steps):
            for k in range(i * per_turn, (i + 1) * per_turn):
                engine.push(streams[k % num_streams], audio[first_samples:])
            before = engine.stats.stream_steps
            t0 = time.thread_time()
            engine.iterate()
            dt = time.thread_time() - t0
            if i * per_turn >= num_streams:  # after every stream's first later chunk
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
    runner.launch_step, runner.collect_step = _stub_step(tokens_per_frame, num_streams), _collect_stub
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
            picked = [k % num_streams for k in streams]
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
        steps = max(3, int(seconds * 1000 / g.chunk_ms * num_streams / per_turn))
        cpu, io_cpu, stream_steps, iterations = 0.0, 0.0, 0, 0
        gc.collect()
        for i in range(steps):
            now = time.time()
            io0 = _thread_cpu_s(io_tids)
            write(range(i * per_turn, (i + 1) * per_turn), audio[first_samples:], now)  # off the loop's clock
            before = engine.stats.stream_steps
            t0 = time.thread_time()
            core.iterate_once()
            dt = time.thread_time() - t0
            drain(1000)  # off the clock; waits for the message, so the I/O thread is done with it
            dio = _thread_cpu_s(io_tids) - io0
            if i * per_turn >= num_streams:
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
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model spec (default: the embedded demo model)")
    p.add_argument("--streams", default="1000,4000,16000")
    p.add_argument("--context-right", default="0,13")
    p.add_argument("--seconds", type=float, default=4.0, help="audio per stream per measurement")
    p.add_argument("--ready-fraction", default="1.0", help="comma list: share of the streams stepped per iteration")
    p.add_argument("--tokens-per-frame", type=float, default=0.33, help="stub emission rate (real models: 0.2-0.5)")
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
    entries = []
    for r in [int(x) for x in args.context_right.split(",")]:
        model = load_model(args.model, context_right=r)
        for n, f in [(int(x), float(y)) for x in args.streams.split(",") for y in args.ready_fraction.split(",")]:
            e = measure(model, n, args.seconds, args.tokens_per_frame, f) if not args.core_only else {
                "streams": n, "context_right": r, "chunk_ms": model.geometry.chunk_ms, "ready_fraction": f,
                "budget_us_per_stream_step": round(1e3 * model.geometry.chunk_ms / n, 2)}  # fmt: skip
            for io in args.core_io.split(","):
                gc.collect()
                e = dict(e, **measure_core(model, n, args.seconds, args.tokens_per_frame, f, io_threads=io == "threads"))
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
