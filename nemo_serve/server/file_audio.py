"""An uploaded audio file -> float32 mono samples at the model's rate (POST /v1/audio/transcriptions).

libsndfile (the soundfile package) reads the container: WAV (PCM 8/16/24/32-bit, float, A-law,
mu-law), FLAC, OGG Vorbis and Opus, MP3, AIFF, CAF and its other formats, at any rate. Channels
are averaged. The rate is changed with soxr at the quality /ws uses, whose one-shot output equals
its streaming output (audio.py), so a file and the same samples streamed to /ws give the model the
same input. Runs on the event loop: a minute of audio decodes and resamples in milliseconds.
"""

from __future__ import annotations

import io
import re

import numpy as np
import soundfile
import soxr

# What /v1/audio/transcriptions names in its 400 when libsndfile cannot open the bytes.
READABLE = "WAV, FLAC, OGG (Vorbis, Opus), MP3, AIFF, CAF"


class FileAudioError(ValueError):
    """The file cannot be used; the message says why, for the client."""


class FileTooLong(FileAudioError):
    """Longer than the server's limit on one stream's audio."""


def decode_file(data: bytes, model_rate: int, max_seconds: float) -> tuple[np.ndarray, float]:
    """(samples at `model_rate`, the file's duration in s). Checks the duration from the header
    before decoding, so an over-long file costs no decoding."""
    if not data:
        raise FileAudioError("the file is empty")
    try:
        with soundfile.SoundFile(io.BytesIO(data)) as f:
            rate, frames = f.samplerate, f.frames
            duration_s = frames / rate if rate else 0.0
            if duration_s > max_seconds:
                raise FileTooLong(f"audio is {duration_s:.1f} s long; this server takes at most {max_seconds:g} s (--max-stream-s)")
            audio = f.read(dtype="float32", always_2d=True)
    except FileAudioError:
        raise
    except (soundfile.LibsndfileError, RuntimeError, TypeError, ValueError) as e:
        raise FileAudioError(f"cannot decode the file as audio ({_short(e)}); readable formats: {READABLE}") from None
    if not len(audio):
        raise FileAudioError("the file holds no audio samples")
    samples = audio[:, 0] if audio.shape[1] == 1 else audio.mean(axis=1, dtype=np.float32)
    if not np.isfinite(samples).all():
        raise FileAudioError("audio contains NaN or Inf samples")
    if rate != model_rate:
        samples = soxr.resample(samples, rate, model_rate, quality="HQ")
    return np.ascontiguousarray(samples, dtype=np.float32), len(audio) / rate


def _short(e: Exception) -> str:
    """libsndfile's reason, without the object's repr it names ("Error opening <_io.BytesIO ...>: ")."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return re.sub(r"^Error opening <[^>]*>: ", "", text)[:120]
