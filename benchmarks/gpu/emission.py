"""Decoder load: tokens per encoder frame, their spread, and the label loop's trip counts.

    PYTHONPATH=. .venv/bin/python benchmarks/gpu/emission.py --out benchmarks/results/emission_demo_cpu_fp32.json

Run as a script, it measures the trained demo model (nemo_serve/assets/demo) over the bundled
utterances at each of its chunk modes: every utterance streamed whole through one Engine (no
endpointing), every step's rows recorded. That is the load a benchmark with random weights must
reproduce (benchmarks/gpu/gpu_bench.py calibrates against `TRAINED`, taken from that JSON).

`label_loop_trips` gives the outer and inner iterations NeMo's label-looping decoder runs for one
batched step, from each row's token frames alone (rnnt_label_looping.py `torch_impl`; the CUDA
graph modes run the same loop): an outer iteration finds each active row's next label (one joint
at the row's frame, then inner iterations - one joint each - while some row saw blank and has
frames left), stores it, advances the prediction network, and forces the next frame after
max_symbols labels on one frame. Trip counts are maxima over the rows, not means: the loop runs
until its slowest row is done. A GPU cannot count them inside its graph; they are exact here.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(REPO))

# The trained model's load, measured by this script (benchmarks/results/emission_demo_cpu_fp32.json,
# all modes pooled): what the random-weight calibration targets. Tokens per encoder frame (80 ms)
# and the share of emitting frames that emit a second token.
TRAINED = {"tokens_per_frame": 0.4249, "second_given_first": 0.1991}


def row_trips(counts: list[int], max_symbols: int) -> list[int]:
    """One row: the inner iterations it needs in each of its outer iterations (the list's length is
    its outer count). counts[f]: tokens the row emits on its f-th new frame (len: its frames)."""
    t, done_here, out, n = 0, 0, [], len(counts)
    while t < n:
        if done_here < counts[t]:  # a label at t: found by the outer iteration's own joint
            out.append(0)
            done_here += 1
            if done_here == max_symbols:  # forced to the next frame
                t, done_here = t + 1, 0
            continue
        f = next((i for i in range(t + 1, n) if counts[i]), None)  # blank at t: skip blank frames
        if f is None:
            out.append(n - 1 - t)  # blanks to the end: the row becomes inactive
            break
        out.append(f - t)
        t, done_here = f, 1
        if max_symbols == 1:
            t, done_here = t + 1, 0
    return out


def label_loop_trips(frame_counts: list[list[int]], max_symbols: int) -> tuple[int, int]:
    """(outer, inner) iterations of one batched step whose rows emit frame_counts[row][frame]."""
    per_row = [row_trips(c, max_symbols) for c in frame_counts]
    outer = max((len(r) for r in per_row), default=0)
    inner = sum(max((r[k] for r in per_row if k < len(r)), default=0) for k in range(outer))
    return outer, inner


def step_frame_counts(token_frames: list[list[int]], decoded_frames: list[int], new_frames: list[int]) -> list[list[int]]:
    """Tokens per new frame of each row of one step (token frames are global; the row decoded
    new_frames[row] frames ending at decoded_frames[row])."""
    out = []
    for frames, end, n in zip(token_frames, decoded_frames, new_frames):
        c = [0] * n
        for f in frames:
            c[f - (end - n)] += 1
        out.append(c)
    return out


def spread(frame_counts: list[list[int]]) -> dict:
    """Tokens per frame, the share of frames that emit, and frames by tokens emitted."""
    flat = np.asarray([c for row in frame_counts for c in row], dtype=np.int64)
    frames = int(flat.size)
    hist = np.bincount(flat, minlength=2) if frames else np.zeros(2, np.int64)
    emitting = frames - int(hist[0]) if frames else 0
    return {
        "frames": frames,
        "tokens": int(flat.sum()),
        "tokens_per_frame": round(float(flat.sum()) / max(frames, 1), 4),
        "emit_fraction": round(emitting / max(frames, 1), 4),
        "second_given_first": round(int((flat >= 2).sum()) / max(emitting, 1), 4),
        "frames_by_tokens": {str(k): int(v) for k, v in enumerate(hist.tolist())},
    }


# ----------------------------------------------------------------------------- the trained model
class StepRecorder:
    """Wraps one Stepper's `launch` and `collect` (instance attributes; `close` removes them), so
    both `run` and the engine's launch-then-collect loop are seen: each collected step's results
    kept as they are (a list append: the timed calls carry no counting), turned into per-row frame
    counts and the trip counts of each device step (a call over more than the pool's max_step_rows
    runs several, each with its own label loop) when `steps` is read."""

    def __init__(self, stepper) -> None:
        self.stepper = stepper
        self.raw: list = []  # (is_first, slots, StepResult) per call
        self._steps: list = []  # (is_first, counts per row, [(outer, inner) per device step])
        self.decoded: dict[int, int] = {}  # slot -> frames decoded before the step being counted
        self._launched: dict[int, tuple] = {}  # id(LaunchedStep) -> (is_first, slots), until collected
        launch, collect = stepper.launch, stepper.collect

        def launching(batch):
            step = launch(batch)
            rows = batch.rows.cpu().numpy() if hasattr(batch.rows, "cpu") else np.array(batch.rows)
            self._launched[id(step)] = (batch.is_first, rows)
            return step

        def collecting(step):
            r = collect(step)
            is_first, rows = self._launched.pop(id(step))
            self.raw.append((is_first, rows, r))
            return r

        stepper.launch, stepper.collect = launching, collecting

    @property
    def steps(self) -> list:
        k, ms = self.stepper.max_rows, self.stepper.max_symbols
        for is_first, rows, r in self.raw:
            rows = rows.tolist()
            # a slot first seen at a later chunk (stepped before the recorder): a full chunk
            full = self.stepper.new_frames
            news = [d if is_first else d - self.decoded.get(s, d - full) for s, d in zip(rows, r.decoded_frames)]
            self.decoded.update(zip(rows, r.decoded_frames))
            counts = step_frame_counts(r.token_frames, r.decoded_frames, news)
            trips = [label_loop_trips(counts[i : i + k], ms) for i in range(0, len(counts), k)]
            self._steps.append((is_first, counts, trips))
        self.raw.clear()
        return self._steps

    def close(self) -> None:
        self.stepper.__dict__.pop("launch", None)
        self.stepper.__dict__.pop("collect", None)

    def summary(self, since: int = 0) -> dict:
        """Later chunks' steps from index `since`: tokens per frame and trips per device step."""
        later = [s for s in self.steps[since:] if not s[0]]
        trips = [t for s in later for t in s[2]]
        counts = [row for s in later for row in s[1]]
        if not trips:
            return {"device_steps": 0}
        o, i = np.asarray([t[0] for t in trips]), np.asarray([t[1] for t in trips])
        sp = spread(counts)
        return {"device_steps": len(trips), "tokens_per_frame": sp["tokens_per_frame"],
                "second_given_first": sp["second_given_first"], "outer_median": float(np.median(o)),
                "outer_max": int(o.max()), "inner_median": float(np.median(i)), "inner_max": int(i.max())}  # fmt: skip


def measure_mode(model, mode: int, utterances: list[np.ndarray]) -> dict:
    from nemo_serve.engine.endpoint import EndpointConfig
    from nemo_serve.engine.loop import Engine
    from nemo_serve.engine.step import stepper_for

    engine = Engine(model, num_slots=len(utterances), endpoint=EndpointConfig.off())
    rec = StepRecorder(stepper_for(model, engine.encoder, engine.pool, mode))  # one device step each: 25 rows
    streams = []
    for i, audio in enumerate(utterances):
        s = engine.admit(slot=i, stream_id=f"u{i}", context_right=mode)
        engine.take_audio(s, (audio,), time.time())
        engine.finish(s)
        streams.append(s)
    while engine.num_open_streams:
        engine.iterate()
    later = [(c, t[0]) for first, c, t in rec.steps if not first]  # 25 rows: one device step each
    rows = [row for _, c, _ in rec.steps for row in c]
    g = model.geometry_for(mode)
    return {
        "context_right": mode,
        "chunk_ms": round(g.chunk_ms),
        "new_frames_per_chunk": g.encoder_frames,
        "decoded_frames": sum(s.decoded_frames for s in streams),
        **spread(rows),
        "steps": len(rec.steps),
        "rows_per_step": round(sum(len(c) for _, c, _ in rec.steps) / max(len(rec.steps), 1), 1),
        "later_steps_trips": {"outer": [t[0] for _, t in later], "inner": [t[1] for _, t in later]},
        "per_row_step_trips": _row_step_trips(rows, int(model.decoding_computer.max_symbols)),
        # every later chunk's row-step, tokens per new frame as digits (a load to resample)
        "later_row_steps": ["".join(map(str, row)) for c, _ in later for row in c],
    }


def _row_step_trips(rows: list[list[int]], max_symbols: int) -> dict:
    """Trip counts of each row alone (batch 1): their mean and maximum."""
    trips = [label_loop_trips([r], max_symbols) for r in rows if r]
    o = np.asarray([t[0] for t in trips]) if trips else np.zeros(1)
    i = np.asarray([t[1] for t in trips]) if trips else np.zeros(1)
    return {"outer_mean": round(float(o.mean()), 2), "outer_max": int(o.max()), "inner_mean": round(float(i.mean()), 2),
            "inner_max": int(i.max())}  # fmt: skip


def simulate(measured: dict, rows=(128, 512), draws: int = 20, seed: int = 0) -> list[dict]:
    """Label-loop trips per device step under four loads, mean over `draws` batches of `rows`:
    the demo model's own row-steps resampled (max_symbols 10), random weights as in GPU runs 1-3
    (34% of frames emit 10), and the calibrated load at max_symbols 2 and 3 (frames independent,
    emitting frames emit max_symbols, 0.425 tokens per frame)."""
    rng = np.random.default_rng(seed)
    tpf = measured["all_modes"]["tokens_per_frame"]
    out = []
    for m in measured["modes"]:
        t = m["new_frames_per_chunk"]
        real = [list(map(int, r)) for r in m["later_row_steps"] if len(r) == t]
        for b in rows:
            loads = {
                "trained_rows": (lambda: [real[i] for i in rng.integers(0, len(real), b)], 10),
                "runs_1_3": (lambda: ((rng.random((b, t)) < 0.34) * 10).tolist(), 10),
                "cap_2": (lambda: ((rng.random((b, t)) < tpf / 2) * 2).tolist(), 2),
                "cap_3": (lambda: ((rng.random((b, t)) < tpf / 3) * 3).tolist(), 3),
            }
            row = {"chunk_ms": m["chunk_ms"], "rows": b}
            for name, (draw, k) in loads.items():
                trips = [label_loop_trips(draw(), k) for _ in range(draws)]
                row[name] = {"outer": round(float(np.mean([x[0] for x in trips])), 1),
                             "inner": round(float(np.mean([x[1] for x in trips])), 1)}  # fmt: skip
            out.append(row)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default=None, help="default: the shipped demo model")
    ap.add_argument("--simulate", help="a measurement JSON: write trip counts under each load to --out instead")
    args = ap.parse_args(argv)
    if args.simulate:
        sim = simulate(json.loads(Path(args.simulate).read_text()))
        cmd = f"PYTHONPATH=. .venv/bin/python benchmarks/gpu/emission.py --simulate {args.simulate} --out {args.out}"
        Path(args.out).write_text(json.dumps({"what": simulate.__doc__.split(chr(10))[0], "command": cmd,
                                              "trips": sim}, indent=1) + "\n")  # fmt: skip
        for r in sim:
            print(r)
        return 0
    import torch

    from nemo_serve.model import load_model
    from nemo_serve.selftest import BUNDLED_MANIFEST, load_utterances

    torch.set_num_threads(2)
    model = load_model(args.model, context_right="all")
    utts = [u.audio for u in load_utterances(BUNDLED_MANIFEST, model.geometry.sample_rate)]
    t = time.time()
    with torch.inference_mode():
        modes = [measure_mode(model, m, utts) for m in model.modes]
    all_rows = {k: sum(m[k] for m in modes) for k in ("frames", "tokens")}
    emitting = sum(m["frames"] - m["frames_by_tokens"]["0"] for m in modes)
    second = sum(sum(v for k, v in m["frames_by_tokens"].items() if int(k) >= 2) for m in modes)
    out = {
        "what": "tokens per encoder frame of the trained demo model over the bundled utterances, every mode",
        "command": "PYTHONPATH=. .venv/bin/python benchmarks/gpu/emission.py --out " + args.out,
        "model": model.name,
        "utterances": len(utts),
        "audio_s": round(sum(map(len, utts)) / model.geometry.sample_rate, 2),
        "encoder_frame_ms": round(1000 * model.geometry.encoder_frame_s),
        "max_symbols": int(model.decoding_computer.max_symbols),
        "all_modes": {**all_rows, "tokens_per_frame": round(all_rows["tokens"] / max(all_rows["frames"], 1), 4),
                      "emit_fraction": round(emitting / max(all_rows["frames"], 1), 4),
                      "second_given_first": round(second / max(emitting, 1), 4)},  # fmt: skip
        "modes": modes,
        "seconds": round(time.time() - t, 1),
    }
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out["all_modes"]), [(m["chunk_ms"], m["tokens_per_frame"], m["frames_by_tokens"]) for m in modes])
    return 0


if __name__ == "__main__":
    sys.exit(main())
