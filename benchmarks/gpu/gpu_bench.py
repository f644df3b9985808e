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
import os
import platform
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.gpu import record  # noqa: E402
from benchmarks.gpu.calibration import build, calibrate, set_blank_bias  # noqa: E402
from benchmarks.gpu.capacity import capacity, overlap  # noqa: E402
from benchmarks.gpu.emission import TRAINED  # noqa: E402
from benchmarks.gpu.mode_checks import mode_checks  # noqa: E402
from benchmarks.gpu.paths import CAPACITY_ORDER, SELFTEST_ORDER, parse_paths, parse_phase_ends  # noqa: E402
from benchmarks.gpu.preflight import preflight  # noqa: E402
from benchmarks.gpu.record import Results, err, free_gpu, left  # noqa: E402
from benchmarks.gpu.selftest_phase import selftest  # noqa: E402


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
    record.restart_clock()  # the budget counts from the run, not from the import
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
        res.write("done", ok=False, seconds=round(time.time() - record.T0, 1), why="preflight")
        return 4
    free_gpu()
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
                res.write("error", what=f"{phase} r={r}", error=err(e), where=traceback.format_exc()[-3000:])
                free_gpu()
    args.budget_s = total
    res.write("done", ok=True, seconds=round(time.time() - record.T0, 1))
    return 0


if __name__ == "__main__":
    code = main()
    # No interpreter teardown: after a device fault (an illegal memory access) freeing CUDA tensors
    # at exit aborts the process, and the wrapper would see 134 instead of this exit code.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
