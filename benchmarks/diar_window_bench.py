"""What a diarized stream's speaker probabilities cost per step as the stream grows: the old
whole-history array (np.concatenate per step) against SpeakerWindow (diarization/runner.py), which
keeps only the frames still needed. Side by side in one run, CPU, one thread.

    python benchmarks/diar_window_bench.py --out benchmarks/results/diar_window_cpu.json

A stream of 4 speakers at the model card's 1.04 s setting (6 frames of 80 ms per step) is grown to
each length; then --steps more steps are timed (append the step's frames; the window also forgets
all but the last --kept-s seconds, as the attacher lets it). Reported per length: microseconds per
step (over the --steps after it) and bytes held at that length, for both.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import run_record, write_json  # noqa: E402
from nemo_serve.diarization.runner import SpeakerWindow  # noqa: E402

FRAME_S, CHUNK, SPEAKERS = 0.08, 6, 4


def per_step(length_s: float, steps: int, kept_s: float) -> dict:
    chunk = np.random.default_rng(0).random((CHUNK, SPEAKERS), dtype=np.float32)
    frames = int(length_s / FRAME_S)
    whole = np.zeros((frames, SPEAKERS), np.float32)
    window = SpeakerWindow(SPEAKERS)
    for _ in range(0, frames, CHUNK):
        window.append(chunk)
        window.forget_before(window.num_frames - int(kept_s / FRAME_S))
    held = {"whole_history_bytes": whole.nbytes, "window_bytes": window.capacity * SPEAKERS * 4}  # at length_s
    started = time.perf_counter()
    for _ in range(steps):
        whole = np.concatenate([whole, chunk])
    old_us = (time.perf_counter() - started) / steps * 1e6
    started = time.perf_counter()
    for _ in range(steps):
        window.append(chunk)
        window.forget_before(window.num_frames - int(kept_s / FRAME_S))
    new_us = (time.perf_counter() - started) / steps * 1e6
    return {"stream_s": length_s, "whole_history_us_per_step": round(old_us, 2), "window_us_per_step": round(new_us, 2),
            "ratio": round(old_us / new_us, 1), **held}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--kept-s", type=float, default=5.0, help="seconds the attacher still needs")
    args = parser.parse_args()
    rows = [per_step(s, args.steps, args.kept_s) for s in (60, 600, 3600, 4 * 3600)]
    for r in rows:
        print(r)
    write_json(args.out, {**run_record(), "kept_s": args.kept_s, "rows": rows})


if __name__ == "__main__":
    main()
