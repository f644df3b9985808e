"""The GPU run (benchmarks/gpu/) dry-run on CPU with a tiny model: every phase runs and writes its result
as it goes; the shell wrapper installs carried wheels, sets the cache and passes the budget."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_gpu_bench_dry_run_on_cpu(tmp_path):
    from benchmarks.gpu import gpu_bench

    gpu_bench.main([
        "--out", str(tmp_path), "--model", "tiny-prompt", "--device", "cpu", "--dtype", "fp32", "--modes", "3",
        "--batches", "1,3,8", "--step-seconds", "0.1", "--levels", "3:2,3", "--level-seconds", "1.5",
        "--calibrate-iters", "3", "--threads", "1", "--budget-s", "120",
    ])
    recs = _records(tmp_path / "results.jsonl")
    kinds = [r["kind"] for r in recs]
    assert kinds[:4] == ["env", "model", "calibration", "engine"], kinds
    assert kinds[-1] == "done" and "error" not in kinds, recs
    steps = [r for r in recs if r["kind"] == "step"]
    assert [r["batch"] for r in steps] == [1, 3, 8]
    assert all(r["ms_median"] > 0 and r["us_per_stream_step"] > 0 for r in steps)
    engine = recs[3]
    assert engine["slots"] == 8 and engine["buckets"] == [1, 2, 4, 8] and engine["graphs"] is False
    caps = [r for r in recs if r["kind"] == "capacity"]
    assert caps and caps[0]["streams"] == 2 and caps[0]["results"] > 0
    assert caps[0]["lateness_p50_ms"] <= caps[0]["lateness_p95_ms"] and caps[0]["bound_ms"] == 640.0
    assert all(c["open_after_drain"] == 0 for c in caps)


def test_run_gpu_sh_installs_carried_wheels_and_runs_the_bench(tmp_path):
    """The wrapper with a stand-in Python: wheels go to /tmp/site with pip --no-index, the cache and
    PYTHONPATH are set, gpu_bench.py gets the model, device, dtype, budget and extra options."""
    carry = tmp_path / "carry"
    (carry / "wheels").mkdir(parents=True)
    (carry / "wheels" / "x-1-py3-none-any.whl").write_bytes(b"")
    (carry / "cache").mkdir()
    log = tmp_path / "calls.txt"
    fake = tmp_path / "python3"
    fake.write_text(f"#!/bin/sh\necho \"$@ | PYTHONPATH=$PYTHONPATH | CACHE=$NEMO_SERVE_CACHE\" >> {log}\n")
    fake.chmod(0o755)
    out = tmp_path / "out"
    env = {**os.environ, "PY": str(fake), "CARRY": str(carry), "DEVICE": "cpu", "DTYPE": "fp32", "BUDGET_S": "100"}
    r = subprocess.run(["bash", "benchmarks/gpu/run_gpu.sh", str(out), "--modes", "3"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    calls = log.read_text().splitlines()
    assert calls[0].startswith("-m pip install -q --no-index --no-deps") and "--target /tmp/site" in calls[0]
    assert str(carry / "wheels" / "x-1-py3-none-any.whl") in calls[0]
    bench = [c for c in calls if "gpu_bench.py" in c]
    assert len(bench) == 1
    args = bench[0].split(" | ")[0].split()
    assert args[args.index("--model") + 1] == "nemotron-0.6b"
    assert args[args.index("--device") + 1] == "cpu" and args[args.index("--dtype") + 1] == "fp32"
    assert 90 <= int(args[args.index("--budget-s") + 1]) <= 100
    assert args[-2:] == ["--modes", "3"]
    assert "/tmp/site" in bench[0] and str(REPO) in bench[0] and f"CACHE={carry / 'cache'}" in bench[0]
    assert (out / "run.log").exists() and (out / "env.txt").exists()
