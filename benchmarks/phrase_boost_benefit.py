"""What per-stream phrase boosting buys: key terms the model never learnt, with and without their phrases.

    python benchmarks/phrase_boost_benefit.py --out benchmarks/results/phrase_boost_benefit_demo_r13_cpu.json

Test set (made here, deterministic): 12 terms that are not in the demo model's training vocabulary
(nemo_serve/training/sentences.py `vocabulary()`: names and rare nouns), each in two carrier sentences
of in-vocabulary words ("add quinoa to the shopping list"), spoken by espeak-ng's en-us and
en-gb-x-rp voices (training voices, as corpus.py renders them: 16 kHz, trimmed, no noise) and by
flite's slt voice (a voice the demo model trained on only through flite's other voices): 72
utterances. The negative set: the 20 bundled utterances (nemo_serve/assets/demo), none of which
holds a term.

Every stream brings the same list, all 12 terms (a contact list / glossary, as a client would send
it), at each `--boosts` weight; 0 is no phrases. Reported per weight:
  term_error_rate   terms not found word for word in the transcript / terms spoken
  wer_positive      word error rate over the whole positive utterances
  false_alarm_rate  negative utterances whose transcript holds any term / negative utterances
  wer_negative      word error rate over the negatives (what boosting costs speech without terms)
Decoded by the engine (in-process, one batch, the server's own step); tokens of a boosted stream
are NeMo's own boosted decoding (tests/test_phrase_boost.py).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import run_record, write_json  # noqa: E402

TERMS = ["zanzibar", "quinoa", "marmalade", "telescope", "volcano", "penguin", "giraffe", "saxophone",
         "okonkwo", "nakamura", "rutherford", "kilimanjaro"]  # fmt: skip
CARRIERS = ["add {} to the shopping list", "please call {} at nine", "play {} in the kitchen now"]
VOICES = [("espeak", "en-us"), ("espeak", "en-gb-x-rp"), ("flite", "slt")]
SR = 16000


def synthesize(text: str, engine: str, voice: str) -> np.ndarray:
    import soxr

    from nemo_serve.training.synthesizers import espeak_wave, flite_wave

    if engine == "espeak":
        x, sr = espeak_wave(text, voice, 160, 50)
    else:
        with tempfile.TemporaryDirectory() as d:
            x, sr = flite_wave(text, voice, str(Path(d) / "x.wav"))
    x = soxr.resample(x, sr, SR) if sr != SR else x
    nz = np.nonzero(np.abs(x) > 1e-3)[0]
    x = x[nz[0] : nz[-1] + 1] if len(nz) else x
    pad = np.zeros(int(0.3 * SR), dtype=np.float32)
    return np.concatenate([pad, x.astype(np.float32), pad])


def positive_set(carriers_per_term: int) -> list[dict]:
    rows = []
    for i, term in enumerate(TERMS):
        for k in range(carriers_per_term):
            text = CARRIERS[(i + k) % len(CARRIERS)].format(term)
            for engine, voice in VOICES:
                rows.append({"text": text, "term": term, "voice": f"{engine}:{voice}", "audio": synthesize(text, engine, voice)})
    return rows


def negative_set() -> list[dict]:
    from nemo_serve.selftest import BUNDLED_MANIFEST, load_utterances

    return [{"text": u.text, "term": None, "voice": "bundled", "audio": u.audio} for u in load_utterances(BUNDLED_MANIFEST, SR)]


def transcribe(model, audios: list[np.ndarray], phrases: list[str] | None, boost: float) -> list[str]:
    """All utterances as streams of one engine, stepped together; each stream boosts `phrases`."""
    from nemo_serve.engine.endpoint import EndpointConfig
    from nemo_serve.core.inproc import LocalEngine
    from nemo_serve.engine.loop import Engine

    texts: list[list[str]] = [[] for _ in audios]
    eng = LocalEngine(Engine(model, num_slots=len(audios), endpoint=EndpointConfig.off()))
    for i, a in enumerate(audios):
        s = eng.open_stream(lambda r, i=i: texts[i].append(r.text) if r.is_final else None,
                            phrases=phrases, boost=boost if phrases else None)  # fmt: skip
        eng.push(s, a)
        eng.finish(s)
    while eng.iterate().busy:
        pass
    eng.iterate()
    return [" ".join(" ".join(t).split()) for t in texts]


def has_term(text: str, term: str) -> bool:
    return f" {term} " in f" {text} "


def score(pos: list[dict], neg: list[dict], pos_hyp: list[str], neg_hyp: list[str]) -> dict:
    from nemo_serve.scoring import word_errors

    missed = sum(not has_term(h, r["term"]) for r, h in zip(pos, pos_hyp))
    e_pos = [word_errors(r["text"], h) for r, h in zip(pos, pos_hyp)]
    e_neg = [word_errors(r["text"], h) for r, h in zip(neg, neg_hyp)]
    alarms = [h for h in neg_hyp if any(has_term(h, t) for t in TERMS)]
    by_voice = {}
    for v in sorted({r["voice"] for r in pos}):
        rows = [(r, h) for r, h in zip(pos, pos_hyp) if r["voice"] == v]
        by_voice[v] = round(sum(not has_term(h, r["term"]) for r, h in rows) / len(rows), 3)
    return {
        "term_error_rate": round(missed / len(pos), 3),
        "terms_spoken": len(pos),
        "terms_missed": missed,
        "term_error_rate_by_voice": by_voice,
        "wer_positive": round(sum(e for e, _ in e_pos) / sum(n for _, n in e_pos), 3),
        "false_alarm_rate": round(len(alarms) / len(neg), 3),
        "false_alarms": alarms,
        "wer_negative": round(sum(e for e, _ in e_neg) / sum(n for _, n in e_neg), 3),
        "negatives": len(neg),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="default: the shipped demo model")
    ap.add_argument("--context-right", default=None)
    ap.add_argument("--boosts", default="0,1,2,3", help="boost weights; 0 = no phrases")
    ap.add_argument("--carriers-per-term", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import torch

    from nemo_serve.model import load_model

    torch.set_num_threads(1)
    model = load_model(args.model, context_right=args.context_right)
    pos, neg = positive_set(args.carriers_per_term), negative_set()
    audios = [r["audio"] for r in pos + neg]
    results, examples = [], {}
    for boost in (float(b) for b in args.boosts.split(",")):
        hyps = transcribe(model, audios, TERMS if boost > 0 else None, boost)
        row = {"boost": boost if boost > 0 else None, **score(pos, neg, hyps[: len(pos)], hyps[len(pos) :])}
        results.append(row)
        examples[str(boost)] = hyps[: len(VOICES) * 2]
        print(f"boost {boost:g}: term error {row['term_error_rate']:.3f}, WER pos {row['wer_positive']:.3f}, "
              f"false alarms {row['false_alarm_rate']:.3f}, WER neg {row['wer_negative']:.3f}", file=sys.stderr)  # fmt: skip
    write_json(Path(args.out), {
        "benchmark": "phrase_boost_benefit",
        **run_record(),
        "model": args.model or "demo",
        "chunk_ms": model.geometry.chunk_ms,
        "terms": TERMS,
        "voices": [f"{e}:{v}" for e, v in VOICES],
        "carriers": CARRIERS,
        "phrases_per_stream": len(TERMS),
        "results": results,
        "examples_first_utterances": {"references": [r["text"] for r in pos[: len(VOICES) * 2]], **examples},
    })  # fmt: skip


if __name__ == "__main__":
    main()
