"""Operators dispatched per engine step, counted with torch.profiler on CPU: on CUDA each operator that
computes launches about one kernel, and each one dispatched from Python costs host time.

    PYTHONPATH=. .venv/bin/python benchmarks/kernel_count.py --model nemotron-0.6b --label after \
        --out benchmarks/results/kernel_count_nemotron.json
    (--configs window:matmul,ring:matmul,ring:sdpa: each KV layout / attention pair counted, with the
    cache bytes per row-step its layout moves, `cache_bytes_per_row_step`; a third field picks the
    layer epilogues, NEMO_SERVE_KERNELS: ring:matmul:nemo,ring:matmul:fused)
    Epilogues before/after per layer (benchmarks/results/kernel_count_epilogues_fastconformer-l.json):
    .venv/bin/python benchmarks/kernel_count.py --model fastconformer-l --modes 0,13 --batch 4 \
        --configs ring:matmul:nemo,ring:matmul:fused --label epilogues --out benchmarks/results/kernel_count_epilogues_fastconformer-l.json
    git worktree add /tmp/before <commit>; .venv/bin/python benchmarks/kernel_count.py \
        --source /tmp/before --label before --out benchmarks/results/kernel_count_nemotron.json

`--source DIR` imports nemo_serve from another checkout (the code before a change); the model is
built from this checkout's configs (benchmarks/architecture.py: random init, no calibration), so
both count the same architecture. A run adds its label to the JSON and keeps the others.

Counted per step (steady state: later chunks, every row full, after warm-up steps):
- `aten_ops`: every ATen operator the profiler records, nested ones included;
- `leaf_ops`: operators that launch a kernel themselves: not a view or allocation op (view,
  transpose, slice, empty, ...) and with no kernel-launching operator inside (`is_leaf_kernel`):
  an estimate of CUDA kernel launches;
- `top_level_ops`: operators called from Python (each pays the dispatcher's host cost once);
- each split by phase: the encoder (`encoder.step`), its attention (inside the encoder's count too), NeMo's label-looping decoder (its loop runs
  once per emitted label, so with random weights its count is not Nemotron's), and the rest of the
  step (staging, gathers, scatters, prompt, packing).
A fused epilogue (engine/epilogues.py, NEMO_SERVE_KERNELS=fused) is one Triton kernel on CUDA; on
the CPU its torch twin runs NeMo's ops, so each call is counted as one leaf (and one top-level)
operator, its ops inside not (`fused:` ranges).
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


def _launches(e) -> bool:
    """Whether `e` or an operator inside it launches a kernel (allocation and view ops do not)."""
    return e.name not in NO_KERNEL or any(_launches(c) for c in e.cpu_children if c.name.startswith("aten::"))


def is_leaf_kernel(e) -> bool:
    """An ATen operator that launches a kernel itself: not a view/allocation op, and nothing inside
    it launches one. (Counting only operators with no ATen child at all missed the ones whose only
    children allocate: native_layer_norm, glu, ... hold an aten::empty.)"""
    return e.name.startswith("aten::") and e.name not in NO_KERNEL and not any(
        _launches(c) for c in e.cpu_children if c.name.startswith("aten::"))


PHASES = ("encoder", "attention", "decoder")  # attention is inside the encoder: counted in both


def save_run(args, nemo_serve, torch, results: dict, **settings) -> None:
    """Add this run, under its label, to the JSON at args.out (the other labels' runs kept)."""
    path = Path(args.out)
    data = json.loads(path.read_text()) if path.exists() else {"model": args.model, "runs": {}}
    data["runs"][args.label] = {
        "command": " ".join(sys.argv),
        "nemo_serve": str(Path(nemo_serve.__file__).parent),  # --source: the checkout that ran
        "dtype": args.dtype,
        **settings,
        "torch": torch.__version__,
        "results": results,
    }
    path.write_text(json.dumps(data, indent=1) + "\n")


def count(prof, phases_counted: tuple[str, ...] = PHASES) -> dict:
    """Per phase (a `phase:NAME` record_function around it; nested phases count in each, an op
    in none counts as "rest") and in total: ATen ops, leaf ops that launch a kernel, ops called
    from Python. decoder_kernel_count.py counts its phases with this too."""
    events = [e for e in prof.events() if e.name.startswith("aten::")]
    out = {p: {"aten_ops": 0, "leaf_ops": 0, "top_level_ops": 0} for p in (*phases_counted, "rest", "total")}
    fused = [e for e in prof.events() if e.name.startswith("fused:")]  # one kernel each (module doc)
    for e in events + fused:
        phases, parent, top, in_fused = set(), e.cpu_parent, True, False
        while parent is not None:
            if parent.name.startswith("aten::"):
                top = False
            if parent.name.startswith("phase:") and parent.name[6:] in phases_counted:
                phases.add(parent.name[6:])
            in_fused = in_fused or parent.name.startswith("fused:")
            parent = parent.cpu_parent
        if in_fused:
            top = False
        leaf = e.name.startswith("fused:") or (not in_fused and is_leaf_kernel(e))
        for p in (*(phases or {"rest"}), "total"):
            out[p]["aten_ops"] += 1
            out[p]["leaf_ops"] += leaf
            out[p]["top_level_ops"] += top
    return out


def cache_bytes_per_row_step(layout: str, layers: int, heads: int, d_k: int, cache_len: int, scratch: int,
                             t: int, d_model: int, conv_cache: int, elt: int) -> dict:  # fmt: skip
    """Bytes one row's encoder caches move per step (reads + writes, every layer), from the layout:
    what the cache handling copies, plus attention's read of the window, plus (ring) the int64
    indices it reads. Window: gather C+S positions (read + write), new K/V into the buffer, attention
    reads C+t, scatter C (read + write); the conv cache gathered and scattered whole. Ring: new K/V
    into the ring, gather C+t (read + write) into the one-layer buffer, attention reads C+t; the conv
    cache read in order (read + write), its newest min(t, K-1) columns written."""
    pos = heads * 2 * d_k * elt  # one position's K|V over the heads
    conv = d_model * elt  # one conv-cache column
    m = min(t, conv_cache)
    if layout == "window":
        parts = {
            "kv_gather": 2 * (cache_len + scratch) * pos, "kv_new": 2 * t * pos,
            "attention_read": (cache_len + t) * pos, "kv_scatter": 2 * cache_len * pos,
            "conv_gather": 2 * conv_cache * conv, "conv_scatter": 2 * conv_cache * conv,
        }
    else:
        parts = {
            "kv_new": 2 * t * pos, "kv_gather": 2 * (cache_len + t) * pos, "attention_read": (cache_len + t) * pos,
            "conv_read": 2 * conv_cache * conv, "conv_write": 2 * m * conv,
            "indices": 8 * (heads * (cache_len + 2 * t) + conv_cache + m),
        }
    parts = {k: v * layers for k, v in parts.items()}
    return {"total": sum(parts.values()), **parts}


def _count_config(model, layout: str, attention: str, b: int, record_function, profile, activities, torch,
                  kernels: str = "nemo") -> dict:  # fmt: skip
    import os

    from nemo_serve.engine.encoder import make_encoder
    from nemo_serve.engine.step import StepBatch, run_step

    os.environ["NEMO_SERVE_KV_LAYOUT"], os.environ["NEMO_SERVE_ATTENTION"] = layout, attention
    os.environ["NEMO_SERVE_KERNELS"] = kernels
    encoder = make_encoder(model)
    epilogues = getattr(encoder, "epilogues", None)
    for name in ("residual_norm", "glu_mask", "norm_silu"):  # each call one range: one kernel on CUDA
        if epilogues is not None:
            setattr(epilogues, name, _in_range(getattr(epilogues, name), f"fused:{name}", record_function))
    try:
        from nemo_serve.engine.ring_cache import make_slot_pool
    except ImportError:  # --source: a checkout from before the ring layout
        from nemo_serve.engine.slots import SlotPool

        pool = SlotPool(model, b, encoder.channel_shape)
    else:
        pool = make_slot_pool(model, encoder, b)
    g = model.geometry
    for i in range(b):
        pool.open_row(i)
    for name, phase in (("step", "encoder"), ("step_in_place", "encoder"), ("_attention", "attention")):
        fn = getattr(encoder, name, None)
        if fn is not None:
            setattr(encoder, name, _in_phase(fn, phase, record_function))
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
    with profile(activities=activities) as prof:
        res = run_step(model, encoder, pool, StepBatch(rows, later, [g.chunk_frames] * b, False, None))
    computer_cls.__call__ = call
    counts = count(prof)
    layers = len(model.nemo.encoder.layers)
    counts["tokens_emitted"] = sum(len(t) for t in res.token_ids)
    counts["layers"] = layers
    counts["per_layer_leaf_ops"] = {p: round(counts[p]["leaf_ops"] / layers, 2) for p in ("encoder", "attention")}
    counts["pool_layout"] = getattr(pool, "layout", "window")
    a = model.nemo.encoder.layers[0].self_attn
    c = model.nemo.encoder.streaming_cfg.last_channel_cache_size
    counts["cache_bytes_per_row_step"] = cache_bytes_per_row_step(
        counts["pool_layout"], layers, a.h, a.d_k, c, encoder.channel_shape[1] - c, g.encoder_frames,
        model.nemo.encoder.d_model, model.cache_shapes[1][2], torch.finfo(model.dtype).bits // 8,
    )  # fmt: skip
    return counts


def _in_range(fn, name: str, record_function):
    def wrapped(*a, **k):
        with record_function(name):
            return fn(*a, **k)

    return wrapped


def _in_phase(fn, phase: str, record_function):
    def wrapped(*a, **k):
        with record_function(f"phase:{phase}"):
            return fn(*a, **k)

    return wrapped


def common_parser(doc: str) -> argparse.ArgumentParser:
    """The options both kernel counts take (this one and decoder_kernel_count.py, which adds its own)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--model", default="nemotron-0.6b")
    ap.add_argument("--modes", default="0,3,13", help="right contexts")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--source", default=None, help="import nemo_serve from this checkout")
    ap.add_argument("--label", required=True)
    ap.add_argument("--out", default=None)
    return ap


def import_from_source(args) -> None:
    """This checkout's benchmarks, and nemo_serve from --source when given."""
    sys.path.insert(0, str(REPO))
    if args.source:
        sys.path.insert(0, str(Path(args.source).resolve()))


def main(argv=None) -> None:
    ap = common_parser(__doc__)
    ap.add_argument("--configs", default="window:matmul,ring:matmul,ring:sdpa",
                    help="KV layout:attention pairs (NEMO_SERVE_KV_LAYOUT, NEMO_SERVE_ATTENTION), each counted")
    args = ap.parse_args(argv)
    import_from_source(args)
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    import importlib.util

    import nemo_serve

    spec = importlib.util.spec_from_file_location("architecture", REPO / "benchmarks" / "architecture.py")
    architecture = importlib.util.module_from_spec(spec)  # this checkout's, whatever --source is
    spec.loader.exec_module(architecture)
    torch.set_grad_enabled(False)
    torch.set_num_threads(1)
    configs = [(*c.split(":"), "nemo")[:3] for c in args.configs.split(",")]  # layout:attention[:kernels]
    results = {}
    for r in [int(x) for x in args.modes.split(",")]:
        t0 = time.time()
        model = architecture.served(args.model, r, args.dtype)
        for layout, attention, kernels in configs:
            counts = _count_config(model, layout, attention, args.batch, record_function, profile,
                                   [ProfilerActivity.CPU], torch, kernels)  # fmt: skip
            key = f"{layout}:{attention}" + (f":{kernels}" if kernels != "nemo" else "")
            results.setdefault(key, {})[f"r{r}"] = {
                "chunk_ms": round(model.geometry.chunk_ms), "batch": args.batch, **counts,
            }
            print(args.label, layout, attention, kernels, f"r={r}", json.dumps(counts["per_layer_leaf_ops"]),
                  counts["cache_bytes_per_row_step"]["total"], f"({time.time() - t0:.0f} s)", flush=True)
    if args.out:
        save_run(args, nemo_serve, torch, results)


if __name__ == "__main__":
    main()
