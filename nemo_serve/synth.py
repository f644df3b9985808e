"""Deterministic speech-like test signals, for models with random weights and for runs without recordings.

The built-in models calibrate their weights on it (nemo_serve.builtin), the benchmarks stream it
(`--audio synth`) and the self-test falls back on it when no demo utterances are bundled.
"""

from __future__ import annotations

import numpy as np
import torch

SAMPLE_RATE = 16000


def synth_audio(seconds: float, seed: int, sample_rate: int = SAMPLE_RATE) -> torch.Tensor:
    """Deterministic speech-like test signal [T] float32 in [-1, 1].

    A sequence of phone-length (50-300 ms) segments: voiced harmonic complexes with two
    formant-like peaks and pitch glides, noise bursts, chirps and pure tones, at varying
    levels, with pauses (200-800 ms of near-silence). Not speech; enough to move a random
    encoder around about as often as speech moves a trained one.
    """
    rng = np.random.default_rng(seed)
    num_samples = int(round(seconds * sample_rate))
    out = np.zeros(num_samples, dtype=np.float64)
    pos = 0
    while pos < num_samples:
        kind = rng.choice(["silence", "voiced", "voiced", "voiced", "voiced", "noise", "noise", "chirp", "tone"])
        seconds_here = rng.uniform(0.2, 0.8) if kind == "silence" else rng.uniform(0.05, 0.3)
        n = min(int(seconds_here * sample_rate), num_samples - pos)
        t = np.arange(n) / sample_rate
        if kind == "silence":
            seg = rng.normal(0.0, 1e-4, n)
        elif kind == "voiced":
            f0 = rng.uniform(90, 260) * (1 + rng.uniform(-0.15, 0.15) * t / max(t[-1], 1e-3))
            phase = 2 * np.pi * np.cumsum(f0) / sample_rate
            formants = rng.uniform([300, 900], [900, 2600])
            seg = np.zeros(n)
            for k in range(1, int(3800 / f0.max())):
                gain = sum(1.0 / (1.0 + ((k * f0.mean() - f) / 120.0) ** 2) for f in formants)
                seg += gain / k**0.5 * np.sin(k * phase)
            seg *= rng.uniform(0.05, 0.4) / (np.abs(seg).max() + 1e-9)
        elif kind == "noise":
            seg = rng.normal(0.0, 1.0, n)
            if rng.random() < 0.5:
                seg = np.diff(seg, prepend=0.0)  # brighter, fricative-like
            seg *= rng.uniform(0.01, 0.15)
        elif kind == "chirp":
            f_start, f_end = rng.uniform(150, 4000, size=2)
            phase = 2 * np.pi * (f_start * t + (f_end - f_start) * t**2 / (2 * max(t[-1], 1e-3)))
            seg = rng.uniform(0.02, 0.3) * np.sin(phase)
        else:
            seg = rng.uniform(0.02, 0.3) * np.sin(2 * np.pi * rng.uniform(100, 3000) * t)
        ramp = np.minimum(1.0, np.minimum(np.arange(n), np.arange(n)[::-1]) / (0.005 * sample_rate))
        out[pos : pos + n] = seg * ramp
        pos += n
    out += rng.normal(0.0, 3e-5, num_samples)  # no digital silence: log-mel of exact zeros is an outlier
    return torch.from_numpy(np.clip(out, -1.0, 1.0).astype(np.float32))
