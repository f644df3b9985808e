"""Synthetic conversations for the demo diarizer: 2-4 of the project's TTS voices taking turns.

Two steps, both deterministic for a given ``--seed``:

1. A bank of utterances per speaker (``bank_train/``, ``bank_heldout/``). A speaker is one synthesizer
   voice at a fixed rate and pitch, and for flite/MBROLA/Pico voices a fixed vocal-tract warp (formants
   scaled by resampling, as corpus.py's pseudo-speakers), so one voice gives many speakers. Training
   speakers come from espeak-ng (its training variants), MBROLA (20 voices), flite (4) and Pico (2); the
   held-out speakers are voices no training speaker uses: espeak-ng's held-out variants (corpus.py's
   HELDOUT_VARIANTS, each on a random base voice) and flite's rms. Sentences of the two banks differ.
2. Conversations mixed from a bank (``make_conversation``): turns of random speakers, each turn one
   utterance, separated by pauses (0.1-1.2 s, sometimes 1.5-3 s) or overlapping the turn before by
   0.2-1.5 s; per-speaker gains, then white or pink noise at 25-50 dB SNR. Labels are each speaker's
   speech regions (10 ms energy activity of their utterances, gaps under 0.25 s filled), RTTM-style,
   speakers numbered in order of first speech (the arrival order Sortformer outputs them in).
   Training draws conversations on the fly (``diar_train``); ``heldout/`` holds fixed ones as WAV + RTTM
   for ``diar_eval``.

    python -m nemo_serve.training.diar_corpus --out work_data/diar_corpus --workers 2
"""

from __future__ import annotations

import argparse
import json
import os
import random
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from .corpus import SR
from .sentences import unique_sentences
from .synthesizers import (ESPEAK_VOICES, FLITE_TRAIN_VOICES, HELDOUT_VARIANTS, MBROLA_ACCENTED_VOICES, MBROLA_VOICES,
                           PICO_VOICES, TRAIN_VARIANTS, espeak_wave, flite_wave, pico_wave)

ACTIVITY_HOP = 160  # samples (10 ms) per activity frame
LABEL_FRAME_S = 0.08  # Sortformer's output frame: 8 x 10 ms


@dataclass(frozen=True)
class Speaker:
    name: str
    engine: str  # espeak | mbrola | flite | pico
    voice: str
    rate: float  # espeak/mbrola: words per minute; flite/pico: duration stretch
    pitch: int  # espeak/mbrola: 0-99; flite: target F0 Hz (0: the voice's own); pico: percent
    warp: float  # resampling factor (1.0: none); formants, pitch and tempo move together

    @property
    def timbre(self) -> str:
        """What makes two speakers sound alike: one per conversation (espeak-ng's variant, else the voice)."""
        return self.voice.split("+")[-1] if self.engine == "espeak" else self.voice


def training_speakers(n: int, seed: int) -> list[Speaker]:
    rng = random.Random(seed)
    engines = ["espeak"] * 5 + ["mbrola"] * 3 + ["flite"] + ["pico"]
    speakers = []
    for i in range(n):
        engine = rng.choice(engines)
        if engine == "espeak":
            voice = rng.choice(ESPEAK_VOICES) + "+" + (rng.choice(TRAIN_VARIANTS[1:]))
            rate, pitch, warp = rng.randint(130, 200), rng.randint(15, 85), 1.0
        elif engine == "mbrola":
            voice = rng.choice(MBROLA_VOICES + MBROLA_ACCENTED_VOICES)
            rate, pitch, warp = rng.randint(130, 190), rng.randint(20, 80), round(rng.uniform(0.85, 1.18), 3)
        elif engine == "flite":
            voice = rng.choice(FLITE_TRAIN_VOICES)
            rate, pitch, warp = round(rng.uniform(0.85, 1.2), 3), 0, round(rng.uniform(0.85, 1.18), 3)
        else:
            voice = rng.choice(PICO_VOICES)
            rate, pitch = round(rng.uniform(0.85, 1.2), 3), rng.randint(80, 125)
            warp = round(rng.uniform(0.85, 1.18), 3)
        speakers.append(Speaker(f"train{i:03d}", engine, voice, rate, pitch, warp))
    return speakers


def heldout_speakers(seed: int) -> list[Speaker]:
    """One speaker per held-out espeak-ng variant (a random base voice each) and flite's rms as it ships."""
    rng = random.Random(seed + 1)
    speakers = [Speaker(f"heldout_{v}", "espeak", rng.choice(ESPEAK_VOICES) + "+" + v, rng.randint(130, 200),
                        rng.randint(15, 85), 1.0) for v in HELDOUT_VARIANTS]
    return speakers + [Speaker("heldout_rms", "flite", "rms", 0.0, 0, 1.0)]


def synthesize(speaker: Speaker, text: str, tmp: str) -> np.ndarray:
    """float32 16 kHz waveform of one utterance, synthesizer silence trimmed, peak at 0.5."""
    import soxr

    if speaker.engine in ("espeak", "mbrola"):
        x, sr = espeak_wave(text, speaker.voice, int(speaker.rate), speaker.pitch)
    elif speaker.engine == "flite":
        x, sr = flite_wave(text, speaker.voice, tmp, speaker.rate, speaker.pitch)
    else:
        x, sr = pico_wave(text, speaker.voice, tmp, speaker.rate, speaker.pitch)
    if os.path.exists(tmp):
        os.remove(tmp)
    x = soxr.resample(x.astype(np.float32), sr * speaker.warp, SR) if (sr != SR or speaker.warp != 1.0) else x
    loud = np.nonzero(np.abs(x) > 1e-3)[0]
    x = x[max(0, loud[0] - 160): loud[-1] + 160] if len(loud) else x
    return (0.5 * x / (np.abs(x).max() + 1e-6)).astype(np.float32)


def speech_activity(x: np.ndarray, floor_db: float = 35.0, fill_s: float = 0.25) -> np.ndarray:
    """bool per 10 ms frame: energy within floor_db of the utterance's loudest frame, gaps < fill_s filled."""
    n = len(x) // ACTIVITY_HOP
    energy = (x[: n * ACTIVITY_HOP].reshape(n, ACTIVITY_HOP).astype(np.float64) ** 2).mean(axis=1)
    db = 10 * np.log10(energy + 1e-12)
    active = db > db.max() - floor_db
    idx = np.nonzero(active)[0]
    max_gap = int(fill_s * SR / ACTIVITY_HOP)
    for a, b in zip(idx[:-1], idx[1:]):
        if 1 < b - a <= max_gap:
            active[a:b] = True
    return active


def _bank_job(args):
    speaker, idx, text, out_wav = args
    import soundfile as sf

    if not os.path.exists(out_wav):
        sf.write(out_wav, synthesize(speaker, text, out_wav + ".tmp.wav"), SR, subtype="PCM_16")
    return idx, round(sf.info(out_wav).frames / SR, 3)


def build_bank(out: Path, split: str, speakers: list[Speaker], sentences: list[str], per_speaker: int,
               workers: int) -> list[dict]:
    """Synthesize per_speaker sentences per speaker into out/bank_<split>/ and out/bank_<split>.jsonl."""
    wav_dir = out / f"bank_{split}"
    wav_dir.mkdir(parents=True, exist_ok=True)
    rows, jobs = [], []
    for s, speaker in enumerate(speakers):
        for u in range(per_speaker):
            text = sentences[(s * per_speaker + u) % len(sentences)]
            rel = f"bank_{split}/{speaker.name}_{u:02d}.wav"
            jobs.append((speaker, len(rows), text, str(out / rel)))
            rows.append({"audio_filepath": rel, "text": text, "speaker": speaker.name, "timbre": speaker.timbre,
                         **{f"tts_{k}": v for k, v in asdict(speaker).items() if k != "name"}})
    with ProcessPoolExecutor(workers) as ex:
        for idx, duration in ex.map(_bank_job, jobs, chunksize=16):
            rows[idx]["duration"] = duration
    with open(out / f"bank_{split}.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    print(f"bank_{split}: {len(rows)} utterances of {len(speakers)} speakers, "
          f"{sum(r['duration'] for r in rows) / 3600:.2f} h", flush=True)
    return rows


@dataclass
class Utterance:
    audio: np.ndarray  # float32 [N]
    activity: np.ndarray  # bool [N // ACTIVITY_HOP]


class Bank:
    """A split's utterances in memory, by speaker, with their timbres (who may share a conversation)."""

    def __init__(self, manifest: Path):
        import soundfile as sf

        self.by_speaker: dict[str, list[Utterance]] = {}
        self.timbre: dict[str, str] = {}
        for line in open(manifest):
            row = json.loads(line)
            x, _ = sf.read(manifest.parent / row["audio_filepath"], dtype="float32")
            self.by_speaker.setdefault(row["speaker"], []).append(Utterance(x, speech_activity(x)))
            self.timbre[row["speaker"]] = row["timbre"]
        self.speakers = sorted(self.by_speaker)


@dataclass
class Conversation:
    audio: np.ndarray  # float32 [N], 16 kHz
    segments: list[tuple[int, float, float]]  # (speaker in arrival order, start_s, end_s)
    speakers: list[str]  # bank speaker names in arrival order

    @property
    def duration_s(self) -> float:
        return len(self.audio) / SR


def pick_speakers(bank: Bank, rng: random.Random, num_speakers: int) -> list[str]:
    """num_speakers bank speakers of distinct timbres."""
    chosen, timbres = [], set()
    for name in rng.sample(bank.speakers, len(bank.speakers)):
        if bank.timbre[name] not in timbres:
            chosen.append(name)
            timbres.add(bank.timbre[name])
        if len(chosen) == num_speakers:
            return chosen
    raise ValueError(f"the bank has fewer than {num_speakers} distinct timbres")


def make_conversation(bank: Bank, rng: random.Random, min_s: float, max_s: float, min_speakers: int = 2,
                      max_speakers: int = 4, overlap_prob: float = 0.2) -> Conversation:
    """Turns of 2-4 speakers until min_s..max_s of audio; everything drawn from rng (deterministic)."""
    names = pick_speakers(bank, rng, rng.randint(min_speakers, max_speakers))
    target_s = rng.uniform(min_s, max_s)
    turns, cursor, prev_end, last_end = [], rng.uniform(0.2, 1.0), 0.0, {n: 0.0 for n in names}
    order = names[:]  # every speaker talks once before anyone talks twice
    while cursor < target_s:
        name = order.pop(0) if order else rng.choice([n for n in names if n != turns[-1][0]])
        utt = rng.choice(bank.by_speaker[name])
        start = max(cursor, last_end[name] + 0.1)
        turns.append((name, start, utt))
        end = start + len(utt.audio) / SR
        last_end[name], prev_end = end, max(prev_end, end)
        roll = rng.random()
        if roll < overlap_prob:  # the next speaker starts before this one ends
            cursor = end - rng.uniform(0.2, min(1.5, 0.5 * len(utt.audio) / SR))
        else:
            cursor = prev_end + (rng.uniform(1.5, 3.0) if roll > 0.9 else rng.uniform(0.1, 1.2))
    return _mix(turns, names, rng, prev_end + rng.uniform(0.3, 1.0))


def _mix(turns, names, rng: random.Random, duration_s: float) -> Conversation:
    audio = np.zeros(int(duration_s * SR) + 1, np.float32)
    gains = {n: 10 ** (rng.uniform(-6, 0) / 20) for n in names}
    arrival = []  # speakers in order of first speech
    activity = {n: np.zeros(len(audio) // ACTIVITY_HOP + 1, bool) for n in names}
    for name, start_s, utt in turns:
        start = int(start_s * SR) // ACTIVITY_HOP * ACTIVITY_HOP  # on the activity grid
        audio[start: start + len(utt.audio)] += gains[name] * utt.audio
        activity[name][start // ACTIVITY_HOP: start // ACTIVITY_HOP + len(utt.activity)] |= utt.activity
        if name not in arrival:
            arrival.append(name)
    audio = _add_noise(audio, np.random.default_rng(rng.getrandbits(32)), rng.uniform(25, 50))
    audio *= 10 ** (rng.uniform(-20, -3) / 20) / (np.abs(audio).max() + 1e-6)
    segments = [(k, s, e) for k, n in enumerate(arrival) for s, e in _runs(activity[n])]
    return Conversation(audio, sorted(segments, key=lambda seg: seg[1]), arrival)


def _add_noise(x: np.ndarray, rng: np.random.Generator, snr_db: float) -> np.ndarray:
    power = float(np.mean(x[np.abs(x) > 1e-4] ** 2)) if np.any(np.abs(x) > 1e-4) else 1e-6
    noise = rng.standard_normal(len(x)).astype(np.float32)
    if rng.random() < 0.5:  # pink-ish: one-pole low-pass
        from scipy.signal import lfilter

        noise = lfilter([1.0], [1.0, -0.95], noise).astype(np.float32)
    noise *= np.sqrt(power / (np.mean(noise ** 2) + 1e-12) / 10 ** (snr_db / 10))
    return x + noise


def _runs(active: np.ndarray) -> list[tuple[float, float]]:
    """(start_s, end_s) of each run of True in a 10 ms activity track."""
    edges = np.diff(np.concatenate([[0], active.astype(np.int8), [0]]))
    starts, ends = np.nonzero(edges == 1)[0], np.nonzero(edges == -1)[0]
    hop_s = ACTIVITY_HOP / SR
    return [(round(s * hop_s, 2), round(e * hop_s, 2)) for s, e in zip(starts, ends)]


def frame_targets(segments, num_frames: int, num_speakers: int = 4) -> np.ndarray:
    """[num_frames, num_speakers] float32: 1 where a speaker speaks for at least half of an 80 ms frame."""
    fine = np.zeros((num_frames * 8, num_speakers), np.float32)
    for k, start_s, end_s in segments:
        fine[int(round(start_s * 100)): int(round(end_s * 100)), k] = 1.0
    return (fine.reshape(num_frames, 8, num_speakers).mean(axis=1) >= 0.5).astype(np.float32)


def write_rttm(path: Path, file_id: str, segments) -> None:
    with open(path, "w") as f:
        for k, start_s, end_s in segments:
            f.write(f"SPEAKER {file_id} 1 {start_s:.2f} {end_s - start_s:.2f} <NA> <NA> speaker_{k} <NA> <NA>\n")


def read_rttm(path: Path) -> list[tuple[int, float, float]]:
    segments = []
    for line in open(path):
        parts = line.split()
        start, dur = float(parts[3]), float(parts[4])
        segments.append((int(parts[7].split("_")[-1]), start, round(start + dur, 2)))
    return segments


def write_conversations(out: Path, split: str, bank: Bank, n: int, seed: int, min_s: float, max_s: float) -> None:
    """n conversations as out/<split>/NNN.wav + .rttm and out/<split>.jsonl."""
    import soundfile as sf

    rng = random.Random(seed)
    (out / split).mkdir(parents=True, exist_ok=True)
    with open(out / f"{split}.jsonl", "w") as f:
        for i in range(n):
            conv = make_conversation(bank, rng, min_s, max_s)
            sf.write(out / split / f"{i:03d}.wav", conv.audio, SR, subtype="PCM_16")
            write_rttm(out / split / f"{i:03d}.rttm", f"{split}_{i:03d}", conv.segments)
            f.write(json.dumps({"audio_filepath": f"{split}/{i:03d}.wav", "rttm_filepath": f"{split}/{i:03d}.rttm",
                                "duration": round(conv.duration_s, 2), "num_speakers": len(conv.speakers),
                                "speakers": conv.speakers}) + "\n")
    print(f"{split}: {n} conversations", flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seed", type=int, default=50)
    p.add_argument("--train-speakers", type=int, default=300)
    p.add_argument("--per-speaker", type=int, default=10, help="utterances per training speaker")
    p.add_argument("--heldout-per-speaker", type=int, default=12)
    p.add_argument("--heldout-conversations", type=int, default=40)
    p.add_argument("--dev-conversations", type=int, default=20, help="training speakers, for checkpoint choice")
    p.add_argument("--min-s", type=float, default=40.0)
    p.add_argument("--max-s", type=float, default=70.0)
    p.add_argument("--workers", type=int, default=2)
    a = p.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(a.seed)
    train_spk, heldout_spk = training_speakers(a.train_speakers, a.seed), heldout_speakers(a.seed)
    train_sentences = unique_sentences(rng, a.train_speakers * a.per_speaker, set())
    heldout_sentences = unique_sentences(rng, len(heldout_spk) * a.heldout_per_speaker, set(train_sentences))
    build_bank(a.out, "train", train_spk, train_sentences, a.per_speaker, a.workers)
    build_bank(a.out, "heldout", heldout_spk, heldout_sentences, a.heldout_per_speaker, a.workers)
    write_conversations(a.out, "heldout", Bank(a.out / "bank_heldout.jsonl"), a.heldout_conversations,
                        a.seed + 2, a.min_s, a.max_s)
    write_conversations(a.out, "dev", Bank(a.out / "bank_train.jsonl"), a.dev_conversations,
                        a.seed + 3, a.min_s, a.max_s)


if __name__ == "__main__":
    main()
