"""Are the diarizer's feature frames NeMo's whole-file frames? Shared (from the ASR side) and own.

    python benchmarks/diar_feature_frames.py --out benchmarks/results/diar_feature_frames_cpu.json

The demo ASR model beside demo-sortformer (the same preprocessor: diarization/shared_features.py),
two diarized streams in the in-process engine (1234-sample packets, the second opened two ticks
later), at each latency setting, once with the frames taken from the ASR side and once with the
diarizer's own preprocessor. Every frame a diarizer chunk reads is compared with NeMo's features of
the whole file (diarization/reference.py stream_features, what NeMo's loop reads): the largest
difference and how many frames are not bit-equal. Not a timing: one thread, any load.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import run_record, write_json  # noqa: E402
from nemo_serve.builtin.sortformer import build_diarizer  # noqa: E402
from nemo_serve.diarization.reference import stream_features  # noqa: E402
from nemo_serve.diarization.runner import SortformerRunner  # noqa: E402
from nemo_serve.diarization.settings import MODEL_CARD_SETTINGS, apply_settings  # noqa: E402
from tests import helpers  # noqa: E402
from tests.helpers_diarization import _drive  # noqa: E402


def frames_read(diarizer, audios, share: bool) -> list[tuple[str, int, torch.Tensor]]:
    """(stream id, first frame, [n, F] frames) of every chunk the diarizer stepped."""
    seen, chunk_features = [], SortformerRunner._chunk_features

    def recording(self, streams, t0s, ns):
        windows = chunk_features(self, streams, t0s, ns)
        seen.extend((s.stream_id, t0, w.clone()) for s, t0, w in zip(streams, t0s, windows))
        return windows

    SortformerRunner._chunk_features = recording
    try:
        engine = helpers.new_engine(helpers.model(None), len(audios), diarizer=diarizer)
        assert engine.engine.diarizer.shares_asr_features
        engine.engine.diarizer.shares_asr_features = share
        _, ids = _drive(engine, audios, [{"max_speakers": 4}] * len(audios), packet=1234, start_tick=[0, 2])
    finally:
        SortformerRunner._chunk_features = chunk_features
    return seen, ids


def compare(diarizer, audios, share: bool) -> dict:
    seen, ids = frames_read(diarizer, audios, share)
    whole = {i: stream_features(diarizer, torch.from_numpy(a)) for i, a in zip(ids, audios)}  # [F, T]
    worst, unequal, total = 0.0, 0, 0
    for stream_id, t0, w in seen:
        ref = whole[stream_id][:, t0 : t0 + len(w)].T
        worst = max(worst, (ref - w).abs().max().item())
        unequal += int((ref != w).any(dim=1).sum())
        total += len(w)
    return {"max_abs_diff_vs_whole_file": worst, "frames_not_bit_equal": unequal, "frames_read": total}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--settings", default="very_high,high,low,ultra_low")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    diarizer = build_diarizer("demo-sortformer")
    diarizer.streaming_mode = diarizer.async_streaming = True
    audios = helpers.utterances(2, seed=7)
    rows = []
    for setting in args.settings.split(","):
        apply_settings(diarizer, MODEL_CARD_SETTINGS[setting])
        for share in (True, False):
            rows.append({"setting": setting, "frames": "shared" if share else "own", **compare(diarizer, audios, share)})
            print(rows[-1], flush=True)
    write_json(args.out, {**run_record(), "asr_model": "demo", "diarizer": "builtin:demo-sortformer", "results": rows})


if __name__ == "__main__":
    main()
