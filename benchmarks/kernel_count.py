"""Operators dispatched per engine step, counted with torch.profiler on CPU: on CUDA each operator that
computes launches about one kernel, and each one dispatched from Python costs host time.

    PYTHONPATH=. .venv/bin/python benchmarks/kernel_count.py --model nemotron-0.6b --label after \
        --out benchmarks/results/kernel_count_nemotron.json
    git worktree add /tmp/before <commit>; .venv/bin/python benchmarks/kernel_count.py \
        --source /tmp/before --label before --out benchmarks/results/kernel_count_nemotron.json

`--source DIR` imports nemo_serve from another checkout (the code before a change); the model is
built from this checkout's configs (benchmarks/architecture.py: random init, no calibration), so
both count the same architecture. A run adds its label to the JSON and keeps the others.

Counted per step (steady state: later chunks, every row full, after warm-up steps):
- `aten_ops`: every ATen operator the profiler records, nested ones included;
- `leaf_ops`: operators with no ATen operator inside them, less the ones that only make views or
  allocate (view, transpose, slice, empty, ...): an estimate of CUDA kernel launches;
- `top_level_ops`: operators called from Python (each pays the dispatcher's host cost once);
- each split by phase: the encoder (`encoder.step`), NeMo's label-looping decoder (its loop runs
  once per emitted label, so with random weights its count is not Nemotron's), and the rest of the
  step (staging, gathers, scatters, prompt, packing).
With CUDA graphs (engine/cuda_graphs.py) the encoder phase and the rest up to the decoder replay
as one graph launch: what the host dispatches per step is then the decoder's and the rest's
eager operators; the kernels inside the graph are the same in number.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

NO_KERNEL = {
    "aten::view", "aten::_unsafe_view", "aten::as_strided", "aten::transpose", "aten::t", "aten::permute",
    "aten::slice", "aten::select", "aten::unsqueeze", "aten::squeeze", "aten::expand", "aten::reshape",
    "aten::alias", "aten::detach", "aten::empty", "aten::empty_like", "aten::empty_strided", "aten::resize_",
    "aten::narrow", "aten::split", "aten::unbind", "aten::chunk", "aten::lift_fresh", "aten::contiguous",
    "aten::flatten", "aten::view_as", "aten::expand_as", "aten::unflatten", "aten::movedim", "aten::numpy_T",
    "aten::result_type", "aten::is_nonzero", "aten::_reshape_alias", "aten::set_", "aten::item",
    "aten::_local_scalar_dense", "aten::dim", "aten::size", "aten::stride", "aten::is_same_size",
}


def count(prof) -> dict:
    events = [e for e in prof.events() if e.name.startswith("aten::")]
    out = {p: {"aten_ops": 0, "leaf_ops": 0, "top_level_ops": 0} for p in ("encoder", "decoder", "rest", "total")}
    for e in events:
        phase, parent, top = "rest", e.cpu_parent, True
        while parent is not None:
            if parent.name.startswith("aten::"):
                top = False
            if parent.name in ("phase:encoder", "phase:decoder"):
                phase = parent.name.split(":")[1]
                break
            parent = parent.cpu_parent
        leaf = not any(c.name.startswith("aten::") for c in e.cpu_children) and e.name not in NO_KERNEL
        for p in (phase, "total"):
            out[p]["aten_ops"] += 1
            out[p]["leaf_ops"] += leaf
            out[p]["top_level_ops"] += top
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="nemotron-0.6b")
    ap.add_argument("--modes", default="0,3,13", help="right contexts")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--source", default=None, help="import nemo_serve from this checkout")
    ap.add_argument("--label", required=True)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(REPO))
    if args.source:
        sys.path.insert(0, str(Path(args.source).resolve()))
    import numpy as np
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    import importlib.util

    import nemo_serve

    spec = importlib.util.spec_from_file_location("architecture", REPO / "benchmarks" / "architecture.py")
    architecture = importlib.util.module_from_spec(spec)  # this checkout's, whatever --source is
    spec.loader.exec_module(architecture)
    served = architecture.served
    from nemo_serve.engine.encoder import make_encoder
    from nemo_serve.engine.slots import SlotPool
    from nemo_serve.engine.step import StepBatch, run_step

    torch.set_grad_enabled(False)
    results = {}
    for r in [int(x) for x in args.modes.split(",")]:
        t0 = time.time()
        model = served(args.model, r, args.dtype)
        encoder = make_encoder(model)
        b, g = args.batch, model.geometry
        pool = SlotPool(model, b, encoder.channel_shape)
        for i in range(b):
            pool.open_row(i)
        step = encoder.step

        def encoder_step(*a, **k):
            with record_function("phase:encoder"):
                return step(*a, **k)

        encoder.step = encoder_step
        computer_cls = type(model.decoding_computer)
        call = computer_cls.__call__

        def decoder_call(self, *a, **k):
            with record_function("phase:decoder"):
                return call(self, *a, **k)

        computer_cls.__call__ = decoder_call
        gen = torch.Generator().manual_seed(0)
        first = torch.randn(b, model.num_mels, g.first_frames, generator=gen)
        later = torch.randn(b, model.num_mels, g.chunk_frames, generator=gen)
        rows = torch.arange(b)
        run_step(model, encoder, pool, StepBatch(rows, first, [g.first_frames] * b, True, None))
        for _ in range(2):  # warm: lazy caches, the stepper's buffers
            run_step(model, encoder, pool, StepBatch(rows, later, [g.chunk_frames] * b, False, None))
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            res = run_step(model, encoder, pool, StepBatch(rows, later, [g.chunk_frames] * b, False, None))
        computer_cls.__call__ = call
        counts = count(prof)
        counts["tokens_emitted"] = sum(len(t) for t in res.token_ids)
        counts["layers"] = len(model.nemo.encoder.layers)
        results[f"r{r}"] = {"chunk_ms": round(g.chunk_ms), "batch": b, **counts}
        print(args.label, f"r={r}", json.dumps(counts), f"({time.time() - t0:.0f} s)", flush=True)
    if args.out:
        path = Path(args.out)
        data = json.loads(path.read_text()) if path.exists() else {"model": args.model, "runs": {}}
        data["runs"][args.label] = {
            "command": " ".join(sys.argv),
            "nemo_serve": str(Path(nemo_serve.__file__).parent),
            "dtype": args.dtype,
            "torch": torch.__version__,
            "results": results,
        }
        path.write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    main()
