"""Device memory of the engine for an architecture, at each mode, bf16 and fp32: per stream, at N slots,
and the most slots that fit in a device of a given size. Computed on CPU from the model built from its
config (random init, no download, benchmarks/architecture.py) and the engine's own SlotPool.

    PYTHONPATH=. .venv/bin/python benchmarks/memory_table.py --model nemotron-0.6b --slots 8000 \
        --device-gib 139 --out benchmarks/results/memory_nemotron.json

Per stream: everything a slot holds (SlotPool.bytes_per_slot: key/value and convolution caches, fill
level, decoder state, feature history, language). Fixed: the weights, the scratch slot, the step's
gather buffer (max_step_rows x one slot's attention cache; engine/buckets.py caps the rows) and the
activations of the largest step, measured on CPU with the profiler's allocator trace at two batch
sizes and extrapolated linearly to max_step_rows (what a CUDA graph's memory pool holds). Not
counted: the CUDA context and cuBLAS/cuDNN workspaces (a few hundred MiB), NeMo's decoder buffers
per bucket (sized to one chunk by Stepper.computer: at 1120 ms [bucket, 14, 640] projected encoder
frames and 2 x [bucket, 140] int64 hypotheses, ~25 KB a row in bf16 with the LSTM state; NeMo's default 375 frames made
it ~540 KB a row, 0.55 GB per mode over buckets 1-512).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.architecture import served  # noqa: E402
from nemo_serve.engine.buckets import max_step_rows  # noqa: E402
from nemo_serve.engine.encoder import make_encoder  # noqa: E402
from nemo_serve.engine.slots import SlotPool  # noqa: E402
from nemo_serve.engine.step import StepBatch, run_step  # noqa: E402

GIB = 2**30


def peak_step_bytes(model, encoder, pool, rows: int, is_first: bool) -> int:
    """Peak bytes allocated during one step over `rows` rows, above what was live before it."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    g = model.geometry
    width = g.first_frames if is_first else g.chunk_frames
    feats = torch.randn(rows, model.num_mels, width, generator=torch.Generator().manual_seed(0))
    batch = StepBatch(np.arange(rows), feats, [width] * rows, is_first, None)
    run_step(model, encoder, pool, batch)  # warm: lazy caches, stepper buffers
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run_step(model, encoder, pool, batch)
    totals = []

    def walk(node):
        if node.tag == _EventType.Allocation:
            totals.append((node.start_time_ns, node.extra_fields.total_allocated))
        for c in node.children:
            walk(c)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    return max(t for _, t in totals) if totals else 0


def measure(name: str, context_right: int, dtype: str, slots: int, device_gib: float) -> dict:
    model = served(name, context_right, dtype)
    encoder = make_encoder(model)
    small = (2, 8)
    pool = SlotPool(model, max(small), encoder.channel_shape, max_rows=max(small))
    per_slot, gather_row = pool.bytes_per_slot, pool.gather_bytes_per_row
    peaks = {b: max(peak_step_bytes(model, encoder, pool, b, f) for f in (True, False)) for b in small}
    per_row_act = (peaks[small[1]] - peaks[small[0]]) / (small[1] - small[0])
    base_act = max(0.0, peaks[small[0]] - per_row_act * small[0])
    rows = max_step_rows(slots, gather_row)
    act = base_act + per_row_act * rows
    weights = sum(t.numel() * t.element_size() for t in (*model.nemo.parameters(), *model.nemo.buffers()))
    fixed = weights + per_slot + rows * gather_row + act  # weights, scratch slot, gather buffer, activations
    fit = int((device_gib * GIB - fixed) // per_slot)
    return {
        "mode_ms": round(model.geometry.chunk_ms),
        "context_right": context_right,
        "dtype": dtype,
        "bytes_per_stream": per_slot,
        "attention_cache_bytes_per_stream": gather_row,
        "max_step_rows": rows,
        "gather_buffer_bytes": rows * gather_row,
        "activation_bytes_measured": {str(b): peaks[b] for b in small},
        "activation_bytes_at_max_step_rows": int(act),
        "weights_bytes": weights,
        "fixed_bytes": int(fixed),
        "slots": slots,
        "total_bytes_at_slots": int(fixed + slots * per_slot),
        "device_gib": device_gib,
        "most_slots_that_fit": fit,
        "before_gather_buffer_bytes_at_slots": slots * gather_row,  # max_batch = slots, as before the cap
    }


def markdown(rows: list[dict]) -> str:
    slots, dev = rows[0]["slots"], rows[0]["device_gib"]
    out = [
        f"| mode | dtype | per stream | step rows | fixed (weights + gather + activations) | at {slots:,} slots | most slots in {dev:g} GiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['mode_ms']} ms | {r['dtype']} | {r['bytes_per_stream'] / 2**20:.2f} MiB | {r['max_step_rows']} | "
            f"{r['fixed_bytes'] / GIB:.2f} GiB | {r['total_bytes_at_slots'] / GIB:.1f} GiB | {r['most_slots_that_fit']:,} |"
        )
    return "\n".join(out)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="nemotron-0.6b")
    ap.add_argument("--modes", default=None, help="right contexts, comma-separated (default: every trained one)")
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--slots", type=int, default=8000)
    ap.add_argument("--device-gib", type=float, default=139.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    t0 = time.time()
    modes = [int(x) for x in args.modes.split(",")] if args.modes else None
    if modes is None:
        modes = list(served(args.model, None, "fp32").trained_context_right)
    rows = []
    for dtype in args.dtypes.split(","):
        for r in modes:
            rows.append(measure(args.model, r, dtype, args.slots, args.device_gib))
            print(json.dumps(rows[-1]), flush=True)
            if args.out:  # written as each row exists
                Path(args.out).write_text(json.dumps({"model": args.model, "command": " ".join(sys.argv), "rows": rows}, indent=1) + "\n")
    print(markdown(rows))
    print(f"({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
