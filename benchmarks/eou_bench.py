"""Turn-end latency and transcripts of the demo EOU model against the demo model's silence rule and Silero.

    python benchmarks/eou_bench.py --eou-model work_data/eou_ft/best.nemo --data work_data/eou_corpus \
        --sets heldout_sentences,heldout_voices --context-right 0,13 --out benchmarks/results/eou_demo_cpu.json

Each held-out utterance (the corpus's own: 0.1-0.5 s of trailing silence already) is followed by
--silence-s more of noise at the level of its last 50 ms, and streamed through the engine (all audio
pushed at once; the latency is in audio time: when a final is available at real-time pace, its
`audio_processed`, so the chunk's wait counts and the compute does not). The end of the last word is
exact: the corpus draws each utterance's trailing pad from a seeded generator (corpus._job / augment),
redrawn here. Per utterance:
- EOU model (its EOU endings on, the silence rules as fallback): the first `eou` final at or after the
  speech end (minus one 80 ms frame): latency = its audio_processed - speech end; none: missed;
  an early cut: an EOU/EOB final with text followed by more text (the utterance was split); and
  the turn's end over every utterance, a missed EOU counted at the silence rule's final that ended it;
- demo model, default rules (rule 2: 1.2 s of silence after text): the first `silence` final;
- Silero VAD (server/speech_detector.py, threshold 0.5, --vad-silence-ms, OpenAI's server_vad default
  500 ms), 20 ms packets: when its `stopped` event is emitted, minus the speech end.
WER of both models on the same audio (the EOU model's token is no word; all finals' text joined).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import soundfile
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import percentiles, run_record, write_json  # noqa: E402

SR = 16000
SPLIT_SEEDS = {"dev": 1, "heldout_sentences": 2, "heldout_voices": 3}  # corpus.main: a.seed + k
FRAME_S = 0.08


def speech_end_s(split: str, index: int, num_samples: int, seed: int = 1234) -> float:
    """Where the synthesized speech ends: corpus.augment's trailing pad, redrawn from its seed."""
    rng = np.random.default_rng((seed + SPLIT_SEEDS[split]) * 1000003 + index)
    rng.uniform(-18, -1)  # peak gain
    rng.uniform(0.05, 0.5)  # leading pad
    tail = int(SR * rng.uniform(0.1, 0.5))
    return (num_samples - tail) / SR


def with_silence(x: np.ndarray, seconds: float, rng: np.random.Generator) -> np.ndarray:
    level = float(np.sqrt(np.mean(x[-800:] ** 2))) + 1e-5
    return np.concatenate([x, (rng.standard_normal(int(seconds * SR)) * level).astype(np.float32)])


def load_set(data: Path, split: str, limit: int) -> list[dict]:
    rows = [json.loads(line) for line in open(data / f"{split}.jsonl")][:limit]
    for i, r in enumerate(rows):
        r["audio"], _ = soundfile.read(data / r["audio_filepath"], dtype="float32")
        r["speech_end_s"] = speech_end_s(split, i, len(r["audio"]))
    return rows


def run_engine(spec: str, audios: list[np.ndarray], context_right: int, num_slots: int, endpoint=None) -> list[list]:
    """Every final of each stream (all audio pushed at once, streams num_slots at a time); `endpoint`:
    the silence rules (None: the defaults)."""
    from nemo_serve.engine.endpoint import EndpointConfig
    from nemo_serve.core.inproc import LocalEngine
    from nemo_serve.engine.loop import Engine
    from nemo_serve.model import load_model

    model = load_model(spec, context_right=context_right)
    eng = LocalEngine(Engine(model, num_slots=num_slots, endpoint=endpoint or EndpointConfig()),
                      max_queue_delay_s=0.0)  # fmt: skip
    finals: list[list] = [[] for _ in audios]
    for start in range(0, len(audios), num_slots):
        batch = range(start, min(start + num_slots, len(audios)))
        done = set()
        for i in batch:
            def take(r, i=i):
                if r.is_final:
                    finals[i].append(r)
                if r.done:
                    done.add(i)
            s = eng.open_stream(take)
            eng.push(s, audios[i])
            eng.finish(s)
        while len(done) < len(batch):
            eng.iterate()
    eng.iterate()
    return finals


def eou_outcome(finals: list, end_s: float) -> tuple[float | None, bool]:
    """(latency of the turn's EOU final or None, early cut)."""
    texts = [bool(f.text) for f in finals]
    early = any(f.end_reason in ("eou", "eob") and f.text and any(texts[k + 1 :]) for k, f in enumerate(finals))
    for f in finals:
        if f.end_reason == "eou" and f.eou_time_s is not None and f.eou_time_s >= end_s - FRAME_S:
            return f.audio_processed_s - end_s, early
    return None, early


def turn_end_latency(finals: list, end_s: float) -> float | None:
    """When the EOU model's stream reports the turn over, whatever ended it: its EOU final, or, where
    the model emitted none after the last word, the silence rule's final (its fallback)."""
    latency, _ = eou_outcome(finals, end_s)
    return latency if latency is not None else silence_rule_latency(finals, end_s)


def silence_rule_latency(finals: list, end_s: float) -> float | None:
    for f in finals:
        if f.end_reason == "silence" and f.audio_processed_s >= end_s:
            return f.audio_processed_s - end_s
    return None


def silero_latency(audio: np.ndarray, end_s: float, silence_ms: float) -> float | None:
    from nemo_serve.server.speech_detector import SpeechDetector

    det = SpeechDetector(SR, 0.5, silence_ms / 1000)
    packet = SR // 50
    for i in range(0, len(audio), packet):
        for ev in det.push(audio[i : i + packet]):
            if ev.kind == "stopped" and ev.sample / SR >= end_s - FRAME_S:
                return det.num_samples / SR - end_s
    return None


def summary(latencies: list[float | None]) -> dict:
    got = [x for x in latencies if x is not None]
    return {"n": len(latencies), "detected": len(got), "missed": len(latencies) - len(got),
            **{k: (round(v, 3) if v is not None else None) for k, v in percentiles(got, (50, 95)).items()}}  # fmt: skip


def wer(rows: list[dict], finals: list[list]) -> float:
    from nemo_serve.scoring import word_errors

    errors = words = 0
    for r, fs in zip(rows, finals):
        e, n = word_errors(r["text"], " ".join(f.text for f in fs if f.text))
        errors, words = errors + e, words + n
    return round(errors / max(words, 1), 4)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--eou-model", required=True)
    ap.add_argument("--demo-model", default=None, help="default: the shipped demo model")
    ap.add_argument("--data", required=True)
    ap.add_argument("--sets", default="heldout_sentences,heldout_voices")
    ap.add_argument("--limit", type=int, default=100)
    ap.add_argument("--context-right", default="13", help="modes, comma-separated (0: 80 ms chunks)")
    ap.add_argument("--silence-s", type=float, default=3.0)
    ap.add_argument("--vad-silence-ms", type=float, default=500.0)
    ap.add_argument("--num-slots", type=int, default=16)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows_out = []
    for split, mode in [(s, int(m)) for s in args.sets.split(",") for m in args.context_right.split(",")]:
        rows = load_set(Path(args.data), split, args.limit)
        rng = np.random.default_rng(7)
        audios = [with_silence(r["audio"], args.silence_s, rng) for r in rows]
        eou_finals = run_engine(args.eou_model, audios, mode, args.num_slots)
        demo_finals = run_engine(args.demo_model, audios, mode, args.num_slots)
        outcomes = [eou_outcome(f, r["speech_end_s"]) for f, r in zip(eou_finals, rows)]
        row = {
            "set": split, "utterances": len(rows), "context_right": mode,
            "wer_demo": wer(rows, demo_finals), "wer_eou_model": wer(rows, eou_finals),
            "eou_model_turn_end_s": summary([o[0] for o in outcomes]),
            "early_cuts": sum(o[1] for o in outcomes),
            # every turn, a missed EOU counted at its fallback (the percentiles above leave it out)
            "eou_model_turn_end_with_fallback_s": summary([turn_end_latency(f, r["speech_end_s"]) for f, r in zip(eou_finals, rows)]),
            "silence_rule_turn_end_s": summary([silence_rule_latency(f, r["speech_end_s"]) for f, r in zip(demo_finals, rows)]),
            f"silero_{args.vad_silence_ms:g}ms_turn_end_s": summary(
                [silero_latency(a, r["speech_end_s"], args.vad_silence_ms) for a, r in zip(audios, rows)]),
        }  # fmt: skip
        print(json.dumps(row), flush=True)
        rows_out.append(row)
    write_json(args.out, {"run": run_record(), "argv": sys.argv[1:], "rows": rows_out})


if __name__ == "__main__":
    main()
