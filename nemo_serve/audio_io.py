"""Audio files and NeMo manifests: the one reader the self-test, the client, the training recipe,
its evaluation and the benchmarks share.

soundfile reads any format libsndfile knows. Without it (the client may run where the server's
dependencies are not installed) only 16-bit PCM WAV is read, with the standard library's `wave`.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def read_audio(path: str | Path, sample_rate: int | None = None, dtype: str = "float32") -> tuple[np.ndarray, int]:
    """(mono samples, their rate) of an audio file; several channels are averaged.

    dtype: "float32" (in [-1, 1]), "int16", or "native": int16 for 8- and 16-bit PCM files and
    float32 otherwise (what a client can send without converting). `sample_rate`: resample to it
    (soxr) where the file's rate differs; None keeps the file's rate.
    """
    try:
        import soundfile
    except ImportError:
        data, rate = _read_pcm16_wav(path)
        if dtype == "float32":
            data = data.astype(np.float32) / 32768.0
    else:
        if dtype == "native":
            dtype = "int16" if soundfile.info(str(path)).subtype in ("PCM_16", "PCM_S8", "PCM_U8") else "float32"
        data, rate = soundfile.read(str(path), dtype=dtype, always_2d=True)
    audio = data[:, 0] if data.shape[1] == 1 else data.mean(axis=1).astype(data.dtype)
    if sample_rate is not None and rate != sample_rate:
        import soxr

        audio, rate = soxr.resample(audio, rate, sample_rate).astype(audio.dtype), sample_rate
    return np.ascontiguousarray(audio), rate


def _read_pcm16_wav(path: str | Path) -> tuple[np.ndarray, int]:
    import wave

    with wave.open(str(path)) as w:
        if w.getsampwidth() != 2:
            raise ValueError(f"{path}: only 16-bit PCM WAV without the soundfile package")
        data = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").reshape(-1, w.getnchannels())
        return data, w.getframerate()


def read_manifest(path: str | Path, limit: int | None = None) -> list[dict]:
    """The rows of a NeMo manifest (JSON lines: audio_filepath, text, ...), the first `limit` if given."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return rows[:limit] if limit else rows


def audio_path(manifest: str | Path, row: dict) -> Path:
    """A row's audio file: relative paths are relative to the manifest's folder."""
    path = Path(row["audio_filepath"])
    return path if path.is_absolute() else Path(manifest).parent / path


def load_manifest(
    path: str | Path, sample_rate: int = 16000, dtype: str = "float32", limit: int | None = None
) -> list[tuple[dict, np.ndarray]]:
    """Every row of a manifest (the first `limit`) with its audio, mono at `sample_rate` (read_audio)."""
    return [(row, read_audio(audio_path(path, row), sample_rate, dtype)[0]) for row in read_manifest(path, limit)]
