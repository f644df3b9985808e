"""The GPU run's clock and its results file (gpu_bench.py's phases share them): every record is a line
of OUT/results.jsonl written the moment it exists, so a run killed at its limit keeps what it measured."""

from __future__ import annotations

import gc
import json
import time
from importlib import metadata
from pathlib import Path

T0 = time.time()
PACKAGES = ("torch", "nemo-toolkit", "lightning", "pytorch-lightning", "numpy", "cuda-bindings", "cuda-python",
            "omegaconf", "hydra-core", "transformers", "huggingface-hub", "sentencepiece")  # fmt: skip


class Results:
    def __init__(self, out_dir: Path) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        self.path = out_dir / "results.jsonl"
        self.records: list[dict] = []  # this run's, as written (a later phase reads an earlier one's)

    def write(self, kind: str, **fields) -> None:
        rec = {"kind": kind, "t_s": round(time.time() - T0, 2), **fields}
        self.records.append(rec)
        with self.path.open("a") as f:
            f.write(json.dumps(rec) + "\n")
            f.flush()
        print(json.dumps(rec)[:3000], flush=True)


def left(budget_s: float) -> float:
    return budget_s - (time.time() - T0)


def versions() -> dict:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def err(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:1000]


def free_gpu() -> None:
    """Between phases: cyclic garbage that holds CUDA tensors is collected, then the cache is emptied.
    Nothing to do without CUDA: a full gc.collect() costs 0.3-0.5 s in a process that has imported
    NeMo (more in the test process, eleven calls per dry run), for memory the next phase does not
    need back (the collector's own passes free it)."""
    import torch

    if not torch.cuda.is_available():
        return
    gc.collect()
    torch.cuda.empty_cache()



def restart_clock() -> None:
    """The budget counts from the run, not from the import (main() also runs inside the tests' process)."""
    global T0
    T0 = time.time()
