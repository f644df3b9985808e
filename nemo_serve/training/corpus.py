"""Synthetic English speech corpus for the embedded demo model.

Speech is generated with espeak-ng (8 English voices x ~60 voice variants, varied rate and
pitch); with ``--n-train-flite`` also with four of flite's five voices (varied, optionally
formant-warped into new speakers, ``--flite-warp``), with ``--n-train-festival`` with three festival
voices, with ``--n-train-mbrola`` with four MBROLA voices, with ``--n-train-pico`` with SVOX Pico's two
English voices, with ``--n-train-rhvoice`` with four RHVoice voices and with ``--n-train-festival-rab-don`` and
``--n-train-rhvoice-alan-slt`` with the last English voices of those packages and with
``--n-train-mbrola-accented`` with sixteen MBROLA voices of other languages speaking English (accented), all for
training only, while the fifth flite voice (rms) stays held out.
Every waveform is resampled to 16 kHz mono and lightly augmented (gain, white/pink noise at
15-45 dB SNR, leading/trailing silence).  Sentences are drawn from templates over a fixed
vocabulary: digits, numbers up to a thousand, ordinals, days, months, a few hundred common
English words and voice-assistant commands.

Splits (NeMo-style JSONL manifests, ``audio_filepath`` relative to the manifest directory):

* ``train``             training sentences: espeak-ng training voices/variants (+ ``train_flite``,
                        ``train_festival``, ``train_mbrola``, ``train_pico``, ``train_rhvoice``,
                        ``train_festival_rab_don``, ``train_rhvoice_alan_slt``, ``train_mbrola_accented``
                        when asked for)
* ``dev``               unseen sentences, training voices (espeak-ng) - used for checkpoint choice
                        (``dev_mix``: every third row a training flite voice, with flite in training)
* ``heldout_sentences`` unseen sentences, training voices (espeak-ng)
* ``heldout_voices``    unseen sentences, voice variants never used in training (espeak-ng)
* ``flite``             unseen sentences, flite voices never used in training (rms with flite in
                        training, all five without)

Usage (the shipped model's corpus)::

    python -m nemo_serve.training.corpus --out work_data/corpus --n-train 24000 --n-train-flite 12000 \
        --flite-warp 0.2 --n-train-festival 4000 --n-train-mbrola 6000 --n-train-pico 4000 --n-train-rhvoice 6000 \
        --n-train-festival-rab-don 3000 --n-train-rhvoice-alan-slt 2000 --n-train-mbrola-accented 8000

Deterministic for a given ``--seed``.  About 4 minutes for 24k espeak-ng utterances on 2 cores, 10 with
the flite ones; the festival ones are slower (about 70 a minute on one shared core); the 10,000 MBROLA and
Pico ones took under 3 minutes, the 6,000 RHVoice ones 7.5, the 5,000 rab/don and alan/slt ones 13, the 8,000
accented MBROLA ones 2.
Everything but RHVoice's: 20 minutes on 2 idle cores.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from .sentences import held_out_sets, training_sentences, unique_sentences
from .synthesizers import (ESPEAK_VOICES, FESTIVAL_F0, FLITE_F0, FLITE_HELDOUT_VOICES, FLITE_TRAIN_VOICES, FLITE_VOICES,
                           HELDOUT_VARIANTS, MORE_SYNTHESIZERS, TRAIN_VARIANTS, espeak_wave, festival_wave, flite_wave,
                           pico_wave, rhvoice_wave)

SR = 16000


def augment(x: np.ndarray, rng: np.random.Generator, clean: bool = False) -> np.ndarray:
    x = x.astype(np.float32)
    peak = float(np.abs(x).max()) + 1e-6
    x = x / peak * (10 ** (rng.uniform(-18, -1) / 20))  # peak between -18 and -1 dBFS
    lead = int(SR * rng.uniform(0.05, 0.5))
    tail = int(SR * rng.uniform(0.1, 0.5))
    x = np.concatenate([np.zeros(lead, np.float32), x, np.zeros(tail, np.float32)])
    if not clean and rng.random() < 0.8:
        snr = rng.uniform(15, 45)
        sig_pow = float(np.mean(x[lead:len(x) - tail] ** 2)) + 1e-10
        n = rng.standard_normal(len(x)).astype(np.float32)
        if rng.random() < 0.5:  # pink-ish: one-pole low-pass
            from scipy.signal import lfilter
            n = lfilter([1.0], [1.0, -0.95], n).astype(np.float32)
        n *= np.sqrt(sig_pow / (np.mean(n ** 2) + 1e-10) / (10 ** (snr / 10)))
        x = x + n
    else:
        x = x + rng.standard_normal(len(x)).astype(np.float32) * 1e-5  # avoid exact digital silence
    return np.clip(x, -1.0, 1.0)


def _job(args):
    idx, text, engine, voice, rate, pitch, speed, seed, out_wav, clean, keep = args
    import soundfile as sf
    import soxr
    if keep and os.path.exists(out_wav):  # made by an earlier run with the same seed and arguments
        return idx, round(sf.info(out_wav).frames / SR, 3)
    if engine in ("espeak", "mbrola"):  # MBROLA's voices are espeak-ng voices (mb-*) with MBROLA's diphones
        x, sr = espeak_wave(text, voice, rate, pitch)
    else:
        synth = {"flite": flite_wave, "festival": festival_wave, "pico": pico_wave, "rhvoice": rhvoice_wave}[engine]
        x, sr = synth(text, voice, out_wav + ".tmp.wav", rate, pitch)
        os.remove(out_wav + ".tmp.wav")
    if sr != SR:
        x = soxr.resample(x, sr, SR)
    if speed != 1.0:  # speed perturbation: tempo, pitch and formants move together (resampling)
        x = soxr.resample(x, SR * speed, SR)
    rng = np.random.default_rng(seed)
    # trim synthesizer's own leading/trailing silence before adding ours
    nz = np.nonzero(np.abs(x) > 1e-3)[0]
    if len(nz):
        x = x[max(0, nz[0] - 160): nz[-1] + 160]
    x = augment(x, rng, clean=clean)
    sf.write(out_wav, x, SR, subtype="PCM_16")
    return idx, len(x) / SR


def build_split(name: str, sentences: list[str], engine: str, voices: list[str], variants: list[str],
                out: Path, seed: int, workers: int, clean: bool = False, vary: bool = False,
                write: bool = True, warp: float = 0.0, keep: bool = False) -> list[dict]:
    """Synthesize one split into ``out/name/`` and (``write``) ``out/name.jsonl``; returns the manifest rows.

    espeak-ng: a random voice + variant, rate 120-230 wpm, pitch 20-80.  flite: a random voice, as it ships;
    with ``vary`` (training flite data) also ``duration_stretch`` 0.75-1.35, ``int_f0_target_mean`` in the
    voice's range (FLITE_F0) and, for half of the utterances, speed perturbation 0.9-1.1; with ``warp`` > 0,
    80% of them get their formants scaled by 1/(1+warp)..1+warp instead (pseudo-speakers).  festival (training
    only, always varied): the same, with the diphone voices' pitch in FESTIVAL_F0.  pico and rhvoice (training
    only, always varied): the same, with the pitch at 80-125% of the voice's own.  mbrola (training only): a
    random voice, rate 120-210 wpm, pitch 20-80 and, with ``warp``, 80% warped as above (the rate slowed by the
    factor, the pitch left to its random draw).  ``keep``: wav files that
    exist are kept (an earlier run with the same arguments made them), only the missing ones are synthesized."""
    rng = random.Random(seed)
    wav_dir = out / name
    wav_dir.mkdir(parents=True, exist_ok=True)
    jobs, meta = [], []
    for i, text in enumerate(sentences):
        speed = 1.0
        if engine == "espeak":
            v = rng.choice(voices)
            var = rng.choice(variants)
            voice = v + ("+" + var if var else "")
            rate, pitch = rng.randint(120, 230), rng.randint(20, 80)
        elif engine == "mbrola":  # espeak-ng's rate (wpm) and pitch (0-99); the warp slows the rate instead
            voice, rate, pitch = rng.choice(voices), rng.randint(120, 210), rng.randint(20, 80)
            if warp and rng.random() < 0.8:
                speed = round(math.exp(rng.uniform(-math.log1p(warp), math.log1p(warp))), 3)
                rate = round(rate / speed)
        elif vary:
            voice = rng.choice(voices)
            rate = round(rng.uniform(0.75, 1.35), 3)
            if engine in ("pico", "rhvoice"):  # percent of the voice's own pitch
                pitch = rng.randint(80, 125)
            else:
                f0_range = (FLITE_F0 if engine == "flite" else FESTIVAL_F0).get(voice)
                pitch = rng.randint(*f0_range) if f0_range else 0
            if warp and rng.random() < 0.8:
                # a new vocal tract: resampling by `speed` scales the formants; the synthesizer is asked for
                # `speed` times the duration and 1/speed of the pitch, so only the formants move (and the
                # pitch too for voices that ignore int_f0_target_mean)
                speed = round(math.exp(rng.uniform(-math.log1p(warp), math.log1p(warp))), 3)
                rate, pitch = round(rate * speed, 3), round(pitch / speed)
            elif rng.random() < 0.5:
                speed = round(rng.uniform(0.9, 1.1), 3)
        else:
            voice, rate, pitch = rng.choice(voices), 0, 0
        rel = f"{name}/{i:06d}.wav"
        jobs.append((i, text, engine, voice, rate, pitch, speed, seed * 1000003 + i, str(out / rel), clean, keep))
        row = {"audio_filepath": rel, "text": text, "voice": voice, "rate": rate, "pitch": pitch}
        if engine == "mbrola" or (engine != "espeak" and vary):
            row["speed"] = speed
        meta.append(row)
    with ProcessPoolExecutor(workers) as ex:
        for idx, dur in ex.map(_job, jobs, chunksize=32):
            meta[idx]["duration"] = round(dur, 3)
    if write:
        write_manifest(out / f"{name}.jsonl", meta)
    hours = sum(m["duration"] for m in meta) / 3600
    print(f"{name}: {len(meta)} utterances, {hours:.2f} h", flush=True)
    return meta


def write_manifest(path: Path, rows: list[dict]) -> None:
    with open(path, "w") as f:
        for m in rows:
            f.write(json.dumps(m) + "\n")


def interleave(a: list, b: list, every: int) -> list:
    """b's rows spread through a's: after every ``every`` rows of a, one of b (the rest of either at the end)."""
    out, j = [], 0
    for i, r in enumerate(a):
        out.append(r)
        if (i + 1) % every == 0 and j < len(b):
            out.append(b[j])
            j += 1
    return out + b[j:]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--n-train", type=int, default=20000, help="espeak-ng training utterances")
    p.add_argument("--n-train-flite", type=int, default=0,
                   help="flite training utterances (FLITE_TRAIN_VOICES, varied); 0: an espeak-ng-only corpus")
    p.add_argument("--flite-warp", type=float, default=0.0,
                   help="scale the formants of the training flite, festival, MBROLA, Pico and RHVoice voices by up "
                        "to 1+W either way (80%% of them, duration and pitch kept): new speakers from few voices; 0: "
                        "speed perturbation only")
    for name, (engine, voices, _) in MORE_SYNTHESIZERS.items():  # --n-train-festival ... (read back by name)
        vary = "warped by --flite-warp" if engine == "mbrola" else "varied and warped as the flite ones"
        p.add_argument(f"--n-train-{name.replace('_', '-')}", type=int, default=0,
                       help=f"{engine} training utterances of {', '.join(voices)} ({vary}; needs --n-train-flite)")
    p.add_argument("--keep-existing", action="store_true",
                   help="keep wav files an earlier run with the same arguments made; synthesize only the missing")
    p.add_argument("--n-eval", type=int, default=300, help="utterances per held-out set")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(a.seed)
    # Evaluation sentences first; training sentences exclude all of them.  The flite additions are drawn
    # after the espeak-ng training sentences, so every espeak-ng split is the same as in an espeak-only corpus.
    dev, hs, hv, fl = held_out_sets(rng, a.n_eval)
    held = set(dev) | set(hs) | set(hv) | set(fl)
    train = training_sentences(rng, a.n_train, held)
    flite_train, dev_flite = [], []
    if a.n_train_flite:
        # unseen sentences in the training flite voices, mixed into the dev set (one in three rows)
        dev_flite = unique_sentences(rng, a.n_eval // 2, held | set(train))
        held |= set(dev_flite)
        flite_train = training_sentences(rng, a.n_train_flite, held)
    # Then the training-only synthesizers, in MORE_SYNTHESIZERS' order and last: each added split leaves every
    # split drawn before it as it was.
    more_train = {}
    for name in MORE_SYNTHESIZERS:
        n = getattr(a, f"n_train_{name}")
        if a.n_train_flite and n:
            more_train[name] = training_sentences(rng, n, held)
    with open(out / "train_text.txt", "w") as f:
        f.write("\n".join(train + flite_train + sum(more_train.values(), [])) + "\n")
    keep = a.keep_existing
    build_split("dev", dev, "espeak", ESPEAK_VOICES, TRAIN_VARIANTS, out, a.seed + 1, a.workers, keep=keep)
    build_split("heldout_sentences", hs, "espeak", ESPEAK_VOICES, TRAIN_VARIANTS, out, a.seed + 2, a.workers,
                keep=keep)
    build_split("heldout_voices", hv, "espeak", ESPEAK_VOICES, HELDOUT_VARIANTS, out, a.seed + 3, a.workers,
                keep=keep)
    held_flite = FLITE_HELDOUT_VOICES if a.n_train_flite else FLITE_VOICES
    build_split("flite", fl, "flite", held_flite, [], out, a.seed + 4, a.workers, keep=keep)
    rows = build_split("train", train, "espeak", ESPEAK_VOICES, TRAIN_VARIANTS, out, a.seed + 5, a.workers,
                       keep=keep, write=not a.n_train_flite)
    if a.n_train_flite:
        frows = build_split("train_flite", flite_train, "flite", FLITE_TRAIN_VOICES, [], out, a.seed + 6,
                            a.workers, keep=keep, vary=True, warp=a.flite_warp)
        more_rows = {}
        for name, sentences in more_train.items():
            engine, voices, seed = MORE_SYNTHESIZERS[name]
            more_rows[name] = build_split(f"train_{name}", sentences, engine, voices, [], out, a.seed + seed,
                                          a.workers, vary=True, warp=a.flite_warp, keep=keep)
        write_manifest(out / "train.jsonl", rows + frows + sum(more_rows.values(), []))
        drows = build_split("dev_flite", dev_flite, "flite", FLITE_TRAIN_VOICES, [], out, a.seed + 7,
                            a.workers, keep=keep, vary=True, warp=a.flite_warp)
        dev_rows = [json.loads(line) for line in open(out / "dev.jsonl")]
        write_manifest(out / "dev_mix.jsonl", interleave(dev_rows, drows, 2))
        added = "".join(f" + {len(r)} {name}" for name, r in more_rows.items())
        print(f"train.jsonl: {len(rows)} espeak-ng + {len(frows)} flite{added}; "
              f"dev_mix.jsonl: espeak-ng dev with every third row flite", flush=True)


if __name__ == "__main__":
    main()
