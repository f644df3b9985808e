"""Where each millisecond of a step goes: the profile run_gpu.sh runs first on a GPU (issue 46 step 2).

    python benchmarks/gpu/profile_step.py --out OUT/profile [--model nemotron-0.6b] [--device cuda] [--dtype bf16]

On the architecture built from configs/ (random init) with the calibrated decoder load of
gpu_bench.py (max_symbols 3, tokens per encoder frame of the trained demo model), per mode (80, 320,
1120 ms) and rows (128, 512):
1. `split`: the production step (CUDA graphs on a GPU) over --steps later chunks: GPU ms of the
   whole device step and of the decoder half (CUDA events around Stepper.decode; the encoder half is
   the rest), host ms per call, and each step's label-loop trips (emission.StepRecorder). `fit`:
   decoder ms = a + b * outer + c * inner over every step of a row count (least squares).
2. `kernels`: one eager step (no graphs: NeMo's torch_impl decoder) under torch.profiler with a
   record_function range per part: cache gather and scatter, pre-encode, masks, norms, FFN,
   attention, conv module, prompt, joint, prediction network, decoder bookkeeping (the decoder's
   own time outside those), encoder other, step other. Per range: GPU ms, CPU ms, kernels; the top
   kernels by GPU time; the index kernels' share. The ranges are installed by wrapping the
   instances' methods here, for the profiled step only: the engine carries no record_function, so
   profiling costs nothing when it is off (nothing to measure). The first profile's chrome trace
   is kept (gzip).
3. `index`: index_select / index_copy_ of --index-rows rows on the pool's K/V cache laid out as
   the engine's (all layers in one tensor: 64-bit index math past 2^31 elements) and per layer
   (32-bit), against a plain copy_ of the same bytes: GB/s each.
4. `big`: one device step of --big-rows rows against the same rows as parts of --big-part (the
   step-cache cap's split): GPU ms each, at the --big-modes.
Results: OUT/profile.json (rewritten after every phase: a killed run keeps what it measured) and
OUT/summary.txt. On CPU (the dry run, tests/test_profile_step.py) every key is there; what needs
CUDA (GPU ms, kernels) is null, and times are wall clock (`timer`).
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import sys
import time
import traceback
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.gpu.emission import StepRecorder  # noqa: E402
from benchmarks.gpu.index_bench import index_bench  # noqa: E402
from benchmarks.gpu.record import free_gpu  # noqa: E402
from benchmarks.gpu.step_ranges import analyse, ranges  # noqa: E402
from benchmarks.gpu.timing import Timer, median_ms  # noqa: E402

T0 = time.time()


# ----------------------------------------------------------------------------- 1 split
def _stepper(model, rows: int, slots: int | None = None, graphs: bool | None = None):
    from benchmarks.architecture import set_mode
    from nemo_serve.engine.encoder import make_encoder
    from nemo_serve.engine.slots import SlotPool
    from nemo_serve.engine.step import Stepper

    set_mode(model)
    enc = make_encoder(model)
    pool = SlotPool(model, slots or rows, enc.channel_shape, max_rows=rows)
    return pool, Stepper(model, enc, pool, graphs=graphs, context_right=model.geometry.context_right)


def _chunks(model, stepper, n: int, steps: int, seed: int = 0):
    """Opens n rows, runs their first chunk, then yields `steps` later-chunk batches."""
    import torch

    from nemo_serve.engine.step import StepBatch

    g = model.geometry
    rows = np.arange(n)
    for r in rows.tolist():
        stepper.pool.open_row(r)
    gen = torch.Generator().manual_seed(seed)
    first = torch.randn(n, model.num_mels, g.first_frames, generator=gen).to(model.device)
    stepper.run(StepBatch(rows, first, [g.first_frames] * n, True, None))
    for _ in range(steps):
        feats = torch.randn(n, model.num_mels, g.chunk_frames, generator=gen).to(model.device)
        yield StepBatch(rows, feats, [g.chunk_frames] * n, False, None)


def split(args, model, rows: int, timer: Timer) -> dict:
    """Encoder half against decoder half of the production step, with each step's trips."""
    import torch

    pool, stepper = _stepper(model, rows)
    if stepper.cuda:
        stepper.prepare([rows])  # captured at start-up, as the server does
    decode, marks = stepper.decode, []

    def timed_decode(*a, **k):
        m0 = timer.mark()
        decode(*a, **k)
        marks.append((m0, timer.mark()))

    stepper.decode = timed_decode
    rec, steps, host = StepRecorder(stepper), [], []
    with torch.inference_mode():
        for k, batch in enumerate(_chunks(model, stepper, rows, args.steps + 1)):
            marks.clear()
            t, m0 = time.perf_counter(), timer.mark()
            stepper.run(batch)
            m1 = timer.mark()
            host.append(1000 * (time.perf_counter() - t))
            if k:  # the first later chunk warms up
                steps.append((m0, m1, marks[0]))
    if timer.cuda:
        torch.cuda.synchronize()
    rec.close()
    trips = [t for s in rec.steps[2:] for t in s[2]]  # first chunk and warm-up left out
    total = [timer.ms(a, b) for a, b, _ in steps]
    dec = [timer.ms(*d) for _, _, d in steps]
    out = {"chunk_ms": round(model.geometry.chunk_ms), "rows": rows, "graphs": stepper.graphs is not None,
           "steps": len(steps), "step_ms": median_ms(total), "decoder_ms": median_ms(dec),
           "encoder_ms": median_ms([t - d for t, d in zip(total, dec)]), "host_ms": median_ms(host[1:]),
           "per_step": [{"step_ms": round(t, 3), "decoder_ms": round(d, 3), "outer": o, "inner": i}
                        for t, d, (o, i) in zip(total, dec, trips)],
           "label_loop": rec.summary(since=2)}  # fmt: skip
    del stepper, pool
    free_gpu()
    return out


def fit(points: list[dict]) -> dict | None:
    """decoder_ms = a + b * outer + c * inner, least squares (None: too few distinct points)."""
    x = np.asarray([[1.0, p["outer"], p["inner"]] for p in points])
    y = np.asarray([p["decoder_ms"] for p in points])
    if len(points) < 3 or np.linalg.matrix_rank(x) < 3:
        return None
    (a, b, c), *_ = np.linalg.lstsq(x, y, rcond=None)
    return {"fixed_ms": round(float(a), 4), "per_outer_ms": round(float(b), 4), "per_inner_ms": round(float(c), 4),
            "points": len(points)}  # fmt: skip


# ----------------------------------------------------------------------------- 2 kernels
def kernel_profile(args, model, rows: int, cuda: bool, trace: Path | None) -> dict:
    """One eager later-chunk step of `rows` rows under torch.profiler, after a warm-up step."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    pool, stepper = _stepper(model, rows, graphs=False)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch.inference_mode():
        batches = _chunks(model, stepper, rows, 2)
        stepper.run(next(batches))
        batch = next(batches)
        if cuda:
            torch.cuda.synchronize()
        with ranges(stepper), profile(activities=acts) as prof:
            stepper.run(batch)
            if cuda:
                torch.cuda.synchronize()
    out = {"chunk_ms": round(model.geometry.chunk_ms), "rows": rows, **analyse(prof, cuda)}
    if trace is not None:
        raw = trace.with_suffix("")
        prof.export_chrome_trace(str(raw))
        with raw.open("rb") as f, gzip.open(trace, "wb") as g:
            shutil.copyfileobj(f, g)
        raw.unlink()
        out["trace"] = trace.name
    del stepper, pool, prof
    free_gpu()
    return out


# ----------------------------------------------------------------------------- 4 big (3 index: index_bench.py)
def big(args, model, timer: Timer) -> dict:
    """One step of big_rows rows against the same rows in parts of big_part (one pool, two steppers)."""
    import torch

    from nemo_serve.engine.buckets import bucket_sizes
    from nemo_serve.engine.step import Stepper

    n, part = args.big_rows, args.big_part
    pool, whole = _stepper(model, n)
    parts = Stepper(model, whole.encoder, pool, context_right=model.geometry.context_right)
    parts.max_rows, parts.sizes = part, bucket_sizes(part)  # the step-cache cap's split, on the same pool
    out = {"chunk_ms": round(model.geometry.chunk_ms), "rows": n, "part_rows": part}
    for name, s in (("one_step", whole), ("parts", parts)):
        if s.cuda:
            s.prepare([n if s is whole else part])
        marks = []
        with torch.inference_mode():
            for k, batch in enumerate(_chunks(model, s, n, args.steps_big + 1, seed=3)):
                a = timer.mark()
                s.run(batch)
                if k:  # the first later chunk warms up
                    marks.append((a, timer.mark()))
        for r in range(n):
            pool.close_row(r)
        out[f"{name}_ms"] = median_ms(timer.done(marks))
    out["parts_over_one_step"] = round(out["parts_ms"] / out["one_step_ms"], 3) if out["one_step_ms"] else None
    del whole, parts, pool
    free_gpu()
    return out


# ----------------------------------------------------------------------------- main
def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="nemotron-0.6b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--modes", default="0,3,13")
    ap.add_argument("--rows", default="128,512")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--profile-rows", default="128,512", help="rows of the kernel profiles (each mode)")
    ap.add_argument("--index-slots", type=int, default=2048)
    ap.add_argument("--index-rows", type=int, default=512)
    ap.add_argument("--index-reps", type=int, default=5)
    ap.add_argument("--big-rows", type=int, default=2048)
    ap.add_argument("--big-part", type=int, default=512)
    ap.add_argument("--big-modes", default="0,13")
    ap.add_argument("--steps-big", type=int, default=4)
    ap.add_argument("--max-symbols", type=int, default=3)
    ap.add_argument("--calibrate-iters", type=int, default=16)
    ap.add_argument("--budget-s", type=float, default=280.0)
    ap.add_argument("--threads", type=int, default=4)
    args = ap.parse_args(argv)
    for k in ("modes", "rows", "profile_rows", "big_modes"):
        setattr(args, k, [int(x) for x in getattr(args, k).split(",") if x])
    return args


def main(argv=None) -> int:
    import torch

    args = parse(argv)
    torch.set_num_threads(args.threads)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        doc = run(args, out_dir)
    (out_dir / "summary.txt").write_text(summary(doc))
    print(summary(doc), flush=True)
    return 0 if not doc["errors"] else 1


def run(args, out_dir: Path) -> dict:
    import torch

    from benchmarks.architecture import served, set_mode
    from benchmarks.gpu.calibration import calibrate, set_blank_bias
    from benchmarks.gpu.emission import TRAINED

    cuda = args.device == "cuda"
    timer = Timer(cuda)
    doc = {"env": {"torch": torch.__version__, "device": torch.cuda.get_device_name(0) if cuda else "cpu",
                   "model": args.model, "dtype": args.dtype, "argv": sys.argv[1:] if argv_is_cli() else None},
           "timer": "cuda_events" if cuda else "wall_clock", "calibration": [], "split": [], "fit": {},
           "kernels": [], "index": None, "big": [], "skipped": [], "errors": [], "seconds": None}  # fmt: skip
    save = lambda: (out_dir / "profile.json").write_text(json.dumps(doc, indent=1) + "\n")  # noqa: E731

    def phase(what: str, fn, need_s: float):
        if args.budget_s - (time.time() - T0) < need_s:
            doc["skipped"].append(what)
            return None
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - the other phases still measure
            doc["errors"].append({"what": what, "error": f"{type(e).__name__}: {e}"[:500],
                                  "where": traceback.format_exc()[-2000:]})  # fmt: skip
            free_gpu()
            return None
        finally:
            save()

    models = {r: served(args.model, r, args.dtype, args.device) for r in args.modes}
    models[args.modes[0]].decoding_computer.max_symbols = args.max_symbols  # shared by the modes (calibration.build)

    class Sink:  # calibration.calibrate writes its records here
        def write(self, kind, **fields):
            doc["calibration"].append(fields)

    ns = argparse.Namespace(modes=args.modes, tokens_target=TRAINED["tokens_per_frame"], tokens_tol=0.03,
                            calibrate_iters=args.calibrate_iters)  # fmt: skip
    biases = phase("calibration", lambda: calibrate(ns, models, Sink()), 20) or {}

    def at(r):
        set_mode(models[r])
        if r in biases:
            set_blank_bias(models[r], biases[r])
        return models[r]

    for r in args.modes:
        for n in args.rows:
            s = phase(f"split r={r} rows={n}", lambda: split(args, at(r), n, timer), 15)
            if s:
                doc["split"].append(s)
    for n in args.rows:
        pts = [p for s in doc["split"] if s["rows"] == n for p in s["per_step"]]
        doc["fit"][str(n)] = fit(pts)
    first = True
    for r in args.modes:
        for n in args.profile_rows:
            trace = out_dir / f"trace_{round(models[r].geometry.chunk_ms)}ms_{n}.json.gz" if first else None
            k = phase(f"kernels r={r} rows={n}", lambda: kernel_profile(args, at(r), n, cuda, trace), 15)
            if k:
                doc["kernels"].append(k)
                first = False
    doc["index"] = phase("index", lambda: index_bench(args, at(args.modes[0]), timer), 10)
    for r in args.big_modes:
        if r in models:
            b = phase(f"big r={r}", lambda: big(args, at(r), timer), 30)
            if b:
                doc["big"].append(b)
    doc["seconds"] = round(time.time() - T0, 1)
    save()
    return doc


def argv_is_cli() -> bool:
    return Path(sys.argv[0]).name == "profile_step.py"


def summary(doc: dict) -> str:
    """The short text: per (mode, rows) encoder and decoder ms with trips, ranges, top kernels."""
    unit = "GPU ms" if doc["timer"] == "cuda_events" else "ms (CPU wall clock)"
    lines = [f"{doc['env']['device']}, {doc['env']['model']} {doc['env']['dtype']}, {unit}", ""]
    for s in doc["split"]:
        ll = s["label_loop"]
        lines.append(f"{s['chunk_ms']:>5} ms x {s['rows']:>4} rows: step {s['step_ms']} = encoder {s['encoder_ms']} + "
                     f"decoder {s['decoder_ms']}; host {s['host_ms']}; tokens/frame {ll.get('tokens_per_frame')}, "
                     f"outer {ll.get('outer_median')} inner {ll.get('inner_median')}")
    for n, f in doc["fit"].items():
        lines.append(f"decoder fit at {n} rows: {f}")
    for k in doc["kernels"]:
        lines.append(f"\nkernel profile {k['chunk_ms']} ms x {k['rows']} rows (eager): GPU {k['gpu_ms_total']} ms in "
                     f"{k['kernels_total']} kernels, CPU {k['cpu_ms_total']} ms")
        for name, r in k["ranges"].items():
            lines.append(f"  {name:<20} calls {r['calls']:>4}  GPU {r['gpu_ms']} ms  kernels {r['kernels']}  CPU {r['cpu_ms']} ms")
        for t in (k["top_kernels"] or [])[:10]:
            lines.append(f"    {t['total_us']:>10} us {t['calls']:>5} x {t['mean_us']:>8} us  {t['name'][:90]}")
    if doc["index"]:
        lines.append(f"\nindex kernels: {doc['index']}")
    for b in doc["big"]:
        lines.append(f"{b['chunk_ms']} ms: {b['rows']} rows in one step {b['one_step_ms']} ms, in parts of "
                     f"{b['part_rows']} {b['parts_ms']} ms")
    lines += [f"skipped: {doc['skipped']}", f"errors: {[e['what'] + ': ' + e['error'] for e in doc['errors']]}",
              f"seconds: {doc['seconds']}"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    import os

    os._exit(code)  # as gpu_bench.py: no CUDA teardown after a device fault
