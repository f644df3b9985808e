"""Multi-turn streams through an EOU model in NeMo's own cache-aware loop (issue 49): does each turn end
with its own `<EOU>`, and are the later turns' words transcribed?

    python benchmarks/eou_turns_bench.py --models work_data/old_eou.nemo,nemo_serve/assets/demo/demo_eou.nemo \
        --turns 2,3 --context-right 0,13 --out benchmarks/results/eou_turns_cpu.json

The 24 bundled utterances, in order, cut into streams of --turns each, every turn followed by --gap-s of
silence. Per model, turns and mode: the `<EOU>` count against the number of turns, the streams with one
`<EOU>` per turn, and the WER of each stream's text (EOU tokens dropped) against its turns' references
joined (a turn the model stopped hearing counts as deleted words).

The token count cannot say where each `<EOU>` fell (two in one turn and none in the next count as
two), so the same streams also go through the engine (eou_bench.run_engine: NeMo's loop's tokens,
each `<EOU>` a final with its `eou_time`), silence rules out of reach: a turn is ended by the model
when an `eou` final's time lies between its start and the next turn's (`turns_ended_by_eou`), and
split when more than one does (`turns_with_more_than_one_eou`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import run_record, write_json  # noqa: E402


def stream_row(path: str, turns: int, mode: int, gap_s: float) -> dict:
    from nemo.collections.asr.metrics.wer import word_error_rate

    from nemo_serve.model import load_model
    from nemo_serve.oracle import oracle_transcribe
    from nemo_serve.selftest import BUNDLED_MANIFEST, load_utterances
    from nemo_serve.training.eou import EOU_PIECE, strip_eou

    model = load_model(path, context_right=mode)
    utts = load_utterances(BUNDLED_MANIFEST, 16000)
    gap = np.zeros(int(gap_s * 16000), np.float32)
    eous, full, hyps, refs, streams = 0, 0, [], [], []
    for k in range(0, len(utts) - turns + 1, turns):
        group = utts[k: k + turns]
        streams.append(([u.audio for u in group], np.concatenate([x for u in group for x in (u.audio, gap)])))
        tokens = oracle_transcribe(model, streams[-1][1]).token_ids
        n = sum(model.vocabulary[t] == EOU_PIECE for t in tokens)
        eous, full = eous + n, full + (n == turns)
        hyps.append(strip_eou("".join(model.vocabulary[t] for t in tokens).replace("▁", " ")))
        refs.append(" ".join(u.text for u in group))
    return {"model": path, "turns": turns, "context_right": mode, "streams": len(refs), "eou_tokens": eous,
            "turns_total": turns * len(refs), "streams_with_one_eou_per_turn": full,
            "wer": round(word_error_rate(hyps, refs), 4), **turns_ended(path, streams, mode, gap_s)}


def eou_per_turn(turn_seconds: list[float], gap_s: float, finals: list) -> list[int]:
    """How many `eou` finals each turn got: those whose eou_time lies from its start (0, then each
    earlier turn's audio and gap) up to the next turn's start; the last turn's span runs on to the end."""
    starts = np.cumsum([0.0] + [s + gap_s for s in turn_seconds])
    starts[-1] = np.inf
    times = [f.eou_time_s for f in finals if f.end_reason == "eou"]
    return [int(sum(starts[k] <= t < starts[k + 1] for t in times)) for k in range(len(turn_seconds))]


def turns_ended(path: str, streams: list[tuple[list, np.ndarray]], mode: int, gap_s: float) -> dict:
    """Per turn, the `eou` finals the engine gave between its start and the next turn's start."""
    from benchmarks.eou_bench import run_engine
    from nemo_serve.engine.endpoint import EndpointConfig

    far = EndpointConfig(rule1_min_trailing_silence_s=3000, rule2_min_trailing_silence_s=3000,
                         rule3_min_utterance_length_s=3000)  # only the model ends a turn
    finals = run_engine(path, [audio for _, audio in streams], mode, num_slots=len(streams), endpoint=far)
    per_turn = []
    for (turn_audios, _), stream_finals in zip(streams, finals):
        per_turn += eou_per_turn([len(a) / 16000 for a in turn_audios], gap_s, stream_finals)
    return {"turns_ended_by_eou": int(sum(n >= 1 for n in per_turn)),
            "turns_with_more_than_one_eou": int(sum(n > 1 for n in per_turn)), "eou_finals": int(sum(per_turn))}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", required=True, help="comma-separated .nemo files")
    ap.add_argument("--turns", default="2,3")
    ap.add_argument("--context-right", default="0,13")
    ap.add_argument("--gap-s", type=float, default=1.0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for path in args.models.split(","):
        for turns in [int(t) for t in args.turns.split(",")]:
            for mode in [int(m) for m in args.context_right.split(",")]:
                rows.append(stream_row(path, turns, mode, args.gap_s))
                print(rows[-1], flush=True)
    write_json(args.out, {"run": run_record(), "argv": sys.argv[1:], "rows": rows})


if __name__ == "__main__":
    main()
