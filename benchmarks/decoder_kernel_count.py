"""Operators dispatched per engine step by decoder (NeMo's computer or our label loop), counted with torch.profiler on CPU: on CUDA each operator that
computes launches about one kernel, and each one dispatched from Python costs host time.

    PYTHONPATH=. .venv/bin/python benchmarks/decoder_kernel_count.py --model nemotron-0.6b --label after \
        --out benchmarks/results/kernel_count_nemotron.json
    git worktree add /tmp/before <commit>; .venv/bin/python benchmarks/decoder_kernel_count.py \
        --source /tmp/before --label before --out benchmarks/results/kernel_count_nemotron.json

`--source DIR`, the model (random init from this checkout's configs), the run labels and what is
counted per step (`aten_ops`, `leaf_ops`: an estimate of CUDA kernel launches, `top_level_ops`),
by phase (encoder, decoder, the rest) and under CUDA graphs: as kernel_count.py, whose count() this
uses.

Decoders (`--decoder nemo | label_loop | label_loop:active`, engine/nemo_decoder.py `decoder_kind`; the
decoder phase is `Stepper.decode`: the decoder with its state gather/scatter and result packing).
Per step also counted: the joint's evaluations (`joint_calls`: NeMo's outer plus inner label-loop
trips; our loop's trips, one joint each), the prediction network's calls (`predict_calls`: NeMo's
outer trips) and emitted tokens, and per trip the decoder's leaf operators. `--model demo` is the
trained demo model; `--audio` feeds bundled speech (whole-file features cut into the mode's
chunks) instead of random features, so the emission is a trained model's; `--steps N` profiles N
later chunks and sums. The per-decoder table:

    PYTHONPATH=. .venv/bin/python benchmarks/decoder_kernel_count.py --model demo --audio --modes 0,13 \
        --batch 8 --steps 4 --skip-s 1.5 --decoder nemo --label demo-nemo --out benchmarks/results/kernel_count_decoder.json
    (and --decoder label_loop --label demo-label_loop; --decoder label_loop:active --label demo-label_loop-active)
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# kernel_count.py's count (one definition of a kernel estimate: the two must not drift apart).
import kernel_count  # noqa: E402  (run as a script: benchmarks/ is on the path)


def count(prof) -> dict:
    return kernel_count.count(prof, ("encoder", "decoder"))


def main(argv=None) -> None:
    ap = kernel_count.common_parser(__doc__)
    ap.add_argument("--decoder", default=None, help="nemo | label_loop | label_loop:active (default: the engine's)")
    ap.add_argument("--audio", action="store_true", help="bundled speech instead of random features")
    ap.add_argument("--steps", type=int, default=1, help="later chunks profiled (summed)")
    ap.add_argument("--skip-s", type=float, default=0.0, help="audio stepped through before the profiled chunks")
    args = ap.parse_args(argv)
    kernel_count.import_from_source(args)
    if args.decoder:
        kind, _, rows = args.decoder.partition(":")
        os.environ["NEMO_SERVE_DECODER"] = kind
        os.environ["NEMO_SERVE_LABEL_LOOP_ROWS"] = rows or "all"
    import torch

    import nemo_serve

    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    results = {}
    for r in [int(x) for x in args.modes.split(",")]:
        t0 = time.time()
        results[f"r{r}"] = measure(args, r)
        print(args.label, f"r={r}", json.dumps(results[f"r{r}"]), f"({time.time() - t0:.0f} s)", flush=True)
    if args.out:
        kernel_count.save_run(args, nemo_serve, torch, results,
                              decoder=os.environ.get("NEMO_SERVE_DECODER", "engine default"),
                              label_loop_rows=os.environ.get("NEMO_SERVE_LABEL_LOOP_ROWS", "all"))  # fmt: skip


def _load(args, r):
    import importlib.util

    if args.model == "demo":
        from nemo_serve.model import load_model

        return load_model(None, context_right=r, dtype=args.dtype)
    spec = importlib.util.spec_from_file_location("architecture", REPO / "benchmarks" / "architecture.py")
    architecture = importlib.util.module_from_spec(spec)  # this checkout's, whatever --source is
    spec.loader.exec_module(architecture)
    return architecture.served(args.model, r, args.dtype)


def _features(model, b: int, steps: int, audio: bool, warm: int):
    """The first chunk and `steps` later chunks [B, F, W] per row: random, or bundled speech (each
    row another utterance, whole-file features cut at the mode's chunk grid)."""
    import torch

    g = model.geometry
    if not audio:
        gen = torch.Generator().manual_seed(0)
        first = torch.randn(b, model.num_mels, g.first_frames, generator=gen)
        return first, [torch.randn(b, model.num_mels, g.chunk_frames, generator=gen) for _ in range(steps + warm)]
    from nemo_serve.selftest import BUNDLED_MANIFEST, load_utterances

    utts = load_utterances(BUNDLED_MANIFEST, g.sample_rate)
    need = g.first_frames + (steps + warm) * g.chunk_frames
    feats = []
    for u in utts[:b]:
        x = torch.from_numpy(u.audio).unsqueeze(0)
        f, _ = model.preprocessor(input_signal=x, length=torch.tensor([x.shape[1]]))
        f = torch.nn.functional.pad(f, (0, max(0, need - f.shape[-1])))
        feats.append(f[0, :, :need])
    feats = torch.stack([feats[i % len(feats)] for i in range(b)])
    first = feats[:, :, : g.first_frames]
    later = [feats[:, :, g.first_frames + k * g.chunk_frames : g.first_frames + (k + 1) * g.chunk_frames]
             for k in range(steps + warm)]  # fmt: skip
    return first, later


def measure(args, r: int) -> dict:
    from torch.profiler import ProfilerActivity, profile, record_function

    import torch
    from nemo_serve.engine import step as step_mod
    from nemo_serve.engine.encoder import make_encoder
    from nemo_serve.engine.slots import SlotPool
    from nemo_serve.engine.step import StepBatch, run_step

    model = _load(args, r)
    encoder = make_encoder(model)
    b, g = args.batch, model.geometry
    pool = SlotPool(model, b, encoder.channel_shape)
    for i in range(b):
        pool.open_row(i)
    calls = {"joint_calls": 0, "predict_calls": 0}
    restore = []

    def phase(obj, name, label, counter=None):
        fn = getattr(obj, name)

        def wrapped(*a, **k):
            if counter:
                calls[counter] += 1
            if label is None:
                return fn(*a, **k)
            with record_function(label):
                return fn(*a, **k)

        setattr(obj, name, wrapped)
        restore.append((obj, name, fn))

    phase(encoder, "step", "phase:encoder")
    phase(step_mod.Stepper, "decode", "phase:decoder")
    phase(model.nemo.joint, "joint_after_projection", None, "joint_calls")
    phase(model.nemo.decoder, "predict", None, "predict_calls")
    warm = max(2, math.ceil(args.skip_s * 1000 / g.chunk_ms))  # lazy caches, buffers; past leading silence
    first, later = _features(model, b, args.steps, args.audio, warm)
    rows = torch.arange(b)
    run_step(model, encoder, pool, StepBatch(rows, first, [g.first_frames] * b, True, None))
    for x in later[:warm]:
        run_step(model, encoder, pool, StepBatch(rows, x, [g.chunk_frames] * b, False, None))
    calls.update(joint_calls=0, predict_calls=0)
    tokens = 0
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for x in later[warm:]:
            res = run_step(model, encoder, pool, StepBatch(rows, x, [g.chunk_frames] * b, False, None))
            tokens += sum(len(t) for t in res.token_ids)
    for obj, name, fn in reversed(restore):
        if name in vars(obj) and obj is not step_mod.Stepper:
            delattr(obj, name)
        else:
            setattr(obj, name, fn)
    counts = count(prof)
    dec = counts["decoder"]
    return {
        "chunk_ms": round(g.chunk_ms), "batch": b, "steps": args.steps, "skipped_steps": warm, **counts,
        "tokens_emitted": tokens, **calls, "layers": len(model.nemo.encoder.layers),
        "decoder_leaf_ops_per_joint_call": round(dec["leaf_ops"] / max(calls["joint_calls"], 1), 1),
        "decoder_top_level_ops_per_joint_call": round(dec["top_level_ops"] / max(calls["joint_calls"], 1), 1),
    }


if __name__ == "__main__":
    main()
