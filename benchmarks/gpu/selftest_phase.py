"""gpu_bench.py phase 2: `nemo-serve --selftest` parity with NeMo's own loop on the device, once per
(model, dtype, --selftest-configs path)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from benchmarks.gpu.record import Results, left

REPO = Path(__file__).resolve().parent.parent.parent

def selftest(args, res: Results) -> None:
    """`nemo-serve --selftest N --context-right all` on the device, as a user runs it: one process per
    (model, dtype), all at once (each loads its model once; a second restore of the same .nemo in
    one CUDA process failed on the H200 with an empty pos_bias in the restored state dict)."""
    import subprocess

    if left(args.budget_s) < args.reserve_s + 60:
        res.write("skipped", what="selftest", why="budget")
        return
    t = time.time()
    procs = {}
    for model in args.selftest_models:
        for dtype in args.selftest_dtypes:
            # engine/ring_cache.py, attention.py, label_loop.py, epilogues.py (Triton kernels on CUDA), loop.py
            for path in args.selftest_configs:
                cmd = [sys.executable, "-m", "nemo_serve.cli", "--selftest", str(args.selftest_n), "--context-right",
                       "all", "--dtype", dtype, "--device", args.device] + (["--model", model] if model else [])  # fmt: skip
                procs[(model or "demo", dtype, path)] = subprocess.Popen(
                    cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                    env={**os.environ, **path.env})  # fmt: skip
    for (model, dtype, path), p in procs.items():
        timed_out = False
        try:
            out, _ = p.communicate(timeout=max(10.0, min(180.0, left(args.budget_s) - args.reserve_s)))
        except subprocess.TimeoutExpired:  # its box ended: not measured, which is not a failure (decide.py)
            p.kill()
            out, _ = p.communicate()
            timed_out = True
        lines = [ln for ln in out.splitlines() if not ln.startswith(("[NeMo", "    "))]
        summary = next((ln for ln in reversed(lines) if "token-identical" in ln and "/" in ln.split()[0]), None)
        res.write("selftest", model=model, dtype=dtype, device=args.device, n=args.selftest_n, passed=p.returncode == 0,
                  timed_out=timed_out,
                  **path.fields, kernels=next((ln for ln in lines if ln.startswith("kernels: ")), None),
                  paths=next((ln for ln in lines if ln.startswith("paths: ")), None),
                  rc=p.returncode, summary=summary, per_mode=[ln for ln in lines if ln.startswith("context-right")],
                  diffs=[ln for ln in lines if ln.startswith("[DIFF]")],
                  tail=None if p.returncode == 0 else "\n".join(lines[-15:])[-3000:],
                  seconds=round(time.time() - t, 1))  # fmt: skip

