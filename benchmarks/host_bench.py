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
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import run_record, write_json  # noqa: E402
from benchmarks import host_bench_measure, host_bench_profile  # noqa: E402
from benchmarks.host_bench_measure import measure, measure_core  # noqa: E402
from benchmarks.host_bench_profile import profile_summary  # noqa: E402
from benchmarks.host_bench_stub import trained_emission  # noqa: E402


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
    host_bench_measure.OVERLAP[0] = args.overlap
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
                host_bench_profile.PROFILER[0] = cProfile.Profile() if args.profile else None
                e = dict(e, **measure_core(model, n, args.seconds, emission, f, io_threads=io == "threads"))
                if host_bench_profile.PROFILER[0] is not None:
                    e["profile"] = profile_summary(host_bench_profile.PROFILER[0], e["core_stream_steps"])
                    host_bench_profile.PROFILER[0] = None
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
