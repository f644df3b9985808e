"""A small corpus for the EOU fine-tune (train --eou): the demo corpus's held-out splits and a short
espeak-ng training split, drawn exactly as `corpus.main` draws them (same seed, same sentences for the
same --n-eval), without the flite set and the extra synthesizers: the fine-tune had ~40 minutes of
two shared CPU cores, most of which synthesis would otherwise take.

    python -m nemo_serve.training.eou_corpus --out work_data/eou_corpus --n-train 1000 --n-eval 100

Multi-turn examples (`--n-train-turns N`, issue 49): a model fine-tuned on one utterance per example
emitted nothing after its first `<EOU>`, while a voice agent's stream holds many turns. The split
`train_turns` holds N further training sentences as examples of one turn or (`--turns-share`, half by
default) 2-3 turns of one voice (the same espeak-ng voice, rate and pitch), each turn followed by
0.3-1.5 s of silence before the next and the usual 0.1-0.5 s after the last (corpus.augment), the
transcript `first turn<EOU> second turn<EOU>`: train --eou puts one `<EOU>` after each turn's words
(`eou.eou_token_ids`). Drawn after every other split, so those stay as they were.
"""

from __future__ import annotations

import argparse
import random
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from .corpus import SR, augment, build_split, write_manifest
from .eou import EOU_PIECE
from .sentences import held_out_sets, training_sentences
from .synthesizers import ESPEAK_VOICES, HELDOUT_VARIANTS, TRAIN_VARIANTS, espeak_wave

TURN_GAP_S = (0.3, 1.5)  # silence between two turns of one example (a pause a turn-taker must not cut at)


def group_turns(n: int, rng: random.Random, share: float, max_turns: int = 3) -> list[list[int]]:
    """Sentence indices 0..n-1 in order, cut into examples: with probability `share` an example holds
    2..max_turns sentences, else one."""
    groups, i = [], 0
    while i < n:
        k = rng.randint(2, max_turns) if rng.random() < share else 1
        groups.append(list(range(i, min(n, i + k))))
        i += k
    return groups


def turns_text(texts: list[str]) -> str:
    """The transcript of one example: each turn's words followed by its `<EOU>`."""
    return " ".join(t + EOU_PIECE for t in texts)


def join_turns(waves: list[np.ndarray], gaps: list[int]) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """The turns' audio in order with gaps[i] samples of silence after turn i (one fewer gap than turns),
    and each turn's (start, end) sample span in the result."""
    parts, spans, pos = [], [], 0
    for i, w in enumerate(waves):
        parts.append(w)
        spans.append((pos, pos + len(w)))
        pos += len(w)
        if i < len(waves) - 1:
            parts.append(np.zeros(gaps[i], w.dtype))
            pos += gaps[i]
    return np.concatenate(parts), spans


def _speech(text: str, voice: str, rate: int, pitch: int) -> np.ndarray:
    """espeak-ng's audio of `text` at 16 kHz, its own leading/trailing silence trimmed (as corpus._job)."""
    import soxr

    x, sr = espeak_wave(text, voice, rate, pitch)
    if sr != SR:
        x = soxr.resample(x, sr, SR)
    nz = np.nonzero(np.abs(x) > 1e-3)[0]
    return x[max(0, nz[0] - 160): nz[-1] + 160] if len(nz) else x


def _turns_job(args) -> tuple[int, float]:
    idx, texts, voice, rate, pitch, gaps, seed, out_wav = args
    import soundfile as sf

    audio, _ = join_turns([_speech(t, voice, rate, pitch).astype(np.float32) for t in texts], gaps)
    audio = augment(audio, np.random.default_rng(seed))  # lead/trail silence and noise over the whole example
    sf.write(out_wav, audio, SR, subtype="PCM_16")
    return idx, len(audio) / SR


def build_turns_split(name: str, sentences: list[str], out: Path, seed: int, workers: int,
                      share: float) -> list[dict]:
    """Synthesize `out/name/` and `out/name.jsonl`: the sentences as one- and multi-turn examples."""
    rng = random.Random(seed)
    (out / name).mkdir(parents=True, exist_ok=True)
    jobs, rows = [], []
    for i, group in enumerate(group_turns(len(sentences), rng, share)):
        var = rng.choice(TRAIN_VARIANTS)
        voice = rng.choice(ESPEAK_VOICES) + ("+" + var if var else "")
        rate, pitch = rng.randint(120, 230), rng.randint(20, 80)
        gaps = [int(rng.uniform(*TURN_GAP_S) * SR) for _ in group[1:]]
        texts = [sentences[j] for j in group]
        rel = f"{name}/{i:06d}.wav"
        jobs.append((i, texts, voice, rate, pitch, gaps, seed * 1000003 + i, str(out / rel)))
        rows.append({"audio_filepath": rel, "text": turns_text(texts), "turns": len(texts), "voice": voice,
                     "rate": rate, "pitch": pitch, "gaps_s": [round(g / SR, 3) for g in gaps]})
    with ProcessPoolExecutor(workers) as ex:
        for idx, dur in ex.map(_turns_job, jobs, chunksize=16):
            rows[idx]["duration"] = round(dur, 3)
    write_manifest(out / f"{name}.jsonl", rows)
    multi = sum(r["turns"] > 1 for r in rows)
    print(f"{name}: {len(rows)} examples ({multi} multi-turn), {sum(r['duration'] for r in rows) / 3600:.2f} h",
          flush=True)
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--n-train", type=int, default=1000)
    p.add_argument("--n-train-turns", type=int, default=0,
                   help="sentences for the train_turns split (one- and multi-turn examples); 0: none")
    p.add_argument("--turns-share", type=float, default=0.5, help="share of train_turns examples with 2-3 turns")
    p.add_argument("--n-eval", type=int, default=100)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--workers", type=int, default=2)
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(a.seed)
    dev, hs, hv, fl = held_out_sets(rng, a.n_eval)  # as corpus.main: the flite set is drawn, not made
    held = set(dev) | set(hs) | set(hv) | set(fl)
    train = training_sentences(rng, a.n_train, held)
    build_split("dev", dev, "espeak", ESPEAK_VOICES, TRAIN_VARIANTS, out, a.seed + 1, a.workers, keep=True)
    build_split("heldout_sentences", hs, "espeak", ESPEAK_VOICES, TRAIN_VARIANTS, out, a.seed + 2, a.workers, keep=True)
    build_split("heldout_voices", hv, "espeak", ESPEAK_VOICES, HELDOUT_VARIANTS, out, a.seed + 3, a.workers, keep=True)
    build_split("train", train, "espeak", ESPEAK_VOICES, TRAIN_VARIANTS, out, a.seed + 5, a.workers, keep=True)
    if a.n_train_turns:  # drawn last: every split above is the same with or without it
        turns = training_sentences(rng, a.n_train_turns, held | set(train))
        build_turns_split("train_turns", turns, out, a.seed + 8, a.workers, a.turns_share)


if __name__ == "__main__":
    main()
