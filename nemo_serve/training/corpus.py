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
import subprocess
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from ..audio_io import read_audio

SR = 16000

# --------------------------------------------------------------------------------------------
# Vocabulary and sentence generator
# --------------------------------------------------------------------------------------------

ONES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
TEENS = ["ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen",
         "eighteen", "nineteen"]
TENS = ["", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]
ORDINALS = ["first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth",
            "tenth", "eleventh", "twelfth", "thirteenth", "fourteenth", "fifteenth", "sixteenth",
            "seventeenth", "eighteenth", "nineteenth", "twentieth", "twenty first", "twenty second",
            "twenty third", "twenty fourth", "twenty fifth", "twenty sixth", "twenty seventh",
            "twenty eighth", "twenty ninth", "thirtieth", "thirty first"]
DAYS = ["monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday"]
MONTHS = ["january", "february", "march", "april", "may", "june", "july", "august", "september",
          "october", "november", "december"]

COMMON = """the of and to a in is it you that he was for on are with as i his they be at one have
this from or had by word but what some we can out other were all there when up use your how said
an each she which do their time if will way about many then them write would like so these her
long make thing see him two has look more day could go come did number sound no most people my
over know water than call first who may down side been now find any new work part take get place
made live where after back little only round man year came show every good me give our under name
very through just form sentence great think say help low line differ turn cause much mean before
move right boy old too same tell does set three want air well also play small end put home read
hand port large spell add even land here must big high such follow act why ask men change went
light kind off need house picture try us again animal point mother world near build self earth
father head stand own page should country found answer school grow study still learn plant cover
food sun four between state keep eye never last let thought city tree cross farm hard start might
story saw far sea draw left late run while press close night real life few north open seem together
next white children begin got walk example ease paper group always music those both mark often
letter until mile river car feet care second book carry took science eat room friend began idea
fish mountain stop once base hear horse cut sure watch color face wood main enough plain girl
usual young ready above ever red list though feel talk bird soon body dog family direct pose leave
song measure door product black short numeral class wind question happen complete ship area half
rock order fire south problem piece told knew pass since top whole king space heard best hour
better true during hundred five remember step early hold west ground interest reach fast verb sing
listen six table travel less morning ten simple several vowel toward war lay against pattern slow
center love person money serve appear road map rain rule govern pull cold notice voice unit power
town fine certain fly fall lead cry dark machine note wait plan figure star box noun field rest
correct able pound done beauty drive stood contain front teach week final gave green oh quick
develop ocean warm free minute strong special mind behind clear tail produce fact street inch
multiply nothing course stay wheel full force blue object decide surface deep moon island foot
system busy test record boat common gold possible plane stead dry wonder laugh thousand ago ran
check game shape equate hot miss brought heat snow tire bring yes distant fill east paint language
among""".split()

COMMAND_WORDS = """please turn on off set timer alarm remind me what is weather today tomorrow tonight
play pause stop resume next previous song music volume up down louder quieter lights kitchen
bedroom living room bathroom garage temperature degrees call send message text open close lock
unlock door window thermostat heat cool fan minutes seconds hours wake at am pm noon midnight
morning evening afternoon add shopping list calendar meeting schedule cancel show news read
navigate home work directions traffic how long will it take hey assistant thanks thank you yes
no okay cancel repeat skip shuffle radio station podcast battery brightness screen camera photo
start stop timer weekend week month year percent half quarter past to""".split()

ROOMS = ["kitchen", "bedroom", "living room", "bathroom", "garage", "office", "hallway", "garden"]
DEVICES = ["lights", "fan", "heater", "radio", "television", "music", "camera", "alarm", "lamp"]
TASKS = ["call mother", "buy milk", "water the plants", "check the mail", "feed the dog",
         "read the news", "pay the bill", "clean the house", "walk the dog", "go to school",
         "take the medicine", "send the letter", "start the car", "close the window", "open the door",
         "write the story", "study for the test", "call my friend", "book a table", "plan the trip"]
UNITS = ["minutes", "seconds", "hours", "days", "weeks", "degrees", "percent", "miles", "pounds",
         "dollars", "people", "books", "songs", "steps"]


def number_words(n: int) -> str:
    """0..1000 in words, American style without 'and' (e.g. 'three hundred twenty one')."""
    if n < 10:
        return ONES[n]
    if n < 20:
        return TEENS[n - 10]
    if n < 100:
        t, o = divmod(n, 10)
        return TENS[t] + ("" if o == 0 else " " + ONES[o])
    if n < 1000:
        h, r = divmod(n, 100)
        return ONES[h] + " hundred" + ("" if r == 0 else " " + number_words(r))
    if n == 1000:
        return "one thousand"
    raise ValueError(n)


def rand_number(rng: random.Random) -> str:
    r = rng.random()
    if r < 0.35:
        return number_words(rng.randint(0, 20))
    if r < 0.7:
        return number_words(rng.randint(21, 99))
    return number_words(rng.randint(100, 1000))


def rand_time(rng: random.Random) -> str:
    h = number_words(rng.randint(1, 12))
    m = rng.choice(["", " fifteen", " thirty", " forty five", " " + number_words(rng.randint(10, 59))])
    ap = rng.choice(["", " am", " pm", " in the morning", " in the evening"])
    return h + m + ap


def rand_date(rng: random.Random) -> str:
    d, m = rng.choice(ORDINALS), rng.choice(MONTHS)
    return rng.choice([f"{m} {d}", f"the {d} of {m}", f"{rng.choice(DAYS)} {m} {d}"])


def rand_words(rng: random.Random, pool: list[str], lo: int, hi: int) -> str:
    return " ".join(rng.choice(pool) for _ in range(rng.randint(lo, hi)))


TEMPLATES = [
    lambda r: f"set a timer for {rand_number(r)} {r.choice(['minutes', 'seconds', 'hours'])}",
    lambda r: f"set an alarm for {rand_time(r)}",
    lambda r: f"wake me up at {rand_time(r)} on {r.choice(DAYS)}",
    lambda r: f"turn {r.choice(['on', 'off'])} the {r.choice(ROOMS)} {r.choice(DEVICES)}",
    lambda r: f"please turn {r.choice(['up', 'down'])} the volume",
    lambda r: f"set the volume to {rand_number(r)} percent",
    lambda r: f"set the temperature to {rand_number(r)} degrees",
    lambda r: f"what is the weather {r.choice(['today', 'tomorrow', 'tonight', 'on ' + r.choice(DAYS)])}",
    lambda r: f"remind me to {r.choice(TASKS)} on {r.choice(DAYS)}",
    lambda r: f"remind me to {r.choice(TASKS)} at {rand_time(r)}",
    lambda r: f"add {rand_number(r)} {r.choice(['apples', 'eggs', 'books', 'boxes'])} to the shopping list",
    lambda r: f"schedule a meeting on {rand_date(r)}",
    lambda r: f"my birthday is on {rand_date(r)}",
    lambda r: f"today is {r.choice(DAYS)} {rand_date(r)}",
    lambda r: f"the next meeting is on {r.choice(DAYS)} at {rand_time(r)}",
    lambda r: f"{r.choice(['play', 'pause', 'stop', 'skip', 'shuffle', 'repeat'])} the {r.choice(['music', 'song', 'radio', 'podcast'])}",
    lambda r: f"{r.choice(['open', 'close', 'lock', 'unlock'])} the {r.choice(['door', 'window', 'garage', 'front door'])}",
    lambda r: f"call {r.choice(['mother', 'father', 'my friend', 'the school', 'home', 'work'])}",
    lambda r: f"how long will it take to drive {r.choice(['home', 'to work', 'to school', 'to the city'])}",
    lambda r: f"the number is {' '.join(r.choice(ONES) for _ in range(r.randint(3, 8)))}",
    lambda r: " ".join(r.choice(ONES) for _ in range(r.randint(2, 9))),
    lambda r: f"{rand_number(r)} {r.choice(UNITS)}",
    lambda r: f"{rand_number(r)} {r.choice(['plus', 'minus', 'times'])} {rand_number(r)}",
    lambda r: f"in {r.choice(MONTHS)} there are {rand_number(r)} {r.choice(UNITS)}",
    lambda r: f"{r.choice(DAYS)} {r.choice(['morning', 'afternoon', 'evening', 'night'])}",
    lambda r: f"{r.choice(MONTHS)} {r.choice(ORDINALS)}",
    lambda r: rand_words(r, COMMON, 3, 9),
    lambda r: rand_words(r, COMMON, 3, 9),
    lambda r: rand_words(r, COMMON, 3, 9),
    lambda r: rand_words(r, COMMON + COMMAND_WORDS, 3, 8),
    lambda r: f"{rand_words(r, COMMAND_WORDS, 1, 3)} {rand_words(r, COMMON, 2, 5)}",
    lambda r: f"hey assistant {rand_words(r, COMMAND_WORDS, 2, 5)}",
]


def make_sentence(rng: random.Random) -> str:
    s = rng.choice(TEMPLATES)(rng)
    return " ".join(s.lower().split())


def vocabulary() -> set[str]:
    words = set(ONES + TEENS + TENS[2:] + DAYS + MONTHS + COMMON + COMMAND_WORDS + ROOMS + DEVICES + UNITS)
    for o in ORDINALS:
        words.update(o.split())
    for t in TASKS:
        words.update(t.split())
    words.update("hundred thousand plus minus times apples eggs books boxes front".split())
    return {w for w in words if w}


# --------------------------------------------------------------------------------------------
# Voices
# --------------------------------------------------------------------------------------------

ESPEAK_VOICES = ["en-us", "en", "en-gb-scotland", "en-gb-x-gbclan", "en-gb-x-rp", "en-gb-x-gbcwmd",
                 "en-029", "en-us-nyc"]
# Variants that sound like speech (whisper / novelty variants excluded).
TRAIN_VARIANTS = ["", "m1", "m2", "m3", "m4", "m5", "m6", "m7", "f1", "f2", "f3", "f4", "adam", "Alex",
                  "Alicia", "Andrea", "antonio", "belinda", "benjamin", "boris", "caleb", "david",
                  "Denis", "Diogo", "ed", "edward", "Gene", "gustave", "Henrique", "Hugo", "iven",
                  "iven2", "Jacky", "john", "Lee", "marcelo", "Marco", "Mario", "max", "Michael",
                  "michel", "miguel", "pablo", "paul", "pedro", "quincy", "rob", "robert", "steph",
                  "steph2", "zac", "anika", "grandpa", "grandma", "klatt", "klatt2", "klatt4", "croak",
                  "norbert", "aunty", "sandro", "shelby", "travis", "victor", "announcer"]
# Never used in training (the unseen-voice-variant held-out set).
HELDOUT_VARIANTS = ["Annie", "linda", "Mike", "Andy", "edward2", "Gene2", "iven3", "steph3", "f5",
                    "klatt3", "klatt5", "m8"]
FLITE_VOICES = ["slt", "rms", "awb", "kal16", "kal"]  # flite's built-in voices
# Flite voices in training (with varied duration, pitch and speed) and the one never used in training (the
# ``flite`` held-out set).  rms is held out: a US male clustergen voice whose pitch flite cannot change
# (``int_f0_target_mean`` leaves it bit-identical), so training could not have covered it by pitch shifts.
FLITE_TRAIN_VOICES = ["slt", "awb", "kal16", "kal"]
FLITE_HELDOUT_VOICES = ["rms"]
# int_f0_target_mean ranges (Hz) for the training voices (slt is female, the others male); awb ignores it.
FLITE_F0 = {"slt": (140, 250), "awb": (80, 160), "kal16": (75, 160), "kal": (75, 160)}
# A third synthesizer for training only (Debian: festival festvox-kdlpc16k festvox-kallpc16k
# festvox-us-slt-hts): two residual-excited LPC diphone voices (ked, a speaker no other synthesizer has, and
# kal) and an HTS voice (slt).  Each speaker is rendered by a different engine than in flite.
FESTIVAL_VOICES = ["ked_diphone", "kal_diphone", "cmu_us_slt_arctic_hts"]
# target_f0_mean ranges (Hz) of the diphone voices' LR intonation; the HTS voice keeps its own pitch.
FESTIVAL_F0 = {"ked_diphone": (75, 160), "kal_diphone": (75, 160), "rab_diphone": (75, 160),
               "don_diphone": (75, 160)}
# Two more engines, training only, for speakers no other synthesizer has (Debian contrib/non-free: mbrola
# mbrola-us1 mbrola-us2 mbrola-us3 mbrola-en1, libttspico-utils).  MBROLA's diphone voices (US female, two US
# males, a British male), driven by espeak-ng's front end with espeak-ng's rate and pitch; SVOX Pico's US and
# British female voices (pico2wave), with its own speed and pitch markup.
MBROLA_VOICES = ["mb-us1", "mb-us2", "mb-us3", "mb-en1"]
PICO_VOICES = ["en-US", "en-GB"]
# A sixth engine, training only (Debian non-free: rhvoice rhvoice-english): RHVoice's statistical parametric
# voices of four speakers no other synthesizer has: bdl (US male) and clb (US female) of CMU ARCTIC, recorded
# as the held-out rms was but other people, and evgeniy-eng and lyubov (English with a Russian accent).
RHVOICE_VOICES = ["bdl", "clb", "evgeniy-eng", "lyubov"]
# The last English voices these Debian packages hold (festvox-rablpc16k festvox-don, rhvoice-english): festival's
# diphone voices of two British male speakers no other synthesizer has (rab; don, a minimal 10 kHz diphone set),
# and RHVoice's renderings of two speakers flite and festival also have (alan is CMU ARCTIC's awb; slt).
FESTIVAL_RAB_DON_VOICES = ["rab_diphone", "don_diphone"]
RHVOICE_ALAN_SLT_VOICES = ["alan", "slt"]
# English through MBROLA's diphones of other languages' speakers (espeak-ng's mb-XX-en voices; Debian contrib:
# mbrola-af1 mbrola-nl2 mbrola-fr1 ...): sixteen speakers no other synthesizer has, nine male and seven female,
# each speaking English with the phones of their own language (an accent), through espeak-ng's English front end.
MBROLA_ACCENTED_VOICES = ["mb-af1-en", "mb-nl2-en", "mb-fr1-en", "mb-fr4-en", "mb-de1-en", "mb-de2-en",
                          "mb-de3-en", "mb-de4-en", "mb-de5-en", "mb-de6-en", "mb-gr2-en", "mb-hu1-en",
                          "mb-pl1-en", "mb-ro1-en", "mb-sw1-en", "mb-sw2-en"]
# The training-only splits after flite (train_NAME, --n-train-NAME): engine, voices and seed offset, in the order
# their sentences are drawn, so each added split leaves every split drawn before it as it was.
MORE_SYNTHESIZERS = {"festival": ("festival", FESTIVAL_VOICES, 8), "mbrola": ("mbrola", MBROLA_VOICES, 9),
                     "pico": ("pico", PICO_VOICES, 10), "rhvoice": ("rhvoice", RHVOICE_VOICES, 11),
                     "festival_rab_don": ("festival", FESTIVAL_RAB_DON_VOICES, 12),
                     "rhvoice_alan_slt": ("rhvoice", RHVOICE_ALAN_SLT_VOICES, 13),
                     "mbrola_accented": ("mbrola", MBROLA_ACCENTED_VOICES, 14)}


def espeak_wave(text: str, voice: str, rate: int, pitch: int) -> tuple[np.ndarray, int]:
    cmd = ["espeak-ng", "-v", voice, "-s", str(rate), "-p", str(pitch), "--stdout", text]
    out = subprocess.run(cmd, check=True, capture_output=True).stdout
    return _parse_wav_bytes(out)


def flite_wave(text: str, voice: str, tmp: str, stretch: float = 0.0, f0: int = 0) -> tuple[np.ndarray, int]:
    """flite's voice as it ships, or (stretch > 0 / f0 > 0) with ``duration_stretch`` / ``int_f0_target_mean``."""
    cmd = ["flite", "-voice", voice]
    if stretch > 0:
        cmd += ["--setf", f"duration_stretch={stretch:.3f}"]
    if f0 > 0:
        cmd += ["--setf", f"int_f0_target_mean={f0}"]
    subprocess.run(cmd + ["-t", text, "-o", tmp], check=True, capture_output=True)
    return read_audio(tmp)


def festival_wave(text: str, voice: str, tmp: str, stretch: float = 0.0, f0: int = 0) -> tuple[np.ndarray, int]:
    """festival's ``voice`` (text2wave), with durations stretched by ``stretch`` and (diphone voices) the mean
    F0 at ``f0`` Hz when they are > 0."""
    cmd = ["text2wave", "-eval", f"(voice_{voice})"]
    if stretch > 0:
        if voice.endswith("_hts"):  # the HTS engine keeps its own durations; its -r is a speaking rate
            rate = f'(list (list "-r" {1 / stretch:.3f}))'
            cmd += ["-eval", f"(set! hts_engine_params (append hts_engine_params {rate}))"]
        else:
            cmd += ["-eval", f"(Parameter.set 'Duration_Stretch {stretch:.3f})"]
    if f0 > 0:
        cmd += ["-eval", f"(set! int_lr_params '((target_f0_mean {f0}) (target_f0_std 15) "
                         f"(model_f0_mean 170) (model_f0_std 34)))"]
    subprocess.run(cmd + ["-o", tmp], input=text.encode(), check=True, capture_output=True)
    return read_audio(tmp)


def pico_wave(text: str, voice: str, tmp: str, stretch: float = 0.0, pitch: int = 0) -> tuple[np.ndarray, int]:
    """SVOX Pico's ``voice`` (pico2wave), its durations stretched by ``stretch`` and its pitch at ``pitch``
    percent of its own when they are > 0 (Pico's ``<speed>`` and ``<pitch>`` markup)."""
    if stretch > 0:
        text = f"<speed level='{round(100 / stretch)}'>{text}</speed>"
    if pitch > 0:
        text = f"<pitch level='{pitch}'>{text}</pitch>"
    subprocess.run(["pico2wave", "-l", voice, "-w", tmp, text], check=True, capture_output=True)
    return read_audio(tmp)


def rhvoice_wave(text: str, voice: str, tmp: str, stretch: float = 0.0, pitch: int = 0) -> tuple[np.ndarray, int]:
    """RHVoice's ``voice`` (RHVoice-test), its durations stretched by ``stretch`` and its pitch at ``pitch``
    percent of its own when they are > 0 (``-r``: speed in percent, ``-t``: pitch in percent)."""
    cmd = ["RHVoice-test", "-p", voice, "-o", tmp]
    if stretch > 0:
        cmd += ["-r", str(round(100 / stretch))]
    if pitch > 0:
        cmd += ["-t", str(pitch)]
    subprocess.run(cmd, input=text.encode(), check=True, capture_output=True)
    return read_audio(tmp)


def _parse_wav_bytes(b: bytes) -> tuple[np.ndarray, int]:
    # espeak-ng --stdout writes a streaming RIFF header with bogus sizes; find 'data' chunk.
    sr = int.from_bytes(b[24:28], "little")
    i = b.find(b"data", 12)
    pcm = np.frombuffer(b[i + 8:len(b) - ((len(b) - i - 8) % 2)], dtype="<i2")
    return pcm.astype(np.float32) / 32768.0, sr


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


def unique_sentences(rng: random.Random, n: int, exclude: set[str], max_words: int = 14) -> list[str]:
    out, seen = [], set(exclude)
    while len(out) < n:
        s = make_sentence(rng)
        if s in seen or len(s.split()) > max_words:
            continue
        seen.add(s)
        out.append(s)
    return out


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
    dev = unique_sentences(rng, a.n_eval, set())
    hs = unique_sentences(rng, a.n_eval, set(dev))
    hv = unique_sentences(rng, a.n_eval, set(dev) | set(hs))
    fl = unique_sentences(rng, a.n_eval, set(dev) | set(hs) | set(hv))
    held = set(dev) | set(hs) | set(hv) | set(fl)
    train = [make_sentence(rng) for _ in range(a.n_train * 2)]
    train = [s for s in train if s not in held and len(s.split()) <= 14][: a.n_train]
    flite_train, dev_flite = [], []
    if a.n_train_flite:
        # unseen sentences in the training flite voices, mixed into the dev set (one in three rows)
        dev_flite = unique_sentences(rng, a.n_eval // 2, held | set(train))
        held |= set(dev_flite)
        flite_train = [make_sentence(rng) for _ in range(a.n_train_flite * 2)]
        flite_train = [s for s in flite_train if s not in held and len(s.split()) <= 14][: a.n_train_flite]
    # Then the training-only synthesizers, in MORE_SYNTHESIZERS' order and last: each added split leaves every
    # split drawn before it as it was.
    more_train = {}
    for name in MORE_SYNTHESIZERS:
        n = getattr(a, f"n_train_{name}")
        if a.n_train_flite and n:
            drawn = [make_sentence(rng) for _ in range(n * 2)]
            more_train[name] = [s for s in drawn if s not in held and len(s.split()) <= 14][:n]
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
