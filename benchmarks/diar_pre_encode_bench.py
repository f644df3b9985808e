"""The diarizer's pre-encoder alone: NeMo's forward (every row masked) against diarization/pre_encode.py.

    nice -n 5 python benchmarks/diar_pre_encode_bench.py --out benchmarks/results/diar_pre_encode_cpu.json

One chunk window per latency setting of the model card ((left + chunk + right) x 8 feature frames),
B rows, side by side in one run, interleaved, one CPU thread; times are the thread's CPU time
(median of --repeats). Two batches per size: every row a steady chunk (no row padded: NeMo's masks
all ones, ours skipped), and one row a stream's first chunk (no left context, so shorter: that
row masked, as NeMo masks it). Outputs are checked equal bit for bit.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import run_record, write_json  # noqa: E402
from nemo_serve.diarization.load import load_diarizer  # noqa: E402
from nemo_serve.diarization.pre_encode import pre_encode  # noqa: E402
from nemo_serve.diarization.settings import MODEL_CARD_SETTINGS  # noqa: E402


def cpu_ms(fn) -> float:
    started = time.thread_time()
    fn()
    return 1e3 * (time.thread_time() - started)


def measure(module, lengths: np.ndarray, repeats: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    features = torch.zeros(len(lengths), int(lengths.max()), module._feat_in)
    for row, n in enumerate(lengths):
        features[row, :n] = torch.randn(int(n), module._feat_in, generator=gen)
    theirs = lambda: module(x=features, lengths=torch.from_numpy(lengths))  # noqa: E731
    ours = lambda: pre_encode(module, features, lengths)  # noqa: E731
    assert torch.equal(theirs()[0], ours()[0])
    times = {"nemo": [], "ours": []}
    for _ in range(repeats):
        times["nemo"].append(cpu_ms(theirs))
        times["ours"].append(cpu_ms(ours))
    nemo, mine = statistics.median(times["nemo"]), statistics.median(times["ours"])
    return {"nemo_ms": round(nemo, 3), "ours_ms": round(mine, 3), "ratio": round(nemo / mine, 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--diarizer", default="builtin:tiny-sortformer")
    p.add_argument("--batches", default="1,16,32")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    module = load_diarizer(args.diarizer).encoder.pre_encode
    rows = []
    for name, s in MODEL_CARD_SETTINGS.items():
        sub = 8
        window, left = (s.chunk_left_context + s.chunk_len + s.chunk_right_context) * sub, s.chunk_left_context * sub
        for batch in [int(b) for b in args.batches.split(",")]:
            steady = np.full(batch, window, np.int64)
            first = steady.copy()
            first[0] -= left  # a stream's first chunk: no left context
            row = {"setting": name, "window_frames": window, "batch": batch,
                   "steady": measure(module, steady, args.repeats), "one_first_chunk": measure(module, first, args.repeats)}  # fmt: skip
            rows.append(row)
            print(f"{name} B={batch} ({window} frames): steady {row['steady']}, one first chunk {row['one_first_chunk']}", flush=True)
    write_json(args.out, {**run_record(), "diarizer": args.diarizer, "threads": 1, "repeats": args.repeats, "results": rows})


if __name__ == "__main__":
    main()
