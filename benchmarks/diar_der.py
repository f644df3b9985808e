"""Diarization error rate of a streaming Sortformer on held-out synthetic conversations, per latency setting.

The batched streaming path of nemo_serve.diarization (every conversation a row of one batch) at each
setting of nemo_serve/diarization/settings.py, and the offline forward as a cross-check; collar 0.25 s
on each side of each reference boundary and none, overlap scored (nemo_serve/training/diar_eval.py).
The conversations are diar_corpus's held-out split (voices never in training); build it first:

    python -m nemo_serve.training.diar_corpus --out work_data/diar_corpus
    python benchmarks/diar_der.py --model demo-sortformer --data work_data/diar_corpus \\
        --limit 16 --out benchmarks/results/diar_der_demo_cpu.json

``--model a.pt,b.pt,...`` scores the mean of several checkpoints (trainer ``last.pt`` states or ``.nemo``
files: checkpoint averaging); ``--settings`` with no names scores the offline forward only (seconds), e.g.
on ``--split dev`` to compare checkpoints on training voices.

Streaming Sortformer recomputes its encoder over [speaker cache, FIFO, chunk] every step: at 0.32 s that
is about 380 frames per 3 new ones, so on a shared CPU the 16 conversations of the documented run take
minutes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import file_digest, run_record, write_json  # noqa: E402
from nemo_serve.builtin.sortformer import DEMO_DIARIZER_PATH  # noqa: E402
from nemo_serve.diarization.settings import MODEL_CARD_SETTINGS  # noqa: E402
from nemo_serve.training.diar_eval import evaluate, load_conversations, load_model  # noqa: E402


def averaged_model(paths: list[Path]):
    """The demo Sortformer with the element-wise mean of these checkpoints' weights (one: that checkpoint)."""
    from nemo_serve.training.average import average_states
    from nemo_serve.training.diar_train import build_model

    def state(path: Path) -> dict:
        if path.suffix == ".nemo":
            return load_model(str(path)).state_dict()
        return torch.load(path, map_location="cpu", weights_only=False)["model"]

    model = build_model(init_encoder=None)
    model.load_state_dict(average_states([state(path) for path in paths]))
    return model.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="demo-sortformer", help="demo-sortformer or a .nemo path")
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--split", default="heldout")
    parser.add_argument("--limit", type=int, default=0, help="the first N conversations (0: all)")
    parser.add_argument("--check-nemo", type=int, default=1, help="conversations also run through NeMo's loop")
    parser.add_argument("--settings", nargs="*", default=list(MODEL_CARD_SETTINGS), choices=list(MODEL_CARD_SETTINGS))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    paths = [DEMO_DIARIZER_PATH] if args.model == "demo-sortformer" else [Path(m) for m in args.model.split(",")]
    conversations = load_conversations(args.data / f"{args.split}.jsonl")[: args.limit or None]
    digests = [file_digest(path) for path in paths]
    record = {**run_record(), "model": args.model, "model_digest": digests[0] if len(paths) == 1 else digests,
              "split": args.split,
              "num_conversations": len(conversations),
              "audio_s": round(sum(duration for _, _, duration in conversations), 1),
              "threshold": 0.5, "collar_s": [0.25, 0.0]}
    settings = {name: MODEL_CARD_SETTINGS[name] for name in args.settings}
    model = load_model(str(paths[0])) if len(paths) == 1 and paths[0].suffix == ".nemo" else averaged_model(paths)
    record.update(evaluate(model, conversations, settings, args.check_nemo))
    print({"offline": record["offline"]["collar_0.25"]["der"],
           **{name: row["collar_0.25"]["der"] for name, row in record["streaming"].items()}}, flush=True)
    if args.out:
        write_json(args.out, record)


if __name__ == "__main__":
    main()
