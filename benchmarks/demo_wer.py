"""The demo model's streaming WER table: every held-out set at every mode, alone and chained by four.

    python benchmarks/demo_wer.py --data work_data/corpus --out benchmarks/results/demo_wer_NAME_cpu.json

Runs ``nemo_serve.training.evaluate`` (NeMo's own cache-aware loop, one stream at a time) on the first
--limit utterances of each held-out set: once with one utterance per stream, once with --chain consecutive
utterances per stream (0.3 s of silence between them), at every --rights mode. Writes one JSON with both
tables, the model's sha256 and the run record, and prints docs/demo_model.md's table with the targets checked:
at most --target WER on every set at every mode, and chained within --chain-slack points of alone.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import file_digest, run_record, write_json  # noqa: E402
from nemo_serve.model import DEMO_MODEL_PATH  # noqa: E402
from nemo_serve.training import evaluate  # noqa: E402

LABELS = {"heldout_sentences": "unseen sentences (espeak-ng)", "heldout_voices": "unseen voice variants (espeak-ng)",
          "flite": "held-out flite voice"}


def table(alone: dict, chained: dict, sets, rights, chain_k: int, target: float, slack: float) -> tuple[str, list]:
    """The markdown table (alone, then chained, per set) and the list of missed targets, in words."""
    lines = ["| held-out set | " + " | ".join(f"{(r + 1) * 80} ms" for r in rights) + " |",
             "|---|" + "---|" * len(rights)]
    missed = []
    for s in sets:
        cells = []
        for r in rights:
            w = alone[(s, r)]["wer"]
            cells.append(f"**{100 * w:.2f}%**" if w <= target else f"{100 * w:.2f}%")
            if w > target:
                missed.append(f"{s} at R={r}: {100 * w:.2f}% > {100 * target:.0f}%")
        lines.append(f"| {LABELS.get(s, s)} | " + " | ".join(cells) + " |")
    for s in sets:
        cells = []
        for r in rights:
            c, a = chained[(s, r)]["wer"], alone[(s, r)]["wer"]
            cells.append(f"{100 * c:.2f}%")
            if c - a > slack:
                missed.append(f"{s} chained by {chain_k} at R={r}: {100 * c:.2f}% vs {100 * a:.2f}% alone "
                              f"(+{100 * (c - a):.1f} points)")
        lines.append(f"| {chain_k} utterances per stream: {LABELS.get(s, s)} | " + " | ".join(cells) + " |")
    return "\n".join(lines), missed


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(DEMO_MODEL_PATH))
    p.add_argument("--data", required=True, help="the corpus directory (nemo_serve.training.corpus --out)")
    p.add_argument("--sets", nargs="+", default=evaluate.DEFAULT_SETS)
    p.add_argument("--rights", nargs="+", type=int, default=evaluate.DEFAULT_RIGHTS)
    p.add_argument("--limit", type=int, default=100)
    p.add_argument("--chain", type=int, default=4)
    p.add_argument("--target", type=float, default=0.10)
    p.add_argument("--chain-slack", type=float, default=0.02)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    model = evaluate.load_model(a.model)
    alone = evaluate.evaluate(model, Path(a.data), a.sets, a.rights, a.limit)
    chained = evaluate.evaluate(model, Path(a.data), a.sets, a.rights, a.limit, chain_k=a.chain)
    md, missed = table(alone, chained, a.sets, a.rights, a.chain, a.target, a.chain_slack)
    print("\n" + md)
    print("targets met" if not missed else "targets missed:\n  " + "\n  ".join(missed))
    write_json(a.out, {
        "benchmark": "demo model streaming WER (NeMo's cache-aware loop), first --limit utterances per held-out set",
        "model_file": a.model,
        "model_sha256": file_digest(a.model, length=64),
        "run": run_record(),
        "limit": a.limit,
        "one_utterance_per_stream": {f"{s}@R{r}": v for (s, r), v in alone.items()},
        f"chained_by_{a.chain}": {f"{s}@R{r}": v for (s, r), v in chained.items()},
        "target": {"wer": a.target, "chain_slack": a.chain_slack},
        "missed": missed,
        "table": md,
    })


if __name__ == "__main__":
    main()
