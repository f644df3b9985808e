"""Calibrate a trained Sortformer's speaker decisions on the dev conversations: one logit offset in its head.

The demo diarizer is cautious: on speech of held-out voices its probabilities often sit just under 0.5, so
missed speech is half of its DER while it almost never speaks where no one does. Serving decides at
p > 0.5 (NeMo's threshold, the same in the engine and in NeMo's loop), so instead of a second threshold the
offset goes into the weights: ``sortformer_modules.single_hidden_to_spks.bias`` + b, which makes the
offline decisions at 0.5 exactly those of the unshifted model at p > sigmoid(-b). b is chosen on the dev
conversations (training speakers; the trainer's selection metric, offline DER with no collar), never on
the held-out ones. Streaming also feeds the probabilities to the speaker-cache update, so the streaming
DER is measured again after calibration (benchmarks/diar_der.py).

    python -m nemo_serve.training.diar_calibrate --model work_data/diar_run5/ema.nemo \\
        --data work_data/diar_corpus --out work_data/diar_run5/calibrated.nemo
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch

from .diar_metrics import DerCounts, der_counts, preds_to_segments

OFFSETS = (0.0, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5)  # logits; 0.5 moves the threshold to 0.38


def threshold_for(offset: float) -> float:
    """The probability threshold on the unshifted model that a logit offset turns into 0.5."""
    return 1.0 / (1.0 + math.exp(offset))


def der_at_offsets(preds: list[np.ndarray], conversations, offsets=OFFSETS, collar_s: float = 0.0) -> dict:
    """{offset: DerCounts} of the decisions the shifted head would make ([T, K] preds per conversation)."""
    out = {}
    for offset in offsets:
        counts = DerCounts()
        for p, (_, reference, duration) in zip(preds, conversations):
            counts += der_counts(reference, preds_to_segments(p, threshold=threshold_for(offset)), duration, collar_s)
        out[offset] = counts
    return out


def best_offset(scores: dict) -> float:
    """The offset of the lowest DER; ties go to the smaller shift (the model as trained)."""
    return min(scores, key=lambda offset: (round(scores[offset].der, 6), abs(offset)))


@torch.no_grad()
def shift_speaker_logits(model, offset: float) -> None:
    model.sortformer_modules.single_hidden_to_spks.bias += offset


def main(argv=None) -> None:
    from .diar_eval import load_conversations, load_model, offline_preds

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--data", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--offsets", default=",".join(map(str, OFFSETS)), help="candidate logit offsets")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--report", type=Path, help="also write the dev DER per offset and the choice here (JSON)")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    model = load_model(a.model)
    dev = load_conversations(a.data / "dev.jsonl")
    offsets = tuple(float(o) for o in a.offsets.split(","))
    scores = der_at_offsets([offline_preds(model, audio).numpy() for audio, _, _ in dev], dev, offsets)
    for offset, counts in scores.items():
        print(json.dumps({"logit_offset": offset, "threshold": round(threshold_for(offset), 4),
                          "dev_der_no_collar": counts.as_dict()}), flush=True)
    chosen = best_offset(scores)
    shift_speaker_logits(model, chosen)
    model.save_to(str(a.out))
    if a.report:
        args = argv if argv is not None else sys.argv[1:]
        command = " ".join(["python -m nemo_serve.training.diar_calibrate", *args])
        a.report.write_text(json.dumps({"command": command, "model": a.model, "split": "dev",
                                        "num_conversations": len(dev), "chosen_logit_offset": chosen,
                                        "dev_der_no_collar": {str(o): c.as_dict() for o, c in scores.items()}},
                                       indent=1) + "\n")
    print(f"logit offset {chosen} (dev DER {scores[chosen].der:.4f}) -> {a.out}")


if __name__ == "__main__":
    main()
