"""The demo corpus's voices and the synthesizers that speak them (espeak-ng, flite, festival, MBROLA,
SVOX Pico, RHVoice): which voices train and which stay held out, and one function per engine that
returns (waveform, sample rate)."""

from __future__ import annotations

import subprocess

import numpy as np

from ..audio_io import read_audio


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
