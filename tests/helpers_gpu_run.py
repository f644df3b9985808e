"""The GPU run's CPU dry-run helpers: the records a run writes, and run_gpu.sh driven with a stand-in
`python3` (used by test_gpu_dry_run.py, test_run_gpu_sh.py and test_loadgen_gpu_phase.py)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _fake_python(tmp_path, script: str = "") -> tuple[Path, Path]:
    """A stand-in `python3` that logs each call (arguments, PYTHONPATH, cache, graph settings) and
    then runs `script` (sh) with the arguments."""
    log = tmp_path / "calls.txt"
    fake = tmp_path / "python3"
    fake.write_text(
        "#!/bin/sh\n"
        f'echo "$@ | PYTHONPATH=$PYTHONPATH | CACHE=$NEMO_SERVE_CACHE | ENC=$NEMO_SERVE_ENCODER_GRAPHS" >> {log}\n'
        + script
    )
    fake.chmod(0o755)
    return fake, log


def _archived(out: Path) -> list[str]:
    import tarfile

    with tarfile.open(out / "extra.tar.gz") as tar:
        return tar.getnames()


def _run_sh(tmp_path, fake, *args, env: dict | None = None):
    carry = tmp_path / "carry"
    (carry / "wheels").mkdir(parents=True)
    (carry / "wheels" / "x-1-py3-none-any.whl").write_bytes(b"")
    (carry / "cache").mkdir()
    out = tmp_path / "out"
    env = {**os.environ, "PY": str(fake), "CARRY": str(carry), "DEVICE": "cpu", "DTYPE": "fp32", "BUDGET_S": "100",
           **(env or {})}
    r = subprocess.run(["bash", "benchmarks/gpu/run_gpu.sh", str(out), *args], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=60)
    return r, carry, out
