"""Which part of the graph path fails on this device: run after a failed preflight (run_gpu.sh does).

Each variant is the preflight's one-bucket check (the tiny prompt architecture, bucket 2 captured
at start-up, then a first and three later chunks of two real rows) in its own process, so an
illegal memory access in one cannot poison another, with CUDA_LAUNCH_BLOCKING=1, so its traceback
points at the failing launch. Variants switch the graph halves on and off through the stepper's
environment settings (engine/step.py). Every variant writes a `diagnose` record; the tokens of
each are compared with the all-eager variant. The last line printed is the environment of the
first variant, in order of preference, that ran and matched eager: run_gpu.sh re-runs the bench
with it, so a second run still measures something.

    python benchmarks/gpu/diagnose.py --out OUT [--dtype bf16] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(REPO))

# name -> environment; in order of preference (the fastest configuration first)
VARIANTS = {
    "graphs": {},
    "graphs_async": {"DIAG_ASYNC": "1"},  # without CUDA_LAUNCH_BLOCKING: fails alone if timing matters
    "graphs_decoder_375": {"NEMO_SERVE_DECODER_MAX_TIME": "375"},
    "graphs_decoder_no_while_loops": {"NEMO_SERVE_DECODER_GRAPHS": "no_while_loops"},
    "decoder_graphs_only": {"NEMO_SERVE_ENCODER_GRAPHS": "0"},
    "decoder_graphs_only_375": {"NEMO_SERVE_ENCODER_GRAPHS": "0", "NEMO_SERVE_DECODER_MAX_TIME": "375"},
    "encoder_graphs_only": {"NEMO_SERVE_DECODER_GRAPHS": "off"},
    "eager": {"NEMO_SERVE_ENCODER_GRAPHS": "0", "NEMO_SERVE_DECODER_GRAPHS": "off"},
    "eager_nemo_encoder": {"NEMO_SERVE_ENCODER_GRAPHS": "0", "NEMO_SERVE_DECODER_GRAPHS": "off", "DIAG_KV": "0"},
}


def variant(dtype: str, device: str) -> dict:
    """One variant, in this process (the environment is already set)."""
    import numpy as np
    import torch

    from benchmarks.architecture import served
    from nemo_serve.engine.encoder import make_encoder
    from nemo_serve.engine.slots import SlotPool
    from nemo_serve.engine.step import StepBatch, Stepper

    torch.set_grad_enabled(False)
    model = served("tiny-prompt", 3, dtype, device)
    encoder = make_encoder(model, kv_cache=os.environ.get("DIAG_KV", "1") == "1")
    pool = SlotPool(model, 4, encoder.channel_shape)
    st = Stepper(model, encoder, pool, context_right=3)
    where = "prepare"
    tokens: list = []
    try:
        st.prepare([2])
        where = "steps"
        rows = np.array([0, 1])
        pool.open_row(0), pool.open_row(1)
        g = model.geometry
        gen = torch.Generator().manual_seed(0)
        for k in range(4):
            first = k == 0
            w = g.first_frames if first else g.chunk_frames
            feats = (3 * torch.randn(2, model.num_mels, w, generator=gen)).to(model.device)
            with torch.inference_mode():
                r = st.run(StepBatch(rows, feats, [w, w], first, None))
            tokens.append(r.token_ids)
        return {"ok": True, "tokens": tokens, "report": st.report()}
    except Exception as e:  # noqa: BLE001 - the record says where and what
        import traceback

        return {"ok": False, "where": where, "error": f"{type(e).__name__}: {e}"[:600],
                "traceback": traceback.format_exc()[-2500:], "report": st.report()}  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--timeout-s", type=float, default=150)
    ap.add_argument("--variant", help=argparse.SUPPRESS)  # internal: run one variant, print its JSON
    args = ap.parse_args(argv)
    if args.variant:
        print("DIAG " + json.dumps(variant(args.dtype, args.device)), flush=True)
        return 0
    t = time.time()
    procs = {}
    for name, env in VARIANTS.items():  # all at once: each is small, the machine has many cores
        e = {**os.environ, **env, "PYTHONUNBUFFERED": "1"}
        if "DIAG_ASYNC" not in env:
            e["CUDA_LAUNCH_BLOCKING"] = "1"
        procs[name] = subprocess.Popen(
            [sys.executable, __file__, "--out", args.out, "--dtype", args.dtype, "--device", args.device,
             "--variant", name], env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    results = {}
    for name, p in procs.items():
        try:
            out, _ = p.communicate(timeout=max(5.0, args.timeout_s - (time.time() - t)))
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
            results[name] = {"ok": False, "where": "timeout", "error": "timed out", "tail": out[-1500:]}
            continue
        line = next((ln for ln in reversed(out.splitlines()) if ln.startswith("DIAG ")), None)
        results[name] = json.loads(line[5:]) if line else {"ok": False, "where": "process", "rc": p.returncode,
                                                           "error": "no result", "tail": out[-2500:]}  # fmt: skip
    ref = results.get("eager", {}).get("tokens")
    chosen = None
    out_path = Path(args.out) / "results.jsonl"
    with out_path.open("a") as f:
        for name, r in results.items():
            r["matches_eager"] = bool(r.get("ok") and ref is not None and r.get("tokens") == ref)
            rec = {"kind": "diagnose", "variant": name, "env": VARIANTS[name], **{k: v for k, v in r.items() if k != "tokens"}}
            f.write(json.dumps(rec) + "\n")
            print(json.dumps(rec)[:1500], flush=True)
    racy = results["graphs"].get("ok") and not results["graphs_async"].get("ok")  # passes only when serialised
    for name, r in results.items():
        if chosen is None and r["matches_eager"] and not name.endswith("_async") and not (racy and name == "graphs"):
            chosen = name
    print(f"diagnosis in {time.time() - t:.0f} s; first variant that ran and matched eager: {chosen}"
          + (" (the graph path passes only with CUDA_LAUNCH_BLOCKING=1: a race)" if racy else ""), flush=True)
    env = {k: v for k, v in VARIANTS.get(chosen, {}).items() if k.startswith("NEMO_SERVE_")}
    print("CHOSEN " + (" ".join(f"{k}={v}" for k, v in env.items()) if chosen else "NONE"), flush=True)
    return 0 if chosen else 5


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # no CUDA teardown after a device fault (see gpu_bench.py)
